"""The decode model of an Engine: a plain (unsharded, no FSDP hooks) CausalLM over the trained model's own weights,
for sampling in-process with no weight sync (Engine.sample, engine/sampling.py).

`decode_model(engine_model, dtype)` builds a CausalLM of the same config on the meta device and gives it the full
tensors of the Engine's (FSDP-sharded) model, under the same names:
- on one rank, each DTensor's local tensor as it is: a view, no copy, no collective. The decode model shares storage
  with the trained model, so it follows every optimizer step in place and costs no memory; only a parameter stored
  in another dtype than `dtype` (fp32 masters of a full-parameter model decoding in bf16) is cast, a copy;
- on N ranks, `full_tensor()` of each parameter once, in model order on every rank (one all-gather per tensor, all
  ranks at the same point), cast to `dtype`: the whole model's weights on every rank (16 GB for the 8B shape in
  bf16, which an 80 GB GPU holds beside its shards). Where they do not fit the free memory, every rank refuses in one
  line with the arithmetic, decided by one all-reduce (MIN) of the room left, before any gather.
Buffers (RoPE frequencies, the MoE balancing biases) are the Engine's own tensors (not sharded: views everywhere).
LoRA layers (and LoRA experts) become plain base layers (the frozen base, gathered once: it never changes) and their
adapters move to a LoRABank (sampling/lora_bank.py) of `capacity` slots; `adapter_tensors` reads the live model's
adapters (full A and B per target, one all-gather per tensor on N ranks), which the caller loads into a slot. A
full-parameter model's gathered copy is stale after each optim_step: `refresh` copies the new values in place (the
sampler's tensors, and CUDA graphs captured on them, stay valid); the Engine counts its weights' epochs to know when.
The caller reshards first (Engine.finish: no gathered copy of a no-grad pass left as the module's parameters).
A quantised base (model.quantize: NF4, FP8; adapters/quantized.py) decodes from its storage: the decode model's
layers are of the same format, given the storage tensors as they are (views on one rank, gathered uncast on N: never
cast, their bytes are codes), and each runs its format's own matmul (an FP8 base: FP8 tensor cores where the GPU has
them, 1 byte of weight read a parameter; NF4: dequantised a layer at a time). The decode computes as the trainer's
forward does, so the sampler's log-probs stay the trainer's. Refused: parameters offloaded to the host.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardfit.adapters.expert_lora import LoRAExperts
from shardfit.adapters.fp8_base import quantized_class
from shardfit.adapters.lora import LoRAModule, is_adapter
from shardfit.adapters.quantized import quantized_modules, to_quantized
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.models.init import is_quantized_storage
from shardfit.parallel.dtensor import local_tensor
from shardfit.sampling.lora_bank import LoRABank
from shardfit.weights.hf_export import full_tensor

_ROOM = 0.9  # of the free memory the gathered model may take on N ranks (the rest: activations, the KV pool's start)


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _base_params(engine_model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of everything but the adapters, tied weights once, in model order (every rank alike)."""
    out = []
    for name, p in engine_model.named_parameters():
        if not is_adapter(name):
            out.append((name, p))
    return out


def lora_modules(engine_model: nn.Module) -> dict[str, nn.Module]:
    """{full name: module} of the adapted modules (apply_lora's names; an MoE layer's experts as its weights')."""
    out = {}
    for fqn, mod in engine_model.named_modules():
        if isinstance(mod, LoRAModule):
            out[fqn] = mod
        elif isinstance(mod, LoRAExperts):
            out.update({f"{fqn}.{w}": mod for w in mod.adapted})
    return out


def gathers(engine_model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether decode_model copies (N ranks, or a cast to dtype) rather than viewing the Engine's storage: then a
    full-parameter model's decode weights need `refresh` after each optim_step."""
    return _world() > 1 or any(_cast(n, p, dtype) for n, p in _base_params(engine_model))


def _cast(name: str, p: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the decode model holds p cast to dtype (a copy): never a quantised weight's storage (codes)."""
    return local_tensor(p).dtype != dtype and not is_quantized_storage(name)


def _full(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """One rank: the local tensor (a view where the dtype matches); N ranks: the gathered whole (a collective).
    dtype None: as stored (a quantised weight's storage)."""
    t = full_tensor(p) if _world() > 1 and isinstance(p, DTensor) else local_tensor(p)
    return t.detach() if dtype is None else t.detach().to(dtype)


def _check_room(params: list[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device) -> None:
    """On CUDA, what decode_model copies must fit: every parameter on N ranks (gathered whole), those cast to dtype
    on one. N ranks: one all-reduce (MIN) of the room left, the same verdict on every rank before any gather."""
    if device.type != "cuda":
        return
    world = _world()
    copied = [(n, p) for n, p in params if world > 1 or _cast(n, p, dtype)]
    if not copied and world == 1:
        return  # views only
    n = sum(p.numel() for _, p in copied)
    need = sum(p.numel() * (p.element_size() if is_quantized_storage(name) else dtype.itemsize) for name, p in copied)
    room = float(torch.cuda.mem_get_info(device)[0] * _ROOM - need)
    if world > 1:
        agreed = torch.tensor(room, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
        room = float(agreed)
    if room < 0:
        whole = "the whole model on every rank" if world > 1 else "a copy of the weights cast to the compute dtype"
        stored = any(is_quantized_storage(name) for name, _ in copied)
        raise ShardfitError(f"the decode model needs {whole}: {n:,} parameters x {dtype.itemsize} bytes"
                            f"{' (a quantised base as stored)' if stored else ''} = {need / 2**30:.1f} GiB, and a "
                            f"rank has {-room / 2**30:.1f} GiB too little ({_ROOM:.0%} of its free memory)",
                            where="Engine.sample",
                            fix="sample through Engine.weights() in an inference engine, or shard the model over "
                            "more GPUs (a smaller shard per rank leaves more room)")


def _set(model: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    prefix, _, leaf = name.rpartition(".")
    mod = model.get_submodule(prefix) if prefix else model
    if buffer:
        mod._buffers[leaf] = value
    else:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)


@torch.no_grad()
def decode_model(engine_model: nn.Module, dtype: torch.dtype, capacity: int = 4, live_adapters: bool = True):
    """(plain CausalLM, LoRABank or None, the live model's adapters {name: (A, B)} or None: live_adapters=False
    skips reading them); module docstring. Every rank calls it at the same point (N ranks: one all-reduce, then one
    all-gather per tensor)."""
    params = _base_params(engine_model)
    device = local_tensor(params[0][1]).device
    if device.type == "cpu" and any(local_tensor(p).device.type == "cpu" and isinstance(p, DTensor)
                                    and p.device_mesh.device_type != "cpu" for _, p in params):
        raise ShardfitError("sampling in-process with parameters offloaded to the host is not supported",
                            where="parallel.offload", fix="sample through Engine.weights() in an inference engine")
    _check_room(params, dtype, device)
    with torch.device("meta"):
        plain = build_model(engine_model.cfg, loss_chunk=engine_model.loss_chunk)
        for fqn, mod in quantized_modules(engine_model):  # the same format, its storage set below
            to_quantized(plain.get_submodule(fqn), quantized_class(mod.FORMAT)).fused_dequant = mod.fused_dequant
    for name, p in params:
        _set(plain, name, _full(p, None if is_quantized_storage(name) else dtype))
    if plain.cfg.tie_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    for name, b in engine_model.named_buffers():
        _set(plain, name, b, buffer=True)
    left = [n for n, p in [*plain.named_parameters(), *plain.named_buffers()] if p.is_meta]
    if left:
        raise RuntimeError(f"decode model: {left[0]} has no tensor in the Engine's model")
    plain.eval()
    targets = lora_modules(engine_model)
    if not targets:
        return plain, None, None
    rank = next(iter(targets.values())).lora_rank
    bank = LoRABank(plain, list(targets), capacity, rank, dtype, device)
    return plain, bank, adapter_tensors(engine_model) if live_adapters else None


@torch.no_grad()
def refresh(plain: nn.Module, engine_model: nn.Module) -> None:
    """Copy the Engine's current base weights into the decode model's, in place (after an optim_step of a
    full-parameter model, where decode_model copied). N ranks: one all-gather per tensor, every rank alike."""
    mine = dict(plain.named_parameters())
    for name, p in _base_params(engine_model):
        t = mine[name]
        src = _full(p, t.dtype)
        if src.data_ptr() != t.data_ptr():
            t.copy_(src)


@torch.no_grad()
def adapter_tensors(engine_model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{target name: (A, B)} full fp32 tensors of the adapters in the slot now. N ranks: one all-gather per tensor,
    in model order on every rank."""
    out = {}
    for fqn, mod in lora_modules(engine_model).items():
        if isinstance(mod, LoRAExperts):  # <experts>.gate_up_proj: A [E, r, in], B [E, out, r]
            w = fqn.rpartition(".")[2]
            a, b = getattr(mod, f"{w}_lora_A"), getattr(mod, f"{w}_lora_B")
        else:
            a, b = mod.adapter_pair()
        out[fqn] = (_full(a, torch.float32).clone(), _full(b, torch.float32).clone())  # not views: the slot changes
    return out


def adapter_scale(engine_model: nn.Module) -> float:
    """alpha / r of the Engine's adapters (one LoRA config for every model of the registry)."""
    return next(iter(lora_modules(engine_model).values())).lora_scale


__all__ = ["adapter_scale", "adapter_tensors", "decode_model", "gathers", "lora_modules", "refresh"]
