"""The reference sampler through the Engine's FSDP model (what `shardfit serve` ran before the Sampler): kept as the
reference that Engine.sample is checked against (tests/engine, tests/rl) and as the "before" of
benchmarks/bench_sampling.py. Nothing serves through it. num_samples continuations of one prompt, batched.

Every rank runs the same forward calls (FSDP all-gathers parameters inside each): the prompt once ([1, S], which
also gives the prompt's log-probs), then one token per step for all B = num_samples rows ([B, 1]) until every row
has stopped. The forwards go through the root module's call (engine.model(ids)), so FSDP's root hooks run as in
training; the cache reaches the decoder through a forward pre-hook (models/ holds no serving code). Each step rank
0 samples the tokens and decides which rows stopped (stop token, stop string through the tokenizer, EOS), and
broadcasts both (int64 [2B]): every rank feeds the same tokens and agrees on when to stop. Rows that stopped keep
being fed (their outputs are ignored) so that shapes stay the same on every rank.
Log-probs returned are those of the model's distribution (temperature 1, no top-k/top-p), as the trainer computes
them, so that sampler and trainer log-probs are comparable.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from shardfit.models.decoder import KVCache
from shardfit.sampling.params import Sampled
from shardfit.sampling.sample import top_p_filter


@dataclass
class SampleArgs:
    prompt: list[int]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False


@contextlib.contextmanager
def _with_cache(model, cache: KVCache):
    """Hand `cache` to the decoder (model.model) on every call of the root module, through a forward pre-hook."""
    def hook(_module, args, kwargs):
        return args, {**kwargs, "cache": cache}

    handle = model.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def _agree(values: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank 0's int64 values on every rank (one broadcast)."""
    if world > 1:
        import torch.distributed as dist

        dist.broadcast(values, 0)
    return values


def _pick(logits: torch.Tensor, a: SampleArgs, gen: torch.Generator) -> torch.Tensor:
    """logits [B, V] fp32 -> tokens [B]: greedy at temperature 0, else sampled within top-k and top-p."""
    if a.temperature <= 0:
        return logits.argmax(-1)
    scaled = logits / a.temperature
    if 0 < a.top_k < scaled.shape[-1]:
        kth = scaled.topk(a.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(top_p_filter(scaled, a.top_p), -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


class StopCheck:
    """Rank 0's stop decision per row: a stop token, or a stop string in the text decoded so far."""

    def __init__(self, a: SampleArgs, tokenizer):
        self.tokens, self.strings, self.tokenizer = set(a.stop_tokens), a.stop_strings, tokenizer

    def __call__(self, generated: list[int]) -> bool:
        if generated[-1] in self.tokens:
            return True
        if self.strings and self.tokenizer is not None:
            # The stop string may span tokens: look at the tail that could hold it (bytes >= chars).
            tail = self.tokenizer.decode(generated[-(max(len(s) for s in self.strings) + 8):])
            return any(s in tail for s in self.strings)
        return False


@torch.no_grad()
def sample(model, a: SampleArgs, dtype: torch.dtype, device: torch.device, rank: int = 0, world: int = 1,
           tokenizer=None) -> tuple[list[Sampled], list[float] | None]:
    """(num_samples sequences, the prompt's log-probs or None). `model` is the Engine's (sharded) CausalLM."""
    m = model.cfg
    B, S = a.num_samples, len(a.prompt)
    head_dim = model.model.head_dim
    total = S + a.max_tokens
    prefill = KVCache(m.n_layers, 1, total, m.n_kv_heads, head_dim, dtype, device)
    with _with_cache(model, prefill):
        logits = model(torch.tensor([a.prompt], device=device))[0].float()  # [S, V]
    prompt_lp = None
    if a.prompt_logprobs:
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(a.prompt[1:], device=device)[:, None])
        prompt_lp = [float("nan")] + lp.squeeze(-1).tolist()
    # B rows share the prompt: its keys and values are copied, not recomputed.
    cache = KVCache(m.n_layers, B, total, m.n_kv_heads, head_dim, dtype, device)
    for layer in range(m.n_layers):
        cache.k[layer][:, :S] = prefill.k[layer][:, :S]
        cache.v[layer][:, :S] = prefill.v[layer][:, :S]
    cache.length = S
    del prefill
    last = logits[-1:].expand(B, -1)  # [B, V]
    gen = torch.Generator(device=device).manual_seed(a.seed)
    stop = StopCheck(a, tokenizer)
    out = [Sampled([], [], "length") for _ in range(B)]
    done = [False] * B
    for step in range(a.max_tokens):
        tokens = _pick(last, a, gen)  # every rank computes; rank 0's are the ones used
        logp = torch.log_softmax(last, -1).gather(-1, tokens[:, None]).squeeze(-1)
        agreed = torch.zeros(2 * B, dtype=torch.int64, device=device)
        if rank == 0:
            for i in range(B):
                if not done[i]:
                    out[i].tokens.append(int(tokens[i]))
                    out[i].logprobs.append(float(logp[i]))
                    out[i].stop_reason = "stop" if stop(out[i].tokens) else "length"
            agreed[:B] = tokens
            agreed[B:] = torch.tensor([d or o.stop_reason == "stop" for d, o in zip(done, out)], dtype=torch.int64)
        agreed = _agree(agreed, rank, world).cpu()
        done = [bool(x) for x in agreed[B:]]
        if all(done) or step == a.max_tokens - 1:
            break
        with _with_cache(model, cache):
            last = model(agreed[:B, None].to(device))[:, -1].float()  # [B, V]
    return out, prompt_lp
