"""A frozen base stored quantised (model.quantize=nf4|fp8): what QLoRA's NF4 (adapters/qlora.py) and the FP8 base
(adapters/fp8_base.py) share: how a linear layer's weight becomes storage, is filled, sharded and counted.

The module: each LoRA target that is a linear layer of a block loses its `weight` parameter; in its place (same
position, so module order is kept) come its format's storage tensors (`STORAGE`), frozen, all with the same dim 0,
stored bit for bit as views in the replaced weight's dtype (the "carrier": the compute dtype). FSDP2 shards them
along dim 0, so a rank holds the same rows of each: whole quantisation groups (NF4) or whole weight rows (FP8), never
a split one. The carrier is FSDP's param_dtype, so the bytes are all-gathered uncast (FSDP2 before torch 2.13 cannot
hold integer parameters at all). Only the adapters train, so the group's one trainable dtype (fp32) is unchanged;
nothing reads the carriers as numbers (init, norms and finiteness checks skip them by name: models/init.py).
Filling: a rank's storage rows cover rows [r0, r1) of the weight; those rows alone are staged in fp32 (drawn from
(seed, name) as plain LoRA draws them, or read from model.path through weights/quantized_io.py), quantised into the
local shards and freed, a layer at a time: no rank holds the whole model in bf16, and 1 and N ranks hold the same
codes (every format quantises per group or per row, deterministically). No collectives.
A format is a QuantizedLinear subclass: its storage shapes, the weight rows a shard covers (`span`), quantising
rows into shards, dequantising the whole storage (merges, exports), and its own frozen matmul in `forward`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from shardfit.adapters.lora import LoRAModule, lora_class
from shardfit.models.init import ShardView, is_quantized_storage, seeded_normal_, whole_view


class Span(NamedTuple):
    """What this rank holds of one quantised weight: its shards of the storage (the same rows [s0, s0 + n) of each),
    the elements [e0, e1) of the flattened weight they stand for, and the weight's rows [r0, r1) that cover them."""
    shards: list[torch.Tensor]
    groups: int  # n: storage rows held (NF4: groups; FP8: weight rows)
    elems: tuple[int, int]
    rows: tuple[int, int]


class QuantizedLinear(nn.Linear):
    """A frozen linear layer whose weight is stored quantised (module docstring); LoRA's class for it adds the
    adapter (adapters/lora.py's lora_class). Subclasses: NF4Linear, FP8Linear."""

    STORAGE: tuple[str, ...] = ()  # the storage parameters' names, in module order
    FORMAT = ""  # model.quantize's value
    LABEL = ""  # its name in messages
    DESCRIPTION = ""  # the start notice's first words, formatted with (layers, weights)
    quantized_numel: int  # out x in: the weights it stands for (models.count_params counts these, not its bytes)
    fused_dequant = False  # compute.compile: the format's PyTorch fallbacks run as one compiled kernel
    NOTICE = ""  # how its matmuls run, for the start notice (notice())

    @classmethod
    def eligible(cls, out_features: int, in_features: int) -> bool:
        """Whether a weight of this shape can take the format (FP8's matmul needs dims of multiples of 16)."""
        return True

    @classmethod
    def storage_shapes(cls, out_features: int, in_features: int, carrier: torch.dtype) -> list[tuple[int, int]]:
        """The shape of each STORAGE tensor, in the carrier dtype."""
        raise NotImplementedError

    def span(self, view: ShardView) -> Span:
        raise NotImplementedError

    def quantize_rows(self, rows: torch.Tensor, span: Span) -> None:
        """Quantise this rank's storage rows from `rows` (the weight's rows span.rows, any float dtype)."""
        raise NotImplementedError

    def dequantized(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in dtype from its whole (gathered) storage tensors, in STORAGE order."""
        raise NotImplementedError

    def notice(self) -> str:
        return self.NOTICE

    def stored_bytes(self) -> int:
        return sum(getattr(self, k).numel() * getattr(self, k).element_size() for k in self.STORAGE)


def local_shards(mod: QuantizedLinear, view: ShardView) -> tuple[list[torch.Tensor], int, int]:
    """This rank's shards of the module's storage tensors, the first storage row they hold and how many (the same
    rows of each: they share dim 0, and FSDP splits it alike)."""
    local = [view(getattr(mod, n)) for n in mod.STORAGE]
    shards, s0, n = [t for t, _, _ in local], local[0][2], local[0][0].shape[0]
    assert all(t.shape[0] == n and row0 == s0 for t, _, row0 in local), "quantised shards must hold the same rows"
    return shards, s0, n


def rows_span(mod: QuantizedLinear, view: ShardView) -> Span:
    """A format whose storage rows are the weight's rows (FP8): this rank's shards and the rows they stand for."""
    shards, r0, n = local_shards(mod, view)
    return Span(shards, n, (r0 * mod.in_features, (r0 + n) * mod.in_features), (r0, r0 + n))


def register_frozen_matmul(linear, input_grad, n_storage: int) -> None:
    """The fake kernels and autograd of a format's frozen matmul, two custom operators taking (x or dy, *storage
    (n_storage tensors), out_features, in_features, *options): linear gives y [..., out], input_grad dX [..., in].
    Backward saves the storage, never a dequantised weight, and computes dX only where x needs it."""
    linear.register_fake(lambda x, *args: x.new_empty(*x.shape[:-1], args[n_storage]))
    input_grad.register_fake(lambda dy, *args: dy.new_empty(*dy.shape[:-1], args[n_storage + 1]))

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[1:1 + n_storage])
        ctx.args = inputs[1 + n_storage:]

    def backward(ctx, dy):
        dx = input_grad(dy, *ctx.saved_tensors, *ctx.args) if ctx.needs_input_grad[0] else None
        return dx, *[None] * (n_storage + len(ctx.args))

    linear.register_autograd(backward, setup_context=setup)


def quantized_modules(model: nn.Module) -> list[tuple[str, QuantizedLinear]]:
    return [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, QuantizedLinear)]


is_storage = is_quantized_storage  # whether a parameter name is a quantised weight's storage


def staging_rows(mod: QuantizedLinear, span: Span) -> torch.Tensor:
    """An empty fp32 buffer for the weight's rows span.rows, where the shards live."""
    r0, r1 = span.rows
    return torch.empty(r1 - r0, mod.in_features, dtype=torch.float32, device=span.shards[0].device)


def to_quantized(mod: nn.Linear, cls: type[QuantizedLinear]) -> QuantizedLinear:
    """Replace the module's weight by cls's storage, in place (on meta: empty; else quantised from the weight),
    carried in the weight's dtype; an adapted module keeps its adapters."""
    w = mod.weight
    shapes = cls.storage_shapes(w.shape[0], w.shape[1], w.dtype)
    params = {}
    for key, p in mod._parameters.items():  # the storage where the weight was: module order unchanged
        if key != "weight":
            params[key] = p
            continue
        for name, shape in zip(cls.STORAGE, shapes):
            params[name] = nn.Parameter(torch.empty(shape, dtype=w.dtype, device=w.device), requires_grad=False)
    mod._parameters.clear()
    mod._parameters.update(params)
    mod.__class__ = lora_class(cls) if isinstance(mod, LoRAModule) else cls
    mod.quantized_numel = w.numel()
    if w.device.type != "meta":
        mod.quantize_rows(w.detach(), mod.span(whole_view))
    return mod


def apply_quantized(model: nn.Module, targets: list[str], cls: type[QuantizedLinear], fused: bool = False) -> int:
    """Store the base weight of every adapted linear layer among `targets` (apply_lora's names; adapted experts stay
    in the compute dtype) in cls's format; returns how many. Called right after apply_lora: on the meta model
    (parallelize's step 0) or a materialised one (generate, export)."""
    mods = dict(model.named_modules())  # the blocks' linear layers: not the output head (an nn.Linear too)
    chosen = [mods[t] for t in targets if t.startswith("model.layers.") and isinstance(mods.get(t), nn.Linear)
              and cls.eligible(*mods[t].weight.shape)]
    for mod in chosen:
        to_quantized(mod, cls).fused_dequant = fused
    return len(chosen)


@torch.no_grad()
def init_quantized(model: nn.Module, seed: int, view: ShardView = whole_view) -> None:
    """Draw this rank's rows of each quantised weight as the seeded initialisation draws an unquantised one
    (models/init.py: the same values from (seed, name)), quantise them into the local shards, free them; one layer
    at a time."""
    std = model.cfg.init_std
    for fqn, mod in quantized_modules(model):
        span = mod.span(view)
        if not span.groups or span.shards[0].device.type == "meta":
            continue
        rows, shape = staging_rows(mod, span), (mod.out_features, mod.in_features)
        seeded_normal_(rows, std, seed, f"{fqn}.weight", view=lambda t, s=shape, r=span.rows[0]: (t, s, r))
        mod.quantize_rows(rows, span)


def to_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """model.to(dtype), quantised storage kept bit for bit (a cast would turn its bytes into other bytes): it is
    carried in the new dtype instead, as FSDP would gather it. Each storage tensor's row bytes divide by the new
    dtype's size (every format's rows are multiples of 4 bytes)."""
    storage = {n: p for n, p in model.named_parameters() if is_storage(n)}
    raw = {n: p.data.view(torch.uint8) for n, p in storage.items()}
    model.to(dtype)
    for n, p in storage.items():
        p.data = raw[n].view(dtype)
    return model


def quantized_summary(model: nn.Module) -> str:
    """One notice line: how much of the base is quantised, in which format, and its bytes."""
    mods = quantized_modules(model)
    n = sum(m.quantized_numel for _, m in mods)
    stored = sum(m.stored_bytes() for _, m in mods)
    return (mods[0][1].DESCRIPTION.format(len(mods), n) + f", {stored / 2**20:,.1f} MiB in all "
            f"(~{stored / max(n, 1):.3f} bytes a weight, sharded over the ranks); " + mods[0][1].notice())


__all__ = ["QuantizedLinear", "Span", "apply_quantized", "init_quantized", "is_storage", "local_shards",
           "quantized_modules", "quantized_summary", "register_frozen_matmul", "rows_span", "staging_rows",
           "to_dtype", "to_quantized"]
