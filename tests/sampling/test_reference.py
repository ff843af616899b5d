"""The reference decode (sampling/reference.py) through the dense KV cache changes nothing: the logits of the full
forward for a prompt in one go, in chunks, or token by token, and the same tokens with or without the cache."""

import torch

from shardfit.config.schema import ModelConfig
from shardfit.models import build_model
from shardfit.models.decoder import KVCache
from shardfit.sampling.reference import reference_decode


def test_kv_cache_changes_nothing():
    """Prompt in one go, then in two chunks (the masked branch), then token by token: the logits of the full forward."""
    torch.manual_seed(0)
    m = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64)
    model = build_model(m).eval()
    model.init_weights(1)
    ids = torch.randint(0, 50, (1, 20))
    with torch.no_grad():
        full = model(ids)
        for cuts in ([20], [7, 20], list(range(1, 21))):
            cache = KVCache(2, 1, 20, 2, 8, torch.float32)
            parts, start = [], 0
            for end in cuts:
                parts.append(model.lm_head(model.model(ids[:, start:end], cache=cache)))
                start = end
            torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
        prompt = ids[0, :5].tolist()
        assert reference_decode(model, prompt, 15) == reference_decode(model, prompt, 15, use_cache=False)
        assert reference_decode(model, prompt, 15, temperature=0.8, top_p=0.9, seed=4) == \
            reference_decode(model, prompt, 15, temperature=0.8, top_p=0.9, seed=4, use_cache=False)
