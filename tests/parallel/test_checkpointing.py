"""Selective checkpointing's policy on LoRA blocks (parallel/parallelize.py keeps_output): the adapters'
up-projections are recomputed in backward, not saved, and the recomputed block computes the same gradients."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardfit.config.schema import ModelConfig
from shardfit.models.decoder import DecoderBlock
from shardfit.parallel.parallelize import apply_activation_checkpointing
from shardfit.plan.adapters import adapt_block

RANK, TARGETS = 4, 7  # q, k, v, o, gate, up, down


class _UpProjections(TorchDispatchMode):
    """Counts matmuls whose contraction is the adapter rank: B's forward h [T, r] @ B^T [r, out], and in backward
    A's input gradient dh [T, r] @ A [r, in] (the weight gradients contract over T, B's input gradient over out)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += args[-2 if func is torch.ops.aten.addmm.default else 0].shape[-1] == RANK
        return func(*args, **(kwargs or {}))


def _block(mode: str) -> DecoderBlock:
    m = ModelConfig(name="test", dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
    torch.manual_seed(0)
    block = DecoderBlock(m, 0)
    adapt_block(block, (RANK, 0.0, "all-linear"), torch.float32)
    for name, p in block.named_parameters():  # B starts at zero: give it values so its gradient path is exercised
        if "lora" in name:
            torch.nn.init.normal_(p, std=0.1)
    apply_activation_checkpointing([block], mode, adapter_rank=RANK)
    return block


def _backward_up_projections(mode: str) -> tuple[int, list[torch.Tensor]]:
    block = _block(mode)
    x = torch.randn(2, 8, 32, requires_grad=True, generator=torch.Generator().manual_seed(1))
    cos, sin = torch.ones(2, 8, 8), torch.zeros(2, 8, 8)
    forward, backward = _UpProjections(), _UpProjections()
    with forward:
        out = block(x, cos, sin)
    with backward:
        out.square().sum().backward()
    assert forward.count == TARGETS
    return backward.count, [p.grad for p in block.parameters() if p.grad is not None]


def test_selective_checkpointing_recomputes_the_adapter_up_projections():
    """Without checkpointing backward holds the 7 input gradients through A; full checkpointing redoes the block,
    up-projections included (all but down_proj's, which only the residual add reads: the recompute stops early);
    selective redoes exactly as many, since it saves none of them. Gradients are equal in all three."""
    none, ref = _backward_up_projections("none")
    selective, grads = _backward_up_projections("selective")
    full, _ = _backward_up_projections("full")
    assert none == TARGETS and full > none
    assert selective == full
    torch.testing.assert_close(grads, ref, rtol=0, atol=0)


class _NF4Calls(TorchDispatchMode):
    """Counts QLoRA's frozen matmuls (adapters/qlora.py's custom operator)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.shardfit.nf4_linear.default
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_saves_the_nf4_matmuls():
    """QLoRA's base matmul is one custom operator: selective checkpointing keeps its output as it keeps a bf16
    matmul's (never redone in backward), where full checkpointing redoes it."""
    from shardfit.adapters.qlora import NF4Linear
    from shardfit.adapters.quantized import apply_quantized

    redone = {}
    for mode in ("selective", "full"):
        m = ModelConfig(name="test", dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64)
        holder = torch.nn.Module()
        holder.model = torch.nn.Module()
        holder.model.layers = torch.nn.ModuleList([DecoderBlock(m, 0)])
        adapt_block(holder.model.layers[0], (RANK, 0.0, "all-linear"), torch.float32)
        targets = [n for n, mod in holder.named_modules() if hasattr(mod, "lora_A")]
        assert apply_quantized(holder, targets, NF4Linear) == TARGETS
        block = holder.model.layers[0]
        apply_activation_checkpointing([block], mode, adapter_rank=RANK)
        x = torch.randn(2, 8, 32, requires_grad=True)
        out = block(x, torch.ones(2, 8, 8), torch.zeros(2, 8, 8))
        calls = _NF4Calls()
        with calls:
            out.square().sum().backward()
        redone[mode] = calls.count
    assert redone["selective"] == 0 and redone["full"] > 0, redone
