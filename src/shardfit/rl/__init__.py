"""The RL API (Tinker's) as a client of the Engine: the data model (datum.py), the losses and their normalisation
(losses.py), datums -> packed micro-batches (pack.py), and forward / forward_backward / optim_step over datums
(step.py)."""

from shardfit.engine.optim import AdamParams
from shardfit.rl.datum import Datum, ForwardBackwardResult, make_datum
from shardfit.rl.step import DatumEngine, forward, forward_backward, optim_step

__all__ = ["AdamParams", "Datum", "DatumEngine", "ForwardBackwardResult", "forward", "forward_backward", "make_datum",
           "optim_step"]
