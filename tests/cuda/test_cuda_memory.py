"""GPU tests of the memory monitor and the doctor on a real shardfit run."""

import os
import subprocess
import sys

import pytest
import torch

from shardfit.doctor import examine
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import small_config

pytestmark = pytest.mark.cuda
BIGGER = ["--train.device=cuda", "--model.dim=512", "--model.n_layers=4", "--model.n_heads=8", "--model.ffn_dim=1536",
          "--data.seq_len=64", "--train.steps=5", "--logging.log_every=100"]


def _recorded_step(rank, world, run_dir):
    trainer = Trainer(small_config(*BIGGER, "--memory.snapshot_steps=3", run_dir=run_dir))
    trainer.train_step()
    trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step()  # recorded from its start, dumped at its end
    return {"measured_peak": torch.cuda.max_memory_allocated(), "file": str(trainer.recorder.files[3])}


def test_doctor_replays_a_real_run_to_the_measured_peak(tmp_path):
    world = min(2, torch.cuda.device_count())
    res = run_ranks(_recorded_step, world, str(tmp_path), backend="nccl")
    results, findings = examine([r["file"] for r in res])
    for r, x in zip(res, results):
        assert abs(x.replay.peak.allocated - r["measured_peak"]) / r["measured_peak"] < 0.01
    if world == 2:
        assert not [f for f in findings if f.code == "imbalance"]
    assert any(c in results[0].replay.peak.categories for c in ("activations", "fsdp_all_gather", "logits_loss"))


def test_oom_dumps_snapshot_and_exits_with_verdict(tmp_path):
    world = min(2, torch.cuda.device_count())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "-m",
           "shardfit", "train", *BIGGER, "--train.micro_batch=64", f"--train.global_batch={64 * world}",
           "--memory.max_fraction=0.001", f"--logging.run_dir={tmp_path}", "--logging.progress=lines"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ})
    assert p.returncode != 0
    assert "ran out of GPU memory in step 1" in p.stderr and "doctor:" in p.stderr, p.stderr[-3000:]
    assert list((tmp_path / "snapshots").glob("oom_step000001_rank*.pickle"))
