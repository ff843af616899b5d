"""The shardfit command as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

from shardfit.config import load_config
from tests.helpers import EXTEND

TINY = ["--train.device=cpu", "--model.dim=32", "--model.n_layers=1",
        "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
        "--data.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--logging.log_every=1",
        "--logging.plot=false"]


def _run(*args, cwd=None, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "shardfit", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def test_train_smoke_then_auto_resume(tmp_path):
    run_dir = tmp_path / "run"
    p = _run("train", *TINY, "--train.steps=3", f"--logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr
    assert "step 3/3" in p.stdout and "loss" in p.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"loss", "grad_norm", "lr", "tokens_per_s_per_gpu", "peak_allocated_max", "peak_reserved_min",
            "alloc_retries_max"} <= set(records[0])
    assert load_config(run_dir / "config.toml").train.steps == 3
    assert (run_dir / "checkpoints" / "step_00000003" / "complete.json").is_file()
    # a longer schedule continues the run only when asked (another experiment otherwise: tests/train/test_run_config)
    p = _run("train", *TINY, "--train.steps=5", EXTEND, f"--logging.run_dir={run_dir}")
    assert p.returncode == 0, p.stderr
    assert "resumed from" in p.stdout and "step 4/5" in p.stdout and "step 1/5" not in p.stdout
    # the same command once more: a finished run trains nothing, says so, exits non-zero, keeps its recorded config
    before = (run_dir / "config.toml").read_bytes()
    p = _run("train", *TINY, "--train.steps=5", "--train.lr=1e-3", "--checkpoint.allow_changes=train.lr",
             f"--logging.run_dir={run_dir}")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "nothing to train: resumed at step 5" in lines[0], p.stderr
    assert "train.steps=5" in lines[0] and "step 5/5" not in p.stdout
    assert (run_dir / "config.toml").read_bytes() == before


@pytest.mark.slow  # the launch and its start line are also test_trackers_get_rank_0_records_only's
def test_nproc_launches_torchrun(tmp_path):
    p = _run("train", *TINY, "--train.steps=2", "--nproc=2", f"--logging.run_dir={tmp_path}")
    assert p.returncode == 0, p.stderr
    assert "2 x cpu" in p.stdout


def test_help_lists_keys_and_recipes_are_listed_and_planned(tmp_path):
    from tests.cli.session import run_commands

    assert _run("--help").returncode == 0  # argparse's help leaves main through SystemExit: a process of its own
    helped, default_8b, recipes, fits, too_big = run_commands([
        ["train", "--help"],
        ["train", "--model.name=llama3-8b", "--data.seq_len=4096", "--help"],  # that model's defaults
        ["recipes"],
        ["plan", "--config", "recipe:llama3-8b-sft-8gpu", "--nproc", "8", "--gpu-memory", "79"],
        ["plan", "--config", "recipe:llama3-70b-sft", "--nproc", "8", "--gpu-memory", "139"]], cwd=tmp_path)
    assert helped.returncode == 0 and "--compute.activation_checkpoint=" in helped.stdout
    assert "--train.lr=0.003 " in helped.stdout
    assert default_8b.returncode == 0 and "--train.lr=0.0003 " in default_8b.stdout
    assert "Training defaults by model size" in default_8b.stdout
    assert recipes.returncode == 0 and "llama3-8b-sft-8gpu" in recipes.stdout and "qwen3-30b-a3b-sft" in recipes.stdout
    assert fits.returncode == 0 and "as configured: fits" in fits.stdout, fits.stderr
    assert too_big.returncode == 0 and "as configured: DOES NOT FIT" in too_big.stdout  # as the recipe's comment says


# The default cases share one subprocess through the CLI's entry point (tests/cli/session.py: the interpreter and torch
# started once); `shardfit train`'s bad input as a process of its own is tests/cli/test_bad_input.py's (empty dataset).
SHARED = [["--data.path=/nonexistent/data.jsonl"], ["--data.tokenizer=/nonexistent/tok.json"]]


@pytest.fixture(scope="module")
def in_one_session(tmp_path_factory):
    from tests.cli.session import run_commands

    dirs = [tmp_path_factory.mktemp("bad_input") for _ in SHARED]
    done = run_commands([["train", "--train.device=cpu", *args, f"--logging.run_dir={d}/r"]
                         for args, d in zip(SHARED, dirs)], cwd=tmp_path_factory.getbasetemp())
    return {tuple(args): p for args, p in zip(SHARED, done)}


@pytest.mark.parametrize("args, needle", [
    pytest.param(["--train.lrr=1"], "did you mean 'train.lr'", marks=pytest.mark.slow),  # also test_bad_input
    (SHARED[0], "/nonexistent/data.jsonl: no such file"),
    (SHARED[1], "tokenizer file not found"),
    pytest.param(["--train.global_batch=6", "--train.micro_batch=4"], "train.global_batch",
                 marks=pytest.mark.slow),  # also test_bad_input
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, needle, request):
    if args in SHARED:
        p = request.getfixturevalue("in_one_session")[tuple(args)]
    else:
        p = _run("train", "--train.device=cpu", *args, f"--logging.run_dir={tmp_path}/r")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("shardfit: error:")


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "-1"], "--nproc: -1 is out of range; fix: give 1 or more processes"),
    (["--nproc=abc"], "--nproc: 'abc' is not a whole number"),
    (["--nproc", "1.5"], "--nproc: '1.5' is not a whole number"),
    (["--nproc", "2", "--nnodes=0"], "--nnodes: 0 is out of range"),
    (["--nproc"], "--nproc needs a value"),
])
def test_launcher_values_out_of_range_are_one_line(args, needle, capsys):
    """Checked before the config is read and before any process starts (in-process: no torchrun is reached)."""
    from shardfit.cli.main import main

    assert main(["train", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: ") and needle in lines[0], lines


@pytest.mark.slow  # ~9 s (two ranks, both trackers)
def test_trackers_get_rank_0_records_only(tmp_path, monkeypatch):
    """--nproc 2 with TensorBoard (and W&B offline, when installed): one writer, rank 0's, holding the numbers of
    metrics.jsonl, which rank 0 alone writes."""
    import importlib.util

    pytest.importorskip("tensorboard")
    from tests.train.test_progress import _jsonl_numbers, _tensorboard_numbers, _wandb_offline_records

    wandb = importlib.util.find_spec("wandb") is not None
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    run = tmp_path / "run"
    extra = ["--logging.wandb=true", "--logging.wandb_mode=offline"] if wandb else []
    p = _run("train", *TINY, "--train.steps=3", "--nproc=2", "--logging.tensorboard=true",
             "--checkpoint.final=false", f"--logging.run_dir={run}", *extra)
    assert p.returncode == 0, p.stderr
    assert "2 x cpu" in p.stdout  # torchrun started the two ranks
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 3  # one record a step, not one a rank
    assert len(list((run / "tensorboard").iterdir())) == 1  # one event file
    want = _jsonl_numbers(run)
    got = _tensorboard_numbers(run)
    assert {s for s, k in want if k == "loss"} == {1, 2, 3} and set(got) == set(want)
    assert all(got[k] == pytest.approx(v, rel=1e-6) for k, v in want.items())
    if wandb:
        assert len(list((run / "wandb").glob("offline-run-*"))) == 1
        history, config = _wandb_offline_records(run)
        assert history == pytest.approx(want) and config
