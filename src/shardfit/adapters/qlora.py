"""QLoRA (model.quantize=nf4): the adapted linear layers' frozen base weights stored in NF4 (adapters/nf4.py), how
they are sharded, filled (seeded or from model.path), multiplied and merged.

The module: each LoRA target that is a linear layer of a block loses its `weight` parameter; in its place (same
position, so module order is kept) come weight_nf4 (8192 bytes a group), weight_absmax (256) and weight_stats (8)
(g = ceil(out x in / 16,384) groups of the flattened weight), all frozen, stored bit for bit as [g, bytes / size]
views in the replaced weight's dtype (the "carrier": nf4.py's `carried`; the compute dtype). Its forward dequantises the
whole weight to the input's dtype inside a custom operator (shardfit::nf4_linear; on CUDA by one Triton kernel,
kernels/nf4_dequant.py), multiplies and frees it; backward
dequantises again for dX = dY W (saved: the codes, never the dequantised weight). Checkpointing's recompute repeats
the forward, dequantisation included. Embeddings, norms, the head and MoE experts stay in the compute dtype.
FSDP2: the three are parameters of the block's group, sharded along dim 0, so a rank holds rows [g0, g0 + n) of each,
the same rows of all three (same dim-0 size), whole groups (a group never straddles ranks) and 1/world of the codes.
The carrier is FSDP's param_dtype, so the codes are all-gathered uncast, as copies of their bytes (FSDP2 before
torch 2.13 cannot hold integer parameters at all). Only the adapters train, so the group's one trainable dtype (fp32)
is unchanged; nothing reads the carriers as numbers (init, norms and finiteness checks skip STORAGE by name).
Filling: a rank's groups cover rows [r0, r1) of the weight; those rows alone are staged in fp32 (drawn from (seed,
name) as plain LoRA draws them, or read from model.path through weights/hf_load.py), quantised into the local shards and
freed, a bounded batch of layers at a time: no rank holds the whole model in bf16, and 1 and N ranks hold the same
codes (quantisation is per group and deterministic). No collectives. Loading from model.path and the merge's
whole weight: weights/nf4_io.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from shardfit.adapters.lora import LoRAModule, lora_class
from shardfit.adapters.nf4 import (
    BYTES_PER_WEIGHT,
    GROUP,
    ROW_STORED_BYTES,
    carried,
    dequantize,
    dequantize_kernel,
    kernel_dequantizes,
    n_groups,
    pad_to_groups,
    quantize,
)
from shardfit.models.init import QUANTIZED_STORAGE as STORAGE
from shardfit.models.init import ShardView, is_quantized_storage, seeded_normal_, whole_view
from shardfit.models.loss import compiled_once

# Groups quantised at once. quantize() is ~40 small kernels a chunk whatever its size: on the CPU 64 groups (~1M
# weights, ~20 MB of transients) keep the memory down; on a GPU the launches dominate (a 70B base is 68.5B NF4 weights,
# 4.2M groups: ~2.6M launches at 64 groups, ~15-25 s; at 1024 groups ~170k, ~1-2 s, for ~330 MB of transients:
# fp32 weights, their ratios to the absmax and int32 level indices, 64 MB each, beside a 940 MB fp32 staging buffer).
_CHUNK_GROUPS_CPU, _CHUNK_GROUPS_GPU = 64, 1024


def dequantized(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, shape: tuple[int, int],
                dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in] in dtype from its whole (gathered) storage."""
    return dequantize(codes, absmax, stats, dtype)[:shape[0] * shape[1]].view(shape)


# The frozen matmul is a custom operator, opaque to torch.compile: inside a checkpointed block the compiled graph then
# holds one node for it, which checkpointing recomputes like any other. As an autograd.Function traced into the
# graph, its matmul outputs escaped the checkpoint's recompute tags and were saved (measured: 0.56 GiB a block of the
# 70B shape at 4,096 tokens, 97 GiB at full checkpointing where 52 were planned). Its autograd saves the codes, never
# the dequantised weight. On CUDA with Triton the dequantisation is one hand-written kernel (nf4.dequantize_kernel,
# kernels/nf4_dequant.py: ~2.5 bytes of traffic a weight at the memory's speed), compiled or not; elsewhere fused
# dequantises with one compiled kernel (compute.compile; ~2.5 bytes a weight instead of ~18 eagerly, but at about
# half the speed on an H200), made once per process and shape-generic. All three give the same bits.


def _dequant(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, out_features: int, in_features: int,
             dtype: torch.dtype, fused: bool) -> torch.Tensor:
    if kernel_dequantizes(codes, dtype):
        return dequantize_kernel(codes, absmax, stats, out_features * in_features, dtype).view(out_features,
                                                                                                in_features)
    fn = compiled_once(dequantized, dynamic=True) if fused else dequantized
    return fn(codes, absmax, stats, (out_features, in_features), dtype)


@torch.library.custom_op("shardfit::nf4_linear", mutates_args=())
def nf4_linear(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, out_features: int,
               in_features: int, fused: bool) -> torch.Tensor:
    """y = x W^T, W [out, in] dequantised from its NF4 storage and freed."""
    return F.linear(x, _dequant(codes, absmax, stats, out_features, in_features, x.dtype, fused))


@nf4_linear.register_fake
def _(x, codes, absmax, stats, out_features, in_features, fused):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("shardfit::nf4_linear_input_grad", mutates_args=())
def nf4_linear_input_grad(dy: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor,
                          out_features: int, in_features: int, fused: bool) -> torch.Tensor:
    """dX = dY W, W dequantised again."""
    return dy @ _dequant(codes, absmax, stats, out_features, in_features, dy.dtype, fused)


@nf4_linear_input_grad.register_fake
def _(dy, codes, absmax, stats, out_features, in_features, fused):
    return dy.new_empty(*dy.shape[:-1], in_features)


def _setup(ctx, inputs, output):
    _, codes, absmax, stats, out_features, in_features, fused = inputs
    ctx.save_for_backward(codes, absmax, stats)
    ctx.args = (out_features, in_features, fused)


def _backward(ctx, dy):
    codes, absmax, stats = ctx.saved_tensors
    dx = nf4_linear_input_grad(dy, codes, absmax, stats, *ctx.args) if ctx.needs_input_grad[0] else None
    return dx, None, None, None, None, None, None


nf4_linear.register_autograd(_backward, setup_context=_setup)


class NF4Linear(nn.Linear):
    """A frozen linear layer whose weight is stored in NF4 (module docstring); LoRA's class for it adds the adapter
    (adapters/lora.py's lora_class)."""

    quantized_numel: int  # out x in: the weights it stands for (models.count_params counts these, not its bytes)
    fused_dequant = False  # without the Triton kernel (CPU): dequantise with one compiled kernel (compute.compile)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nf4_linear(x, self.weight_nf4, self.weight_absmax, self.weight_stats, self.out_features,
                         self.in_features, self.fused_dequant)
        return out if self.bias is None else out + self.bias


is_storage = is_quantized_storage  # whether a parameter name is an NF4 weight's storage


def quantized_modules(model: nn.Module) -> list[tuple[str, NF4Linear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, NF4Linear)]


class Span(NamedTuple):
    """What this rank holds of one NF4 weight: its shards of the three (the same groups [g0, g0 + n) of each),
    the elements [e0, e1) of the flattened weight they stand for, and the weight's rows [r0, r1) that cover them."""
    shards: list[torch.Tensor]
    groups: int
    elems: tuple[int, int]
    rows: tuple[int, int]


def shard_span(mod: NF4Linear, view: ShardView) -> Span:
    local = [view(getattr(mod, n)) for n in STORAGE]
    shards, g0, n = [t for t, _, _ in local], local[0][2], local[0][0].shape[0]
    assert all(t.shape[0] == n and row0 == g0 for t, _, row0 in local), "NF4 shards must hold the same groups"
    numel, width = mod.quantized_numel, mod.in_features
    e0, e1 = min(g0 * GROUP, numel), min((g0 + n) * GROUP, numel)
    return Span(shards, n, (e0, e1), (e0 // width, -(-e1 // width) if n else e0 // width))


@torch.no_grad()
def quantize_rows(mod: NF4Linear, rows: torch.Tensor, span: Span) -> None:
    """Quantise this rank's groups from `rows` (the weight's rows span.rows, any float dtype) into its shards, a
    chunk of groups at a time."""
    (e0, e1), skip = span.elems, span.rows[0] * mod.in_features
    flat = pad_to_groups(rows.reshape(-1)[e0 - skip:e1 - skip].float(), span.groups)
    chunk = _CHUNK_GROUPS_CPU if rows.device.type == "cpu" else _CHUNK_GROUPS_GPU
    for c0 in range(0, span.groups, chunk):
        c1 = min(span.groups, c0 + chunk)
        for dst, src in zip(span.shards, carried(quantize(flat[c0 * GROUP:c1 * GROUP]), span.shards[0].dtype)):
            dst[c0:c1].copy_(src)  # the same dtype: a copy of the bytes


def staging_rows(mod: NF4Linear, span: Span) -> torch.Tensor:
    """An empty fp32 buffer for the weight's rows span.rows, where the shards live."""
    r0, r1 = span.rows
    return torch.empty(r1 - r0, mod.in_features, dtype=torch.float32, device=span.shards[0].device)


def to_nf4(mod: nn.Linear) -> NF4Linear:
    """Replace the module's weight by its NF4 storage, in place (on meta: empty; else quantised from the weight),
    carried in the weight's dtype; an adapted module keeps its adapters."""
    w = mod.weight
    g, size = n_groups(w.numel()), w.element_size()
    params = {}
    for key, p in mod._parameters.items():  # the storage where the weight was: module order unchanged
        if key != "weight":
            params[key] = p
            continue
        for name, nbytes in zip(STORAGE, ROW_STORED_BYTES):
            params[name] = nn.Parameter(torch.empty(g, nbytes // size, dtype=w.dtype, device=w.device),
                                        requires_grad=False)
    mod._parameters.clear()
    mod._parameters.update(params)
    mod.__class__ = lora_class(NF4Linear) if isinstance(mod, LoRAModule) else NF4Linear
    mod.quantized_numel = w.numel()
    if w.device.type != "meta":
        quantize_rows(mod, w.detach(), shard_span(mod, whole_view))
    return mod


def apply_nf4(model: nn.Module, targets: list[str], fused: bool = False) -> int:
    """Store the base weight of every adapted linear layer among `targets` (apply_lora's names; adapted experts stay in
    the compute dtype) in NF4; returns how many. Called right after apply_lora: on the meta model (parallelize's
    step 0) or a materialised one (generate)."""
    mods = dict(model.named_modules())  # the blocks' linear layers: not the output head (an nn.Linear too)
    chosen = [mods[t] for t in targets if t.startswith("model.layers.") and isinstance(mods.get(t), nn.Linear)]
    for mod in chosen:
        to_nf4(mod).fused_dequant = fused
    return len(chosen)


@torch.no_grad()
def init_quantized(model: nn.Module, seed: int, view: ShardView = whole_view) -> None:
    """Draw this rank's rows of each NF4 weight as the seeded initialisation draws an unquantised one (models/init.py:
    the same values from (seed, name)), quantise them into the local shards, free them; one layer at a time."""
    std = model.cfg.init_std
    for fqn, mod in quantized_modules(model):
        span = shard_span(mod, view)
        if not span.groups or span.shards[0].device.type == "meta":
            continue
        rows, shape = staging_rows(mod, span), (mod.out_features, mod.in_features)
        seeded_normal_(rows, std, seed, f"{fqn}.weight", view=lambda t, s=shape, r=span.rows[0]: (t, s, r))
        quantize_rows(mod, rows, span)


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype), NF4 storage kept bit for bit (a cast would turn its bytes into other bytes): it is carried in
    the new dtype instead, as FSDP would gather it."""
    storage = {n: p for n, p in model.named_parameters() if is_storage(n)}
    raw = {n: p.data.view(torch.uint8) for n, p in storage.items()}
    model.to(dtype)
    for n, p in storage.items():
        p.data = raw[n].view(dtype)
    return model


def qlora_summary(model: nn.Module) -> str:
    """One notice line: how much of the base is NF4 and its bytes."""
    mods = quantized_modules(model)
    n = sum(m.quantized_numel for _, m in mods)
    stored = sum(getattr(m, k).numel() * getattr(m, k).element_size() for _, m in mods for k in STORAGE)
    return (f"QLoRA: the base weights of {len(mods)} adapted linear layers ({n:,} weights) are NF4 with "
            f"double-quantised scales, {stored / 2**20:,.1f} MiB in all (~{BYTES_PER_WEIGHT:.3f} bytes a weight, "
            f"sharded over the ranks); they dequantise one layer at a time in forward and backward")


__all__ = ["NF4Linear", "STORAGE", "apply_nf4", "dequantized", "init_quantized", "is_storage", "qlora_summary",
           "quantize_rows", "quantized_modules", "shard_span", "staging_rows", "to_dtype", "to_nf4"]
