"""QLoRA's module (adapters/qlora.py), one process: the quantized model's logits and gradients equal those of a
model whose base is the dequantised weights (so NF4's rounding is the only difference from LoRA), backward saves
no dequantised weight, the parameters and counts, and the config's refusals."""

from __future__ import annotations

import pytest
import torch

from shardfit.adapters.lora import apply_lora, is_adapter
from shardfit.adapters.qlora import NF4Linear
from shardfit.adapters.quantized import apply_quantized, is_storage, quantized_modules, to_dtype
from shardfit.config.schema import LoraConfig, ModelConfig
from shardfit.errors import ShardfitError
from shardfit.models import build_model, count_params
from shardfit.weights.quantized_io import merged_weight
from tests.adapters.tiny_hf import randomize_adapters
from tests.helpers import SMALL, small_config

IDS = torch.tensor([[5, 17, 99, 3, 250, 42, 7, 8, 120, 64, 1, 2]])


def _pair(dtype: torch.dtype, cls: type = NF4Linear):
    """(a model on a quantised base of format cls (QLoRA's NF4 here; test_fp8_base.py's FP8), LoRA model whose base
    weights are its dequantised ones), same adapters."""
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=264, max_seq_len=64,
                      tie_embeddings=False, qkv_bias=True)
    models = []
    for _ in range(2):
        m = build_model(cfg)
        m.init_weights(3)
        targets = apply_lora(m, LoraConfig(rank=4, alpha=8, targets="all-linear,lm_head"), None)
        randomize_adapters(m)
        models.append((m, targets))
    (q, targets), (plain, _) = models
    assert apply_quantized(q, targets, cls) == 2 * 7  # linear targets only: the head keeps its weight
    with torch.no_grad():
        for fqn, mod in quantized_modules(q):
            plain.get_submodule(fqn).weight.copy_(merged_weight(mod))
    return to_dtype(q, dtype), plain.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_and_gradients_equal_a_lora_model_on_the_dequantised_base(dtype):
    q, plain = _pair(dtype)
    storage = [p for n, p in q.named_parameters() if is_storage(n)]
    assert len(storage) == 3 * 2 * 7 and all(p.dtype == dtype for p in storage)  # carried in the compute dtype
    assert q.lm_head.weight.dtype == dtype and q.model.embed_tokens.weight.dtype == dtype
    out_q, out_p = q(IDS), plain(IDS)
    assert torch.equal(out_q, out_p)
    out_q.float().square().mean().backward()
    out_p.float().square().mean().backward()
    grads_p = {n: p.grad for n, p in plain.named_parameters() if is_adapter(n)}
    for n, p in q.named_parameters():
        if is_adapter(n):
            assert torch.equal(p.grad, grads_p[n]), n
        else:
            assert p.grad is None, n


def test_backward_saves_the_codes_not_the_dequantised_weight():
    q, _ = _pair(torch.float32)
    layer = q.model.layers[0].mlp.down_proj  # [64, 160]
    x = torch.randn(3, 160, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = NF4Linear.forward(layer, x)  # the base matmul alone
    assert [t.shape[1] * t.element_size() for t in saved] == [8192, 256, 8]  # the storage, carried
    assert not any(t.numel() >= 64 * 160 for t in saved)  # never the dequantised [64, 160] weight
    y.sum().backward()
    torch.testing.assert_close(x.grad, merged_weight(layer).sum(0).expand(3, -1))


@pytest.mark.slow  # ~30 s: compiles a block twice
def test_a_compiled_checkpointed_block_saves_its_input_alone():
    """Full checkpointing of a compiled QLoRA block keeps the block input, as the eager one does: the NF4 matmul is a
    custom operator, one node the checkpoint recomputes. As an autograd.Function traced into the graph its outputs
    were saved instead (70B shape on an H200: 0.56 GiB a block, 97 GiB at full checkpointing where 52 were planned;
    torch 2.13 on the CPU failed to compile it at all)."""
    from shardfit.parallel.parallelize import apply_activation_checkpointing
    from shardfit.plan.activation_trace import saved_storages

    q, _ = _pair(torch.float32)
    counts = {}  # (compiled, tokens) -> bytes saved; what grows with the tokens is activations
    for compiled in (False, True):
        block = q.model.layers[0]
        inner = block.forward
        apply_activation_checkpointing([block], "full")
        if compiled:
            block.forward = torch.compile(block.forward)
        for S in (12, 24):
            x = torch.randn(2, S, 64, requires_grad=True)
            cos, sin = torch.ones(2, S, 16), torch.zeros(2, S, 16)
            with saved_storages(block) as seen:
                out = block(x, cos, sin)
            counts[compiled, S] = sum(seen.values())
            out.sum().backward()
        block.forward = inner
    per_12_tokens = 2 * 12 * (64 + 16 + 16) * 4  # x, cos and sin, the checkpoint's inputs
    assert counts[False, 24] - counts[False, 12] == per_12_tokens, counts
    assert counts[True, 24] - counts[True, 12] == per_12_tokens, counts  # a linear output would add 2 x 12 x out


# slow: ~12 s alone, ~21 s in the suite (a CPU inductor compile, cold cache); that torch.compile of the dequantisation
# gives the eager bits is test_cuda_qlora's test_cuda_quantisation_and_dequantisation_equal_the_cpu_ones (GPU), and a
# CPU run through this path test_qlora_training's test_compiled_blocks_train_the_same_adapters (slow)
@pytest.mark.slow
def test_the_fused_dequantisation_equals_the_eager_one():
    """compute.compile's path (one compiled kernel inside the custom operator) gives the eager path's output and
    input gradient, bit for bit."""
    q, _ = _pair(torch.float32)
    layer = q.model.layers[0].mlp.down_proj  # [64, 160]
    got = []
    for fused in (False, True):
        layer.fused_dequant = fused
        x = torch.randn(3, 160, generator=torch.Generator().manual_seed(0), requires_grad=True)
        y = NF4Linear.forward(layer, x)
        y.square().sum().backward()
        got.append((y.detach(), x.grad))
    layer.fused_dequant = False
    assert all(torch.equal(a, b) for a, b in zip(*got))


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_storage_replaces_the_weight_in_place_and_counts_as_its_weights(fmt):
    from shardfit.adapters.fp8_base import quantized_class

    cls = quantized_class(fmt)
    cfg = small_config()
    with torch.device("meta"):
        q = build_model(cfg.model)
        plain = build_model(cfg.model)
    n = count_params(plain)
    targets = apply_lora(q, LoraConfig(rank=4), torch.bfloat16)
    apply_quantized(q, targets, cls)
    names = [k for k, _ in q.model.layers[0].self_attn.q_proj.named_parameters()]
    assert names == [*cls.STORAGE, "lora_A", "lora_B"]  # where the weight was, adapters after
    assert count_params(q) == n + sum(p.numel() for k, p in q.named_parameters() if is_adapter(k))
    assert not hasattr(q.model.layers[0].self_attn.q_proj, "weight")


@pytest.mark.parametrize("extra, message", [
    (["--model.quantize=nf4"], "a quantized base cannot train"),
    (["--model.quantize=nf4", "--lora.rank=4", "--lora.targets=lm_head"], "names none"),
    (["--model.quantize=nf4", "--lora.rank=4", "--compute.fp8=tensorwise"], "FP8 would not use"),
    (["--model.quantize=nf4", "--lora.rank=4", "--parallel.offload=all"], "not supported with CPU offload"),
    (["--model.quantize=int4", "--lora.rank=4"], "int4"),
], ids=["no-rank", "no-linear-target", "fp8", "offload", "unknown"])
def test_config_refusals(extra, message):
    from shardfit.config import load_config

    with pytest.raises(ShardfitError, match=message):
        load_config(None, [*SMALL, *extra])
    assert load_config(None, [*SMALL, "--model.quantize=nf4", "--lora.rank=4"]).model.quantize == "nf4"
