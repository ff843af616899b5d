"""The largest micro-batch that fits: the plan's per-mode edge, `train.micro_batch=0` on GPUs and on the CPU, and the
freed gradients' cache; `shardfit plan` prints the table of them."""

import subprocess
import sys

import pytest

from shardfit.config import load_config
from shardfit.plan.estimate import GiB, estimate
from shardfit.plan.micro_batch import largest_micro_batch


def test_largest_micro_batch_is_the_edge():
    cfg = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096", "--compute.activation_checkpoint=full"])
    budget = 100 * GiB
    best = largest_micro_batch(cfg, 2, budget)
    assert best is not None and best.peak <= budget < estimate(cfg, 2, best.micro_batch + 1).peak
    small = load_config(None, ["--model.name=llama3-70b", "--data.seq_len=4096"])
    assert largest_micro_batch(small, 1, 80 * GiB) is None  # 70B on one 80 GiB GPU: nothing fits


def test_plan_command_prints_the_table():
    p = subprocess.run([sys.executable, "-m", "shardfit", "plan", "--model.name=llama3-8b", "--data.seq_len=4096",
                        "--train.micro_batch=2", "--nproc", "2", "--gpu-memory", "139"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert any(line.startswith("none") and "as configured: fits" in line for line in lines)
    assert {line.split()[0] for line in lines if "largest that fits" in line} == {"none", "selective", "full"}


def test_auto_micro_batch_is_the_largest_divisor_that_fits():
    from shardfit.plan.micro_batch import choose_micro_batch

    cfg = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.micro_batch=0"])
    budget = 100 * GiB
    e = choose_micro_batch(cfg, 2, budget, per_rank=8)
    assert e.peak <= budget
    bigger = [d for d in (2, 4, 8) if d > e.micro_batch]
    assert bigger and estimate(cfg, 2, bigger[0]).peak > budget


def _auto_trainer(rank, world, run_dir):
    from shardfit.train import Trainer
    from tests.helpers import small_config

    t = Trainer(small_config("--train.micro_batch=0", run_dir=run_dir))
    return {"mb": t.cfg.train.micro_batch, "accum": t.accum, "saved": "micro_batch = 4" in t.config_toml}


def test_auto_micro_batch_on_cpu_means_no_accumulation(tmp_path):
    from tests._dist import run_ranks

    for r in run_ranks(_auto_trainer, 2, str(tmp_path)):
        assert r == {"mb": 4, "accum": 1, "saved": True}  # global batch 8 over 2 ranks


def test_auto_micro_batch_says_what_freed_gradients_would_allow():
    """Llama-3-8B compiled on 2 x H200 (139.8 GiB): kept gradients fit micro-batch 2; freed, 4 fits (measured: kept
    gradients at 4 gave allocator retries, freed ones none)."""
    from shardfit.plan.micro_batch import auto_micro_batch

    cfg = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.micro_batch=0",
                             "--train.global_batch=8", "--compute.compile=true"])
    e, line = auto_micro_batch(cfg, 2, 139.8 * GiB, per_rank=4)
    assert e.micro_batch == 2 and line.startswith("train.micro_batch=0: chose 2")
    assert "with --memory.keep_grads=false 4 would fit" in line
    freed = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096", "--train.micro_batch=0",
                               "--train.global_batch=8", "--compute.compile=true", "--memory.keep_grads=false"])
    e, line = auto_micro_batch(freed, 2, 139.8 * GiB, per_rank=4)
    assert e.micro_batch == 4 and "would fit" not in line


def test_freed_gradients_leave_room_for_their_cache():
    """FP8 tensorwise, gradients freed, 2 x H200: micro-batch 5 ran without retries, 6 retried 29 times a step
    (132.8 GiB allocated, under the kept-gradients budget); the freed gradients' cache is what did not fit."""
    pytest.importorskip("torchao.float8", reason="FP8 needs the optional torchao extra")
    from shardfit.plan.estimate import allocation_budget
    from shardfit.plan.micro_batch import choose_micro_batch

    def cfg(per_rank):  # one micro-batch per step, as measured
        return load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096", "--compute.compile=true",
                                  "--compute.fp8=tensorwise", "--memory.keep_grads=false", "--train.micro_batch=0",
                                  f"--train.global_batch={2 * per_rank}"])

    device = 139.8 * GiB
    budget = allocation_budget(device)
    assert estimate(cfg(6), 2, 6).peak < budget  # what the allocated-memory rule alone would allow
    assert choose_micro_batch(cfg(6), 2, budget, 6, device).micro_batch < 6
    assert choose_micro_batch(cfg(5), 2, budget, 5, device).micro_batch == 5
