"""Per-step phase timings: present on every rank, consistent with the step's wall time, no extra collectives."""

import json

from shardfit.engine.timing import PHASES
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import small_config


def _timed_steps(rank, world, run_dir):
    trainer = Trainer(small_config("--train.micro_batch=2", "--train.steps=3", "--logging.log_every=1",
                                   "--logging.level=debug", run_dir=run_dir))
    recs = [trainer.train_step() for _ in range(3)]
    return [{"phases": r.phases, "time_s": r.time_s} for r in recs]


def test_phases_add_up_within_the_step(tmp_path):
    for rank_recs in run_ranks(_timed_steps, 2, str(tmp_path)):
        first, *rest = rank_recs
        assert "optimizer" not in first["phases"]  # the optimizer of step n is read at step n + 1's sync
        for r in rest:
            p = r["phases"]
            assert set(p) == set(PHASES), p
            assert all(v > 0 for v in p.values()), p
            # forward and backward of this step and the previous optimizer fit in this step plus the last one
            assert p["forward"] + p["backward"] < r["time_s"]
            assert p["comm_wait"] < p["forward"] + p["backward"]  # waits happen inside the passes


def test_debug_level_prints_each_micro_batch_and_metrics_hold_phases(tmp_path, capsys):
    Trainer(small_config("--train.micro_batch=2", "--train.steps=2", "--logging.log_every=1",
                         "--logging.level=debug", "--logging.progress=lines", run_dir=str(tmp_path))).fit()
    out = capsys.readouterr().out
    assert "debug: step 1/2 micro-batch 1/4" in out and "debug: step 2/2 micro-batch 4/4" in out
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert all(rec[f"time_{k}_s"] > 0 for k in PHASES)
    assert "fwd/bwd/opt " in out and "comm" not in out  # one process: no communication to wait for
