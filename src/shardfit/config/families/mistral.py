"""Mistral: Llama layout; sliding-window attention is only equivalent while sequences fit in the window."""

from shardfit.config.families.family import Family


def _from_hf(hf: dict, where: str) -> dict:
    return {"sliding_window": hf.get("sliding_window") or 0}


FAMILY = Family("mistral", "MistralForCausalLM", _from_hf, lambda m: {"sliding_window": m.sliding_window or None})
