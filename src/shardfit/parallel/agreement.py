"""One verdict for every rank: a rank's local problem (a file it cannot write, a lock it cannot take) becomes
the same ShardfitError on all ranks, through one small all-gather, so no rank leaves while its peers wait in the
next collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfit.errors import ShardfitError


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(problem: str | None, where: str, fix: str, device: torch.device | None = None) -> None:
    """Raise on every rank if any rank has a problem. The rank that has one raises its own message; the others
    name the lowest such rank. Every rank must call it, at the same point, problem or not."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        from shardfit.parallel.dist import all_gather_rows

        flag = torch.tensor([problem is not None], dtype=torch.int64, device=device or _collective_device())
        bad = all_gather_rows(flag)[:, 0].tolist()
        if problem is None and any(bad):
            raise ShardfitError(f"rank {bad.index(1)} stopped (its message says why)", where=where, fix=fix)
    if problem is not None:
        raise ShardfitError(problem, where=where, fix=fix)
