"""LoRA in and out in PEFT's format: the adapter directory a run exports (and loads to continue training), the
merged model, and an adapter attached to a loaded model (shardfit generate --adapter).

Export (`export_adapter`, checkpoint.export_hf of a LoRA run): adapter_config.json (peft_config.py) and
adapter_model.safetensors holding every adapter parameter in fp32 under PEFT's key (peft_config.peft_key:
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), which peft.PeftModel.from_pretrained loads on
the transformers model. Each adapter is gathered whole (`full_tensor`, a collective every rank issues in the same
order); rank 0 writes into <out>.tmp and renames it (hf_export.py's publish); the outcome is agreed in one
collective, so every rank returns or raises together. Adapters are small (r x (in + out) per layer; MoE experts'
E times that: 2.5 GB fp32 on Qwen3-30B-A3B at r=16): rank 0 holds them all at once. MoE experts' adapters
(adapters/expert_lora.py) are written in PEFT's layout and keys for target_parameters (peft 0.21, tuners/lora/
layer.py ParamWrapper, the version tested; older ones read 3-D experts unswapped): lora_A.weight [E*r, in] (row
e*r + j is expert e's j-th), lora_B.weight [out, r*E] (column j*E + e), scale alpha / r. One ParamWrapper per
parameter, nested in the module's parameter order: with both adapted, gate_up_proj's pair is
`<experts>.base_layer.lora_A.weight` and down_proj's `<experts>.lora_A.weight`; one alone is `<experts>.lora_A...`
(`peft_expert_key`, `to_peft`, `from_peft`).
Merged (`merged_parameters`, checkpoint.export_merged and Engine.weights): the base's parameters, each adapted
weight as W + (alpha/r) B A in fp32 (a quantised base, adapters/quantized.py: W dequantised, its rounding kept; stacked
experts per expert, gate_up's B split between gate and up), streamed through hf_export.py one parameter at
a time. A tied embedding has one weight for two uses, so adapters on embed_tokens or lm_head of a tied model cannot
be merged: refused.
Load (`load_adapter`, lora.adapter): through hf_load.py's reader, each rank reading its own rows of each
adapter (an MoE expert adapter's B whole: its experts are strided columns in PEFT's layout), no collective. The
base weights PEFT saves beside an embedding adapter (`...base_layer.weight`) are not read: the base is
model.path's. A transformers-4 MoE adapter (one pair a module and expert, `...mlp.experts.0.gate_proj.lora_A.weight`)
is read into the same adapters by peft_per_expert.py, exactly (gate and up at rank 2r on the fused gate_up).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardfit.adapters.expert_lora import DOWN, GATE_UP, LoRAExperts, adapted_experts, adapter_of, is_expert_adapter
from shardfit.adapters.lora import (
    LoRAEmbedding,
    LoRAModule,
    LoRAOutputHead,
    apply_lora,
    is_adapter,
    target_names,
)
from shardfit.adapters.quantized import QuantizedLinear
from shardfit.config.schema import LoraConfig
from shardfit.errors import ShardfitError
from shardfit.parallel.agreement import agree
from shardfit.parallel.dtensor import local_view
from shardfit.weights.hf_export import batched_by_bytes, copy_tokenizer, full_tensor, publish, write_safetensors
from shardfit.weights.hf_load import LoadResult, Rows, file_map, load_hf_checkpoint
from shardfit.weights.peft_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PREFIX,
    adapter_config_json,
    peft_key,
    per_expert_source,
    read_adapter_config,
)
from shardfit.weights.peft_per_expert import conversion_notice, per_expert_params
from shardfit.weights.quantized_io import merged_weight

_STAGE_BYTES = 256 << 20  # expert B adapters staged whole per batch while loading (load_adapter)



def target_parameters(adapted: tuple[str, ...]) -> list[str]:
    """adapter_config.json's target_parameters for these expert weights (PEFT matches them in every layer)."""
    return [f"mlp.experts.{w}" for w in adapted]


def peft_expert_key(name: str, adapted: tuple[str, ...]) -> str:
    """shardfit's `<experts>.gate_up_proj_lora_A` -> PEFT's key in adapter_model.safetensors (module docstring)."""
    prefix, _, leaf = name.rpartition(".")
    weight, _, ab = leaf.rpartition("_lora_")
    nested = "base_layer." if weight == GATE_UP and DOWN in adapted else ""
    return f"{PREFIX}{prefix}.{nested}lora_{ab}.weight"


def to_peft(name: str, t: torch.Tensor) -> torch.Tensor:
    """A full adapter in PEFT's layout: A [E, r, in] -> [E*r, in]; B [E, out, r] -> [out, r*E] (column j*E + e)."""
    if name.endswith("_A"):
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def from_peft(name: str, t: torch.Tensor, n_experts: int) -> torch.Tensor:
    """to_peft's inverse (a view where it can be): PEFT's [E*r, in] -> [E, r, in]; [out, r*E] -> [E, out, r]."""
    if name.endswith("_A"):
        return t.view(n_experts, -1, t.shape[-1])
    return t.view(t.shape[0], -1, n_experts).permute(2, 0, 1)


def export_adapter(model: nn.Module, out: str | Path, lora: LoraConfig, targets: list[str], base: str | None,
                   source: str | Path | None = None) -> Path | None:
    """Write the PEFT adapter directory `out` (module docstring); rank 0 returns it, the others None."""
    out = Path(out)
    rank = dist.get_rank() if dist.is_initialized() else 0
    tensors = {}
    experts = adapted_experts(targets)
    for name, p in model.named_parameters():  # the same order on every rank: the gathers line up
        if is_adapter(name):
            full = full_tensor(p)
            if rank == 0:
                t = full.detach().to(device="cpu", dtype=torch.float32)
                if is_expert_adapter(name):  # PEFT's layout of a 3-D parameter's adapter (adapters/expert_lora.py)
                    tensors[peft_expert_key(name, experts)] = to_peft(name, t).contiguous()
                else:
                    tensors[peft_key(name)] = t.contiguous()
    problem = None
    if rank == 0:
        tmp = out.with_name(out.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write_safetensors(tensors, tmp / ADAPTER_WEIGHTS)
            config = adapter_config_json(lora.rank, lora.alpha, lora.dropout, target_names(targets), base,
                                         target_parameters(experts))
            (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
            copy_tokenizer(source, tmp)
            problem = publish(tmp, out)
        except OSError as e:
            problem = f"could not write {tmp} ({e.strerror or e})"
    agree(problem, "checkpoint.export_hf", f"free {out} (or choose another directory) and export again")
    return out if rank == 0 else None


def check_mergeable(model: nn.Module) -> None:
    """Refuse (on every rank alike: the model decides) a merge a tied embedding cannot hold."""
    if getattr(model.cfg, "tie_embeddings", False) and any(isinstance(m, (LoRAEmbedding, LoRAOutputHead))
                                                            for m in model.modules()):
        raise ShardfitError("the embedding is tied to the output head (one weight), and an adapter sits on one of "
                            "them: merged, the two uses would need different weights", where="lora.targets",
                            fix="leave embed_tokens and lm_head out of lora.targets, or export the adapter only")


def merged_parameters(model: nn.Module):
    """(name, full tensor) of the base with every adapter merged in (fp32 where merged), in model order, adapters
    left out. Every rank must iterate to the end (each gather is a collective)."""
    check_mergeable(model)
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        for key, p in list(mod._parameters.items()):
            quantized = isinstance(mod, QuantizedLinear) and key in mod.STORAGE
            if p is None or id(p) in seen or is_adapter(key) or quantized and key != mod.STORAGE[0]:
                continue
            seen.add(id(p))
            if quantized:  # a quantised base: its dequantised weight (the format's rounding is in the merged model)
                key, full = "weight", merged_weight(mod)
            else:
                full = full_tensor(p)
            if isinstance(mod, LoRAModule) and key == "weight":
                a, b = mod.adapter_pair()
                full = full.float() + mod.delta_weight(full_tensor(a), full_tensor(b))
            elif isinstance(mod, LoRAExperts) and adapter_of(key) in mod.adapted:  # [E, out, in], per expert
                a, b = (getattr(mod, f"{adapter_of(key)}_lora_{ab}") for ab in "AB")
                full = full.float() + mod.delta(key, full_tensor(a), full_tensor(b))
            yield (f"{prefix}.{key}" if prefix else key), full


@torch.no_grad()
def load_adapter(model: nn.Module, path: str | Path) -> LoadResult:
    """Fill the model's adapters from a PEFT adapter directory (this rank's rows of each; no collective). Every
    adapter must be in the file with its shape, and every adapter of the file must have a place in the model.
    Experts' adapters (adapters/expert_lora.py): A's experts are whole rows of PEFT's [E*r, in], read as any rows;
    B's are strided columns of PEFT's [out, r*E], so each B is read whole into a staging buffer (batches of at most
    _STAGE_BYTES, where the shards live) and this rank's experts copied out of it."""
    path = Path(path)
    files = {k: f for k, f in file_map(path / ADAPTER_WEIGHTS).items() if not k.endswith(".base_layer.weight")}
    source = per_expert_source(path)
    if source is not None:  # transformers 4's per-expert keys: each read into its block (peft_per_expert.py)
        params, files = per_expert_params(model, files, source)
        return load_hf_checkpoint(model, path, params=params, files=files)
    params, strided = {}, []
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        if not is_expert_adapter(name):
            params[peft_key(name)] = p
            continue
        key = peft_expert_key(name, model.get_submodule(name.rpartition(".")[0]).adapted)
        local, shape, row0 = local_view(p)  # [n, r, in] or [n, out, r] of [E, ...]: this rank's experts
        if name.endswith("_A"):
            params[key] = Rows(local.view(-1, shape[2]), (shape[0] * shape[1], shape[2]), row0 * shape[1])
        else:
            strided.append((key, name, local, shape, row0))
    staged = {key for key, *_ in strided}
    results = [load_hf_checkpoint(model, path, params=params, files={k: f for k, f in files.items()
                                                                     if k not in staged})]
    for batch in batched_by_bytes(strided, lambda item: 4 * math.prod(item[3]), _STAGE_BYTES):  # whole Bs, fp32
        rows = {key: Rows(torch.empty(s[1], s[2] * s[0], dtype=torch.float32, device=local.device),
                          (s[1], s[2] * s[0]), 0) for key, _, local, s, _ in batch}
        results.append(load_hf_checkpoint(model, path, params=rows, files={k: files[k] for k in rows if k in files}))
        for key, name, local, s, row0 in batch:
            local.copy_(from_peft(name, rows[key].local, s[0])[row0:row0 + local.shape[0]])
        del rows  # the batch's staging, freed before the next one is allocated
    return LoadResult.total(results)


def adapter_notices(path: str | Path) -> list[str]:
    """The notice lines loading the adapter directory brings: what a transformers-4 MoE adapter was read as."""
    source = per_expert_source(path)
    return [] if source is None else [conversion_notice(path, source)]


def attach_adapter(model: nn.Module, path: str | Path) -> list[str]:
    """Put the adapter directory's LoRA on a loaded, unsharded model (its dtype kept) and load it: shardfit generate
    --adapter. Returns the adapted modules' names."""
    lora = LoraConfig(**read_adapter_config(path), adapter=str(path))
    targets = apply_lora(model, lora, None)
    load_adapter(model, path)
    return targets


def adapter_base(path: str | Path) -> str | None:
    """base_model_name_or_path of the adapter's config when it names a local directory, else None."""
    try:
        base = json.loads((Path(path) / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return base if isinstance(base, str) and base and Path(base).is_dir() else None
