"""Llama 2 / 3 / 3.1 / 3.2: the common decoder as it is (Llama-3 RoPE scaling handled in the common mapping)."""

from shardfit.config.families.family import Family
from shardfit.errors import ShardfitError


def _from_hf(hf: dict, where: str) -> dict:
    if hf.get("attention_bias"):
        raise ShardfitError("attention_bias=true is not supported for llama (o_proj bias)", where=where)
    return {}


FAMILY = Family("llama", "LlamaForCausalLM", _from_hf, lambda m: {"attention_bias": False, "mlp_bias": False})
