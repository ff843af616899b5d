"""`shardfit generate --checkpoint` on a run whose LoRA base is quantized (model.quantize=nf4|fp8): the checkpoint
holds no codes, the base is rebuilt from the run's seed and quantized as training did (weights/local.py's load_dcp:
tests/adapters/test_qlora_runs.py checks its logits), and the Sampler decodes that model, its quantized layers
included: its greedy answer is the reference loop's (--no-cache, the whole sequence recomputed every step)."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.helpers import train_small


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_generate_decodes_a_checkpoint_on_a_quantized_base_as_the_reference_loop(tmp_path, capsys, fmt):
    from shardfit.cli.generate import generate

    run = tmp_path / "run"
    run_ranks(train_small, 1, str(run), "--train.device=cpu", "--lora.rank=4", "--lora.targets=all-linear",
              f"--model.quantize={fmt}", "--checkpoint.final=true", "--train.steps=2", "--train.lr=3e-2")
    args = ["--checkpoint", str(run), "--prompt", "the cat", "--max-new-tokens", "12", "--device", "cpu", "--raw"]
    answers = []
    for extra in ([], ["--no-cache"]):
        capsys.readouterr()
        assert generate([*args, *extra]) == 0
        answers.append(capsys.readouterr().out)
    assert answers[0] == answers[1] and len(answers[0]) > 1, answers  # 12 tokens (a tiny model: maybe spaces)
