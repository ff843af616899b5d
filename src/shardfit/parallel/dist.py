"""Process-group setup: one code path for a single process, torchrun on one node, and torchrun on many."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    gloo on CPU.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_kind == "auto" and dist.is_initialized() and dist.get_backend() == "gloo":
        device_kind = "cpu"  # an existing gloo group (tests, CPU jobs) means CPU tensors
    device = pick_device(device_kind, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        if "RANK" not in os.environ:
            # Plain `shardfit train`: a group of one (so the code path is the same) over an in-process store. No port
            # and no environment variables: a process that trains twice, or starts a child that trains, must not
            # hand a port it still holds to the next group (EADDRINUSE).
            store, rank, world = dist.HashStore(), 0, 1
        else:
            store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
            # Under torchrun --max-restarts, each attempt's keys live under their own prefix, so a restarted worker
            # can never read an address the previous attempt's (dead) workers published.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"shardfit/attempt{attempt}/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def shutdown_distributed() -> None:
    """Leave the process group cleanly (also after an error: NCCL warns about groups left open at exit)."""
    if dist.is_initialized():
        release_dtensor_caches()
        dist.destroy_process_group()


def release_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribution caches, which keep DeviceMeshes (hence their process
    groups) alive past destroy_process_group: after fully_shard, a gloo group's worker threads then outlive the
    group, and one destroying a finished work during interpreter exit takes the GIL and aborts the process
    ("terminate called without an active exception"; benchmarks/NOTES.md, session 10). The caches only save
    recomputation; they are private (torch 2.6-2.13), so each is cleared only where it exists. Clears this thread's
    thread-local entries (the trainer's DTensor ops run on it)."""
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
