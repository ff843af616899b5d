"""Hugging Face architectures: each family maps its config.json onto ModelConfig and back.

Adding an architecture is one file here (a `Family` with its model_type and its differences from the common decoder)
plus a logit-parity test. The common fields are mapped once, in `common_from_hf` / `common_to_hf`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardfit.config.families.family import Family, common_from_hf, common_to_hf
from shardfit.errors import ShardfitError

__all__ = ["Family", "common_from_hf", "common_to_hf", "hf_config_json", "read_hf_config"]


def _registry() -> dict[str, Family]:
    from shardfit.config.families import llama, mistral, qwen2, qwen3, qwen3_moe

    return {f.model_type: f for f in (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY)}


def read_hf_config(path: str | Path) -> tuple[Family, dict[str, Any]]:
    """(family, ModelConfig fields) from <path>/config.json."""
    cfg_file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise ShardfitError("model directory not found", where=str(path), fix="check model.path")
    try:
        hf = json.loads(cfg_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardfitError("no config.json", where=str(path), fix="point model.path at a Hugging Face model "
                            "directory (config.json, *.safetensors)") from None
    except json.JSONDecodeError as e:
        raise ShardfitError(f"invalid JSON ({e.msg}, line {e.lineno})", where=str(cfg_file)) from None
    families = _registry()
    model_type = hf.get("model_type")
    if model_type not in families:
        raise ShardfitError(f"model_type '{model_type}' is not supported", where=f"{cfg_file} model_type",
                            fix="supported: " + ", ".join(sorted(families)))
    family = families[model_type]
    where = str(cfg_file)
    return family, {**common_from_hf(hf, where), **family.from_hf(hf, where)}


def hf_config_json(m) -> dict[str, Any]:
    family = _registry().get(m.name)
    if family is None:  # a preset or the tiny model: closest family by features
        family = _registry()["qwen3_moe" if m.n_experts else "qwen3" if m.qk_norm else "qwen2" if m.qkv_bias
                             else "llama"]
    return {"architectures": [family.architecture], "model_type": family.model_type, **common_to_hf(m),
            **family.to_hf(m)}
