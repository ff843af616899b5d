"""Training: the loop, optimizer and schedule, checkpoints, metrics and progress."""

from shardfit.train.trainer import Trainer, TrainingHalted, apply_alloc_conf

__all__ = ["Trainer", "TrainingHalted", "apply_alloc_conf"]
