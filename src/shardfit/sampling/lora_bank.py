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
Linears of one parent that read one input (SIBLINGS: q|k|v, gate|up) get their bank_A as row blocks of one stacked
tensor [members*S*R, in] (views: no more memory), and at decode share one shrink launch (_SiblingGroup; exact:
each member's partials the bits of its own shrink) where GROUP_SIBLINGS is on (the default).
`load(slot, adapters, scale)` copies one adapter version in (name -> (A, B) as adapters/lora.py names and shapes
them: the module's full name, lora_A [r, in] and lora_B [out, r], or the embedding's pair); a target the version does
not adapt gets zeros (what "not adapted" means). `free(slot)` zeroes it. Before every forward the sampler's runner
calls `set_rows(slots)` with a LongTensor shaped like the forward's input_ids [B, S]: each token's slot, -1 for the
base alone; the column mask of kernels/multi_lora.py is made there once and read by every banked layer.
The head, called apart on the positions the sampler wants logits for (a prompt's span, its last position, each
decode row's one), is told its rows the same way: the runner calls set_rows in the shape of the head's input first
(sampling/runner.py's _head; a decode step's [B, 1] serves both). `n_slots` tells the sampler's request check how
many slots there are.
MoE experts (adapters/expert_lora.py: `<layer>.mlp.experts.gate_up_proj` / `.down_proj`, A [E, r, in], B [E, out,
r]) -> BankedExperts, with banks [E, S*R, in] and [E, out, S*R] (slot s's rank rows / columns s*R : s*R + r); its
MoE layer (-> BankedMoE) hands the experts each routed row's token's columns (cols[order // k]: the rows are sorted by
expert), and every projection adds its two more grouped matmuls (kernels/multi_lora.py's multi_lora_grouped).
Refused in one line, never skipped: a target of another kind. Memory: S x R x (in + out) elements per target (x E
for the experts) in the decode dtype; no collective anywhere here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardfit.adapters.expert_lora import DOWN, GATE_UP, is_expert_target
from shardfit.adapters.quantized import QuantizedLinear
from shardfit.errors import ShardfitError
from shardfit.kernels.multi_lora import multi_lora, multi_lora_embedding, multi_lora_grouped, slot_columns
from shardfit.kernels.multi_lora_decode import MAX_TOKENS, lora_expand_, lora_shrink, multi_lora_decode_
from shardfit.kernels.multi_lora_decode import available as decode_kernel_available
from shardfit.models.decoder import OutputHead
from shardfit.models.moe import Experts, MoE

BANK_SLOTS = 4  # adapter slots of a decode model's first bank (Engine.sample doubles it when a call needs more)
# banked linears of one parent that read one input, in the order models/decoder.py calls them (the first computes
# the group's shrink); GROUP_SIBLINGS: whether they share it at decode (read per call: a benchmark's A/B switch;
# benchmarks/README.md's sampler section has the A/B that made it the default)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
GROUP_SIBLINGS = True

class _Banked:
    """What every banked linear, head or embedding has: its bank (the owner of the column mask) and two buffers."""

    lora_bank: LoRABank
    bank_A: torch.Tensor
    bank_B: torch.Tensor

    def _delta(self, x: torch.Tensor, out: torch.Tensor, group: _SiblingGroup | None = None) -> torch.Tensor:
        """out [..., out] + every token's own slot's adapter on x [..., in]: at decode (few tokens, no autograd, the
        kernel runs here) added in place by kernels/multi_lora_decode.py's launches (a sibling group's shrink shared:
        _SiblingGroup), else multi_lora's torch ops (prefill chunks, the CPU)."""
        flat = x.reshape(-1, x.shape[-1])  # [N, in]
        cols = self.lora_bank.columns(flat.shape[0])  # [N, S*R]
        fits = _decode_kernel_fits(flat, out)
        part = group.partials(self, x, flat, fits) if group is not None else None  # [SPLITS, N, members*S*R]
        if part is not None:
            lora_expand_(out.view(-1, out.shape[-1]), part, self.bank_B, cols, offset=group.offset(self))
            return out
        if fits:
            multi_lora_decode_(out.view(-1, out.shape[-1]), flat, self.bank_A, self.bank_B, cols)
            return out
        d = multi_lora(flat, self.bank_A, self.bank_B, cols)
        return out + d.view(out.shape).to(out.dtype)


def _decode_kernel_fits(flat: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether _delta adds in place through the decode kernel: N <= MAX_TOKENS tokens, no autograd (it writes the
    base output in place), layouts it reads (out contiguous: the base layer's fresh output), Triton on the device."""
    return (flat.shape[0] <= MAX_TOKENS and not torch.is_grad_enabled() and out.is_contiguous()
            and flat.stride(-1) == 1 and decode_kernel_available(flat))


class BankedLinear(_Banked, nn.Linear):
    lora_group: _SiblingGroup | None = None  # set by the bank where the layer has siblings (SIBLINGS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._delta(x, super().forward(x), self.lora_group if GROUP_SIBLINGS else None)


_BANKED_QUANTIZED: dict[type, type] = {}


def banked_quantized(cls: type[QuantizedLinear]) -> type:
    """BankedLinear over a quantised base (adapters/quantized.py: NF4, FP8): the base's own matmul from its storage,
    then the slots' adapters; a class made once per format. Never a sibling group (those are plain BankedLinear)."""
    if cls not in _BANKED_QUANTIZED:
        _BANKED_QUANTIZED[cls] = type(f"Banked{cls.__name__}", (BankedLinear, cls), {})
    return _BANKED_QUANTIZED[cls]


def _version(t: torch.Tensor) -> int:
    """t's in-place write counter (shared with its views); inference tensors keep none."""
    return -1 if t.is_inference() else t._version


class _SiblingGroup:
    """Banked linears of one parent that read one input (SIBLINGS: q|k|v, gate|up), whose A banks are row blocks
    of one tensor a [members*S*R, in] (each member's bank_A a view of it: no copy, load and free write through),
    so that at decode one shrink launch serves them all (kernels/multi_lora_decode.py: 10 launches a layer of 7
    banked linears instead of 14).

    The first member's call computes the group's partials on its x and keeps (x, part): x held (its id is not
    reused while kept) with its and the bank's write counters. A later member handed that same x, unwritten since,
    reads its columns of part; any other call takes its own shrink (always correct). The last member drops what is
    kept (nothing of one forward is held past it: a CUDA graph's pool included). Host-side checks only: capturable,
    and the captured launches are the shared ones."""

    def __init__(self, members: list[BankedLinear], a: torch.Tensor):
        self.members, self.a = tuple(members), a  # a [members*S*R, in]
        self.width = a.shape[0] // len(members)  # S*R
        self._drop()

    def _drop(self) -> None:
        self._x: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._part: torch.Tensor | None = None

    def offset(self, mod: BankedLinear) -> int:
        return self.members.index(mod) * self.width

    def _stacked(self) -> bool:
        """Whether every member's bank_A is still its rows of a (a model moved since would break the views)."""
        row = self.a.stride(0) * self.a.element_size()
        return all(m.bank_A.data_ptr() == self.a.data_ptr() + i * self.width * row and m.bank_A.shape[0] == self.width
                   for i, m in enumerate(self.members))

    def partials(self, mod: BankedLinear, x: torch.Tensor, flat: torch.Tensor, fits: bool) -> torch.Tensor | None:
        """part [SPLITS, N, members*S*R] for mod's expand on x (flat: x [N, in]), or None: mod takes its own path.
        fits: whether mod's call runs the decode kernel at all."""
        key = (_version(x), _version(self.a))
        if mod is self.members[0]:
            self._drop()
            if fits and self._stacked():
                self._x, self._key, self._part = x, key, lora_shrink(flat, self.a, members=len(self.members))
            return self._part
        part = self._part if fits and self._x is x and self._key == key else None
        if mod is self.members[-1]:
            self._drop()
        return part


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


class BankedExperts(Experts):
    """Experts whose gate_up and/or down projections add each routed row's own slot's adapter: banks
    bank_{gate_up,down}_proj_{A,B} (None where not adapted), and routed_cols [N, S*R] set by BankedMoE.run."""

    lora_bank: LoRABank
    routed_cols: torch.Tensor | None = None

    def swiglu(self, xs: torch.Tensor, linear, weights) -> torch.Tensor:
        gate, up, down = weights
        cols = self.routed_cols
        g, u = linear(xs, gate), linear(xs, up)  # [N, I] each
        a_gu = getattr(self, f"bank_{GATE_UP}_A", None)
        if a_gu is not None:
            d = multi_lora_grouped(xs, a_gu, getattr(self, f"bank_{GATE_UP}_B"), cols, linear)  # [N, 2I]
            half = gate.shape[1]
            g, u = g + d[:, :half].to(g.dtype), u + d[:, half:].to(u.dtype)  # PEFT's fused gate_up: gate's rows first
        h = F.silu(g) * u  # [N, I]
        y = linear(h, down)  # [N, H]
        a_d = getattr(self, f"bank_{DOWN}_A", None)
        if a_d is None:
            return y
        return y + multi_lora_grouped(h, a_d, getattr(self, f"bank_{DOWN}_B"), cols, linear).to(y.dtype)


class BankedMoE(MoE):
    """An MoE layer whose experts are banked: hands them each routed row's token's column mask."""

    def run(self, r):
        cols = self.experts.lora_bank.columns(r.weights.shape[0])  # [T, S*R]
        self.experts.routed_cols = cols.index_select(0, r.order // self.top_k)  # [T*k, S*R], sorted like r.xs
        return super().run(r)


@dataclass
class _Target:
    """One adapter's place in the bank: the A and B buffers and the dimension of each along which the slots'
    rank rows are stacked; `a_of` / `b_of` turn the adapter's own A / B into the buffer's layout."""

    a: torch.Tensor
    a_dim: int
    a_of: Callable[[torch.Tensor], torch.Tensor]
    b: torch.Tensor
    b_dim: int
    b_of: Callable[[torch.Tensor], torch.Tensor]

    def views(self, slot: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a.narrow(self.a_dim, slot * rank, rank), self.b.narrow(self.b_dim, slot * rank, rank)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.t()


def _bank(mod: nn.Module, name: str, shape: tuple[int, ...], kw: dict) -> torch.Tensor:
    buf = torch.zeros(shape, **kw)
    mod.register_buffer(name, buf, persistent=False)
    return buf


def _module(model: nn.Module, path: str, fqn: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ShardfitError(f"{fqn}: the model has no such module", where="lora.targets",
                            fix="name modules of this model (apply_lora's names)") from None


def _target(model: nn.Module, fqn: str, width: int, kw: dict) -> _Target:
    """The banked module of one target (its class swapped in place; a new bank replaces its buffers)."""
    if is_expert_target(fqn):
        path, _, weight = fqn.rpartition(".")
        mod = _module(model, path, fqn)
        if not isinstance(mod, Experts):
            raise ShardfitError(f"{fqn}: no MoE experts there", where="lora.targets", fix="name the model's experts")
        n, inner, dim = mod.gate_proj.shape  # [E, I, H]
        into, out = (dim, 2 * inner) if weight == GATE_UP else (inner, dim)
        a = _bank(mod, f"bank_{weight}_A", (n, width, into), kw)  # [E, S*R, in]
        b = _bank(mod, f"bank_{weight}_B", (n, out, width), kw)  # [E, out, S*R]
        mod.__class__ = BankedExperts
        model.get_submodule(path.rpartition(".")[0]).__class__ = BankedMoE
        return _Target(a, 1, _same, b, 2, _same)
    mod = _module(model, fqn, fqn)
    if isinstance(mod, _Banked):
        cls = type(mod)
    elif isinstance(mod, OutputHead):
        cls = BankedOutputHead
    elif type(mod) is nn.Linear:
        cls = BankedLinear
    elif isinstance(mod, QuantizedLinear):
        cls = banked_quantized(type(mod))
    elif type(mod) is nn.Embedding:
        cls = BankedEmbedding
    else:
        raise ShardfitError(f"{fqn} ({type(mod).__name__}) cannot hold a bank of adapters for sampling",
                            where="lora.targets", fix="adapt linear layers, lm_head, embed_tokens or experts only")
    out_f, in_f = (mod.out_features, mod.in_features) if isinstance(mod, nn.Linear) else mod.weight.shape  # [V, D]
    mod.__class__ = cls
    if cls is BankedEmbedding:  # PEFT's A [r, V], B [D, r]: A^T [V, S*R], B^T [S*R, D]
        return _Target(_bank(mod, "bank_A", (out_f, width), kw), 1, _transposed,
                       _bank(mod, "bank_B", (width, in_f), kw), 0, _transposed)
    return _Target(_bank(mod, "bank_A", (width, in_f), kw), 0, _same,  # A [r, in] as it is: [S*R, in]
                   _bank(mod, "bank_B", (width, out_f), kw), 0, _transposed)  # B [out, r]: B^T [S*R, out]


def _sibling_names(model: nn.Module, targets: list[str]) -> list[list[str]]:
    """The targets that form SIBLINGS groups: two or more of one tuple under one parent, each a banked plain linear,
    all of one in_features (in the tuple's order)."""
    fqns, groups = set(targets), []
    for parent in dict.fromkeys(t.rpartition(".")[0] for t in targets):
        for names in SIBLINGS:
            group = [f for f in (f"{parent}.{n}" if parent else n for n in names)
                     if f in fqns and type(model.get_submodule(f)) is BankedLinear]
            if len(group) > 1 and len({model.get_submodule(f).in_features for f in group}) == 1:
                groups.append(group)
    return groups


def _stack_group(model: nn.Module, names: list[str], targets: dict[str, _Target], kw: dict) -> _SiblingGroup:
    """The members' A banks made row blocks of one zeroed tensor [members*S*R, in] (each member's bank_A and its
    _Target's A the view of its rows), and the group that shares their shrink."""
    mods = [model.get_submodule(f) for f in names]
    width, in_f = mods[0].bank_A.shape  # [S*R, in]
    a = torch.zeros(len(mods) * width, in_f, **kw)
    for i, (f, mod) in enumerate(zip(names, mods)):
        view = a.narrow(0, i * width, width)
        mod.register_buffer("bank_A", view, persistent=False)
        targets[f].a = view
    group = _SiblingGroup(mods, a)
    for mod in mods:
        mod.lora_group = group
    return group


class LoRABank:
    """S adapter slots on the target modules of a plain (unsharded) decode CausalLM (module docstring)."""

    def __init__(self, model: nn.Module, targets: list[str], capacity: int, rank: int, dtype: torch.dtype,
                 device: torch.device):
        if capacity < 1 or rank < 1:
            raise ShardfitError(f"a LoRA bank of {capacity} slots of rank {rank}", where="LoRABank",
                                fix="give at least one slot and rank 1")
        self.capacity, self.rank, self.dtype, self.device = capacity, rank, dtype, device
        kw = {"dtype": dtype, "device": device}
        self.targets: dict[str, _Target] = {fqn: _target(model, fqn, capacity * rank, kw) for fqn in targets}
        for mod in model.modules():
            if isinstance(mod, (_Banked, BankedExperts)):
                mod.lora_bank = self
            if isinstance(mod, BankedLinear):
                mod.lora_group = None  # a bank made anew on the same model: the old one's groups go
        self.groups = [_stack_group(model, names, self.targets, kw) for names in _sibling_names(model, targets)]
        self.scale = torch.zeros(capacity, **kw)  # [S]: alpha / r per slot
        self._cols: torch.Tensor | None = None  # [B*S, S*R] of the last set_rows

    # ------------------------------------------------------------------ slots
    @torch.no_grad()
    def load(self, slot: int, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> None:
        """Copy one adapter version into `slot`: {target name: (A, B)} full tensors in adapters/lora.py's (and
        expert_lora.py's) shapes; targets missing from it get zeros."""
        self._check_slot(slot)
        unknown = sorted(set(adapters) - set(self.targets))
        if unknown:
            raise ShardfitError(f"adapter for {unknown[0]}, which this bank does not hold", where=unknown[0],
                                fix=f"load adapters of the bank's targets ({', '.join(sorted(self.targets))})")
        R = self.rank
        for fqn, t in self.targets.items():
            a_slot, b_slot = t.views(slot, R)
            a_slot.zero_()
            b_slot.zero_()
            if fqn not in adapters:
                continue
            a, b = (f(x) for f, x in zip((t.a_of, t.b_of), adapters[fqn]))
            r = a.shape[t.a_dim]
            fits = r <= R and b.shape[t.b_dim] == r and all(
                x.dim() == v.dim() and all(x.shape[i] == v.shape[i] for i in range(x.dim()) if i != d)
                for x, v, d in ((a, a_slot, t.a_dim), (b, b_slot, t.b_dim)))
            if not fits:
                raise ShardfitError(f"adapter of shapes A {tuple(adapters[fqn][0].shape)}, B "
                                    f"{tuple(adapters[fqn][1].shape)} does not fit this model's layer at rank <= {R}",
                                    where=fqn, fix="load adapters of this model's shapes, of rank at most the bank's")
            a_slot.narrow(t.a_dim, 0, r).copy_(a)
            b_slot.narrow(t.b_dim, 0, r).copy_(b)
        self.scale[slot] = scale

    @torch.no_grad()
    def free(self, slot: int) -> None:
        """Zero `slot` (its rows then add exactly nothing)."""
        self._check_slot(slot)
        for t in self.targets.values():
            for view in t.views(slot, self.rank):
                view.zero_()
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
        return sum(t.a.nbytes + t.b.nbytes for t in self.targets.values())


__all__ = ["BankedEmbedding", "BankedExperts", "BankedLinear", "BankedMoE", "BankedOutputHead", "LoRABank"]
