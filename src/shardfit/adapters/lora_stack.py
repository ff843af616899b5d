"""AdapterStack: K LoRA models' adapters on every adapted linear layer at once, for one training pass whose rows
belong to different models (engine/multi_model.py); the math is kernels/multi_lora.py's.

For each adapted linear layer (adapters/lora.py's LoRALinear: A [r, in], B [out, r], scale alpha / r) the stack holds
    A_all [K*r, in]   model k's A in rows k*r .. (k+1)*r
    B_all [K*r, out]  model k's B^T, stacked the same way
as fp32 leaf tensors with requires_grad (the K models' whole adapters, not FSDP parameters), and for the current
micro-batch the mask [N, K*r] of its N tokens (`set_rows`): 1 on the r columns of the token's own model, 0 elsewhere
(every column for a padding token, slot -1). The layer then adds
    delta = scale x ((drop(x) A_all^T) * mask) B_all       [N, out]
which for a token of model k is exactly scale x B_k A_k drop(x) (the other models' columns add exact zeros), so
model k's gradients (A_all.grad / B_all.grad rows k*r .. (k+1)*r) come from its own tokens only, and a model with
no token or a zero loss gets exact zeros. The mask is made once per micro-batch and read by every layer (and again
by the recomputation under activation checkpointing: the same micro-batch's). A_all and B_all are cast to the
compute dtype in each layer's forward, as FSDP casts the live adapters (fp32 on the CPU: no cast).

Cost per layer and micro-batch: the K-fold shrink and expand, 2 N K r (in + out) FLOPs where one model's adapter does
2 N r (in + out); for the 8B shape's q_proj (in = out = 4096) at r = 16 and K = 16 that is K r / in = 6% of the base
matmul each way (12.5% more FLOPs on adapted layers), K = 4: 3%. A grouped matmul over each model's token spans
(punica's SGMV) would do 2 N r (in + out) whatever K; it needs a custom kernel, and the spans are on the host (the
packer knows them), so it is the next step where K grows past ~8.

Under compute.compile the K*r dimension of A_all, B_all and the mask is marked dynamic: the blocks compile ONE graph
for passes of several models, whatever K. Left to torch.compile's automatic dynamic shapes, the first pass of K = 2
compiled a graph for K = 2 and the first pass of another K a second one (a recompile of every block's forward and
backward in the middle of a served step), and each variant counts against the recompile limit past which dynamo
falls back to eager.

Each layer reaches its own A_all and B_all through its own attribute (`install` puts a _Layer holding them on the
layer as `lora_stack`), never through an index of the layer: the blocks share one compiled graph only while
nothing in the traced code tells one block's layers from another's. Looking the layer up by `id(mod)` (session 23)
made dynamo guard on each layer object's identity (ID_MATCH), so every block of a pass of several models compiled
a graph of its own, the 8th variant of the block's forward hit torch._dynamo's recompile_limit, and the blocks past
it ran EAGER in every pass of several models from then on (no further recompile to see, and silently): on the 8B
shape's 36 blocks, ~30 of them (the slow passes of benchmarks/README.md's issue 35 section;
tests/adapters/test_lora_stack.py counts the variants).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardfit.kernels.multi_lora import multi_lora, slot_columns


def _dynamic(t: torch.Tensor, dim: int) -> None:
    """Mark t's K*r dimension dynamic for torch.compile (a hint only: nothing without compile)."""
    mark = getattr(torch._dynamo, "maybe_mark_dynamic", None)
    if mark is not None:
        mark(t, dim)


class AdapterStack:
    """`modules`: the adapted linear layers; a[j] [K*r, in] and b[j] [K*r, out] (fp32 leaves) their stacked
    adapters; `dtype`: the compute dtype. `install` puts the stack on the modules, `remove` takes it off."""

    def __init__(self, modules: list[nn.Module], a: list[torch.Tensor], b: list[torch.Tensor], n_models: int,
                 rank: int, dtype: torch.dtype):
        self.modules, self.a, self.b = modules, a, b
        self.n_models, self.rank, self.dtype = n_models, rank, dtype
        self.mask: torch.Tensor | None = None  # [N, K*r] of the current micro-batch
        for t in (*a, *b):  # K*r dynamic under compile (module docstring: one graph for every K)
            _dynamic(t, 0)
        # one per layer, each holding that layer's tensors (module docstring: no lookup by the layer's identity)
        self.layers = [_Layer(self, ta, tb) for ta, tb in zip(a, b)]

    def set_rows(self, slots: torch.Tensor) -> None:
        """slots [N] (long): each token's model, -1 for none, in the order of the layers' flattened inputs."""
        ones = torch.ones(self.n_models, dtype=self.dtype, device=slots.device)
        self.mask = slot_columns(slots, ones, self.rank)
        _dynamic(self.mask, 1)

    def install(self) -> None:
        for m, layer in zip(self.modules, self.layers):
            m.lora_stack = layer

    def remove(self) -> None:
        for m in self.modules:
            m.__dict__.pop("lora_stack", None)
        self.mask = None


class _Layer:
    """One layer's share of an AdapterStack: its A_all [K*r, in] and B_all [K*r, out], and the stack (the current
    micro-batch's mask, the compute dtype). Installed as the layer's `lora_stack`, so that what the traced forward
    reads is reached from the layer itself, the same path in every block (module docstring)."""

    def __init__(self, stack: AdapterStack, a: torch.Tensor, b: torch.Tensor):
        self.stack, self.a, self.b = stack, a, b

    def delta(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """[..., out]: each token's own model's adapter on x [..., in] (module docstring)."""
        flat = x.reshape(-1, x.shape[-1])
        if mod.lora_dropout:
            flat = F.dropout(flat, mod.lora_dropout, mod.training)
        mask, dtype = self.stack.mask, self.stack.dtype
        if mask is None or mask.shape[0] != flat.shape[0]:
            raise RuntimeError(f"AdapterStack: {flat.shape[0]} tokens, the rows set are "
                               f"{None if mask is None else mask.shape[0]}")
        d = multi_lora(flat, self.a.to(dtype), self.b.to(dtype), mask) * mod.lora_scale
        return d.view(*x.shape[:-1], d.shape[-1])
