"""The [lora] section's part of the loader: the rules that tie its keys to each other and to the rest of the config
(config/loader.py runs them with its own, after every key's range is checked; each broken rule is one ShardfitError
line naming the key and the fix), how the lora.* values a PEFT adapter directory gives (lora.adapter) meet the keys
given, and the hint for a key written inside another section ([model.lora], --model.lora.rank). The adapter's files
are read by the caller's reader (weights/peft_config.py's adapter_lora_fields, which shardfit train, plan, serve and
Engine.start pass to load_config): config reads no weight file, and imports nothing of the weights.

lora.targets names modules, not patterns: the linear layers of a block by their Hugging Face names, all-linear,
embed_tokens / lm_head, and the MoE experts' weights (experts, or experts.gate_up_proj / experts.down_proj); a name
the model lacks is refused later, by the swap (adapters/lora.py), which sees the model. The output head's adapter is
merged into the weight the fused loss reads, and PEFT folds expert adapters into their weights: neither takes
dropout. A merged
export needs adapters, and a directory of its own beside the adapter's. model.quantize=nf4 (QLoRA, adapters/qlora.py)
stores the adapted linear layers' frozen weights in NF4: it needs adapters on linear layers, and refuses what would
multiply or hold that base otherwise (FP8 matmuls, FSDP's CPU offload).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardfit.config.schema import LORA_EXPERTS, LORA_LINEAR, LORA_OPTIONAL, LoraConfig
from shardfit.errors import ShardfitError

_BITS = {"nf4": 4, "fp8": 8}  # bits a weight of a model.quantize base

# an adapter directory -> (the lora.* values it gives, their source for messages): weights/peft_config.py's
# adapter_lora_fields
AdapterReader = Callable[[str], tuple[dict[str, Any], str]]


def adapter_fields(lora: LoraConfig, read_adapter: AdapterReader | None) -> tuple[dict[str, Any], str]:
    """(lora.* values, their source) of lora.adapter, read by `read_adapter`; lora.targets as given when it names
    the same modules in another order."""
    if read_adapter is None:
        raise ShardfitError("names a PEFT adapter directory, and this caller of load_config reads no adapter files",
                            where="lora.adapter", fix="pass read_adapter=shardfit.weights.peft_config."
                            "adapter_lora_fields to load_config (as shardfit train and Engine.start do)")
    fields, source = read_adapter(lora.adapter)
    fields = dict(fields)
    fields.pop("base_model_name_or_path", None)
    if {t.strip() for t in lora.targets.split(",")} == set(fields["targets"].split(",")):
        fields["targets"] = lora.targets
    return fields, source


def adapter_base(lora: LoraConfig, read_adapter: AdapterReader | None) -> str | None:
    """The base model lora.adapter was trained on, for a config that names none (no model.path, no model.* key):
    its base_model_name_or_path when that is a local directory (the rule `shardfit generate --adapter` follows);
    None when the adapter names no base (a run of shardfit's presets); one line when it names one not here."""
    if read_adapter is None:
        return None
    base = read_adapter(lora.adapter)[0].get("base_model_name_or_path")
    if not base:
        return None
    if not Path(base).is_dir():
        raise ShardfitError(f"the adapter's base model {base!r} (base_model_name_or_path) is not a local directory",
                            where=f"lora.adapter={lora.adapter}", fix="give the base with --model.path=DIR (or "
                            f"`hf download {base} --local-dir DIR` first)")
    return base


def nested_section(key: str, sections) -> str | None:
    """The fix for a key that names a section inside another ('lora.rank' under [model]), else None."""
    head, _, rest = key.partition(".")
    return f"[{head}] is a section of its own: write {head}.{rest or 'KEY'}" if head in sections else None


def bad_targets(c) -> str | None:
    """Why lora.targets is not a list of modules shardfit adapts, or None."""
    names = [t.strip() for t in c.lora.targets.split(",")]
    for name in names:
        if name not in (*LORA_LINEAR, *LORA_OPTIONAL, *LORA_EXPERTS, "all-linear"):
            shown = name if len(name) <= 40 else name[:37] + "..."
            return f"'{shown}' is not a module shardfit puts an adapter on"
    return f"'{names[0]}' is given twice" if len(set(names)) < len(names) else None


def _experts(c) -> bool:
    return bool({t.strip() for t in c.lora.targets.split(",")} & set(LORA_EXPERTS))


# (key to name, broken(cfg), what is wrong(cfg), fix(cfg)), as config/loader.py's RULES
LORA_RULES: tuple[tuple[str, Any, Any, Any], ...] = (
    ("lora.targets", bad_targets, bad_targets,
     lambda c: f"give comma-separated names of {', '.join(LORA_LINEAR + LORA_OPTIONAL + LORA_EXPERTS)}, or "
               "all-linear"),
    ("lora.dropout", lambda c: c.lora.rank and c.lora.dropout and "lm_head" in c.lora.targets.split(","),
     lambda c: f"{c.lora.dropout} with an adapter on lm_head, whose adapter is merged into the head's weight for the "
               "fused loss (no dropout there)", lambda c: "set lora.dropout=0, or leave lm_head out of lora.targets"),
    ("lora.dropout", lambda c: c.lora.rank and c.lora.dropout and _experts(c),
     lambda c: f"{c.lora.dropout} with adapters on the MoE experts: PEFT folds expert adapters into the weights "
               "(target_parameters) and refuses dropout there, so the adapter would not load in PEFT",
     lambda c: "set lora.dropout=0, or leave experts out of lora.targets"),
    ("checkpoint.export_merged", lambda c: c.checkpoint.export_merged and not c.lora.rank,
     lambda c: "merges LoRA adapters into the base, and lora.rank is 0 (no adapters)",
     lambda c: "use checkpoint.export_hf, or set lora.rank"),
    ("checkpoint.export_merged", lambda c: c.checkpoint.export_merged
     and c.checkpoint.export_merged == c.checkpoint.export_hf,
     lambda c: "is the same directory as checkpoint.export_hf (the adapter)", lambda c: "give another directory"),
    ("model.quantize", lambda c: c.model.quantize != "none" and not c.lora.rank,
     lambda c: f"{c.model.quantize} stores the frozen base of LoRA's adapted layers in {_BITS[c.model.quantize]} bits, "
               "and lora.rank is 0: a quantized base cannot train",
     lambda c: f"set lora.rank ({'QLoRA' if c.model.quantize == 'nf4' else 'LoRA on an FP8 base'}), or "
               "model.quantize=none"),
    ("model.quantize", lambda c: c.model.quantize != "none" and c.lora.rank
     and not {t.strip() for t in c.lora.targets.split(",")} - set(LORA_OPTIONAL) - set(LORA_EXPERTS),
     lambda c: f"{c.model.quantize} quantizes the linear layers LoRA adapts, and lora.targets={c.lora.targets} "
               "names none",
     lambda c: "add linear layers to lora.targets (q_proj, ..., or all-linear), or set model.quantize=none"),
    ("compute.fp8", lambda c: c.model.quantize == "nf4" and c.compute.fp8 != "none",
     lambda c: f"{c.compute.fp8} with model.quantize=nf4: the NF4 base is dequantised to the compute dtype for its "
               "matmuls, which FP8 would not use", lambda c: "set compute.fp8=none, or model.quantize=none"),
    ("compute.fp8", lambda c: c.model.quantize == "fp8" and c.compute.fp8 != "none",
     lambda c: f"{c.compute.fp8} with model.quantize=fp8: the FP8 base already multiplies in FP8 from its stored "
               "codes (adapters/fp8_base.py); compute.fp8 would quantize the same layers again",
     lambda c: "set compute.fp8=none (the base's matmuls stay FP8), or model.quantize=none"),
    ("parallel.offload", lambda c: c.model.quantize != "none" and c.parallel.offload != "none",
     lambda c: f"{c.parallel.offload} with model.quantize={c.model.quantize}: a quantized base is not supported "
               "with CPU offload yet",
     lambda c: f"set parallel.offload=none (a quantized base is ~{_BITS[c.model.quantize] / 16:.2g} of bf16), or "
               "model.quantize=none"),
)
