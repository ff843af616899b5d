"""The Tinker SDK examples (examples/tinker_sft.py, examples/tinker_rl.py) against a real `shardfit serve`.

Fast: the SFT example's loop for a few steps against the real Engine served in one spawned rank (no second
interpreter for the server). Slow: each example as a user runs it (it starts `shardfit serve` itself), shortened;
the SFT loss falls and the capitals come back, the RL reward rises while the sampler/trainer gap stays near 0.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES, SRC = ROOT / "examples", ROOT / "src"
SERVER = ["--model.name=tiny", "--train.device=cpu", "--train.micro_batch_tokens=512"]


@pytest.fixture
def examples(monkeypatch):
    """The examples importable as their own scripts see each other; the server they start imports this src."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    import tinker_rl
    import tinker_sft

    return tinker_sft, tinker_rl


def _sft_in_process(rank, world, run_dir, steps):
    """One rank: the real Engine behind the server's HTTP side and command loop, driven by the example's loop."""
    os.environ["TINKER_TELEMETRY"] = "0"
    sys.path.insert(0, str(EXAMPLES))
    import tinker_sft

    from shardfit.config import load_config
    from shardfit.engine import Engine
    from shardfit.serve.server import start_rank0

    cfg = load_config(None, [*SERVER, f"--logging.run_dir={run_dir}"])
    serving = start_rank0(cfg, Engine.start(cfg), port=0)
    loop = threading.Thread(target=serving.loop.run, daemon=True)
    loop.start()
    try:
        return tinker_sft.train(serving.url, "tml-test", steps=steps, batch=16, lr=2e-3, seed=0, log=lambda _: None)
    finally:
        serving.state.scheduler.close()
        loop.join(30)
        serving.stop()


def test_sft_example_loss_falls_and_samples_come_back(tmp_path):
    from tests._dist import run_ranks

    out = run_ranks(_sft_in_process, 1, str(tmp_path / "run"), 12, timeout=240)[0]
    losses = out["losses"]
    assert len(losses) == 12
    assert losses[0] > 5.0  # random weights over 264 ids: ln 264 = 5.6 nats
    assert losses[-1] < losses[0] - 2.0, losses  # the byte statistics of the answers are learnt within a few steps
    # a greedy answer for every country, sampled from the trained weights (stopped at EOS or max_tokens)
    assert len(out["answers"]) == 16 and all(0 < len(a) <= 16 for a in out["answers"].values()), out["answers"]


@pytest.mark.slow
def test_sft_example_learns_the_capitals(examples):
    tinker_sft, _ = examples
    out = tinker_sft.main(["--steps=100", "--seed=0"])
    losses = out["losses"]
    assert losses[0] > 5.0 and losses[-1] < 0.2, losses
    assert out["correct"] >= 12, out["answers"]  # greedy answers from the sampling client of the trained weights


@pytest.mark.slow
def test_rl_example_reward_rises(examples):
    _, tinker_rl = examples
    out = tinker_rl.main(["--steps=24", "--seed=0"])
    rewards = [h["reward"] for h in out["history"]]
    assert out["after"] > out["before"] + 0.15, out  # mean reward over every problem, 4 samples each
    assert sum(rewards[-6:]) / 6 > sum(rewards[:6]) / 6 + 0.1, rewards
    gaps = [h["gap"] for h in out["history"] if "gap" in h]
    assert gaps and max(gaps) < 1e-3, gaps  # the sampler runs the trained weights: log-probs agree
