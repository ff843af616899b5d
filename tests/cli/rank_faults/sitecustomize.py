"""Fault injection for the launcher tests, loaded by every Python process that has this directory on PYTHONPATH.

SHARDFIT_TEST_FAULT="RANK:KIND" makes that rank of a torchrun job fail as it starts its second training step:
KIND "error" raises a ShardfitError only that rank sees, "crash" raises a RuntimeError (a bug), "kill" SIGKILLs the
rank (as the out-of-memory killer would). Other processes are left alone.
"""

import os

_spec = os.environ.get("SHARDFIT_TEST_FAULT", "")
if _spec and os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("RANK") == _spec.partition(":")[0]:
    import signal

    from shardfit.errors import ShardfitError
    from shardfit.train import trainer

    _kind = _spec.partition(":")[2]
    _train_step = trainer.Trainer.train_step

    def _faulty_step(self):
        if self.step == 1:
            if _kind == "error":
                raise ShardfitError("a value only this rank sees", where="planted.key", fix="remove the fault")
            if _kind == "crash":
                raise RuntimeError("planted bug")
            if _kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        return _train_step(self)

    trainer.Trainer.train_step = _faulty_step
