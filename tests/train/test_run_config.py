"""Issue 27, class 1 (silent no-ops and overwritten records): which run a command continues, and what it refuses.

The key groups and the default directory's name in-process; then, as a user runs it (the CLI in a subprocess on the
embedded model, from a fresh working directory): the same command resumes its own run, another experiment gets its
own directory, and a run directory of another config is refused in one line that leaves every record as it was.
"""

from __future__ import annotations

import json
import re

import pytest

from shardfit.config import config_to_dict, load_config
from shardfit.errors import ShardfitError
from shardfit.train.run_config import check_config, default_run_dir, group
from tests.cli.session import run_commands
from tests.cli.test_cli import TINY


@pytest.mark.parametrize("key, want", [
    ("model.dim", "experiment"), ("model.init_from", "experiment"), ("data.path", "experiment"),
    ("data.seed", "experiment"), ("train.global_batch", "experiment"), ("train.seed", "experiment"),
    ("train.steps", "schedule"), ("train.lr", "schedule"), ("train.warmup_steps", "schedule"),
    ("train.grad_clip", "schedule"), ("train.epochs", "schedule"), ("train.micro_batch", "compatible"),
    ("train.eval_every", "compatible"),
    ("data.val_path", "compatible"), ("parallel.replicate", "compatible"), ("compute.fp8", "compatible"),
    ("checkpoint.every", "compatible"), ("logging.run_dir", "compatible"), ("memory.keep_grads", "compatible"),
])
def test_key_groups(key, want):
    assert group(key) == want


@pytest.mark.parametrize("a, b, same", [
    ([], [], True),
    ([], ["--train.lr=3e-3"], True),  # the default, given: the same experiment
    ([], ["--logging.log_every=1", "--parallel.replicate=1", "--train.micro_batch=4", "--checkpoint.every=5"], True),
    ([], ["--train.lr=1e-3"], False),
    ([], ["--train.steps=300"], False),  # a longer schedule is another experiment (continue one: allow_changes)
    ([], ["--train.epochs=2"], False),
    ([], ["--data.path=corpus.txt"], False),
    ([], ["--model.dim=128"], False),
])
def test_default_run_dir_is_the_experiments_own(a, b, same):
    da, db = default_run_dir(load_config(None, a)), default_run_dir(load_config(None, b))
    assert da.parent.name == "runs" and re.fullmatch(r"tiny-[0-9a-f]{8}", da.name)
    assert (da == db) == same


def _saved(*args):
    return json.loads(json.dumps(config_to_dict(load_config(None, list(args)))))  # as TOML gives it back: plain


@pytest.mark.parametrize("saved, new, refused, notice", [
    ([], ["--parallel.replicate=1", "--train.micro_batch=4", "--logging.log_every=1"], None, None),
    ([], ["--data.path=corpus.txt"], "data.path \"\" -> \"corpus.txt\"", None),
    ([], ["--model.n_layers=2"], "model.n_layers 4 -> 2", None),
    ([], ["--train.steps=300"], "train.steps 150 -> 300", None),
    ([], ["--train.steps=300", "--checkpoint.allow_changes=train.steps"], None,
     "train.steps 150 -> 300, train.warmup_steps 15 -> 30 (checkpoint.allow_changes): the schedule is recomputed "
     "for train.steps=300, step 101 runs at learning rate 0.00"),
    ([], ["--train.lr=1e-3", "--data.seed=7", "--checkpoint.allow_changes=train.lr"], "data.seed 1234 -> 7", None),
])
def test_check_config(saved, new, refused, notice):
    cfg = load_config(None, new)
    if refused:
        with pytest.raises(ShardfitError) as e:
            check_config(cfg, _saved(*saved), "ckpt/config.toml", 100, "ckpt")
        line = str(e.value)
        assert refused in line and "\n" not in line and "--model.init_from=ckpt" in line
        assert re.search(r"--checkpoint.allow_changes=[\w.,]+$", line)
    else:
        notes = check_config(cfg, _saved(*saved), "ckpt/config.toml", 100, "ckpt")
        assert (notes == []) if notice is None else (len(notes) == 1 and notice in notes[0])


def test_epochs_resume_as_the_steps_they_gave():
    """train.epochs is resolved to train.steps when training starts, and saved as 0 beside them: the steps compare."""
    from shardfit.train.schedule import apply_epochs

    class Rows:  # a training set of 296 rows (train/schedule.py asks only these)
        num_windows, info = 296, None

        def items_in(self, epochs):
            return epochs * self.num_windows

    first, again = load_config(None, ["--train.epochs=2"]), load_config(None, ["--train.epochs=2"])
    apply_epochs(first, Rows())
    apply_epochs(again, Rows())
    saved = json.loads(json.dumps(config_to_dict(first)))
    saved["train"]["epochs"] = 0.0  # as the trainer records it
    assert saved["train"]["steps"] == 37 and check_config(again, saved, "ckpt/config.toml", 10, "ckpt") == []


def test_more_epochs_are_named_as_epochs():
    cfg = load_config(None, ["--train.epochs=2"])
    cfg.train.steps = 3  # resolved from the data: 1 epoch gave 2
    with pytest.raises(ShardfitError, match=r"train.steps 2 -> 3 \(train.epochs=2\).*allow_changes=train.epochs$"):
        check_config(cfg, _saved("--train.steps=2"), "ckpt/config.toml", 2, "ckpt")
    cfg.checkpoint.allow_changes = "train.epochs"
    assert "train.steps 2 -> 3" in check_config(cfg, _saved("--train.steps=2"), "ckpt/config.toml", 2, "ckpt")[0]


def test_allow_changes_names_config_keys():
    with pytest.raises(ShardfitError, match="'train.stpes' is not a config key.*did you mean 'train.steps'"):
        check_config(load_config(None, ["--checkpoint.allow_changes=train.stpes"]), _saved(), "x", 1, None)


def test_same_command_resumes_its_run_another_experiment_gets_its_own(tmp_path):
    """The issue's session: a run; the same command again; a command with other data; the first run's directory
    named explicitly with a changed model, data and schedule (continuing with an allowed change: the docs' test,
    tests/cli/test_docs_checkpoints.py, and tests/cli/test_cli.py)."""
    (tmp_path / "other.txt").write_text("other data, for another experiment. " * 200)
    first = [*TINY, "--train.steps=2"]
    run = default_run_dir(load_config(None, first))
    ran, again, other, refused = run_commands([
        ["train", *first], ["train", *first], ["train", *first, "--data.path=other.txt"],
        ["train", *TINY, "--train.steps=4", "--data.path=other.txt", "--model.dim=48", f"--logging.run_dir={run}"],
    ], tmp_path)
    assert ran.returncode == 0 and f"run dir {run}\n" in ran.stdout, ran.stderr
    assert load_config(tmp_path / run / "config.toml").logging.run_dir == str(run)  # the directory, recorded
    assert again.returncode == 2 and "nothing to train: resumed at step 2" in again.stderr, again.stderr
    assert other.returncode == 0, other.stderr
    assert f"{run} holds other runs of this model: --model.init_from=DIR" in other.stdout
    other_run = re.search(r"run dir runs/(tiny-[0-9a-f]{8})", other.stdout).group(1)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted([run.name, other_run])  # no collision

    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    for needle in ("step_00000002/config.toml: this config differs from the checkpoint of step 2 in",
                   "model.dim 32 -> 48", 'data.path "" -> "other.txt"', "train.steps 2 -> 4",
                   "leave logging.run_dir empty", f"--model.init_from={run}/checkpoints/step_00000002",
                   "--checkpoint.allow_changes=data.path,model.dim,train.steps"):
        assert needle in lines[0], (needle, lines[0])
    record = load_config(tmp_path / run / "config.toml")  # the first run's, neither the no-op's nor the refused's
    assert (record.model.dim, record.data.path, record.train.steps) == (32, "", 2)
    assert sorted(p.name for p in (tmp_path / run / "checkpoints").iterdir()) == ["step_00000002"]
