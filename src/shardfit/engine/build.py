"""How an Engine is started: the allocator's settings before the first CUDA allocation, the GPU memory a run may
plan for, and compute.activation_checkpoint=auto resolved for the job's smallest GPU before the model is built."""

from __future__ import annotations

import os

import torch

from shardfit.config import Config
from shardfit.parallel import DistInfo


def apply_alloc_conf(alloc_conf: str) -> None:
    """Default allocator settings for CUDA runs; must happen before the first CUDA allocation. The user's own
    PYTORCH_CUDA_ALLOC_CONF always wins."""
    if alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf


def device_memory_bytes(cfg: Config, device: torch.device) -> float:
    """What a run may plan for on this GPU: its memory, times memory.max_fraction where set."""
    return torch.cuda.get_device_properties(device).total_memory * (cfg.memory.max_fraction or 1.0)


def resolve_auto_checkpointing(cfg: Config, dist: DistInfo) -> str:
    """compute.activation_checkpoint=auto, resolved in place before the model is built (plan/auto_checkpointing.py)
    for the job's smallest GPU: one all-reduce (MIN) of the device memory, so every rank builds the same blocks.
    Returns the line the run prints."""
    from shardfit.plan.auto_checkpointing import auto_checkpointing

    gpu_gib = None
    if dist.device.type == "cuda":
        total = torch.tensor(device_memory_bytes(cfg, dist.device), device=dist.device, dtype=torch.float64)
        if dist.world_size > 1:
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MIN)
        gpu_gib = total.item() / 2**30
    changes, line = auto_checkpointing(cfg, dist.world_size, gpu_gib)
    for key, value in changes.items():
        section, _, name = key.partition(".")
        setattr(getattr(cfg, section), name, value)
    return line
