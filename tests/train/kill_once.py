"""torchrun entry point for the restart test: `shardfit train`, except that on the first attempt rank 1 SIGKILLs
itself at the start of step 5 (after the step-4 checkpoint)."""

import os
import signal
import sys

from shardfit.cli.main import entry
from shardfit.train import trainer

_train_step = trainer.Trainer.train_step


def train_step(self):
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and self.dist.rank == 1 and self.step == 4:
        os.kill(os.getpid(), signal.SIGKILL)
    return _train_step(self)


trainer.Trainer.train_step = train_step
sys.argv[1:1] = ["train"]
entry()
