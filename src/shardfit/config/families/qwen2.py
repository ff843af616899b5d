"""Qwen2 / Qwen2.5: bias on the q/k/v projections."""

from shardfit.config.families.family import Family


def _from_hf(hf: dict, where: str) -> dict:
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else 0
    return {"qkv_bias": True, "sliding_window": window or 0}


FAMILY = Family("qwen2", "Qwen2ForCausalLM", _from_hf, lambda m: {"use_sliding_window": False})
