"""Process-group setup: one code path for a single process, torchrun on one node, and torchrun on many."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Imported before any process group exists where shardfit starts the group itself: torch.distributed.checkpoint
# imports torch.distributed.nn.functional, whose functions take `group=group.WORLD` as a default argument, evaluated
# at import: imported after init_process_group, the default group is held there for good (release_captured_groups).
import torch.distributed.checkpoint  # noqa: F401,E402  (isort: keep with torch.distributed)

from shardfit.errors import ShardfitError


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ShardfitError("train.device=cuda but no CUDA GPU is visible", where="train.device",
                                fix="use train.device=cpu or check CUDA_VISIBLE_DEVICES")
        if local_rank >= torch.cuda.device_count():
            raise ShardfitError(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible)",
                                where="torchrun --nproc_per_node", fix="start at most one process per GPU")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_kind: str = "auto", timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group torchrun describes, or make a 1-process group when started directly.

    An existing group (tests create one) is used as it is. Every rank gets the same backend: NCCL on CUDA,
    gloo on CPU. Launcher variables left in the environment of a plain run are refused (launch_env), and the
    connection to torchrun's store is bounded (STORE_WAIT_S): a bad environment is one line, never a hang.
    """
    if dist.is_initialized():
        env, local_rank = None, int(os.environ.get("LOCAL_RANK", 0))
        if device_kind == "auto" and dist.get_backend() == "gloo":
            device_kind = "cpu"  # an existing gloo group (tests, CPU jobs) means CPU tensors
    else:
        env = launch_env()
        local_rank = env.local_rank if env else 0
    device = pick_device(device_kind, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if env is None or env.world_size == 1:
            # One process: a group of one (so the code path is the same) over an in-process store. No port and no
            # environment variables: a process that trains twice, or starts a child that trains, must not hand a
            # port it still holds to the next group (EADDRINUSE).
            store, rank, world = dist.HashStore(), 0, 1
        else:
            store, rank, world = _join_store(env, timeout_s), env.rank, env.world_size
            store.set_timeout(timeout)  # joined: collectives get the full timeout
            # Under torchrun --max-restarts, each attempt's keys live under their own prefix, so a restarted worker
            # can never read an address the previous attempt's (dead) workers published.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"shardfit/attempt{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


# The variables torchrun sets for each process. In a process torchrun did not start they are leftovers (a shell that
# exported them, a job script, a child of a torchrun worker): joining the group they describe would hang.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_UNSET = ("unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID to train in one process, "
          "or start several with shardfit train --nproc N (or torchrun)")
# How long a rank waits to reach the store of its process group. Under torchrun the agent's store is up before any
# worker starts, so this is only a connection: a minute covers a loaded machine, and a stale address fails in it.
STORE_WAIT_S = 60.0


@dataclass
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_env(environ=None) -> LaunchEnv | None:
    """The process group torchrun's variables describe, checked; None for one process started directly.

    Outside torchrun (no TORCHELASTIC_RUN_ID) only values that mean one process anyway are accepted (RANK=0,
    WORLD_SIZE=1, LOCAL_RANK=0; MASTER_ADDR/MASTER_PORT are then unused): anything else names the variable."""
    environ = os.environ if environ is None else environ
    torchrun = bool(environ.get("TORCHELASTIC_RUN_ID"))
    ints = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")[:4 if torchrun else 3]:
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            ints[name] = int(raw)
        except ValueError:
            raise ShardfitError(f"'{raw}' is not a whole number", where=f"environment variable {name}",
                                fix=_UNSET) from None
    if not torchrun:
        for name, neutral in (("WORLD_SIZE", 1), ("RANK", 0), ("LOCAL_RANK", 0)):
            if ints.get(name, neutral) != neutral:
                raise ShardfitError(f"{name}={ints[name]} is set, but torchrun did not start this process (no "
                                    "TORCHELASTIC_RUN_ID): a value left from another job",
                                    where=f"environment variable {name}", fix=_UNSET)
        return None
    for name in LAUNCH_VARS:
        if not environ.get(name):
            raise ShardfitError("is not set, though TORCHELASTIC_RUN_ID says torchrun started this process",
                                where=f"environment variable {name}", fix=_UNSET)
    rank, world, local, port = ints["RANK"], ints["WORLD_SIZE"], ints["LOCAL_RANK"], ints["MASTER_PORT"]
    for name, ok, rule in (("WORLD_SIZE", world >= 1, "at least 1"), ("RANK", 0 <= rank < world,
                           f"from 0 to WORLD_SIZE-1={world - 1}"), ("LOCAL_RANK", 0 <= local <= rank,
                           f"from 0 to RANK={rank}"), ("MASTER_PORT", 1 <= port <= 65535, "from 1 to 65535")):
        if not ok:
            raise ShardfitError(f"{name}={ints[name]} is out of range (must be {rule})",
                                where=f"environment variable {name}", fix=_UNSET)
    return LaunchEnv(rank, world, local, environ["MASTER_ADDR"], port)


def _join_store(env: LaunchEnv, timeout_s: float):
    """The TCPStore of torchrun's env:// rendezvous, reached within STORE_WAIT_S (or the group's timeout, if
    shorter); a store that cannot be reached is one line naming the address."""
    import socket
    import time

    wait = min(timeout_s, STORE_WAIT_S)
    where = f"MASTER_ADDR:MASTER_PORT={env.master_addr}:{env.master_port}"
    fix = f"start the job with torchrun or shardfit train --nproc N; if no job is running, {_UNSET}"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if agent_store or env.rank != 0:
        # Wait for the store's port here, quietly: TCPStore's own retries log a C++ stack per attempt. torchrun's
        # agent hosts its store before it starts any worker, so there a refused connection is final (a stale
        # address) and is said at once; without it, rank 0 may still be starting its store.
        deadline = time.monotonic() + wait
        while True:
            try:
                socket.create_connection((env.master_addr, env.master_port), timeout=wait).close()
                break
            except OSError as e:
                if agent_store or time.monotonic() > deadline:
                    raise ShardfitError(f"the process group's store does not answer ({e.strerror or e})",
                                        where=where, fix=fix) from None
                time.sleep(0.5)
    try:
        store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=wait)))
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError (a timeout) is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShardfitError(f"the process group's store is not reachable within {wait:.0f} s ({first})", where=where,
                            fix=fix) from None
    return store


def shutdown_distributed() -> None:
    """Leave the process group cleanly (also after an error: NCCL warns about groups left open at exit)."""
    if dist.is_initialized():
        release_dtensor_caches()
        dist.destroy_process_group()
        release_captured_groups()


def release_captured_groups() -> None:
    """Drop the process groups torch.distributed.nn.functional captured as default arguments (`group=group.WORLD`
    is evaluated when the module is imported: after init_process_group, e.g. a Ray worker that creates the group and
    imports shardfit after, the default group itself). Held there, a destroyed gloo group's worker threads never end,
    and one can abort the interpreter at exit. None is what those defaults are when the module is imported first,
    and means the default group to every torch.distributed call."""
    import gc
    import sys

    functional = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(functional).values() if functional is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)
    gc.collect()


def release_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches, which keep DeviceMeshes (hence their process
    groups) alive past destroy_process_group: after fully_shard, a gloo group's worker threads then outlive the
    group, and one destroying a finished work during interpreter exit takes the GIL and aborts the process
    ("terminate called without an active exception"). The caches only save
    recomputation; they are private (torch 2.6-2.13), so each is cleared only where it exists. Clears this thread's
    thread-local entries (the step's DTensor ops run on it)."""
    import gc

    for module, names in (("torch._C", ("_clear_DTensor_sharding_propagator_cache",)),  # C++ fast path: spec -> mesh
                          ("torch.distributed.tensor.debug", ("_clear_python_sharding_prop_cache",)),
                          ("torch.distributed.tensor._redistribute", ("clear_redistribute_planner_cache",)),
                          ("torch.distributed.tensor._redistribute", ("_gen_transform_infos", "cache_clear")),
                          ("torch.distributed.tensor._collective_utils", ("MeshTopoInfo", "build_from_mesh",
                                                                          "cache_clear"))):
        try:
            fn = __import__(module, fromlist=["_"])
            for name in names:
                fn = getattr(fn, name)
            fn()
        except (ImportError, AttributeError):
            pass
    gc.collect()


def all_gather_rows(vec: torch.Tensor) -> torch.Tensor:
    """[k] on every rank -> [world, k] on every rank, in one collective."""
    world = dist.get_world_size()
    out = torch.empty((world, vec.numel()), dtype=vec.dtype, device=vec.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out.view(-1), vec.contiguous())
    return out
