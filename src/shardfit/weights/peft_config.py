"""PEFT's adapter_config.json: read into lora.* values, and written for an export. Torch-free: the config loader is
handed `adapter_lora_fields` (lora.adapter) by the command that loads the config, before any model is built.

What shardfit reads and writes is the plain LoRA of PEFT's LoraConfig: one rank r and one lora_alpha for every
adapted module (scale alpha / r), lora_dropout, and target_modules as a list of module names (or "all-linear").
target_parameters names the MoE experts' stacked weights PEFT adapts as parameters (adapters/expert_lora.py):
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (or a suffix of them), read as lora.targets' experts names.
What it cannot reproduce is refused with one line naming the field, never approximated: DoRA, rsLoRA (scale
alpha / sqrt(r)), per-module rank or alpha patterns, layer subsets, bias training, modules_to_save, a regular
expression as target_modules, fan_in_fan_out, other target_parameters, and pickled weights (adapter_model.bin).

A transformers-4 MoE adapter (PEFT on transformers 4, where each expert was linear modules of its own: keys
`<layer>.mlp.experts.<e>.gate_proj.lora_A.weight`, ...) is read as shardfit's expert adapters (adapters/
peft_per_expert.py converts the tensors): lora.targets gains experts (or experts.gate_up_proj / experts.down_proj,
as the keys say), and with both gate_proj and up_proj adapted the rank is 2r, the rank at which their two As fit
one fused gate_up adapter exactly; shardfit has one rank for every adapter, so the others are zero-padded to it,
and lora_alpha is scaled with the rank so that alpha / rank, PEFT's scale, is unchanged. lora_dropout is not read
from it (0: shardfit's expert adapters take none). An adapter on the MoE router (`mlp.gate`) is refused.

Key mapping (peft.py applies it to tensors): a parameter `<fqn>.lora_A` of shardfit's model is PEFT's
`base_model.model.<fqn>.lora_A.weight` (lora_B alike); an embedding's `<fqn>.lora_embedding_A` is
`base_model.model.<fqn>.lora_embedding_A` (no `.weight`: PEFT stores them as bare parameters). The fqn is the
Hugging Face module name (shardfit's names are Hugging Face's), so the file loads in peft.PeftModel on the
transformers model as it is.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

from shardfit.errors import ShardfitError
from shardfit.fsutil import safetensors_header

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# target_parameters entry -> the lora.targets name it is (PEFT matches an entry as a suffix of "<module>.<parameter>")
_EXPERT_PARAMS = {f"{head}{w}": w for w in ("gate_up_proj", "down_proj") for head in ("", "experts.", "mlp.experts.")}
# transformers 4's per-expert adapter keys: (experts module, expert, weight, A or B)
PER_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$")
_ROUTER = re.compile(r"\.mlp\.gate\.lora_")  # an adapter on an MoE router (PEFT's all-linear took it on transformers 4)

# field: the value shardfit can honour (anything else is refused); a missing field takes PEFT's default, which is it
_PLAIN: dict[str, Any] = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
                          "layers_to_transform": None, "modules_to_save": None, "bias": "none",
                          "fan_in_fan_out": False, "lora_bias": False,
                          "trainable_token_indices": None, "layer_replication": None, "exclude_modules": None}


def peft_key(name: str) -> str:
    """shardfit's adapter parameter name -> PEFT's key in adapter_model.safetensors."""
    return PREFIX + name + ("" if ".lora_embedding_" in name else ".weight")


def shardfit_name(key: str) -> str:
    """PEFT's key -> shardfit's adapter parameter name (the inverse of peft_key)."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    return name[:-len(".weight")] if name.endswith(".weight") else name


class PerExpert(NamedTuple):
    """What a transformers-4 MoE adapter holds (module docstring): its r, the expert weights it adapts (of gate_proj,
    up_proj, down_proj, in that order) and the rank shardfit reads it at."""
    r: int
    weights: tuple[str, ...]
    rank: int


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    """A PEFT adapter directory's LoRA settings as lora.* values: {rank, alpha, dropout, targets}; one
    ShardfitError line naming the file and field for anything shardfit does not reproduce."""
    hf, where = _config(path)
    for field, plain in _PLAIN.items():
        value = hf.get(field, plain)
        if value != plain and not (plain is None and value in ([], {}, "")):
            raise ShardfitError(f"{field}={value!r} is not supported (plain LoRA only)", where=where,
                                fix=f"re-train or convert the adapter with {field}={json.dumps(plain)}")
    r, alpha, dropout = hf.get("r", 8), hf.get("lora_alpha", 8), hf.get("lora_dropout", 0.0)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise ShardfitError(f"r={r!r} is not a rank", where=where, fix="give a positive integer r")
    experts = _expert_parameters(hf.get("target_parameters"), where)
    targets = hf.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ShardfitError(f"target_modules is a regular expression ({targets!r})", where=where,
                            fix="list the module names instead (e.g. [\"q_proj\", \"v_proj\"])")
    if experts and targets in (None, []):
        targets = []  # the experts alone
    elif not (isinstance(targets, list) and all(isinstance(t, str) for t in targets) and targets
              or targets == "all-linear"):
        raise ShardfitError(f"target_modules={targets!r} is not a list of module names", where=where,
                            fix="list the module names the adapters sit on")
    per = _per_expert(Path(path), r, where)
    if per:
        if experts:
            raise ShardfitError("target_parameters and transformers 4's per-expert keys (mlp.experts.0.gate_proj...) "
                                "together: two layouts of the experts' adapters", where=where,
                                fix="save the adapter in one layout (PEFT on transformers 5 writes target_parameters)")
        experts = [w for w, old in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",)))
                   if set(old) & set(per.weights)]
        # alpha / rank stays PEFT's alpha / r (a factor of 1 or 2: exact); no dropout on expert adapters
        r, alpha, dropout = per.rank, alpha * (per.rank // r), 0.0
    names = [targets] if isinstance(targets, str) else sorted(targets)
    names += ["experts"] if len(experts) == 2 else [f"experts.{w}" for w in experts]
    return {"rank": r, "alpha": alpha, "dropout": dropout, "targets": ",".join(names)}


def adapter_lora_fields(path: str) -> tuple[dict[str, Any], str]:
    """(the lora.* values of read_adapter_config, their source for messages): what config/loader.py's load_config
    takes as read_adapter. A conflict with a key given names the rank a transformers-4 MoE adapter is read at, not
    the file's r."""
    fields = read_adapter_config(path)
    hf, _ = _config(path)
    # the base the adapter was trained on, for a config that names no model (config/lora_rules.py adapter_base)
    fields["base_model_name_or_path"] = hf.get("base_model_name_or_path") or None
    source = per_expert_source(path)
    how = f" (transformers 4's per-expert MoE layout, r={source.r} read at rank {source.rank})" if source else ""
    return fields, f"{path}/{ADAPTER_CONFIG}{how}"


def per_expert_source(path: str | Path) -> PerExpert | None:
    """The transformers-4 MoE adapter the directory holds (module docstring), None for any other adapter."""
    hf, where = _config(path)
    return _per_expert(Path(path), hf.get("r", 8), where)


def _config(path: str | Path) -> tuple[dict, str]:
    """(adapter_config.json of a PEFT LoRA adapter directory with safetensors weights, its path for messages)."""
    path = Path(path)
    where = str(path / ADAPTER_CONFIG)
    if not path.is_dir():
        raise ShardfitError("not a directory", where=str(path), fix="give a PEFT adapter directory (lora.adapter)")
    if not (path / ADAPTER_WEIGHTS).is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise ShardfitError(f"no {ADAPTER_WEIGHTS}" + (" (adapter_model.bin is a pickle: refused, it could run code)"
                                                       if pickled else ""), where=str(path),
                            fix="save the adapter with safetensors (PEFT's default, safe_serialization=True)")
    try:
        hf = json.loads((path / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardfitError(f"no {ADAPTER_CONFIG}", where=str(path), fix="give a PEFT adapter directory") from None
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise ShardfitError(f"unreadable ({e})", where=where, fix="restore the adapter's config") from None
    if not isinstance(hf, dict) or hf.get("peft_type") != "LORA":
        raise ShardfitError(f"peft_type is {hf.get('peft_type') if isinstance(hf, dict) else None!r}, not LORA",
                            where=where, fix="give a LoRA adapter")
    return hf, where


@functools.lru_cache(maxsize=8)
def _tensor_names(file: str, size: int, mtime_ns: int) -> tuple[str, ...]:
    """The tensor names in a safetensors file's header, parsed once per version of the file (its size and mtime are
    the key): the config loader, the adapter's load and the run's notice each ask, and a transformers-4 MoE
    adapter's header lists every expert's tensors (~37k for Qwen3-30B-A3B)."""
    with open(file, "rb") as f:
        return tuple(safetensors_header(f, size)[0])


def _per_expert(path: Path, r: int, where: str) -> PerExpert | None:
    """PerExpert of the adapter's tensor names (its safetensors header), or None; an adapter on a router refused."""
    file = path / ADAPTER_WEIGHTS
    try:
        st = file.stat()
        names = _tensor_names(str(file), st.st_size, st.st_mtime_ns)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise ShardfitError(f"corrupt or truncated safetensors file ({e})", where=str(file),
                            fix="save the adapter again") from None
    router = next((n for n in names if _ROUTER.search(n)), None)
    if router is not None:
        raise ShardfitError(f"'{router}' adapts an MoE router, which shardfit keeps frozen", where=str(file),
                            fix="merge the adapter into the model (PEFT's merge_and_unload) and train that, or train "
                                "it again without 'gate' in target_modules")
    found = {m.group(3) for m in map(PER_EXPERT.match, names) if m}
    if not found:
        return None
    weights = tuple(w for w in ("gate_proj", "up_proj", "down_proj") if w in found)
    return PerExpert(r, weights, 2 * r if {"gate_proj", "up_proj"} <= found else r)


def _expert_parameters(value: Any, where: str) -> list[str]:
    """target_parameters -> the expert weights it adapts (gate_up_proj, down_proj); anything else refused."""
    if value in (None, []):
        return []
    bad = value if not isinstance(value, list) else next(
        (v for v in value if not isinstance(v, str) or v not in _EXPERT_PARAMS), None)
    if bad is not None:
        raise ShardfitError(f"target_parameters entry {bad!r} is not an MoE expert weight shardfit adapts",
                            where=where, fix="adapt mlp.experts.gate_up_proj and/or mlp.experts.down_proj in every "
                                             "layer, or convert the adapter")
    found = {_EXPERT_PARAMS[v] for v in value}
    return [w for w in ("gate_up_proj", "down_proj") if w in found]


def adapter_config_json(rank: int, alpha: float, dropout: float, targets: list[str], base: str | None,
                        parameters: list[str] | None = None) -> dict:
    """adapter_config.json of an export: PEFT's plain LoRA (the fields _PLAIN names at their values); parameters:
    target_parameters (the MoE experts' adapted weights, adapters/expert_lora.py), None without."""
    alpha_out: float | int = int(alpha) if float(alpha).is_integer() else alpha
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base or None, "r": rank,
            "lora_alpha": alpha_out, "lora_dropout": dropout, "target_modules": sorted(targets),
            "inference_mode": True, "init_lora_weights": True, "revision": None, "layers_pattern": None,
            **_PLAIN, "target_parameters": parameters or None}
