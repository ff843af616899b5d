"""Choosing the next token of every row on the device: greedy, or Gumbel-max with counter-based noise.

Shapes: B rows, V vocabulary. Every function takes per-row tensors ([B]: temperature, top_k, top_p, seed, sample
index, position) and returns device tensors: no `.item()`, no host sync, no Python loop over rows, so that the decode
step runs as one CUDA graph.

Reproducible whatever shares the batch: the noise of row b for token v is a hash of (the request's seed, the
sample's index, the position of the token being drawn, v), computed with int64 ops on the device; nothing depends
on the row's place in the batch or on a generator's state. argmax(logits / temperature + Gumbel noise), over the
tokens top-k and top-p keep, is a draw from softmax(logits / temperature) restricted to them (the Gumbel-max trick).
At temperature 0 the token is the argmax of the logits (greedy: the noise is not used).

Log-probs reported are those of the model's own distribution: fp32 log_softmax of the logits at temperature 1 with
no top-k/top-p, as the trainer computes them for the same tokens.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for x in [0, 2^32) as int64 without overflow: m split in 16-bit halves (every product
    < 2^49), so the result is exact on every device."""
    hi = ((x * (m >> 16)) & 0xFFFF) << 16
    return (hi + x * (m & 0xFFFF)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser on int64 tensors holding 32-bit values: every input bit moves every output bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seed: torch.Tensor, sample: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[B] int64 32-bit keys of (seed (64-bit), sample index, position), each [B] int64."""
    h = _fmix32(seed & _M32)
    h = _fmix32(h ^ ((seed >> 32) & _M32))
    h = _fmix32(h ^ (sample & _M32))
    return _fmix32(h ^ (position & _M32))


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] fp32 standard Gumbel noise, a function of each row's key and the token id only."""
    ids = torch.arange(vocab, device=keys.device, dtype=torch.int64)
    bits = _fmix32(keys[:, None] ^ _mul32(ids, 0x9E3779B9)[None, :])  # [B, V] 32-bit
    u = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), 24 bits
    return -torch.log(-torch.log(u))


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with every token below the row's k-th largest set to -inf; top_k [...] int64, -1: keep all."""
    V = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)
    kth = logits.sort(-1, descending=True).values.gather(-1, (k - 1)[..., None])  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """logits [..., V] with every token outside the nucleus set to -inf: the smallest set of most likely tokens whose
    probabilities add up to at least top_p (the most likely token always stays). top_p: a float, or per row [...]."""
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        return logits
    probs, order = torch.sort(torch.softmax(logits, -1), descending=True)
    if isinstance(top_p, torch.Tensor):
        # the mass before this token already reaches top_p; a row at 1 keeps every token, rounding of the sum aside
        outside = (probs.cumsum(-1) - probs >= top_p[..., None]) & (top_p < 1)[..., None]
    else:
        outside = probs.cumsum(-1) - probs >= top_p
    return logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))


def draw_kind(params) -> str:
    """How a batch of rows (their SamplingParams) draws: "greedy" (every row at temperature 0: no noise is made),
    "plain" (no sampled row asks for top-k or top-p: the two sorts over V are skipped) or "filtered"."""
    sampled = [p for p in params if p.temperature > 0]
    if not sampled:
        return "greedy"
    return "filtered" if any(p.top_k > 0 or p.top_p < 1 for p in sampled) else "plain"


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           keys: torch.Tensor, draw: str = "filtered") -> torch.Tensor:
    """logits [B, V] fp32 -> tokens [B] int64; draw: draw_kind's (the host knows it from the rows' params)."""
    greedy = logits.argmax(-1)
    if draw == "greedy":
        return greedy
    scaled = logits / temperature.clamp(min=1e-6)[:, None]
    if draw == "filtered":
        scaled = top_p_filter(top_k_filter(scaled, top_k), top_p)
    drawn = (scaled + gumbel_noise(keys, logits.shape[-1])).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, topk: int = 0
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """logits [..., V] -> (the log-prob of each token [...] under log_softmax in fp32, and with topk > 0 the k most
    likely (log-probs [..., k], ids [..., k]))."""
    logp = torch.log_softmax(logits.float(), -1)
    chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)
    if topk <= 0:
        return chosen, None
    top = logp.topk(topk, -1)
    return chosen, (top.values, top.indices)
