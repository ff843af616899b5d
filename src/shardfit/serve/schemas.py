"""The JSON requests of the Tinker API, as the SDK (tinker 0.38.0) sends them, and their checks on rank 0.

Unknown fields are ignored (the SDK adds `type` tags and optional extras); a field of the wrong type is a 400 before
anything is queued. `sample_args` turns an /asample body into the concrete request (plain JSON) every rank runs:
the stop rule resolved (None = the tokenizer's EOS, [] = none, strings, token ids), the seed drawn on rank 0 when
none is given.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict

from shardfit.config.adam_rules import adam_values
from shardfit.errors import ShardfitError, shown
from shardfit.sampling.params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOPK

MAX_SAMPLES = 256
DEFAULT_MAX_TOKENS = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SessionBody(_Body):
    session_id: str


class CreateModelBody(_Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: dict | None = None
    user_metadata: dict | None = None


class ModelBody(_Body):
    model_id: str


class WeightsInfoBody(_Body):
    tinker_path: str


class OptimStepBody(_Body):
    model_id: str
    seq_id: int
    adam_params: dict | None = None
    optimizer_params: dict | None = None


class SaveWeightsBody(_Body):
    model_id: str
    seq_id: int
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str | None = None  # snapshot (a frozen version) | inflight (the model's live weights)
    ttl_seconds: float | None = None  # a named save expires after this long; an unnamed one's version is freed


class LoadWeightsBody(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None


class SamplingSessionBody(_Body):
    session_id: str
    sampling_session_seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None


class SampleBody(_Body):
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    num_samples: int = 1
    prompt: dict
    sampling_params: dict
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


class RetrieveBody(_Body):
    request_id: str


def adam_args(body: OptimStepBody) -> dict[str, float]:
    """adam_params with Tinker's defaults filled in, every value a finite number in range (config/adam_rules.py)."""
    if body.adam_params is None:
        raise ShardfitError("only Adam is served" if body.optimizer_params else "adam_params is missing",
                            where="/optim_step", fix="send adam_params (types.AdamParams)")
    return adam_values(body.adam_params, "/optim_step adam_params")


def prompt_tokens(prompt: dict, vocab: int) -> list[int]:
    chunks = prompt.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ShardfitError("the prompt has no chunks", where="/asample prompt", fix="send ModelInput.from_ints(...)")
    tokens: list[int] = []
    for i, c in enumerate(chunks):
        toks = c.get("tokens") if isinstance(c, dict) else None
        if not isinstance(toks, list) or c.get("type", "encoded_text") != "encoded_text" \
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise ShardfitError(f"chunk {i} is not an encoded_text chunk of token ids", where="/asample prompt",
                                fix="send text as token ids (EncodedTextChunk); images are not served")
        tokens += toks
    if not tokens:
        raise ShardfitError("the prompt is empty", where="/asample prompt", fix="send at least one token")
    bad = next((t for t in tokens if not 0 <= t < vocab), None)  # Python ints: any size, before numpy sees one
    if bad is not None:
        raise ShardfitError(f"token id {shown(bad)} is outside the vocabulary [0, {vocab})", where="/asample prompt",
                            fix="encode with the model's tokenizer (get_tokenizer())")
    return tokens


def sample_args(body: SampleBody, vocab: int, max_len: int, eos_ids: set[int], has_tokenizer: bool) -> dict:
    where = "/asample"
    if body.prompt_alt_tokens_k:
        raise ShardfitError("prompt_alt_tokens_k is not served", where=where, fix="leave prompt_alt_tokens_k at 0")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(body, name)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= min(MAX_TOPK, vocab):
            raise ShardfitError(f"{name}={shown(k)} is out of range", where=f"{where} {name}",
                                fix=f"ask for 0 to {min(MAX_TOPK, vocab)} log-probs a position (the vocabulary's "
                                    f"{vocab} tokens at most)")
    if body.target_prompt_logprobs is not None or body.prompt_logprobs_last_n is not None:
        raise ShardfitError("target_prompt_logprobs and prompt_logprobs_last_n are not served", where=where,
                            fix="ask for prompt_logprobs over the whole prompt")
    if not 1 <= body.num_samples <= MAX_SAMPLES:
        raise ShardfitError(f"num_samples={shown(body.num_samples)} is out of range", where=where,
                            fix=f"ask for 1 to {MAX_SAMPLES} samples per request")
    tokens = prompt_tokens(body.prompt, vocab)
    p = body.sampling_params
    max_tokens = p.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ShardfitError(f"max_tokens={shown(max_tokens)} is not a positive integer",
                            where=f"{where} sampling_params.max_tokens", fix="ask for 1 or more tokens")
    if len(tokens) >= max_len:
        raise ShardfitError(f"the prompt has {len(tokens)} tokens and the model's context is max_seq_len={max_len}: "
                            "no room for a new token", where=f"{where} prompt",
                            fix=f"send a prompt of at most {max_len - 1} tokens")
    if len(tokens) + max_tokens > max_len:
        raise ShardfitError(f"prompt ({len(tokens)} tokens) + max_tokens={max_tokens} exceeds the model's "
                            f"max_seq_len={max_len}", where=f"{where} sampling_params.max_tokens",
                            fix=f"ask for 1 to {max_len - len(tokens)} tokens")
    temperature, top_p, top_k = p.get("temperature", 1.0), p.get("top_p", 1.0), p.get("top_k", -1)
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ShardfitError(f"temperature={shown(temperature)}", where=f"{where} sampling_params",
                            fix="send 0 (greedy) or more")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ShardfitError(f"top_p={shown(top_p)}", where=f"{where} sampling_params", fix="send a value in (0, 1]")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1 or top_k == 0:  # 0 keeps no token
        raise ShardfitError(f"top_k={shown(top_k)}", where=f"{where} sampling_params",
                            fix="send -1 (no limit) or 1 or more")
    stop = p.get("stop")
    stop_tokens: list[int] = sorted(eos_ids) if stop is None else []
    stop_strings: list[str] = []
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list):
        if stop and all(isinstance(s, str) and s for s in stop):
            stop_strings, stop_tokens = stop, sorted(eos_ids)  # Tinker's stop strings end a sample at EOS too
        elif not stop:  # []: nothing stops a sample but max_tokens, EOS included
            pass
        elif all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < vocab for s in stop):
            stop_tokens = list(stop)
        else:
            raise ShardfitError("stop mixes kinds, holds an empty string or a token id outside the vocabulary",
                                where=f"{where} sampling_params.stop", fix="send strings, or token ids, or null")
    elif stop is not None:
        raise ShardfitError(f"stop={shown(stop)}", where=f"{where} sampling_params.stop",
                            fix="send a string, a list of strings, a list of token ids, or null")
    if len(stop_strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop_strings):
        raise ShardfitError(f"{len(stop_strings)} stop strings, the longest {max(map(len, stop_strings))} characters",
                            where=f"{where} sampling_params.stop",
                            fix=f"send at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each")
    if stop_strings and not has_tokenizer:
        raise ShardfitError("stop strings need the model's tokenizer, and this server has none",
                            where=f"{where} sampling_params.stop", fix="send stop token ids")
    seed = p.get("seed")
    seed = secrets.randbits(63) if seed is None else seed
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ShardfitError(f"seed={shown(seed)}", where=f"{where} sampling_params", fix="send an integer or null")
    params = dict(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k, top_p=float(top_p),
                  seed=seed % (2**63 - 1), stop_tokens=list(stop_tokens), stop_strings=list(stop_strings))
    return dict(prompt=tokens, num_samples=body.num_samples, params=params,
                prompt_logprobs=bool(body.prompt_logprobs), topk_prompt_logprobs=body.topk_prompt_logprobs,
                topk_sample_logprobs=body.topk_sample_logprobs)
