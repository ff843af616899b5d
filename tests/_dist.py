"""Run a function on N local ranks (gloo: processes forked from a fork server; CUDA backends: spawned) and collect
what each returns."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# gloo ranks are forked from a server process that imported torch, torch.distributed.checkpoint (before any group
# exists, as shardfit.parallel.dist needs) and the tests' helpers once: a spawned rank spent seconds importing them
# again, for every rank of every run. The server starts at the first run (with this session's sys.path) and holds no
# thread pool to fork (OMP_NUM_THREADS=1, conftest.py, before it starts); each rank takes the parent's environment
# of the moment of its run (_entry), as a spawned one does.
PRELOAD = ["torch", "torch.distributed.checkpoint", "tests.helpers"]
multiprocessing.set_forkserver_preload(PRELOAD)


def _entry(rank: int, world: int, store: str, out_dir: str, fn, args, backend: str,
           environ: dict[str, str] | None = None):
    if environ is not None:  # a forked rank: the environment of its run, not the fork server's of its start
        os.environ.clear()
        os.environ.update(environ)
    # "gloo-one-gpu": every rank on cuda:0 over gloo (NCCL refuses two ranks on one GPU): the multi-rank CUDA code
    # paths (streams, async collectives, compile) on a machine with one GPU; no figure from it means anything.
    one_gpu = backend == "gloo-one-gpu"
    backend = "gloo" if one_gpu else backend
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0" if one_gpu else str(rank),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import shardfit.parallel.dist  # noqa: F401  as every shardfit start-up does before the group exists (its comment)

    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, **kwargs)
    try:
        result = fn(rank, world, *args)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is on disk and the group is gone: leave without interpreter teardown. Under CI load, Debian's
    # Python 3.11 aborted a few of these children *after* this point ("terminate called without an active
    # exception" from a C++ destructor at exit), which failed tests whose work had completed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, timeout: float = 300.0, backend: str = "gloo") -> list:
    """fn(rank, world, *args) -> JSON-able, on `world` processes (gloo; NCCL one GPU each; or "gloo-one-gpu": every
    rank on cuda:0 over gloo); results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        # CUDA backends keep spawn: a fresh process per rank, nothing of the server's state near the driver
        ctx = mp.start_processes(_entry, args=(world, store, tmp, fn, args, backend, dict(os.environ)), nprocs=world,
                                 join=False, start_method="forkserver" if backend == "gloo" else "spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"ranks did not finish within {timeout:.0f} s: a hang")
        except Exception as e:
            errs = [Path(tmp, f).read_text() for f in sorted(os.listdir(tmp)) if f.endswith(".err")]
            raise AssertionError("a rank failed:\n" + "\n".join(errs)) from e
        out = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out
