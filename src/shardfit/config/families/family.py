"""The shape every Hugging Face family file fills in, and the config fields all families share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardfit.errors import ShardfitError


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # the transformers class name written into config.json
    # extra ModelConfig fields from the HF config (after the common ones), and the checks this family needs
    from_hf: Callable[[dict, str], dict[str, Any]]
    to_hf: Callable[[Any], dict[str, Any]]


def common_from_hf(hf: dict, where: str) -> dict[str, Any]:
    def need(key):
        if key not in hf:
            raise ShardfitError(f"missing key '{key}'", where=where, fix="give a complete Hugging Face config.json")
        return hf[key]

    if hf.get("hidden_act", "silu") != "silu":
        raise ShardfitError(f"hidden_act '{hf['hidden_act']}' is not supported (SwiGLU with silu only)", where=where)
    if hf.get("mlp_bias"):
        raise ShardfitError("mlp_bias=true is not supported", where=where)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    out: dict[str, Any] = {
        "vocab_size": need("vocab_size"), "dim": need("hidden_size"), "n_layers": need("num_hidden_layers"),
        "n_heads": need("num_attention_heads"),
        "n_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "ffn_dim": need("intermediate_size"), "max_seq_len": hf.get("max_position_embeddings", 4096),
        "norm_eps": hf.get("rms_norm_eps", 1e-6), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": float(theta), "init_std": hf.get("initializer_range", 0.02),
    }
    head_dim = hf.get("head_dim")
    out["head_dim"] = 0 if not head_dim or head_dim * out["n_heads"] == out["dim"] else head_dim
    if rope_type == "llama3":
        out.update(rope_scaling="llama3", rope_factor=rope["factor"], rope_low_freq_factor=rope["low_freq_factor"],
                   rope_high_freq_factor=rope["high_freq_factor"],
                   rope_original_max_seq_len=rope["original_max_position_embeddings"])
    elif rope_type != "default":
        raise ShardfitError(f"rope type '{rope_type}' is not supported", where=where,
                            fix="supported: default, llama3")
    return out


def common_to_hf(m) -> dict[str, Any]:
    # Written in the form both transformers 4 and 5 read (5 converts rope_theta/rope_scaling to rope_parameters).
    hf = {"vocab_size": m.vocab_size, "hidden_size": m.dim, "num_hidden_layers": m.n_layers,
          "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "intermediate_size": m.ffn_dim,
          "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps, "hidden_act": "silu",
          "tie_word_embeddings": m.tie_embeddings, "rope_theta": m.rope_theta, "initializer_range": m.init_std,
          "head_dim": m.head_dim or m.dim // m.n_heads, "rope_scaling": None}
    if m.rope_scaling == "llama3":
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": m.rope_factor, "low_freq_factor": m.rope_low_freq_factor,
                              "high_freq_factor": m.rope_high_freq_factor,
                              "original_max_position_embeddings": m.rope_original_max_seq_len}
    return hf
