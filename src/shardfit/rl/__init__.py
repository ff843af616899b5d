"""The RL side of the Engine: Tinker's data model (datum.py), the losses and their normalisation (losses.py), and
datums -> token-budget micro-batches (pack.py)."""

from shardfit.rl.datum import AdamParams, Datum, ForwardBackwardResult, make_datum

__all__ = ["AdamParams", "Datum", "ForwardBackwardResult", "make_datum"]
