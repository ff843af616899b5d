"""Issue 27, class 2: `model.init_from`, a new run from a shardfit checkpoint's weights (weights only: a fresh
optimizer, schedule and step 0), written by two ranks and read by one; its architecture and tokenizer come with it,
and each wrong use is one line. As a user runs it (fine-tuning from a run, through the CLI): the docs' test,
tests/cli/test_docs_checkpoints.py."""

from __future__ import annotations

import pytest
import torch

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from tests._dist import run_ranks
from tests.helpers import EXTEND, full_state

BATCH = ["--data.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--train.device=cpu",
         "--logging.plot=false"]


def _started(rank, world, spec, run_dir):
    from shardfit.train import Trainer

    t = Trainer(load_config(None, [f"--model.init_from={spec}", *BATCH, "--logging.progress=none",
                                   f"--logging.run_dir={run_dir}"]))
    return {"step": t.step, "optimizer_state": len(t.optimizer.state), "notices": t.notices,
            "state": {k: v.tolist() for k, v in full_state(t.model).items()}}


def test_a_one_rank_run_starts_from_the_weights_two_ranks_saved(two_rank_run, tmp_path):
    from shardfit.weights.local import load_dcp

    got = run_ranks(_started, 1, str(two_rank_run), str(tmp_path / "new"))[0]
    want, _ = load_dcp(str(two_rank_run), torch.device("cpu"), torch.float32)
    assert got["step"] == 0 and got["optimizer_state"] == 0  # weights only
    for k, v in want.state_dict().items():
        torch.testing.assert_close(torch.tensor(got["state"][k]), v, rtol=0, atol=0, msg=k)
    step2 = two_rank_run / "checkpoints" / "step_00000002"
    assert any(f"weights from {step2} (step 2, model.init_from); a fresh optimizer" in n for n in got["notices"])


@pytest.mark.parametrize("args, needle", [
    (["--model.dim=32"], "model.dim: model.dim=32 conflicts with dim=64 in"),
    (["--model.path=/somewhere"], "model.init_from and model.path both name starting weights"),
    (["--lora.rank=8", "--model.quantize=nf4"], "does not start a run on a quantized base (model.quantize=nf4)"),
    (["--lora.rank=8", "--model.quantize=fp8"], "does not start a run on a quantized base (model.quantize=fp8)"),
])
def test_a_contradicting_key_is_one_line(two_rank_run, args, needle):
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--model.init_from={two_rank_run}", *args])
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("where, needle", [
    ("missing", "model.init_from=MISSING: no such checkpoint or run directory"),
    ("empty", "no complete checkpoint in EMPTY"),
])
def test_a_directory_without_a_checkpoint_is_one_line(tmp_path, where, needle):
    (tmp_path / "empty").mkdir()
    spec = str(tmp_path / where)
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--model.init_from={spec}"])
    assert needle.replace(where.upper(), spec) in str(e.value)


def _lora_run(rank, world, spec, run_dir, steps, resume, *extra):
    from shardfit.train import Trainer

    t = Trainer(load_config(None, [f"--model.init_from={spec}", "--lora.rank=4", *BATCH, *extra,
                                   "--logging.progress=none",
                                   f"--logging.run_dir={run_dir}", f"--train.steps={steps}", "--checkpoint.every=2",
                                   f"--checkpoint.resume={resume}", *([EXTEND] if resume == "auto" else [])]))
    t.fit()
    return {"notices": t.notices, "state": {k: v.tolist() for k, v in full_state(t.model).items()}}


def test_a_lora_run_adapts_the_checkpoint_it_starts_from_and_resumes_on_the_same_base(two_rank_run, tmp_path):
    """The frozen base is the full checkpoint's (bit for bit), at the start and after a resume (the source step is
    recorded in trainer.json, not looked up again); the resumed adapters equal an uninterrupted run's; shardfit's
    own loader (export, generate) rebuilds the same base; a LoRA run's checkpoint is no base for another."""
    import json

    from shardfit.weights.local import load_dcp

    source, _ = load_dcp(str(two_rank_run), torch.device("cpu"), torch.float32)
    straight = run_ranks(_lora_run, 1, str(two_rank_run), str(tmp_path / "a"), 4, "none")[0]
    run_ranks(_lora_run, 1, str(two_rank_run), str(tmp_path / "b"), 2, "none")
    step2 = tmp_path / "b" / "checkpoints" / "step_00000002"
    recorded = json.loads((step2 / "trainer.json").read_text())["base_from"]
    assert recorded == str((two_rank_run / "checkpoints" / "step_00000002").resolve())
    resumed = run_ranks(_lora_run, 1, str(two_rank_run), str(tmp_path / "b"), 4, "auto")[0]
    for k, v in source.state_dict().items():  # the base: the checkpoint's, untouched by training or resume
        for got in (straight, resumed):
            torch.testing.assert_close(torch.tensor(got["state"][k]), v, rtol=0, atol=0, msg=k)
    adapters = [k for k in straight["state"] if "lora_" in k]
    assert adapters and any(torch.tensor(straight["state"][k]).abs().sum() > 0 for k in adapters if "lora_B" in k)
    for k in adapters:
        torch.testing.assert_close(torch.tensor(resumed["state"][k]), torch.tensor(straight["state"][k]),
                                   rtol=0, atol=0, msg=k)
    assert any("frozen base for the LoRA adapters from" in n for n in straight["notices"])
    rebuilt, _ = load_dcp(str(tmp_path / "a"), torch.device("cpu"), torch.float32)
    for k, v in rebuilt.state_dict().items():
        torch.testing.assert_close(v, torch.tensor(straight["state"][k]), rtol=0, atol=0, msg=k)
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--model.init_from={tmp_path / 'a'}", "--lora.rank=4"])
    assert "is a LoRA run's checkpoint: it holds adapters, not the weights they adapt" in str(e.value)


def test_a_bf16_lora_run_takes_its_base_from_an_fp32_checkpoint(two_rank_run, tmp_path):
    """On a GPU the frozen base is kept in the compute dtype (bf16) while a full fine-tune saves fp32 masters: the
    base is the checkpoint's, cast (the checked loader refused the dtype difference as another model's)."""
    from shardfit.weights.local import load_dcp

    source, _ = load_dcp(str(two_rank_run), torch.device("cpu"), torch.float32)
    got = run_ranks(_lora_run, 1, str(two_rank_run), str(tmp_path / "bf16"), 1, "none",
                    "--compute.param_dtype=bfloat16")[0]
    for k, v in source.state_dict().items():
        torch.testing.assert_close(torch.tensor(got["state"][k]).to(torch.bfloat16), v.to(torch.bfloat16),
                                   rtol=0, atol=0, msg=k)
