"""Training: the step (Engine), the loop (Trainer), optimizer and schedule, checkpoints, metrics and progress."""

from shardfit.train.engine import Engine, apply_alloc_conf
from shardfit.train.trainer import Trainer, TrainingHalted

__all__ = ["Engine", "Trainer", "TrainingHalted", "apply_alloc_conf"]
