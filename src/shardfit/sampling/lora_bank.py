"""LoRABank: the decode model's adapted layers hold S adapter slots at once, so that rows of different LoRA models
and frozen versions decode in one batch (the math: kernels/multi_lora.py).

`LoRABank(model, targets, capacity, rank, dtype, device)` swaps the class of each target module of the plain decode
model in place (its weight, name and base computation kept, as adapters/lora.py does for training): nn.Linear ->
BankedLinear, the output head -> BankedOutputHead, the embedding -> BankedEmbedding; each gets its stacked bank as
non-persistent buffers beside its weight:
  linear / head   bank_A [S*R, in]  (slot s's A_s in rows s*R : s*R + r_s, zeros below R)
                  bank_B [S*R, out] (B_s^T, stacked the same way)
  embedding       bank_A [V, S*R]   (PEFT's lora_embedding_A [r, V], transposed into slot s's columns)
                  bank_B [S*R, D]   (lora_embedding_B [D, r], transposed)
S = capacity, R = rank (the largest adapter rank served; smaller ones zero-padded: exact), in the decode dtype.
`load(slot, adapters, scale)` copies one adapter version in (name -> (A, B) as adapters/lora.py names and shapes
them: the module's full name, lora_A [r, in] and lora_B [out, r], or the embedding's pair); a target the version does
not adapt gets zeros (what "not adapted" means). `free(slot)` zeroes it. Before every forward the sampler's runner
calls `set_rows(slots)` with a LongTensor shaped like the forward's input_ids [B, S]: each token's slot, -1 for the
base alone; the column mask of kernels/multi_lora.py is made there once and read by every banked layer.
The head, called apart on the positions the sampler wants logits for (a prompt's span, its last position, each
decode row's one), is told its rows the same way: the runner calls set_rows in the shape of the head's input first
(sampling/runner.py's _head; a decode step's [B, 1] serves both). `n_slots` tells the sampler's request check how
many slots there are.
Refused in one line, never skipped: a target that is not a linear, head or embedding module, and LoRA on MoE experts
(adapters/expert_lora.py's grouped adapters are not banked yet). Memory: S x R x (in + out) elements per target in
the decode dtype; no collective anywhere here.
"""

from __future__ import annotations

import torch
from torch import nn

from shardfit.adapters.expert_lora import is_expert_target
from shardfit.errors import ShardfitError
from shardfit.kernels.multi_lora import multi_lora, multi_lora_embedding, slot_columns
from shardfit.models.decoder import OutputHead


class _Banked:
    """What every banked module has: its bank (the owner of the column mask) and its two stacked buffers."""

    lora_bank: LoRABank
    bank_A: torch.Tensor
    bank_B: torch.Tensor

    def _delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [..., out] + every token's own slot's adapter on x [..., in]."""
        flat = x.reshape(-1, x.shape[-1])
        d = multi_lora(flat, self.bank_A, self.bank_B, self.lora_bank.columns(flat.shape[0]))
        return out + d.view(out.shape).to(out.dtype)


class BankedLinear(_Banked, nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._delta(x, super().forward(x))


class BankedOutputHead(_Banked, OutputHead):
    """The head's adapter per token on the logits (a per-row weight cannot be folded into one head weight, as
    training's LoRAOutputHead does): logits only, no fused loss."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
        if labels is not None:
            raise NotImplementedError("the banked decode head returns logits only (no fused loss or log-probs)")
        return self._delta(h, super().forward(h))


class BankedEmbedding(_Banked, nn.Embedding):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        flat = ids.reshape(-1)
        d = multi_lora_embedding(flat, self.bank_A, self.bank_B, self.lora_bank.columns(flat.shape[0]))
        return out + d.view(out.shape).to(out.dtype)


def _banked_class(mod: nn.Module, fqn: str) -> type:
    if isinstance(mod, OutputHead):
        return BankedOutputHead
    if type(mod) is nn.Linear:
        return BankedLinear
    if type(mod) is nn.Embedding:
        return BankedEmbedding
    raise ShardfitError(f"{fqn} ({type(mod).__name__}) cannot hold a bank of adapters for sampling",
                        where="lora.targets", fix="adapt linear layers, lm_head or embed_tokens only")


class LoRABank:
    """S adapter slots on the target modules of a plain (unsharded) decode CausalLM (module docstring)."""

    def __init__(self, model: nn.Module, targets: list[str], capacity: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        if capacity < 1 or rank < 1:
            raise ShardfitError(f"a LoRA bank of {capacity} slots of rank {rank}", where="LoRABank",
                                fix="give at least one slot and rank 1")
        for fqn in targets:
            if is_expert_target(fqn):
                raise ShardfitError(f"sampling in-process from LoRA on MoE experts ({fqn}) is not supported yet",
                                    where="lora.targets", fix="leave experts out of lora.targets, or sample through "
                                    "Engine.weights() (merged weights) in an inference engine")
        self.capacity, self.rank, self.dtype, self.device = capacity, rank, dtype, device
        self.modules: dict[str, _Banked] = {}
        for fqn in targets:
            mod = model.get_submodule(fqn)
            cls = type(mod) if isinstance(mod, _Banked) else _banked_class(mod, fqn)  # a new bank: buffers replaced
            out_f, in_f = mod.weight.shape  # Linear [out, in]; Embedding [V, D]
            width = capacity * rank
            kw = {"dtype": dtype, "device": device}
            if cls is BankedEmbedding:
                a, b = torch.zeros(out_f, width, **kw), torch.zeros(width, in_f, **kw)  # [V, S*R], [S*R, D]
            else:
                a, b = torch.zeros(width, in_f, **kw), torch.zeros(width, out_f, **kw)  # [S*R, in], [S*R, out]
            mod.register_buffer("bank_A", a, persistent=False)
            mod.register_buffer("bank_B", b, persistent=False)
            mod.__class__ = cls
            mod.lora_bank = self
            self.modules[fqn] = mod
        self.scale = torch.zeros(capacity, **{"dtype": dtype, "device": device})  # [S]: alpha / r per slot
        self._cols: torch.Tensor | None = None  # [B*S, S*R] of the last set_rows

    # ------------------------------------------------------------------ slots
    @torch.no_grad()
    def load(self, slot: int, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Copy one adapter version into `slot`: {target name: (A, B)} full tensors in adapters/lora.py's shapes;
        targets missing from it get zeros."""
        self._check_slot(slot)
        unknown = sorted(set(adapters) - set(self.modules))
        if unknown:
            raise ShardfitError(f"adapter for {unknown[0]}, which this bank does not hold", where=unknown[0],
                                fix=f"load adapters of the bank's targets ({', '.join(sorted(self.modules))})")
        R, rows = self.rank, slice(slot * self.rank, (slot + 1) * self.rank)
        for fqn, mod in self.modules.items():
            embedding = isinstance(mod, BankedEmbedding)
            a_slot = mod.bank_A[:, rows] if embedding else mod.bank_A[rows]  # [V, R] or [R, in]
            b_slot = mod.bank_B[rows]  # [R, out]
            a_slot.zero_()
            b_slot.zero_()
            if fqn not in adapters:
                continue
            a, b = adapters[fqn]
            r = a.shape[0]
            want_a = (r, mod.weight.shape[0] if embedding else mod.weight.shape[1])
            want_b = (mod.weight.shape[1] if embedding else mod.weight.shape[0], r)
            if r > R or tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ShardfitError(f"adapter of shapes A {tuple(a.shape)}, B {tuple(b.shape)} for a bank of rank "
                                    f"{R} expecting A {want_a}, B {want_b} (rank <= {R})", where=fqn,
                                    fix="load adapters of this model's shapes, of rank at most the bank's")
            if embedding:
                a_slot[:, :r].copy_(a.t())
            else:
                a_slot[:r].copy_(a)
            b_slot[:r].copy_(b.t())
        self.scale[slot] = scale

    @torch.no_grad()
    def free(self, slot: int) -> None:
        """Zero `slot` (its rows then add exactly nothing)."""
        self._check_slot(slot)
        rows = slice(slot * self.rank, (slot + 1) * self.rank)
        for mod in self.modules.values():
            (mod.bank_A[:, rows] if isinstance(mod, BankedEmbedding) else mod.bank_A[rows]).zero_()
            mod.bank_B[rows].zero_()
        self.scale[slot] = 0

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise ShardfitError(f"slot {slot} of a bank of {self.capacity}", where="LoRABank",
                                fix=f"a slot in 0..{self.capacity - 1}")

    # ------------------------------------------------------------------ rows
    def set_rows(self, slots: torch.Tensor) -> None:
        """slots [B, S] (long, -1: the base alone): each token's slot for the next forward. Device ops only (no host
        sync): capturable with the forward."""
        self._cols = slot_columns(slots.to(self.device).reshape(-1), self.scale, self.rank)  # [B*S, S*R]

    def columns(self, n: int) -> torch.Tensor:
        """The column mask of the last set_rows' tokens, for a layer called on all n of them."""
        if self._cols is None or n != self._cols.shape[0]:
            raise RuntimeError(f"a banked layer called on {n} tokens; set_rows gave "
                               f"{None if self._cols is None else self._cols.shape[0]}: call it before each forward")
        return self._cols

    @property
    def n_slots(self) -> int:
        return self.capacity

    @property
    def nbytes(self) -> int:
        return sum(m.bank_A.nbytes + m.bank_B.nbytes for m in self.modules.values())


__all__ = ["BankedEmbedding", "BankedLinear", "BankedOutputHead", "LoRABank"]
