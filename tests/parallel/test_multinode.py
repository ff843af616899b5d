"""Two nodes simulated on one machine: two torchrun launchers (--nnodes 2, one process each) meet at one c10d
rendezvous and train as one job, with the losses of both processes on one node (docs/multinode.md).

Every child runs under a timeout, and a failed or hung attempt is torn down (the launchers, then whatever workers
they had started: torchrun starts each worker in a session of its own), so nothing outlives the test.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_cli import TINY
from tests.helpers import EXTEND

ROOT = Path(__file__).parents[2]
ARGS = [*TINY, "--train.steps=3"]  # global batch 4 = 2 ranks x micro-batch 2, accumulation 1
# The launcher variables a parent torchrun (or a test that trained in-process) may have left: the children must
# get theirs from their own launcher and rendezvous only.
SCRUB = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
         "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE")
TIMEOUT_S = 150
BIND_FAILURES = ("address already in use", "eaddrinuse", "rendezvousconnectionerror")


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in SCRUB}, "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """pid's children, grandchildren... (from /proc: torchrun's workers leave its process group)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def _tear_down(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each launcher still running (torchrun stops its workers), then SIGKILL what is left of each tree."""
    live = [p for p in procs if p.poll() is None]
    trees = {p.pid: _descendants(p.pid) for p in live}
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
    for pids in trees.values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it ended with its launcher
                os.kill(pid, signal.SIGKILL)


def _launch(cmds: list[list[str]], logs: Path) -> list[tuple[int, str, str]]:
    """Start every command at once and wait for all under one deadline; (rc, stdout, stderr) per command. A failed
    launcher ends the wait (its peer would sit at the rendezvous); whatever still runs is torn down."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        for i, cmd in enumerate(cmds):
            with open(logs / f"{i}.out", "w") as out, open(logs / f"{i}.err", "w") as err:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=_env(),
                                              cwd=ROOT))
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
            if p.returncode != 0:
                break
    finally:
        _tear_down(procs)
    return [(p.returncode, (logs / f"{i}.out").read_text(), (logs / f"{i}.err").read_text())
            for i, p in enumerate(procs)]


def _two_nodes(command, run_dir: Path, tries: int = 2) -> list[tuple[int, str, str]]:
    """Two launchers of command(rendezvous flags), one c10d rendezvous on 127.0.0.1. The port is probed free and
    closed again; the first launcher to bind it hosts the store, the other connects to it. Should something else
    take the port in between, the attempt is retried once on a new port and rendezvous id."""
    for attempt in range(tries):
        port = _free_port()
        rdzv = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=shardfit-test-{os.getpid()}-{port}"]
        cmd = command(rdzv)
        res = _launch([cmd, cmd], run_dir.parent / f"{run_dir.name}-logs{attempt}")
        if all(rc == 0 for rc, _, _ in res) or not any(s in err.lower() for _, _, err in res for s in BIND_FAILURES):
            return res
        shutil.rmtree(run_dir, ignore_errors=True)
    return res


def _tail(res) -> str:
    return "\n\n".join(f"launcher {i} rc={rc}\n{out[-1500:]}\n{err[-3000:]}" for i, (rc, out, err) in enumerate(res))


def _losses(run_dir: Path) -> list[float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if not r.get("eval")]


def _one_node(rank: int, world: int, run_dir: str) -> list[float]:
    """The job's training on `world` gloo ranks of one node (tests/_dist.run_ranks); its losses."""
    from shardfit.config import load_config
    from shardfit.train import Trainer

    return [h["loss"] for h in Trainer(load_config(None, [*ARGS, f"--logging.run_dir={run_dir}"])).fit()]


def test_two_launchers_one_rendezvous_train_as_one_node(tmp_path):
    # The same job on one node, two processes: forked ranks (tests/_dist.py), not a torchrun of its own (~4 s less;
    # the launchers are what the two nodes below run)
    from tests._dist import run_ranks

    ref = run_ranks(_one_node, 2, str(tmp_path / "one"))[0]

    run_dir = tmp_path / "two"
    res = _two_nodes(lambda rdzv: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", *rdzv,
                                   "-m", "shardfit", "train", *ARGS, f"--logging.run_dir={run_dir}"], run_dir)
    assert all(rc == 0 for rc, _, _ in res), _tail(res)

    # Global rank 0 alone prints and writes the run's files: one banner and one metrics record per step, not one
    # per node (each node has a local rank 0).
    banners = [out for _, out, _ in res if "shardfit: tiny model" in out]
    assert len(banners) == 1 and "2 x cpu" in banners[0] and "step 3/3" in banners[0], _tail(res)
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert "steps = 3" in (run_dir / "config.toml").read_text()

    # Data order depends only on (seed, step) and the loss on the global batch: the same losses as one node.
    two = _losses(run_dir)
    assert len(two) == 3 and two == pytest.approx(ref, rel=1e-5, abs=1e-6)

    # The final checkpoint is whole, written by both ranks (one DCP shard and one RNG file each), sealed by rank 0.
    ckpt = run_dir / "checkpoints" / "step_00000003"
    assert json.loads((ckpt / "complete.json").read_text()) == {"step": 3, "world_size": 2}
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    assert len(list(ckpt.glob("__*.distcp"))) == 2
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_nproc_passes_rendezvous_flags_to_torchrun(monkeypatch, tmp_path):
    """`shardfit train --nproc N --nnodes M --rdzv-*`: torchrun gets the multi-node flags instead of --standalone,
    and the global batch is checked against the world of N x M processes before anything starts."""
    import torch.distributed.run

    from shardfit.cli.main import main

    calls = []
    monkeypatch.setattr(torch.distributed.run, "main", lambda args: calls.append(args))
    run = f"--logging.run_dir={tmp_path}"
    assert main(["train", *TINY, "--nproc", "1", "--nnodes=2", "--rdzv-endpoint", "node0:29400", "--rdzv_id=j7",
                 run]) == 0
    launcher = calls[0][:calls[0].index("-m")]
    assert sorted(launcher) == ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                                "--rdzv-endpoint=node0:29400", "--rdzv-id=j7"]
    assert calls[0][calls[0].index("-m"):] == ["-m", "shardfit", "train", *TINY, run]

    calls.clear()
    assert main(["train", *TINY, "--nproc=2", run]) == 0  # one node: as before
    assert calls[0][:2] == ["--standalone", "--nproc_per_node=2"]

    # global batch 4 = micro-batch 2 x 2 ranks; on 2 nodes x 2 processes it no longer divides: refused up front
    assert main(["train", *TINY, "--nproc=2", "--nnodes=2", "--rdzv-endpoint=node0:29400", run]) == 2
    assert main(["train", *TINY, "--nproc=1", "--nnodes=2", run]) == 2  # no rendezvous address
    assert main(["train", *TINY, "--nnodes=1:2", "--rdzv-endpoint=node0:29400", run]) == 2  # elastic: use torchrun
    assert len(calls) == 1


@pytest.mark.slow
def test_shardfit_launcher_on_two_nodes_then_resume_on_one(tmp_path):
    """`shardfit train --nproc 1 --nnodes 2 ...` on both "nodes" for 2 steps, then a 1-process run resumes the
    2-rank checkpoint for step 3: the losses of an uninterrupted 1-process run (DCP reshards on load)."""
    plain = subprocess.run([sys.executable, "-m", "shardfit", "train", *ARGS, f"--logging.run_dir={tmp_path / 'p'}"],
                           capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT)
    assert plain.returncode == 0, plain.stderr[-3000:]

    run_dir = tmp_path / "r"
    res = _two_nodes(lambda rdzv: [sys.executable, "-m", "shardfit", "train", "--nproc=1", *rdzv, *ARGS,
                                   "--train.steps=2", f"--logging.run_dir={run_dir}"], run_dir)
    assert all(rc == 0 for rc, _, _ in res), _tail(res)
    assert json.loads((run_dir / "checkpoints/step_00000002/complete.json").read_text())["world_size"] == 2
    resumed = subprocess.run([sys.executable, "-m", "shardfit", "train", *ARGS, EXTEND,
                              f"--logging.run_dir={run_dir}"],
                             capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 x cpu" in resumed.stdout and "resumed from" in resumed.stdout and "step 3/3" in resumed.stdout
    assert _losses(run_dir) == pytest.approx(_losses(tmp_path / "p"), rel=1e-5, abs=1e-6)
