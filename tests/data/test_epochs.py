"""train.epochs (train/schedule.py): the steps of E passes over the training set's items (packed rows, examples,
windows), the warm-up as a fraction of them, the header's schedule and its warning when one step holds more items
than the data set; train.steps and train.epochs from one source is one error, from two the command line wins."""

import math
import re

import pytest

from shardfit.config import load_config
from shardfit.data.build import build_datasets
from shardfit.errors import ShardfitError
from shardfit.train.schedule import apply_epochs, schedule_lines


def _data(tmp_path, n=10):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(f'{{"prompt": "q{i}", "completion": "{"a" * (i % 7 + 1)}"}}\n' for i in range(n)))
    return path


def _steps(*args, budget=False):
    cfg = load_config(None, ["--train.global_batch=4", "--train.micro_batch=2", *args])
    train, _, _ = build_datasets(cfg.data, cfg.model.vocab_size, token_budget=budget)
    note = apply_epochs(cfg, train)
    return cfg, train, note


@pytest.mark.parametrize("args, want", [
    (["--data.pack=false", "--train.epochs=1"], math.ceil(10 / 4)),
    (["--data.pack=false", "--train.epochs=2"], math.ceil(20 / 4)),
    (["--data.pack=false", "--train.epochs=0.5"], math.ceil(5 / 4)),
    (["--data.pack=false", "--train.epochs=0.1"], 1),  # one example: still one step
    (["--data.pack=false", "--train.epochs=3", "--train.global_batch=2"], 15),
    (["--train.micro_batch_tokens=64", "--train.epochs=2"], math.ceil(20 / 4)),  # token budgets count examples
])
def test_epochs_give_the_steps_of_their_passes(tmp_path, args, want):
    cfg, _, note = _steps(f"--data.path={_data(tmp_path)}", *args, budget="--train.micro_batch_tokens=64" in args)
    assert cfg.train.steps == want and note.startswith(f"# train.steps = {want}: train.epochs = ")


def test_packed_passes_sum_their_own_rows(tmp_path):
    """Each pass packs its own permutation: 3 epochs are the rows of epochs 0, 1 and 2, not 3 x epoch 0's."""
    cfg, train, _ = _steps(f"--data.path={_data(tmp_path, 60)}", "--data.seq_len=16", "--train.epochs=3")
    rows = [len(train._epoch_rows(e)) for e in range(3)]
    assert cfg.train.steps == math.ceil(sum(rows) / 4)
    cfg, train, _ = _steps(f"--data.path={_data(tmp_path, 60)}", "--data.seq_len=16", "--train.epochs=1.5")
    assert cfg.train.steps == math.ceil((rows[0] + math.ceil(rows[1] / 2)) / 4)
    again = _steps(f"--data.path={_data(tmp_path, 60)}", "--data.seq_len=16", "--train.epochs=1.5")[0]
    assert again.train.steps == cfg.train.steps  # derived from the data and seed alone: a resumed run agrees


def test_pretraining_windows_and_warm_up(tmp_path):
    cfg, train, _ = _steps("--train.epochs=2", "--train.global_batch=16", "--train.micro_batch=8")
    assert cfg.train.steps == math.ceil(2 * train.num_windows / 16)
    assert cfg.train.warmup_steps == max(1, round(0.1 * cfg.train.steps))  # from scratch: 10% of the derived steps
    cfg, _, _ = _steps("--train.epochs=2", "--train.warmup_steps=3")
    assert cfg.train.warmup_steps == 3  # given: kept


def test_schedule_line_and_a_step_larger_than_the_data(tmp_path):
    cfg, train, _ = _steps(f"--data.path={_data(tmp_path, 5)}", "--data.pack=false", "--train.epochs=1",
                           "--train.global_batch=16", "--train.micro_batch=2")
    lines = schedule_lines(cfg, train, per_round=2)
    assert lines[0] == ("schedule: 1 step x 16 examples = 3.20 passes over the training set's 5 examples "
                        "(train.epochs=1); lr warm-up 1 step, then no decay")
    assert lines[1] == ("warning: one step holds train.global_batch=16 examples but the training set has 5: "
                        "train.epochs=1 trains 3.20 passes; fix: --train.global_batch=4, or add data")
    cfg, train, _ = _steps(f"--data.path={_data(tmp_path, 40)}", "--data.pack=false", "--train.steps=20")
    assert schedule_lines(cfg, train, per_round=2) == [
        "schedule: 20 steps x 4 examples = 2.00 passes over the training set's 40 examples (train.steps=20); lr "
        "warm-up 2 steps, then cosine decay to 0.1 x 0.003 at step 20"]


@pytest.mark.parametrize("args, per_round, said", [
    # the run: 5 short chats packed into 1 row, the default global batch 16 and micro-batch 8
    (["--train.epochs=3", "--train.global_batch=16", "--train.micro_batch=8"], 8,
     "one step holds train.global_batch=16 packed rows but the training set has 1: train.epochs=3 trains 16.00 "
     "passes; fix: --train.global_batch=1 --train.micro_batch=1, or add data"),
    (["--data.pack=false", "--train.steps=4", "--train.global_batch=16", "--train.micro_batch=4"], 8,  # 2 ranks
     "one step holds train.global_batch=16 examples but the training set has 5: every step sees the data 3.2 "
     "times; fix: --train.global_batch=4 --train.micro_batch=2, or add data"),
    (["--data.pack=false", "--train.steps=4", "--train.global_batch=16", "--train.micro_batch=1"], 8,  # 8 ranks
     "but the training set has 5: every step sees the data 3.2 times; fix: add data: 8 data-parallel ranks take at "
     "least 8 examples a step"),
])
def test_a_step_larger_than_the_data_names_its_key_and_a_fix_that_fits(tmp_path, args, per_round, said):
    """The fix makes one step hold at most the training set with a global batch that is a multiple of micro-batch x
    ranks (the micro-batch lowered when the data are fewer than one round): the flags it names pass that rule."""
    from shardfit.config.loader import accumulation_steps

    cfg, train, _ = _steps(f"--data.path={_data(tmp_path, 5)}", *args)
    warning = schedule_lines(cfg, train, per_round)[1]
    assert warning.startswith("warning: ") and warning.endswith(said), warning
    flags = dict(re.findall(r"--train\.(\w+)=(\d+)", warning.partition("fix: ")[2]))
    if flags:
        batch, micro = int(flags["global_batch"]), int(flags.get("micro_batch", cfg.train.micro_batch))
        assert batch <= train.num_windows
        accumulation_steps(batch, micro, per_round // cfg.train.micro_batch)  # raises if not a multiple


def test_steps_and_epochs_from_files_and_the_command_line(tmp_path):
    both = tmp_path / "both.toml"
    both.write_text("[train]\nsteps = 10\nepochs = 2.0\n")
    with pytest.raises(ShardfitError, match=re.escape(f"{both}: train.steps=10 and train.epochs=2 are both given")):
        load_config(both)
    steps, epochs = tmp_path / "steps.toml", tmp_path / "epochs.toml"
    steps.write_text("[train]\nsteps = 10\nepochs = 0.0\n")  # a resolved run's config.toml writes both keys
    epochs.write_text("[train]\nepochs = 2.0\n")
    assert load_config(steps).train.steps == 10 and load_config(steps).train.epochs == 0
    assert load_config(steps, ["--train.epochs=3"]).train.epochs == 3  # the command line's epochs win
    assert load_config(epochs, ["--train.steps=7"]).train.epochs == 0  # and its steps turn the file's epochs off


def test_rules_naming_a_step_wait_for_the_derived_steps(tmp_path):
    cfg = load_config(None, [f"--data.path={_data(tmp_path)}", "--data.pack=false", "--train.epochs=1",
                             "--logging.profile_step=9", "--train.global_batch=4", "--train.micro_batch=2"])
    train, _, _ = build_datasets(cfg.data, cfg.model.vocab_size)
    with pytest.raises(ShardfitError, match=r"logging.profile_step: step 9 is after the last step 3"):
        apply_epochs(cfg, train)


@pytest.mark.parametrize("arg", ["--num_train_epochs=3", "--epochs=3", "--train.num_epochs=3"])
def test_other_tools_epochs_name_train_epochs(arg):
    with pytest.raises(ShardfitError, match=r"is train.epochs in shardfit"):
        load_config(None, [arg])
