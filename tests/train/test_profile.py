"""--logging.profile_step: a real profiled step on the CPU writes its trace and summary, on one rank and on two."""

import gzip
import json

from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import small_config


def test_profiled_step_writes_trace_and_summary(tmp_path, capsys):
    Trainer(small_config("--train.micro_batch=2", "--train.steps=3", "--logging.profile_step=2",
                         "--logging.progress=lines", run_dir=str(tmp_path))).fit()
    out = capsys.readouterr().out
    assert "profile of step 2:" in out and "aten::mm" in out
    with gzip.open(tmp_path / "profile" / "step2_rank0.json.gz") as f:
        trace = json.loads(f.read())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    summary = json.loads((tmp_path / "profile" / "step2_summary.json").read_text())
    assert summary["top_ops_ms"] and all(t > 0 for _, t in summary["top_ops_ms"])
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step2_rank0.json.gz", "step2_summary.json"]


def _profiled(rank, world, run_dir):
    trainer = Trainer(small_config("--train.micro_batch=2", "--train.steps=3", "--logging.profile_step=2",
                                   run_dir=run_dir))
    return {"losses": [h["loss"] for h in trainer.fit()]}


def test_two_ranks_profile_the_same_step_and_rank_zero_writes(tmp_path):
    """Every rank profiles step 2 (the step stays symmetric, no rank is left in a collective); only rank 0 writes."""
    results = run_ranks(_profiled, 2, str(tmp_path))
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step2_rank0.json.gz", "step2_summary.json"]
