"""Distributed setup and the parallelize step (checkpointing, compile, FSDP2)."""

from shardfit.parallel.dist import DistInfo, all_gather_rows, init_distributed, shutdown_distributed
from shardfit.parallel.parallelize import apply_activation_checkpointing, apply_fsdp, mixed_precision, parallelize

__all__ = ["DistInfo", "all_gather_rows", "apply_activation_checkpointing", "apply_fsdp", "init_distributed",
           "mixed_precision", "parallelize", "shutdown_distributed"]
