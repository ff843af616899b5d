"""A stalled rank: every rank reports where it was, dumps its stacks, and exits; nothing hangs."""

import os
import tempfile
import time

import torch.multiprocessing as mp

from shardfit.train.watchdog import EXIT_CODE
from tests._dist import _entry
from tests.helpers import small_config


def _stall_rank1_in_step2(rank, world, run_dir):
    from shardfit.train import Trainer

    trainer = Trainer(small_config("--train.steps=4", "--train.watchdog_s=3", "--train.micro_batch=2",
                                   run_dir=run_dir))

    def stall(module, args):
        if rank == 1 and trainer.step == 1:  # during step 2
            time.sleep(120)

    trainer.model.model.layers[1].register_forward_pre_hook(stall)
    trainer.fit()
    return {}


def test_stalled_rank_every_rank_reports_and_exits(tmp_path):
    # forked from tests/_dist.py's fork server (torch imported once), each with this environment, as run_ranks does
    ctx = mp.get_context("forkserver")
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=_entry, args=(r, 2, store, str(tmp_path), _stall_rank1_in_step2, (str(tmp_path),),
                                              "gloo", dict(os.environ))) for r in range(2)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    elapsed = time.monotonic() - t0
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank was still running: the watchdog did not fire"
    assert elapsed < 60
    assert [p.exitcode for p in procs] == [EXIT_CODE, EXIT_CODE]
    for r in range(2):
        report = (tmp_path / f"hang_rank{r}.txt").read_text()
        assert f"rank {r}: no progress for 3 s at step 2 micro-batch 1/2" in report
        assert "Thread" in report or "Current thread" in report  # faulthandler's stacks follow
    assert "in stall" in (tmp_path / "hang_rank1.txt").read_text()  # the stalled rank's stack shows where
