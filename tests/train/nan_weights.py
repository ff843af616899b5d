"""Entry point for the non-finite weights test: `shardfit train`, except that the update of step 3 leaves a NaN in
the weights (what an overflowing update does, without depending on how AdamW overflows)."""

import sys

import torch

from shardfit.cli.main import entry
from shardfit.parallel.step_overlap import local_tensor
from shardfit.train import trainer

_train_step = trainer.Trainer.train_step


def train_step(self):
    rec = _train_step(self)
    if self.step == 3:
        with torch.no_grad():
            local_tensor(self.engine.params[0]).view(-1)[0] = float("nan")
    return rec


trainer.Trainer.train_step = train_step
sys.argv[1:1] = ["train"]
entry()
