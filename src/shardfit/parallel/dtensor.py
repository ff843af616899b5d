"""DTensor helpers: a sharded tensor's local shard, and where its rows sit in the global tensor.

The model's seeded initialisation (models/init.py) and the Hugging Face loader (weights/hf_load.py) take `local_view` to
address a shard's rows by their global index; models/ itself holds no distributed code.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """(local tensor, global shape, global row offset of the local rows) of a DTensor sharded along dim 0 (or
    replicated), or of a plain tensor (itself, its shape, 0). Reads shard metadata only: no collective."""
    if not isinstance(t, DTensor):
        return t, tuple(t.shape), 0
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if any(o for o in offset[1:]):
        raise NotImplementedError("seeded init supports sharding along dim 0 only")
    return t.to_local(), tuple(t.shape), offset[0] if offset else 0


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
