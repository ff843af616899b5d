"""What a sample request asks for and what it gets back, and the checks a request passes at submit time.

`SamplingParams` are Tinker's (max_tokens, temperature, top_k, top_p, seed, stop tokens and strings); a
`SampleRequest` is one prompt, its params, `num_samples` continuations of it, the adapter slot its rows decode with
(-1: the base model; the LoRA bank's slots otherwise) and the log-probs it wants beside the tokens (the prompt's,
and the top-k of every prompt or sampled position). `check_request` refuses a bad request with one line naming the
field (`sampling_params.max_tokens`, `num_samples`, `prompt`...) and the fix, before anything is allocated for it:
a refused request never disturbs the batch already running.

Results: `Sampled` per sample (tokens, the log-prob of each under the model's own distribution at temperature 1,
why it stopped, the top-k per position on request) and `SampleResult` per request, samples in sample-index order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardfit.errors import ShardfitError

# The most samples one request may ask for (a request's rows decode together: Tinker's own limits are far below).
MAX_SAMPLES = 1024
# The most top-k log-probs a position may report (Tinker's topk_prompt_logprobs are a handful).
MAX_TOPK = 1024
# The most stop strings a request may give, and the most characters one may have: every sampled token of every row
# decodes a tail as long as the longest string and searches it for each (runner.py _stop_string), on the one loop
# every request waits on: the server's HTTP check holds a client to these (serve/schemas.py). Clients stop at a
# handful of short strings (a chat turn's end markers).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_k: int = -1  # -1: every token
    top_p: float = 1.0
    seed: int | None = None  # None: one drawn at submit
    stop_tokens: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    params: SamplingParams
    num_samples: int = 1
    adapter: int = -1  # the LoRA bank's slot its rows decode with; -1: the base model
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0


@dataclass
class Sampled:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # of each token, at temperature 1, no top-k/top-p
    stop_reason: str = "length"  # "stop": a stop token or string (included in tokens); "length": max_tokens
    topk: list[list[tuple[int, float]]] | None = None  # per token, on request: the k most likely (id, log-prob)


@dataclass
class SampleResult:
    samples: list[Sampled]
    prompt_logprobs: list[float | None] | None = None  # None first (no context), then one per prompt token
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


def _fail(msg: str, field_name: str, fix: str) -> None:
    raise ShardfitError(msg, where=field_name, fix=fix)


def check_request(req: SampleRequest, *, max_seq_len: int, vocab_size: int, kv_tokens: int, max_rows: int,
                  tokenizer=None, bank=None) -> None:
    """One line naming the field for every request the sampler cannot serve as asked (nothing is allocated yet).
    kv_tokens: what the whole paged KV cache holds (one row must fit in it alone); max_rows: the rows that decode
    at once (a request's samples start together)."""
    p, n, length = req.params, req.num_samples, len(req.prompt)
    if not length:
        _fail("the prompt is empty", "prompt", "give at least one token")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in req.prompt):
        bad = next(t for t in req.prompt if not isinstance(t, int) or not 0 <= t < vocab_size)
        _fail(f"token {bad!r} is not in the model's vocabulary of {vocab_size}", "prompt",
              f"give token ids in [0, {vocab_size})")
    if length >= max_seq_len:
        _fail(f"the prompt has {length} tokens and the model's context is max_seq_len={max_seq_len}: no room for a new "
              "token", "prompt", f"shorten the prompt to at most {max_seq_len - 1} tokens")
    if not isinstance(p.max_tokens, int) or p.max_tokens < 0:
        _fail(f"max_tokens={p.max_tokens!r} is not a count", "sampling_params.max_tokens", "give 1 or more")
    if p.max_tokens == 0 and not (req.prompt_logprobs or req.topk_prompt_logprobs):
        _fail("max_tokens=0 samples nothing", "sampling_params.max_tokens",
              "give 1 or more, or ask for prompt_logprobs (scoring the prompt alone)")
    if length + p.max_tokens > max_seq_len:
        _fail(f"prompt ({length} tokens) + {p.max_tokens} new tokens exceed the model's max_seq_len={max_seq_len}",
              "sampling_params.max_tokens", f"ask for at most {max_seq_len - length} new tokens")
    if length + p.max_tokens > kv_tokens:
        _fail(f"prompt ({length} tokens) + {p.max_tokens} new tokens exceed the KV cache's {kv_tokens} tokens",
              "sampling_params.max_tokens", f"ask for at most {max(0, kv_tokens - length)} new tokens, or give the "
              "sampler more KV cache (kv_blocks / kv_fraction)")
    limit = min(MAX_SAMPLES, max_rows)
    if not isinstance(n, int) or not 1 <= n <= limit:
        _fail(f"num_samples={n!r} is out of range: this sampler decodes at most {limit} rows of one request",
              "num_samples", f"ask for 1 to {limit} samples (split a larger request into several)")
    if not p.temperature >= 0:  # NaN too
        _fail(f"temperature={p.temperature} is negative", "sampling_params.temperature", "give 0 (greedy) or more")
    if not 0 < p.top_p <= 1:
        _fail(f"top_p={p.top_p} is outside (0, 1]", "sampling_params.top_p", "give a value in (0, 1]")
    if not isinstance(p.top_k, int) or not (p.top_k == -1 or p.top_k >= 1):
        _fail(f"top_k={p.top_k!r} keeps no token", "sampling_params.top_k", "give -1 (every token) or 1 or more")
    if p.seed is not None and (not isinstance(p.seed, int) or not 0 <= p.seed < 2 ** 63):
        _fail(f"seed={p.seed!r} is not a non-negative 64-bit integer", "sampling_params.seed",
              "give an integer in [0, 2^63)")
    if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in p.stop_tokens):
        _fail(f"stop tokens {list(p.stop_tokens)} are not all in the vocabulary of {vocab_size}",
              "sampling_params.stop_tokens", f"give token ids in [0, {vocab_size})")
    if p.stop_strings and tokenizer is None:
        _fail("stop strings need a tokenizer and this sampler has none", "sampling_params.stop_strings",
              "give stop_tokens instead, or a sampler with a tokenizer")
    if any(not isinstance(s, str) or not s for s in p.stop_strings):
        _fail("a stop string is empty", "sampling_params.stop_strings", "give non-empty strings")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(req, name)
        if not isinstance(k, int) or not 0 <= k <= min(MAX_TOPK, vocab_size):
            _fail(f"{name}={k!r} is out of range", name, f"give 0 to {min(MAX_TOPK, vocab_size)}")
    slots = getattr(bank, "n_slots", None)  # a bank that says how many slots it has: the others are refused here
    if req.adapter != -1 and (bank is None or not isinstance(req.adapter, int) or req.adapter < 0
                              or (slots is not None and req.adapter >= slots)):
        _fail(f"adapter slot {req.adapter!r} is not served here" + (" (no LoRA bank)" if bank is None else ""),
              "adapter", "give -1 (the base model) or a slot of the sampler's LoRA bank")
