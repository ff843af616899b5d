"""Deterministic, sharding-independent weight initialisation.

`seeded_normal_` fills a parameter, or the local shard of a row-sharded DTensor, with values that depend only on
(seed, parameter name, row) and the device type (CUDA and CPU generators draw different numbers): a 1-rank and an
N-rank run on the same kind of device start from the same weights, and no rank ever builds the
full tensor. Rows are drawn in blocks of about a million elements, each block from its own seeded generator, so a
shard regenerates at most two partial blocks beyond its own rows. No collectives: only shard metadata is read.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

_BLOCK_ELEMS = 1 << 20

# The parameters a quantized weight is stored in (adapters/qlora.py: NF4; adapters/fp8_base.py: FP8), named here so
# that this package skips them without importing adapters/: their bytes are codes, not numbers (never drawn,
# counted or checked as weights).
NF4_STORAGE = ("weight_nf4", "weight_absmax", "weight_stats")
FP8_STORAGE = ("weight_fp8", "weight_scale")
QUANTIZED_STORAGE = NF4_STORAGE + FP8_STORAGE


def is_quantized_storage(name: str) -> bool:
    return name.rpartition(".")[2] in QUANTIZED_STORAGE


# (local rows, global shape, global row offset of the local rows): how a parameter's shard sits in the whole
ShardView = Callable[[torch.Tensor], tuple[torch.Tensor, tuple[int, ...], int]]


def whole_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """The view of an unsharded tensor: all of it, from row 0. Sharded tensors need the view of their sharding
    (shardfit.parallel.dtensor.local_view)."""
    if hasattr(t, "to_local"):
        raise TypeError("a sharded tensor: pass view=shardfit.parallel.dtensor.local_view")
    return t, tuple(t.shape), 0


@torch.no_grad()
def seeded_normal_(t: torch.Tensor, std: float, seed: int, key: str, view: ShardView = whole_view) -> torch.Tensor:
    local, shape, row0 = view(t)
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
