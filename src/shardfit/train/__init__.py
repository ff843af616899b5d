"""Training: the loop (Trainer) around the Engine's step (engine/), checkpoints, metrics and progress.

The names below load on first use, so that the torch-free modules of this package (curves.py: `shardfit plot`,
progress.py, run_config.py's naming) import without torch.
"""

from __future__ import annotations

__all__ = ["Engine", "Trainer", "TrainingHalted", "apply_alloc_conf"]


def __getattr__(name: str):
    if name == "Engine":
        from shardfit.engine import Engine

        return Engine
    if name == "apply_alloc_conf":
        from shardfit.engine.build import apply_alloc_conf

        return apply_alloc_conf
    if name in ("Trainer", "TrainingHalted"):
        from shardfit.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'shardfit.train' has no attribute {name!r}")
