"""The reference decode: one prompt, one token per step, through the dense KV cache (models/decoder.py KVCache) or
recomputing the whole sequence every step (use_cache=False).

It is what the Sampler is checked against (tests/sampling: the same greedy tokens, the same log-probs) and what
`shardfit generate --no-cache` runs: no paging, no batching, nothing clever, so that it is obviously right. Greedy
at temperature 0, else a draw from softmax(logits / temperature) within the top_p nucleus through torch's
generator (not the Sampler's counter-based draws: seeded runs of the two differ, greedy ones do not).
"""

from __future__ import annotations

import torch

from shardfit.models.decoder import CausalLM, KVCache
from shardfit.sampling.sample import top_p_filter


@torch.no_grad()
def reference_decode(model: CausalLM, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                     top_p: float = 1.0, eos_ids: set[int] = frozenset(), seed: int = 0,
                     use_cache: bool = True) -> list[int]:
    """The new tokens after `prompt` (lengths checked by the caller: prompt + max_new_tokens <= max_seq_len); the
    first EOS id drawn ends them (included)."""
    m = model.cfg
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    total = len(prompt) + max_new_tokens
    cache = KVCache(m.n_layers, 1, total, m.n_kv_heads, model.model.head_dim, dtype, device) if use_cache else None
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens, new = list(prompt), []
    step = torch.tensor([tokens], device=device)
    for _ in range(max_new_tokens):
        h = model.model(step, cache=cache) if use_cache else model.model(torch.tensor([tokens], device=device))
        logits = model.lm_head(h[0, -1]).float()  # [V]: only the last position's logits
        if temperature > 0:
            probs = torch.softmax(top_p_filter(logits / temperature, top_p), -1)
            token = int(torch.multinomial(probs, 1, generator=gen))
        else:
            token = int(logits.argmax())
        tokens.append(token)
        new.append(token)
        if token in eos_ids:
            break
        step = torch.tensor([[token]], device=device)
    return new
