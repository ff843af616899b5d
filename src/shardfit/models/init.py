"""Deterministic, sharding-independent weight initialisation.

`seeded_normal_` fills a parameter, or the local shard of a row-sharded DTensor, with values that depend only on
(seed, parameter name, row) and the device type (CUDA and CPU generators draw different numbers): a 1-rank and an
N-rank run on the same kind of device start from the same weights, and no rank ever builds the
full tensor. Rows are drawn in blocks of about a million elements, each block from its own seeded generator, so a
shard regenerates at most two partial blocks beyond its own rows. No collectives: only shard metadata is read.
"""

from __future__ import annotations

import zlib

import torch

_BLOCK_ELEMS = 1 << 20


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """(local tensor, global shape, global row offset of the local rows)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if any(o for o in offset[1:]):
            raise NotImplementedError("seeded init supports sharding along dim 0 only")
        return t.to_local(), tuple(t.shape), offset[0] if offset else 0
    return t, tuple(t.shape), 0


@torch.no_grad()
def seeded_normal_(t: torch.Tensor, std: float, seed: int, key: str) -> torch.Tensor:
    local, shape, row0 = local_view(t)
    if local.device.type == "meta" or local.numel() == 0:
        return t
    rows = local.shape[0]
    row_elems = max(1, local[0].numel()) if local.dim() > 0 else 1
    block = max(1, _BLOCK_ELEMS // row_elems)
    base = (seed * 1_000_003 + zlib.crc32(key.encode())) % (1 << 40)
    gen = torch.Generator(device=local.device)
    if local.dim() == 0:
        gen.manual_seed(base)
        local.copy_(torch.randn((), generator=gen, device=local.device) * std)
        return t
    for b in range(row0 // block, (row0 + rows - 1) // block + 1):
        b0, b1 = b * block, min((b + 1) * block, shape[0])
        gen.manual_seed(base * 1_000_000 + b)
        vals = torch.randn((b1 - b0, *shape[1:]), generator=gen, device=local.device, dtype=torch.float32)
        lo, hi = max(b0, row0), min(b1, row0 + rows)
        local[lo - row0:hi - row0].copy_(vals[lo - b0:hi - b0].mul_(std))
    return t
