"""Many LoRA models on one frozen base, and frozen versions of them (Tinker's model: docs/rl.md); without LoRA the
one model that trains every parameter, and frozen versions of it.

The sharded model holds one set of adapter parameters, the slot (FSDP-sharded with the base, in every block's
group). A model is what fills the slot: its adapter values, its gradients since its last optim_step, its optimizer
state, its step counters and its pending passes. `activate(name)` puts a model in the slot: the adapters' and the
gradients' local shards are copied in and out (this rank's shards only: no collective, every rank swaps the same
model because every rank runs the same commands), the optimizer's per-parameter state is swapped by reference. The
model that was active keeps its own copies; a model stays in the slot until another one is asked for, so a run of
one model's calls costs no swap at all.

A version is a frozen copy of a model's adapter shards at one moment (save_weights_for_sampler): it samples and scores
exactly those weights, whatever trains afterwards. Activating it puts its values in the slot read-only; the base
alone (a sampler of the base model) is the zero adapter. Versions are kept on the device while their bytes fit
`device_budget`, on the host beyond it (copied in when activated). A version is also made from a saved checkpoint
(`load_version`, a sampler of a tinker:// path): the model in the slot leaves it, the checkpoint's weights are read
into the slot and kept as a version, and the slot then belongs to no one ("") until the next activate writes it whole.

Memory, per rank: a model costs its adapter shards (fp32) x 2 (values, gradients) + the optimizer's 2 moments when
inactive; a version its adapter shards. The slot's own copies are the model's parameters themselves.

Without LoRA (`lora=False`) the slot is every parameter and holds one model, "default": `add` and the base alone are
refused naming --lora.rank. A version is a copy of every parameter's local shards in `version_dtype` (the compute
dtype FSDP casts them to for the forward: bf16 on CUDA, so a version samples exactly the weights at freeze time); while
one is in the slot the model's own fp32 shards wait in host memory (`_leave`), copied back when the model is called
again. Such a swap writes every weight: the FP8 scales are refreshed (one all-reduce with tensorwise FP8 all-gather,
on every rank alike).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shardfit.adapters.lora import init_adapters
from shardfit.errors import ShardfitError
from shardfit.parallel.dtensor import local_tensor, local_view
from shardfit.parallel.fp8 import refresh_fp8_scales

BASE = "base"  # the zero adapter: the frozen base alone


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class ModelSlot:
    """A model's contents while it is out of the slot."""

    values: list[torch.Tensor] | None  # this rank's adapter shards; None: in the slot now
    grads: list[torch.Tensor | None] = field(default_factory=list)
    opt_state: list[dict] = field(default_factory=list)
    pending: list = field(default_factory=list)  # the Engine's StepStats since the model's last optim_step
    step: int = 0
    skipped: int = 0
    tokens_seen: int = 0


@dataclass
class Version:
    model: str  # the model it was frozen from, or the path it was loaded from (load_version)
    step: int
    values: list[torch.Tensor]  # this rank's adapter shards (every parameter's without LoRA), device or host
    on_device: bool

    @property
    def nbytes(self) -> int:
        return _nbytes(self.values)


class ModelRegistry:
    """The models and versions of one Engine. `current` names what is in the slot (a model, a version id,
    BASE, or "" for no one). lora=False: the slot is every parameter, one model (module docstring); versions are kept in
    `version_dtype` (None: the parameters' own)."""

    def __init__(self, engine, device_budget: int = 1 << 30, *, lora: bool = True,
                 version_dtype: torch.dtype | None = None):
        self.engine = engine
        self.params = list(engine.params)  # the slot: every trained parameter (the adapters), in a fixed order
        self.models: dict[str, ModelSlot] = {"default": ModelSlot(None)}
        self.versions: dict[str, Version] = {}
        self.current = "default"
        self.device_budget = device_budget
        self.lora, self.version_dtype = lora, version_dtype
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ models
    def add(self, name: str, seed: int) -> None:
        """A new model, starting at the base exactly: A drawn from (seed, parameter name) as PEFT draws it, B zero;
        no optimizer state, step 0. It becomes the active one."""
        if not self.lora:
            raise ShardfitError("a second model needs LoRA: this engine trains every parameter as one model",
                                where="lora.rank", fix="start it with --lora.rank=R (e.g. 16) to hold several models")
        if name in self.models:
            raise ShardfitError(f"model {name!r} exists", where="model_id", fix="choose another name")
        self._leave()
        with torch.no_grad():
            init_adapters(self.engine.model, seed, view=local_view)
        for p in self.params:
            p.grad = None
        self.models[name] = ModelSlot(None)
        self._enter_state(ModelSlot(None))
        self.current = name

    def remove(self, name: str) -> None:
        if name not in self.models:
            raise self._unknown(name)
        if name == self.current:
            self._leave()
            self.current = ""
        del self.models[name]

    def activate(self, name: str) -> None:
        """Put model `name` (or a version id, or BASE) in the slot; "" leaves it to no one (what a caller saw there
        after a version was released or loaded: the next activate writes the slot whole)."""
        if name == self.current:
            return
        if name == "":
            self._leave()
            self.current = ""
            return
        if name != BASE and name not in self.models and name not in self.versions:
            raise self._unknown(name)
        if name == BASE and not self.lora:
            raise ShardfitError("the base alone is LoRA's (the zero adapter): this engine trains every parameter, "
                                "the weights it started from are not kept", where="model_id",
                                fix="freeze a version before training (save_weights_for_sampler), or start it with "
                                "--lora.rank=R")
        self._leave()
        with torch.no_grad():
            if name == BASE:
                for p in self.params:
                    local_tensor(p.data).zero_()  # B = 0 (A too): the adapters add nothing
            elif name in self.versions:
                for p, v in zip(self.params, self.versions[name].values):
                    local_tensor(p.data).copy_(v, non_blocking=True)
            else:
                slot = self.models[name]
                for p, v in zip(self.params, slot.values):
                    local_tensor(p.data).copy_(v)
                self._enter_state(slot)
                slot.values = None
        if not self.lora:
            refresh_fp8_scales(self.engine.model, self.engine.cfg.compute)  # every weight was written
        self.current = name

    @property
    def trainable(self) -> bool:
        """The slot holds a model (not a version or the base): forward_backward and optim_step may run."""
        return self.current in self.models

    # ------------------------------------------------------------------ a pass of several models (multi_model.py)
    def shards(self, name: str) -> list[torch.Tensor]:
        """Model `name`'s adapter values, this rank's shards, wherever they are (the slot, or its own copies)."""
        slot = self.models[name]
        return [local_tensor(p.data) for p in self.params] if slot.values is None else slot.values

    def grads(self, name: str) -> list[torch.Tensor]:
        """Model `name`'s gradients since its last optim_step, this rank's shards, made (zeros) where it has none."""
        slot = self.models[name]
        if slot.values is None:  # in the slot
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return [local_tensor(p.grad) for p in self.params]
        if not slot.grads:
            slot.grads = [None] * len(self.params)
        slot.grads = [g if g is not None else torch.zeros_like(p) for p, g in zip(self.params, slot.grads)]
        return [local_tensor(g) for g in slot.grads]

    def pending(self, name: str) -> list:
        """Model `name`'s pending passes (the Engine's StepStats since its last optim_step), the list itself."""
        slot = self.models[name]
        return self.engine._pending if slot.values is None else slot.pending

    def drop_gradients(self, name: str) -> None:
        """Model `name`'s gradients and pending passes since its last optim_step, dropped (data that differ between
        ranks)."""
        for g in self.grads(name):
            g.zero_()
        self.pending(name).clear()

    # ------------------------------------------------------------------ versions
    def freeze(self, name: str) -> str:
        """A frozen version of model `name` now; returns its id."""
        if name not in self.models:
            raise self._unknown(name)
        self.engine.finish()  # a launched overlapped step writes the adapters
        slot = self.models[name]
        src = [local_tensor(p.data) for p in self.params] if slot.values is None else slot.values
        return self._keep(name, self.engine.step if slot.values is None else slot.step, src)

    def load_version(self, load: Callable[[], None], name: str) -> str:
        """A frozen version of the weights `load()` writes into the slot (a saved checkpoint's: a sampler of a
        tinker:// path), named `name` (its path) in Version.model; its id. The model in the slot leaves it first
        (_leave: without LoRA its fp32 shards wait on the host) and the slot is left to no one: the model's next call
        copies its own values back, so a load that fails half-way disturbs nothing."""
        self._leave()
        self.current = ""
        load()
        return self._keep(name, 0, [local_tensor(p.data) for p in self.params])

    def _keep(self, name: str, step: int, src: list[torch.Tensor]) -> str:
        """Version of `src` (this rank's shards of the slot's parameters, in their order): on the device while the
        versions' bytes fit device_budget, else on the host; in version_dtype where one is set."""
        dtype = self.version_dtype
        need = sum(t.numel() * (dtype.itemsize if dtype is not None else t.element_size()) for t in src)
        on_device = self.device_bytes() + need <= self.device_budget
        with torch.no_grad():  # on the device: where the slot's shard lives (its values may wait on the host)
            values = [t.detach().to(local_tensor(p.data).device if on_device else "cpu", dtype or t.dtype, copy=True)
                      for p, t in zip(self.params, src)]
        vid = f"{name}@{next(self._ids)}"
        self.versions[vid] = Version(name, step, values, on_device)
        return vid

    def release(self, vid: str) -> None:
        if vid not in self.versions:
            raise ShardfitError(f"version {vid!r} is not held (freed, or never saved)", where="model_path",
                                fix="save the weights again (save_weights_for_sampler) and sample from that")
        if self.current == vid:
            self.current = ""  # the slot's values are stale: the next activate writes the slot whole
        del self.versions[vid]

    def device_bytes(self) -> int:
        return sum(v.nbytes for v in self.versions.values() if v.on_device)

    def summary(self) -> dict:
        return {"models": len(self.models), "versions": len(self.versions),
                "versions_on_device": sum(v.on_device for v in self.versions.values()),
                "version_device_bytes": self.device_bytes(),
                "version_host_bytes": sum(v.nbytes for v in self.versions.values() if not v.on_device)}

    # ------------------------------------------------------------------ the slot
    def _leave(self) -> None:
        """Copy what the slot holds out to its model (a version or the base leaves nothing to keep)."""
        self.engine.finish()  # a launched overlapped step writes the adapters and owns the gradients
        if self.current not in self.models:
            return
        slot = self.models[self.current]
        e, opt = self.engine, self.engine.optimizer
        with torch.no_grad():  # without LoRA, every weight: it waits on the host while a version is in the slot
            slot.values = [local_tensor(p.data).to("cpu", copy=True) if not self.lora else
                           local_tensor(p.data).clone() for p in self.params]
        slot.grads = [p.grad for p in self.params]  # by reference: the slot gets fresh ones
        slot.opt_state = [opt.state.pop(p, {}) for p in self.params]
        slot.pending, e._pending = e._pending, []
        slot.step, slot.skipped, slot.tokens_seen = e.step, e.skipped, e.tokens_seen
        for p in self.params:
            p.grad = None

    def _enter_state(self, slot: ModelSlot) -> None:
        e, opt = self.engine, self.engine.optimizer
        for i, p in enumerate(self.params):
            p.grad = slot.grads[i] if slot.grads else None
            if slot.opt_state and slot.opt_state[i]:
                opt.state[p] = slot.opt_state[i]
        e._pending = slot.pending
        e.step, e.skipped, e.tokens_seen = slot.step, slot.skipped, slot.tokens_seen
        slot.grads, slot.opt_state, slot.pending = [], [], []

    def _unknown(self, name: str) -> ShardfitError:
        known = ", ".join(sorted(self.models)) or "none"
        return ShardfitError(f"no model or version {name!r} on this engine", where="model_id",
                             fix=f"one of {known}, or create it first" if self.lora else
                             f"one of {known} (a full-parameter engine trains one model; more need --lora.rank)")
