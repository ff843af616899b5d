"""Qwen3: RMSNorm on queries and keys per head, before RoPE; explicit head_dim."""

from shardfit.config.families.family import Family
from shardfit.errors import ShardfitError


def _from_hf(hf: dict, where: str) -> dict:
    if hf.get("attention_bias"):
        raise ShardfitError("attention_bias=true is not supported for qwen3", where=where)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else 0
    return {"qk_norm": True, "sliding_window": window or 0}


FAMILY = Family("qwen3", "Qwen3ForCausalLM", _from_hf,
                lambda m: {"attention_bias": False, "use_sliding_window": False})
