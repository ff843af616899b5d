"""LoRA training through the Trainer and the Engine: only adapters reach the optimizer and the base stays bit for
bit; 2 gloo ranks equal 1 (plain, checkpointed, Ulysses, offload, expert parallel); a frozen bf16 base and fp32
adapters share one FSDP group; every checkpointing mode and compile agree; the RL API trains adapters only."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shardfit.adapters.lora import is_adapter
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import SMALL, full_state, small_config

LORA = ["--lora.rank=4", "--lora.alpha=8", "--train.lr=1e-2", "--model.tie_embeddings=false"]
MOE = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32"]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _train(rank, world, overrides, run_dir):
    from shardfit.parallel.step_overlap import param_group

    t = Trainer(small_config(*LORA, *overrides, run_dir=run_dir))
    base = {n: _local(p).detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    stepped = {id(p) for g in t.engine.optimizer.param_groups for p in g["params"]}
    in_optimizer = sorted(n for n, p in t.model.named_parameters() if id(p) in stepped)
    group = param_group(t.model.model.layers[0])  # block 0's fully_shard group: base and adapters together
    history = t.fit()
    after = dict(t.model.named_parameters())
    state = full_state(t.model)
    return {"losses": [h["loss"] for h in history],
            "adapters": {k: v.tolist() for k, v in state.items() if is_adapter(k)} if rank == 0 else None,
            "base_same": all(torch.equal(_local(after[n]), v) for n, v in base.items()),
            "base_grads": [n for n, p in after.items() if not p.requires_grad and p.grad is not None],
            "in_optimizer": in_optimizer, "n_base": len(base),
            "group": sorted({f"{str(p.sharded_param.dtype)[6:]}:{p.sharded_param.requires_grad}"
                             for p in group.fsdp_params}),
            "moments": sorted({str(s["exp_avg"].dtype)[6:] for s in t.engine.optimizer.state.values()})}


@pytest.mark.parametrize("overrides", [
    ["--lora.targets=all-linear,embed_tokens,lm_head"],
    pytest.param(["--train.micro_batch=2", "--compute.activation_checkpoint=full"], marks=pytest.mark.slow),
    pytest.param(["--parallel.sequence_parallel=2"], marks=pytest.mark.slow),
    pytest.param(["--parallel.offload=all"], marks=pytest.mark.slow),
    pytest.param([*MOE, "--train.micro_batch=2", "--parallel.expert_parallel=2"], marks=pytest.mark.slow),
    pytest.param(["--compute.fp8=tensorwise"], marks=[pytest.mark.slow, pytest.mark.skipif(
        importlib.util.find_spec("torchao") is None, reason="FP8 needs the optional torchao extra")]),
], ids=["plain-embed-head", "accum2-fullac", "ulysses", "offload", "moe-ep", "fp8"])
def test_two_ranks_equal_one_and_only_adapters_train(tmp_path, overrides):
    two = run_ranks(_train, 2, overrides, str(tmp_path / "two"))
    single = [o for o in overrides if "sequence_parallel" not in o and "expert_parallel" not in o]
    one = _train(0, 1, single, str(tmp_path / "one"))  # in this process: a group of one
    assert two[0]["losses"] == two[1]["losses"]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
    assert one["losses"][-1] < one["losses"][0]
    for k, v in one["adapters"].items():
        torch.testing.assert_close(torch.tensor(two[0]["adapters"][k]), torch.tensor(v), rtol=1e-4, atol=1e-5,
                                   msg=k)
    layers = 7 if "--model.n_experts=4" not in overrides else 4  # MoE blocks: attention only (experts frozen)
    extra = 2 if "embed_tokens" in " ".join(overrides) else 0
    for r in [one, *two]:
        assert r["base_same"] and not r["base_grads"] and r["n_base"] > 0
        assert r["in_optimizer"] and all(is_adapter(n) for n in r["in_optimizer"])
        assert len(r["in_optimizer"]) == len(one["adapters"]) == 2 * (layers * 2 + extra)  # A, B x layers x blocks
        assert r["group"] == ["float32:False", "float32:True"] and r["moments"] == ["float32"]


def test_frozen_bf16_base_and_fp32_adapters_share_an_fsdp_group(tmp_path):
    """compute.param_dtype=bfloat16 (the CUDA default) on gloo: the frozen base is stored in bf16, the adapters in
    fp32, in one fully_shard group per block; FSDP gathers both in bf16 and reduces the adapters' gradients in fp32
    into fp32 shards; AdamW's moments are fp32; the run learns and the base does not move."""
    r = run_ranks(_train, 2, ["--compute.param_dtype=bfloat16"], str(tmp_path))
    assert r[0]["losses"] == r[1]["losses"] and r[0]["losses"][-1] < r[0]["losses"][0]
    assert r[0]["group"] == ["bfloat16:False", "float32:True"]
    assert r[0]["base_same"] and not r[0]["base_grads"] and r[0]["moments"] == ["float32"]


def _modes(rank, world, run_dir, flags=LORA):
    """The same run under each checkpointing mode (flags: LoRA's, or QLoRA's in test_qlora_training.py)."""
    out = {}
    for mode in ("none", "full", "selective"):
        t = Trainer(small_config(*flags, "--train.micro_batch=2", f"--compute.activation_checkpoint={mode}",
                                 run_dir=f"{run_dir}/{mode}"))
        out[mode] = [h["loss"] for h in t.fit()]
    return out


def test_every_checkpointing_mode_gives_the_same_run(tmp_path):
    r = run_ranks(_modes, 1, str(tmp_path))[0]
    assert r["full"] == r["none"] and r["selective"] == r["none"]


def plain_and_compiled(train, tmp_path) -> tuple[dict, dict]:
    """One run with eager blocks, one with compiled blocks (train: LoRA's or QLoRA's runner); their losses agree."""
    plain = run_ranks(train, 1, [], str(tmp_path / "plain"))[0]
    compiled = run_ranks(train, 1, ["--compute.compile=true"], str(tmp_path / "compiled"))[0]
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(plain["losses"]), rtol=1e-4,
                               atol=1e-4)
    return plain, compiled


@pytest.mark.slow  # CPU compile of the blocks: ~30 s
def test_compiled_blocks_train_the_same_adapters(tmp_path):
    plain, compiled = plain_and_compiled(_train, tmp_path)
    assert compiled["base_same"] and compiled["in_optimizer"] == plain["in_optimizer"]


def test_rl_api_trains_the_adapters_only():
    """Engine.forward_backward / optim_step on datums: gradients on adapters only, the base unchanged, and the
    log-probabilities move."""
    import numpy as np

    from shardfit.config import load_config
    from shardfit.rl import AdamParams, make_datum
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)

    engine = Engine.start(load_config(None, [*SMALL, *LORA, "--train.device=cpu", "--train.micro_batch_tokens=32",
                                             "--logging.run_dir="]))
    rng = np.random.default_rng(0)
    datums = [make_datum(s[:-1], target_tokens=s[1:], weights=np.ones(len(s) - 1))
              for s in (rng.integers(0, 256, n) for n in (12, 20, 9))]
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if not p.requires_grad}
    before = engine.forward(datums).outputs[0]["logprobs"]
    engine.forward_backward(datums)
    grads = {n: p.grad for n, p in engine.model.named_parameters()}
    assert all((g is not None) == is_adapter(n) for n, g in grads.items())
    stats = engine.optim_step(AdamParams(learning_rate=1e-2))
    assert stats["skipped:max"] == 0 and stats["grad_norm:mean"] > 0
    assert all(torch.equal(p, base[n]) for n, p in engine.model.named_parameters() if n in base)
    after = engine.forward(datums).outputs[0]["logprobs"]
    assert not torch.equal(torch.as_tensor(before), torch.as_tensor(after))
    # weights() hands an inference engine the merged weights under Hugging Face names, no adapter among them
    weights = dict(t for bucket in engine.weights(torch.float32) for t in bucket)
    q = engine.model.model.layers[0].self_attn.q_proj
    full = {n: p.detach().full_tensor() for n, p in (("W", q.weight), ("A", q.lora_A), ("B", q.lora_B))}
    merged = full["W"] + q.lora_scale * full["B"] @ full["A"]
    assert not any(is_adapter(n) for n in weights) and set(weights) == set(base)
    torch.testing.assert_close(weights["model.layers.0.self_attn.q_proj.weight"], merged)
