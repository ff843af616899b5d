"""The LoRA and QLoRA terms of the plan (adapters/lora.py, docs/lora.md): what a frozen base and its adapters take.

  states     the frozen base as stored: the compute dtype's bytes a parameter (bf16 on CUDA), or under
             model.quantize=nf4 NF4_BYTES for each adapted linear weight of the blocks (fp8: 1 byte a weight and 4
             a row, for those whose dims are multiples of 16, adapters/fp8_base.py); no fp32 master, gradient or
             moment for it. The adapters: fp32, fp32 gradients and AdamW's two moments (16 B a parameter), sharded;
             MoE experts' adapters (adapters/expert_lora.py: E x r x (in + out) per adapted weight) alike.
  gathered   FSDP gathers the base as stored (no fp32 -> bf16 cast copy) and the adapters cast to the compute dtype;
             it reduce-scatters the adapters' gradients only. QLoRA: one dequantised weight in flight (dequant_bytes;
             an FP8 base: one weight's codes transposed for its input gradient, 1 byte a weight; in fp32 the weight).
             Expert adapters go where their experts go (plan/moe.py: n/E of them under EP; none with E = W, where
             the computation casts them and writes their fp32 gradients fresh, as it does full fine-tuning's experts).
  activations  the traced block has its adapters (adapt_block): what autograd saves for them, nothing for the base.
  backward   an adapted MLP's backward holds three more [T, ffn] buffers than a dense one, adapted experts [T*k, 2I]
             (gate_up) and [T*k, I] (down) more (mlp_extra_width).
lora_key and quantize are the config's adapter keys as the planner's caches take them (model.quantize read with
getattr: a shardfit without it plans LoRA alone); every figure is bytes or parameters of one model built on the meta
device (the estimate's). Design and measurements: docs/memory-plan.md.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch
from torch import nn

from shardfit.adapters.expert_lora import GATE_UP, add_expert_adapters, expert_names, expert_targets
from shardfit.adapters.lora import add_adapter, freeze_base, lora_targets
from shardfit.config.schema import Config

# NF4 with double-quantised scales as adapters/nf4.py stores a weight (QLoRA): groups of NF4_GROUP weights padded to
# a whole group, each 4-bit codes (NF4_GROUP / 2 bytes), an int8 absmax per 64 weights (256) and an fp32 mean and
# scale (8 bytes): 0.516113 bytes a weight
NF4_GROUP = 16_384
NF4_GROUP_BYTES = NF4_GROUP // 2 + NF4_GROUP // 64 + 8
NF4_BYTES = NF4_GROUP_BYTES / NF4_GROUP
_MLP = re.compile(r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)$")
_BLOCK = re.compile(r"model\.layers\.(\d+)\.")


def quantize(cfg: Config) -> str:
    """model.quantize ("none" on a shardfit without the key, and with it unset)."""
    return getattr(cfg.model, "quantize", "none") or "none"


def lora_key(cfg: Config) -> tuple:
    """The [lora] keys that change memory, as a cache key: (rank, dropout, targets); () when LoRA is off."""
    lora = cfg.lora
    return (lora.rank, lora.dropout, lora.targets) if lora.rank else ()


@dataclass(frozen=True)
class Counts:
    """A model with adapters, counted once per (model, lora_key, quantize, compute dtype)."""

    adapters: int  # trainable adapter parameters, whole model
    block_adapters: tuple[int, ...]  # of each block
    block_expert_adapters: tuple[int, ...]  # of each block, on its MoE experts (a part of block_adapters)
    base_bytes: int  # the frozen base as stored
    block_base_bytes: tuple[int, ...]  # of each block
    quantized_saving: tuple[int, ...]  # bytes each block's quantised weights take less than in the compute dtype
    largest_quantized: int  # bytes in flight in the largest quantised weight's matmul (_quantized)
    mlp_extra_width: int  # elements a token of the adapted MLP's extra backward buffers (see backward_extra)
    block_mlp_width: tuple[int, ...]  # of each block, its dense MLP's adapted projections alone (recompute_extra)
    head_trains: bool  # the output head's weight takes a gradient (full fine-tuning, or an adapter on lm_head)
    adapter_shapes: tuple[tuple[int, int, int], ...]  # (block or -1, rows, row length) of each adapter tensor


def _block_of(fqn: str) -> int:
    found = _BLOCK.match(fqn)
    return int(found.group(1)) if found else -1


def nf4_bytes(numel: int) -> int:
    """Bytes of one weight of numel elements in NF4 (whole groups)."""
    return -(-numel // NF4_GROUP) * NF4_GROUP_BYTES


def _quantized(quant: str, out_f: int, in_f: int, element: int) -> tuple[int, int]:
    """(bytes stored, bytes in flight in its matmuls) of one adapted [out, in] weight under model.quantize; (0, 0)
    for a weight that stays in the compute dtype (FP8 takes dims of multiples of 16 only)."""
    n = out_f * in_f
    if quant == "nf4":
        return nf4_bytes(n), -(-n // NF4_GROUP) * NF4_GROUP * element  # dequantised whole, padded groups
    if quant == "fp8" and not (out_f % 16 or in_f % 16):
        # e4m3 codes and an fp32 scale a row; in bf16 the transposed codes in backward, in fp32 (no FP8 matmul) the
        # weight dequantised
        return n + 4 * out_f, n if element == 2 else n * element
    return 0, 0


@functools.lru_cache(maxsize=16)
def counts(built: nn.Module, lora: tuple, quant: str, element: int) -> Counts:
    """Counts of `built` (the estimate's meta model, read only): the adapters lora.targets would add, and the base's
    bytes at `element` bytes a parameter, with under quantize="nf4" or "fp8" the adapted linear layers of the blocks
    in that format (adapters/quantized.py: embeddings, norms, the head and MoE experts stay in the compute dtype)."""
    n_blocks = len(built.model.layers)
    block_adapters, shapes, width = [0] * n_blocks, [], [0] * n_blocks
    rank = lora[0] if lora else 0
    targets = lora_targets(built, lora[2]) if lora else []
    for fqn, mod in targets:
        rows, cols = mod.weight.shape  # linear [out, in]; embedding [V, D]
        pair = ((rank, rows), (cols, rank)) if isinstance(mod, nn.Embedding) else ((rank, cols), (rows, rank))
        i = _block_of(fqn)
        shapes += [(i, *s) for s in pair]
        if i >= 0:
            block_adapters[i] += rank * (rows + cols)
            mlp = _MLP.match(fqn)
            if mlp:
                width[i] += cols if mlp.group(2) == "down_proj" else rows
    dense_width = tuple(width)  # the experts' widths are added below
    expert_adapters = [0] * n_blocks
    for fqn, mod in expert_targets(built, lora[2]) if lora else []:
        n, inner, dim = mod.gate_proj.shape  # [E, I, H]
        i = _block_of(fqn)
        for w in expert_names(lora[2]):  # A [E, r, in], B [E, out, r]; the backward's extra [T*k, out] buffers
            in_f, out_f = (dim, 2 * inner) if w == GATE_UP else (inner, dim)
            shapes += [(i, n, rank * in_f), (i, n, out_f * rank)]
            expert_adapters[i] += n * rank * (in_f + out_f)
            width[i] += built.cfg.experts_per_token * (out_f if w == GATE_UP else in_f)
        block_adapters[i] += expert_adapters[i]
    saving = [0] * n_blocks
    largest = 0
    for fqn, mod in targets if quant != "none" else []:
        if (i := _block_of(fqn)) >= 0 and isinstance(mod, nn.Linear):
            stored, in_flight = _quantized(quant, *mod.weight.shape, element)
            if stored:
                saving[i] += mod.weight.numel() * element - stored
                largest = max(largest, in_flight)
    block_params = [sum(p.numel() for p in b.parameters()) for b in built.model.layers]
    block_bytes = tuple(n * element - q for n, q in zip(block_params, saving))
    root_bytes = (sum(p.numel() for p in built.parameters()) - sum(block_params)) * element  # never quantized
    head = not lora or any(fqn == "lm_head" for fqn, _ in targets)
    return Counts(sum(r * c for _, r, c in shapes), tuple(block_adapters), tuple(expert_adapters),
                  root_bytes + sum(block_bytes),
                  block_bytes, tuple(saving), largest, max(width, default=0), dense_width, head, tuple(shapes))


def adapted_block_bytes(c: Counts, gathered_params: tuple[int, ...], gathered_adapters: tuple[int, ...],
                        element: int) -> tuple[int, ...]:
    """Bytes FSDP gathers for each block of a LoRA run: its base as stored (gathered_params: the parameters it
    gathers, expert parallelism's share included; the NF4 weights, never experts, gathered whole as their integer
    storage, uncast) and its adapters cast to the compute dtype (gathered_adapters: the experts' by the same
    share)."""
    return tuple(g * element - s + a * element
                 for g, s, a in zip(gathered_params, c.quantized_saving, gathered_adapters))


def dequant_bytes(c: Counts) -> int:
    """QLoRA: each NF4 layer dequantises its whole weight (padded to whole groups) for its matmul, in forward and
    again in backward (for the input gradient), and frees it: one in flight at a time. On a GPU the Triton kernel
    (kernels/nf4_dequant.py) writes it in the compute dtype and nothing else, compiled or not (adapters/qlora.py's
    _dequant); the PyTorch path, where Triton is missing, holds the fp32 levels first eagerly (4 + 2 B a weight).
    An FP8 base in bf16: the codes transposed for the input gradient's matmul (1 B a weight; its quantised
    activations, 1 B a value, are not counted); in fp32, no FP8 matmul: the weight dequantised in fp32 (4 B). On a
    GPU without FP8 tensor cores (compute capability < 8.9) a bf16 run dequantises too, through fp32 (4 + 2 B a
    weight): not counted, as NF4's PyTorch path."""
    return c.largest_quantized


def backward_extra(c: Counts, tokens: int, element: int) -> int:
    """What an adapted MLP's backward holds beyond a dense one's: the down projection's base and adapter input
    gradients summed into a new buffer (not in place), and the gate and up projections' output gradients scaled by
    alpha/r for their adapters, written by the same fused kernel as the plain ones ([T, ffn] each; Inductor's
    generated code for the LoRA MLP, docs/memory-plan.md). Adapted experts (T*k routed rows): the gradient of
    gate_up's adapter output [T*k, 2I] (its gate and up halves in one buffer) and down's input gradients summed
    [T*k, I]. Attention's adapters add [T, dim]-sized buffers at a point where the MLP's are freed: not counted."""
    return tokens * c.mlp_extra_width * element


def recompute_extra(c: Counts, tokens: int, element: int) -> tuple[int, ...]:
    """What each block's recompute holds beyond what the uncheckpointed block saves (the plan's `none`), compiled and
    fully checkpointed: the forward is recomputed inside the compiled backward graph, where Inductor feeds the fused
    SiLU-backward kernel an adapted gate or up projection's base and adapter outputs as two [T, ffn] buffers (the
    uncheckpointed block saves their sum) and an adapted down projection's base and adapter input gradients unsummed
    (backward_extra counts the one sum): one [T, ffn] more per adapted MLP projection, 11 [T, ffn] live in that
    kernel where 8 were counted: 3 x 3.5 [T, D] a block short before (a block alone, compiled, fully checkpointed:
    benchmarks/README.md#plan-terms). Adapted experts: not measured, not counted."""
    return tuple(tokens * w * element for w in c.block_mlp_width)


def pinned_adapter_bytes(c: Counts, shard: int, gpu_blocks: int) -> int:
    """offload=all: pinned host bytes of the adapters' fp32 shards (each rounded up to a power of two, as
    estimate.pinned_shard_bytes), the first gpu_blocks blocks' excepted. The gradient shards: the same again."""
    total = 0
    for block, rows, cols in c.adapter_shapes:
        if 0 <= block < gpu_blocks:
            continue
        nbytes = 4 * -(-rows // shard) * cols
        total += 1 << max(0, (nbytes - 1).bit_length())
    return total


def adapt_block(block: nn.Module, lora: tuple, dtype: torch.dtype) -> None:
    """A meta block as a LoRA run computes it: the targets lora.targets picks in a block get adapters, everything
    else frozen, the adapters cast to the compute dtype as FSDP's mixed precision casts them for the forward (the
    trace then sees what autograd saves for them, and nothing for the frozen weights' own gradients)."""
    if not lora:
        return
    rank, dropout, targets = lora
    holder = nn.Module()
    holder.model = nn.Module()
    holder.model.layers = nn.ModuleList([block])
    freeze_base(holder, None)
    for _, mod in lora_targets(holder, targets):
        add_adapter(mod, rank, 2.0 * rank, dropout)  # alpha scales values, not shapes: any will do
    for _, mod in expert_targets(holder, targets):
        add_expert_adapters(mod, expert_names(targets), rank, 2.0 * rank)
    block.to(dtype)
