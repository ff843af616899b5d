"""A PEFT adapter of transformers 4's Qwen3-MoE, read into shardfit's expert adapters exactly.

transformers 4 ran each expert as three linear modules, so PEFT adapted them one by one and saved one pair a module
and expert: `<layer>.mlp.experts.<e>.gate_proj.lora_A.weight` [r, H] and `...lora_B.weight` [I, r], up_proj the same,
down_proj [r, I] and [H, r] (peft_config.PER_EXPERT). shardfit's are stacked over the experts on the fused weights
(adapters/expert_lora.py): gate_up_proj_lora_A [E, R, H] shared by gate and up, gate_up_proj_lora_B [E, 2I, R],
down_proj_lora_A [E, R, I], down_proj_lora_B [E, H, R], with R one rank for every adapter (peft_config.py reads the
file at R = 2r when it adapts both gate_proj and up_proj, else r, and alpha scaled with it: the same alpha / R).
Expert e's adapters land as
  gate_up A[e] = [A_gate; A_up]      (rows :r, r:2r)
  gate_up B[e] = [[B_gate, 0],       (rows :I, columns :r)
                  [0,      B_up]]    (rows I:, columns r:2r)
so that B A = [B_gate A_gate; B_up A_up]: each projection gets its own update and nothing of the other's. With one
of gate_proj / up_proj alone, its A and B fill rank :r and the other's rows of B stay zero. down_proj's A and B fill
rank :r. Every other adapter of the file (attention, a dense MLP layer's, embeddings) fills rank :r of its own; with
R = 2r the rest is zero, which contributes nothing, and stays zero in training (a zero row of A beside a zero
column of B: each one's gradient is the other times something, so both are zero). gate_up's zero off-diagonal
blocks do train: the converted adapter is a rank-2r gate_up adapter from then on.

Loading goes through hf_load.py's reader, as every adapter: each per-expert tensor is read straight into its block of
this rank's experts (strided views of the adapter parameters, zeroed first), no staging, no collective. Every rank
checks every per-expert key and shape first (each reads only its own experts, and a problem must stop all ranks
alike): a missing expert, a rank other than r, or a key with no place in the model is one line naming the key.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shardfit.adapters.expert_lora import DOWN, GATE_UP, LoRAExperts, is_expert_adapter
from shardfit.adapters.lora import is_adapter
from shardfit.errors import ShardfitError
from shardfit.parallel.dtensor import local_view
from shardfit.weights.hf_load import Rows
from shardfit.weights.peft_config import ADAPTER_CONFIG, PER_EXPERT, PREFIX, PerExpert, peft_key
from shardfit.weights.safetensors import SafetensorsView

_A_LIKE = ("lora_A", "lora_embedding_A")  # the rank is dim 0 ([r, in]); the Bs' is dim 1 ([out, r])


@torch.no_grad()
def per_expert_params(model: nn.Module, files: dict[str, Path], source: PerExpert) -> tuple[dict, dict]:
    """({PEFT key: parameter or Rows}, {PEFT key: file}) that hf_load.py's reader fills this rank's adapters from,
    for the transformers-4 adapter `source` describes (module docstring). Zeroes every adapter first."""
    _check(model, files, source)
    params: dict = {}
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        local, shape, row0 = local_view(p)
        local.zero_()  # the padding, and gate_up B's off-diagonal blocks
        if is_expert_adapter(name):
            continue  # per module, below
        if source.rank == source.r:
            params[peft_key(name)] = p
        elif name.rpartition(".")[2] in _A_LIKE:  # this rank's rows [row0, row0 + n) of [R, in]: those under r
            n = max(0, min(local.shape[0], source.r - row0))
            params[peft_key(name)] = Rows(local[:n], (source.r, shape[1]), min(row0, source.r))
        else:  # [out, R], sharded along out: the first r columns of this rank's rows
            params[peft_key(name)] = Rows(local[:, :source.r], (shape[0], source.r), row0)
    for fqn, mod in model.named_modules():
        if isinstance(mod, LoRAExperts):
            params.update(_expert_rows(fqn, mod, source))
    return params, {k: f for k, f in files.items() if k in params or not PER_EXPERT.match(k)}


def _expert_rows(fqn: str, mod: LoRAExperts, source: PerExpert) -> dict[str, Rows]:
    """{per-expert key: Rows of its block} for this rank's experts of `mod` (module docstring's layout)."""
    r, out = source.r, {}
    offset = {"gate_proj": 0, "up_proj": r if "gate_proj" in source.weights else 0, "down_proj": 0}
    views = {n: local_view(getattr(mod, n)) for n in (f"{w}_lora_{ab}" for w in mod.adapted for ab in "AB")}
    for w in source.weights:
        fused = GATE_UP if w != "down_proj" else DOWN
        (a, _, e0), (b, b_shape, _) = views[f"{fused}_lora_A"], views[f"{fused}_lora_B"]
        rows = slice(None) if fused == DOWN else slice(0, b_shape[1] // 2) if w == "gate_proj" else \
            slice(b_shape[1] // 2, None)
        cols = slice(offset[w], offset[w] + r)
        for i in range(a.shape[0] if a.numel() else 0):  # this rank's experts
            key = f"{PREFIX}{fqn}.{e0 + i}.{w}.lora_"
            block_a, block_b = a[i, cols], b[i, rows, cols]  # B's block is strided: the reader copies into views
            out[key + "A.weight"] = Rows(block_a, tuple(block_a.shape), 0)
            out[key + "B.weight"] = Rows(block_b, tuple(block_b.shape), 0)
    return out


def _check(model: nn.Module, files: dict[str, Path], source: PerExpert) -> None:
    """Every per-expert key of every expert is in the file with its shape, and every one of the file has a place:
    checked on every rank over all experts (module docstring)."""
    found = {k for k in files if PER_EXPERT.match(k)}
    if not found:
        return
    file = files[next(iter(found))]
    fix_rank = (f"give every expert's gate_proj, up_proj and down_proj adapter the rank r={source.r} of "
                f"{ADAPTER_CONFIG} (per-module ranks are not supported)")
    view = SafetensorsView(file)
    try:
        for fqn, mod in model.named_modules():
            if not isinstance(mod, LoRAExperts):
                continue
            n, inner, dim = mod.gate_proj.shape
            sizes = {"gate_proj": (inner, dim), "up_proj": (inner, dim), "down_proj": (dim, inner)}
            for e in range(n):
                for w in source.weights:
                    (rows, cols), key = sizes[w], f"{PREFIX}{fqn}.{e}.{w}.lora_"
                    for ab, want in (("A", (source.r, cols)), ("B", (rows, source.r))):
                        k = f"{key}{ab}.weight"
                        if k not in found:
                            raise ShardfitError(
                                f"'{k}' is missing: a transformers-4 MoE adapter converts only whole, with "
                                f"{'/'.join(source.weights)} adapters on every expert of every MoE layer",
                                where=str(file), fix="save the adapter again from its PEFT model (which adapts "
                                                     "every expert), or merge it into the base and train that")
                        if view.shape(k) != want:
                            raise ShardfitError(f"'{k}' has shape {list(view.shape(k))}, {w}'s lora_{ab} of rank "
                                                f"r={source.r} is {list(want)}", where=str(file), fix=fix_rank)
                        found.discard(k)
    finally:
        view.close()
    if found:
        extra = sorted(found)[0]
        raise ShardfitError(f"'{extra}' has no place in the model: no MoE layer of it has that expert "
                            f"({len(found)} per-expert tensors left over)", where=str(file),
                            fix="load the adapter on the model it was trained on (base_model_name_or_path)")


def conversion_notice(path: str | Path, source: PerExpert) -> str:
    """One line for the run's notices: what the transformers-4 adapter was read as."""
    both = {"gate_proj", "up_proj"} <= set(source.weights)
    how = (f"gate_proj and up_proj as one gate_up_proj adapter of rank {source.rank} (the two As stacked, the Bs "
           f"block-diagonal), the other adapters zero-padded to rank {source.rank} (scale unchanged)" if both else
           f"{'/'.join(source.weights)} stacked over the experts at rank {source.r}")
    return (f"{path}: a transformers-4 MoE adapter (per-expert keys, r={source.r}) read exactly as shardfit's "
            f"expert adapters: {how}; its lora_dropout is not applied (expert adapters take none)")


__all__ = ["conversion_notice", "per_expert_params"]
