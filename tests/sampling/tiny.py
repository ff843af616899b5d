"""A tiny model for the sampler's tests: built from a ModelConfig (fp32, on the CPU unless moved), with weights large
enough that the model's distributions are peaked (a greedy token wins by more than rounding, samples repeat some
tokens)."""

import torch

from shardfit.config.schema import ModelConfig
from shardfit.models import build_model


def tiny_model(qk_norm: bool = True, seed: int = 0, max_seq_len: int = 128):
    cfg = ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96,
                      max_seq_len=max_seq_len, qk_norm=qk_norm, init_std=0.08, tie_embeddings=False)
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    model.init_weights(seed)
    return model
