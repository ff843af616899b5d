"""The step: the sharded model, its optimizer and one forward_backward / forward / optim_step path whose only variable
is the loss (engine.py, losses.py), over one packed micro-batch type (batch.py). The trainer's loop (train/), the RL
API (rl/) and the server (serve/) are its clients. docs/architecture.md: where it sits."""

from shardfit.engine.batch import PackedBatch, pack_local
from shardfit.engine.engine import Engine
from shardfit.engine.losses import CrossEntropy, Loss, TokenLoss
from shardfit.engine.optim import AdamParams
from shardfit.engine.records import OutOfMemory, StepRecord, StepStats

__all__ = ["AdamParams", "CrossEntropy", "Engine", "Loss", "OutOfMemory", "PackedBatch", "StepRecord", "StepStats",
           "TokenLoss", "pack_local"]
