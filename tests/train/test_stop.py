"""Issue 27, class 1: Ctrl-C and SIGTERM save a checkpoint every rank agrees on, say so in one line, and the same
command resumes it; with checkpoint.on_signal=false the line says what was lost and the key that keeps it.

Run as a user runs it: the CLI in a subprocess (one process, or two gloo ranks under `--nproc 2`), the signal sent
once the run has logged a step, to the process, the launcher, or one rank only (the ranks agree through the step's
stats collective: the rank that got nothing stops at the same step).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfit.weights.checkpoint import complete_checkpoints
from tests.cli.test_cli import _run

# about 20-50 ms a step on one core: the signal lands well before the last step
ARGS = ["--train.device=cpu", "--model.dim=64", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=1",
        "--model.ffn_dim=128", "--data.seq_len=128", "--train.global_batch=8", "--train.micro_batch=4",
        "--logging.log_every=1", "--logging.plot=false"]


def _children(pid: int) -> dict[int, int]:
    """torchrun's rank processes under the launcher `pid`: rank -> pid."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            rank = [e[5:] for e in env if e.startswith(b"RANK=")]
            if rank:
                out[int(rank[0])] = int(child)
    return out


def _signalled(run: Path, sig: int, args: list[str], target: str = "process") -> subprocess.CompletedProcess:
    """Start the run, send `sig` once it has logged its first step (to the process / launcher, or rank 1), wait."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "shardfit", "train", *ARGS, *args, f"--logging.run_dir={run}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 1) and p.poll() is None:
        assert time.monotonic() < deadline, "the run logged no step"
        time.sleep(0.02)
    ranks = _children(p.pid) if target != "process" else {}
    os.kill(ranks[1] if target == "rank 1" else p.pid, sig)
    out, err = p.communicate(timeout=240)
    done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    done.ranks = ranks  # rank -> pid under the launcher (none for one process)
    return done


def _stopped_at(p: subprocess.CompletedProcess, name: str, code: int) -> int:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code and len(lines) == 1 and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    m = re.fullmatch(rf"shardfit: stopped by {name} after step (\d+) of (\d+): (.*)", lines[0])
    assert m, lines[0]
    return int(m.group(1))


@pytest.mark.parametrize("sig, nproc, target", [
    (signal.SIGINT, 1, "process"),  # Ctrl-C, with the default checkpoint.every=0
    (signal.SIGTERM, 2, "launcher"),  # a scheduler's SIGTERM to `shardfit train --nproc 2`, forwarded by torchrun
    pytest.param(signal.SIGTERM, 2, "rank 1", marks=pytest.mark.slow),  # to one rank only: rank 0 stops with it
])
def test_a_signal_saves_a_checkpoint_the_same_command_resumes(tmp_path, sig, nproc, target):
    run, name = tmp_path / "run", signal.Signals(sig).name
    nprocs = [f"--nproc={nproc}"] if nproc > 1 else []
    p = _signalled(run, sig, ["--train.steps=40", *nprocs], target)
    step = _stopped_at(p, name, 128 + sig)
    assert 1 <= step < 40
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    assert f"saved checkpoint {ckpt}; the same command resumes it" in p.stderr
    assert complete_checkpoints(run / "checkpoints") == [ckpt]
    assert json.loads((ckpt / "complete.json").read_text())["world_size"] == nproc
    who = "every rank" if target != "rank 1" else "rank 1"
    assert f"step {step}: {name} received ({who}): saving a checkpoint and stopping" in p.stdout
    logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == step  # the step it stopped after is in the record
    if target == "launcher":  # every rank gone with the launcher (as test_launcher.py's signal test asks)
        assert sorted(p.ranks) == [0, 1], p.ranks
        time.sleep(0.5)
        assert not any(Path(f"/proc/{pid}").exists() for pid in p.ranks.values())
    if target != "rank 1":  # the same command continues it (here on one process: DCP reshards the 2 ranks' one)
        again = _run("train", *ARGS, "--train.steps=40", f"--logging.run_dir={run}")
        assert again.returncode == 0, again.stderr
        assert f"resumed from {ckpt}" in again.stdout and f"step {step + 1}/40" in again.stdout
        assert f"step {step}/40" not in again.stdout


def test_without_on_signal_the_line_says_what_was_lost(tmp_path):
    p = _signalled(tmp_path / "run", signal.SIGTERM, ["--train.steps=40", "--checkpoint.on_signal=false"])
    step = _stopped_at(p, "SIGTERM", 143)
    assert (f"no checkpoint saved (checkpoint.on_signal=false): steps 1-{step} are lost (no checkpoint of this run "
            "exists); fix: leave checkpoint.on_signal=true to save one when stopped") in p.stderr
    assert complete_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_sigterm_before_training_says_nothing_was_trained(monkeypatch, capsys):
    """SIGTERM to a single process during start-up (cli/train.py's handler raises SignalInterrupt): one line, 143."""
    import shardfit.cli.main as cli
    from shardfit.errors import SignalInterrupt

    def starting(argv):
        raise SignalInterrupt(signal.SIGTERM)

    monkeypatch.setitem(cli.COMMANDS, "train", starting)
    assert cli.main(["train"]) == 143
    assert capsys.readouterr().err == "shardfit: stopped by SIGTERM before training started: nothing was trained\n"
