"""Process-group teardown (parallel/dist.py)."""

import os

import pytest

from tests._dist import run_ranks
from tests.helpers import small_config

MOE_EP = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32",
          "--parallel.expert_parallel=2"]


def _gloo_threads() -> list[str]:
    from pathlib import Path

    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return sorted(n for n in names if "gloo" in n)


def _train_then_shutdown(rank, world, extra, run_dir):
    import gc

    from shardfit.parallel import shutdown_distributed
    from shardfit.train import Trainer

    trainer = Trainer(small_config(*extra, "--train.steps=2", run_dir=run_dir))
    trainer.fit()
    during = _gloo_threads()
    del trainer
    gc.collect()
    shutdown_distributed()
    return {"during": during, "after": _gloo_threads()}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from /proc")
@pytest.mark.parametrize("extra", [[], MOE_EP], ids=["dense", "moe-ep2"])
def test_shutdown_ends_the_gloo_threads_after_fully_shard(tmp_path, extra):
    """After fully_shard, DTensor's caches keep the mesh and its gloo group alive past destroy_process_group; a
    worker thread left running at interpreter exit can abort the process (benchmarks/notes/2026-11-23_s10.md).
    shutdown_distributed clears them: the group's threads end."""
    res = run_ranks(_train_then_shutdown, 2, extra, str(tmp_path))
    for r in res:
        assert r["during"], "no gloo threads while the group lives: the check would prove nothing"
        assert r["after"] == [], r


_GROUP_FIRST = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the caller's group, made first
from shardfit.parallel import shutdown_distributed  # imports torch.distributed.checkpoint now, after the group
from shardfit.train import Trainer
from tests.helpers import small_config
Trainer(small_config("--train.steps=1", "--train.device=cpu", run_dir=sys.argv[1])).fit()
names = lambda: [n for t in os.listdir("/proc/self/task") if "gloo" in (n := open(f"/proc/self/task/{t}/comm").read())]
during = names()
shutdown_distributed()
print(len(during), len(names()))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from /proc")
def test_a_group_made_before_shardfit_is_imported_ends_at_shutdown(tmp_path):
    """As a Ray worker runs it: the process group first, then shardfit (torch.distributed.nn.functional captures the
    default group as a default argument at that import); after a run, shutdown_distributed still ends its threads."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _GROUP_FIRST, str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    during, after = map(int, out.stdout.split()[-2:])
    assert during > 0 and after == 0, (during, after)


TORCHRUN = {"TORCHELASTIC_RUN_ID": "job", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("env, want", [
    # One process started directly: nothing set, or only values that mean one process anyway.
    ({}, None),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, None),
    ({"MASTER_ADDR": "nowhere", "MASTER_PORT": "not even a port"}, None),  # unused without a group to join
    ({"WORLD_SIZE": " 1 "}, None),
    # Left from another job: named, never joined.
    ({"RANK": "1", "WORLD_SIZE": "2"}, "environment variable WORLD_SIZE: WORLD_SIZE=2 is set, but torchrun"),
    ({"WORLD_SIZE": "4"}, "environment variable WORLD_SIZE: WORLD_SIZE=4 is set"),
    ({"RANK": "3"}, "environment variable RANK: RANK=3 is set"),
    ({"LOCAL_RANK": "1"}, "environment variable LOCAL_RANK: LOCAL_RANK=1 is set"),
    ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE: WORLD_SIZE=0 is set"),
    ({"RANK": "abc"}, "environment variable RANK: 'abc' is not a whole number"),
    ({"WORLD_SIZE": "2.0"}, "environment variable WORLD_SIZE: '2.0' is not a whole number"),
    ({"LOCAL_RANK": ""}, "environment variable LOCAL_RANK: '' is not a whole number"),
    # torchrun's variables, inconsistent.
    (TORCHRUN, (1, 2, 1, "127.0.0.1", 29500)),
    ({**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, (0, 1, 0, "127.0.0.1", 29500)),
    ({"TORCHELASTIC_RUN_ID": "job"}, "environment variable RANK: is not set, though TORCHELASTIC_RUN_ID"),
    ({**TORCHRUN, "MASTER_ADDR": ""}, "environment variable MASTER_ADDR: is not set"),
    ({**TORCHRUN, "RANK": "2"}, "RANK=2 is out of range (must be from 0 to WORLD_SIZE-1=1)"),
    ({**TORCHRUN, "RANK": "-1"}, "RANK=-1 is out of range"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range (must be at least 1)"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 is out of range (must be from 0 to RANK=1)"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
    ({**TORCHRUN, "MASTER_PORT": "0"}, "MASTER_PORT=0 is out of range"),
    ({**TORCHRUN, "MASTER_PORT": "port"}, "environment variable MASTER_PORT: 'port' is not a whole number"),
])
def test_launch_env_table(env, want):
    from shardfit.errors import ShardfitError
    from shardfit.parallel.dist import launch_env

    if isinstance(want, str):
        with pytest.raises(ShardfitError) as e:
            launch_env(env)
        assert want in str(e.value) and "fix: unset RANK WORLD_SIZE" in str(e.value), str(e.value)
    else:
        got = launch_env(env)
        assert (None if got is None else (got.rank, got.world_size, got.local_rank, got.master_addr,
                                          got.master_port)) == want


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("agent_store", [True, False], ids=["torchrun-agent-store", "rank0-hosts-store"])
def test_unreachable_store_is_one_line_within_a_bound(monkeypatch, agent_store):
    """A stale MASTER_ADDR:MASTER_PORT: with torchrun's agent store a refused connection is final (at once);
    otherwise rank 1 waits for rank 0's store, for at most the bound (here the group timeout, 1 s)."""
    import time

    from shardfit.errors import ShardfitError
    from shardfit.parallel.dist import LaunchEnv, _join_store

    port = _free_port()  # nothing listens on it
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True" if agent_store else "False")
    start = time.monotonic()
    with pytest.raises(ShardfitError) as e:
        _join_store(LaunchEnv(1, 2, 1, "127.0.0.1", port), timeout_s=1.0)
    took = time.monotonic() - start
    assert f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}: the process group's store does not answer" in str(e.value)
    assert took < (1.0 if agent_store else 5.0), took
