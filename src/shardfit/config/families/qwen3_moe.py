"""Qwen3-MoE: Qwen3 attention, top-k routed experts (per-expert tensors in the checkpoint, stacked in the model)."""

from shardfit.config.families.family import Family
from shardfit.config.families.qwen3 import FAMILY as QWEN3
from shardfit.config.schema import dense_layer_ids
from shardfit.errors import ShardfitError


def _from_hf(hf: dict, where: str) -> dict:
    n_experts = hf.get("num_experts", hf.get("num_local_experts"))  # renamed in transformers 5
    if not n_experts or "num_experts_per_tok" not in hf or "moe_intermediate_size" not in hf:
        raise ShardfitError("MoE config needs num_experts, num_experts_per_tok and moe_intermediate_size",
                            where=where, fix="give a complete Qwen3-MoE config.json")
    return {**QWEN3.from_hf(hf, where), "n_experts": n_experts, "experts_per_token": hf["num_experts_per_tok"],
            "moe_ffn_dim": hf["moe_intermediate_size"], "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "moe_every": hf.get("decoder_sparse_step", 1),
            # transformers adds the auxiliary loss only when output_router_logits is set
            "router_aux_coef": float(hf.get("router_aux_loss_coef", 0.001)) if hf.get("output_router_logits") else 0.0,
            "dense_layers": ",".join(str(i) for i in hf.get("mlp_only_layers") or [])}


def _to_hf(m) -> dict:
    return {**QWEN3.to_hf(m), "num_experts": m.n_experts, "num_experts_per_tok": m.experts_per_token,
            "moe_intermediate_size": m.moe_ffn_dim, "norm_topk_prob": m.norm_topk_prob,
            "decoder_sparse_step": m.moe_every, "output_router_logits": m.router_aux_coef > 0,
            "router_aux_loss_coef": m.router_aux_coef or 0.001,
            "mlp_only_layers": dense_layer_ids(m)}


FAMILY = Family("qwen3_moe", "Qwen3MoeForCausalLM", _from_hf, _to_hf)
