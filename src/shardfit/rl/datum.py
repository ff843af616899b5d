"""The data model of the RL API (Tinker's): a datum is a token sequence with per-token loss inputs.

A `Datum` of length L holds `tokens` [L] (the model input) and `inputs`, per-token arrays of length L:
`target_tokens` (the token whose log-probability position t scores, usually tokens shifted by one), and whatever the
loss reads: `weights` (cross_entropy), `logprobs` (the sampler's, importance_sampling / ppo), `advantages`,
`ref_logprobs` (KL penalty), `mask` (which tokens count for normalisation). Every rank is given the same list: the
engine decides which rank computes which datum (rl/pack.py) and returns every datum's outputs on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shardfit.errors import ShardfitError

INT_INPUTS = ("target_tokens",)


@dataclass
class Datum:
    tokens: np.ndarray  # [L] int64: the model input
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # each [L]: target_tokens int64, the rest float32

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class ForwardBackwardResult:
    outputs: list[dict[str, np.ndarray]]  # per datum, in the caller's order: {"logprobs": [L] float32, ...}
    metrics: dict[str, float]  # "name:reduction" keys, e.g. "loss:sum"


def make_datum(tokens, **inputs) -> Datum:
    """A Datum from lists or arrays: make_datum(ids[:-1], target_tokens=ids[1:], weights=w)."""
    return Datum(np.asarray(tokens, dtype=np.int64),
                 {k: np.asarray(v, dtype=np.int64 if k in INT_INPUTS else np.float32) for k, v in inputs.items()})


def check_datums(datums: list[Datum], vocab_size: int, required: tuple[str, ...] = ("target_tokens",)) -> None:
    """One clear error for the first problem: empty data, empty or ragged datums, ids outside the vocabulary,
    a missing loss input, non-finite values."""
    if not datums:
        raise ShardfitError("no data: the list of datums is empty", where="data", fix="pass at least one datum")
    for i, d in enumerate(datums):
        where = f"data[{i}]"
        tokens = np.asarray(d.tokens)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ShardfitError(f"tokens of shape {tuple(tokens.shape)}: a datum needs a 1-D, non-empty sequence",
                                where=where, fix="pass the model input as a flat list of token ids")
        for name in required:
            if name not in d.inputs:
                raise ShardfitError(f"loss input {name!r} is missing (has: {sorted(d.inputs) or 'none'})",
                                    where=where, fix=f"add loss_fn_inputs[{name!r}] with one value per token")
        for name, arr in (("tokens", tokens), *d.inputs.items()):
            arr = np.asarray(arr)
            if arr.shape != tokens.shape:
                raise ShardfitError(f"{name} has shape {tuple(arr.shape)}, the tokens {tuple(tokens.shape)}",
                                    where=f"{where}.{name}", fix="give every loss input one value per token")
            if name == "tokens" or name in INT_INPUTS:
                lo, hi = int(arr.min()), int(arr.max())
                if lo < 0 or hi >= vocab_size:
                    bad = hi if hi >= vocab_size else lo
                    raise ShardfitError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                                        where=f"{where}.{name}", fix="tokenize with the model's own tokenizer")
            elif not np.isfinite(arr).all():
                raise ShardfitError(f"{name} holds a non-finite value", where=f"{where}.{name}",
                                    fix="replace NaN/inf before sending")
