"""Tiny Hugging Face models with random weights, saved with save_pretrained (no network), and shardfit's LoRA model
built on the same weights: what the PEFT parity tests compare."""

from __future__ import annotations

from pathlib import Path

import torch

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)


# Qwen3-MoE: 4 experts, 2 a token, the second block dense (mlp_only_layers): experts and a dense MLP side by side
MOE_SIZES = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                 mlp_only_layers=[1])


def save_tiny(kind: str, root: Path, tied: bool = False, **sizes) -> Path:
    """A tiny LlamaForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM ("qwen3_moe": MOE_SIZES) (fp32, random
    weights) saved under root/kind; sizes: SIZES overridden."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SIZES, **sizes}, tie_word_embeddings=tied))
    elif kind == "qwen3_moe":
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **{**SIZES, "head_dim": 32, **MOE_SIZES, **sizes}, tie_word_embeddings=tied))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**SIZES, "head_dim": 32, **sizes},
                                                                    tie_word_embeddings=tied))
    out = Path(root) / kind
    hf.float().save_pretrained(out)
    return out


def hf_model(path: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def shardfit_model(path: Path):
    """shardfit's CausalLM of the saved model, unsharded, fp32, weights loaded."""
    from shardfit.config.families import read_hf_config
    from shardfit.config.schema import ModelConfig
    from shardfit.models import build_model
    from shardfit.weights.hf_load import load_hf_checkpoint

    family, fields = read_hf_config(path)
    model = build_model(ModelConfig(**{**fields, "name": family.model_type}))
    load_hf_checkpoint(model, path)
    return model


@torch.no_grad()
def randomize_adapters(model, seed: int = 1) -> None:
    """Non-zero B (and embedding A): a fresh adapter is the identity, which would compare nothing."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith(("lora_B", "lora_embedding_A")):  # expert adapters' B too (..._proj_lora_B)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
