"""Per-token losses of the RL API and their normalisation, exact however datums fall into micro-batches and ranks.

A loss is a function of the per-token log-probabilities logp [n] (differentiable) and the datums' per-token inputs
[n]; it returns the per-token loss l [n]. The engine backpropagates sum_t c_t * l_t over the tokens each rank
computes, with c_t a coefficient made on the host from the whole (global) list of datums, which every rank holds:

  sum            c_t = m_t                      Tinker's definition: a sum, never renormalised (the default)
  token_mean     c_t = m_t / N                  N = counted tokens of the global batch
  sequence_mean  c_t = m_t / (n_d * D)          n_d = counted tokens of datum d, D = datums with n_d > 0
  constant       c_t = m_t / normalize_constant (Dr. GRPO's fixed denominator)

m_t is the datum's `mask` input where it has one (else 1); the counted tokens are those with mask != 0, else
weights != 0, else all. Built in (Tinker's definitions, ratio r = exp(logp - sampler logprobs)):
  cross_entropy        -weights * logp
  importance_sampling  -r * advantages
  ppo                  -min(r * A, clamp(r, clip_low_threshold, clip_high_threshold) * A), and with dual_clip = c
                       (> 1) for A < 0 at most -c * A
plus kl_coef * k3(ref_logprobs - logp) and -entropy_coef * entropy per token. A callable loss_fn(logp, inputs, config)
returns l [n] itself (inputs also holds "datum", each token's datum index).
Preference losses over pairs of datums (chosen, then rejected): dpo, ipo (both read ref_logprobs), simpo and orpo,
with beta, label_smoothing and gamma; kto over datums each labelled desirable or not (loss_fn_config's desirable and
kl); not per-token: rl/preference.py and engine/preference.py.

logprobs_at = "counted" scores the counted tokens only: the output head runs on their rows alone (an RL recompute
needs the response's log-probs, not the prompt's: ~30% of the head's work on rollouts), the other tokens report a
log-prob (and entropy) of 0 and take a coefficient of 0. "all" (the default, Tinker's) scores every token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shardfit.errors import ShardfitError
from shardfit.rl.datum import Datum

NORMALIZE = ("sum", "token_mean", "sequence_mean", "constant")
_REQUIRED = {"cross_entropy": ("target_tokens",), "importance_sampling": ("target_tokens", "logprobs", "advantages"),
             "ppo": ("target_tokens", "logprobs", "advantages")}
_CONFIG = {"cross_entropy": set(), "importance_sampling": set(),
           "ppo": {"clip_low_threshold", "clip_high_threshold", "dual_clip"}}
_COMMON = {"normalize", "normalize_constant", "kl_coef", "entropy_coef", "logprobs_at"}
LOGPROBS_AT = ("all", "counted")


def cross_entropy(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    w = x.get("weights")
    return -logp if w is None else -w * logp


def importance_sampling(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    return -torch.exp(logp - x["logprobs"]) * x["advantages"]


def ppo(logp: torch.Tensor, x: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    ratio, adv = torch.exp(logp - x["logprobs"]), x["advantages"]
    clipped = ratio.clamp(float(cfg.get("clip_low_threshold", 0.8)), float(cfg.get("clip_high_threshold", 1.2)))
    loss = -torch.minimum(ratio * adv, clipped * adv)
    dual = float(cfg.get("dual_clip", 0.0))
    if dual > 1.0:  # for negative advantages the loss is bounded by -dual * A (Ye et al., 2020)
        loss = torch.where(adv < 0, torch.minimum(loss, -dual * adv), loss)
    return loss


BUILT_IN: dict[str, Callable] = {"cross_entropy": cross_entropy, "importance_sampling": importance_sampling,
                                 "ppo": ppo}
PAIR_LOSSES = {"dpo": ("target_tokens", "ref_logprobs"), "ipo": ("target_tokens", "ref_logprobs"),
               "simpo": ("target_tokens",), "orpo": ("target_tokens",),
               "kto": ("target_tokens", "ref_logprobs")}  # over pairs of datums (KTO: labelled datums): their
# required inputs (rl/preference.py)
# every loss a name selects, with the inputs it reads (Tinker's names): what the server checks on rank 0
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {**_REQUIRED, **PAIR_LOSSES}


@dataclass
class LossSpec:
    name: str
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], dict], torch.Tensor]
    config: dict
    required: tuple[str, ...]
    normalize: str = "sum"
    constant: float = 1.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    logprobs_at: str = "all"  # or "counted": only the counted tokens are scored (module docstring)


_NUMBERS = ("normalize_constant", "kl_coef", "entropy_coef", "clip_low_threshold", "clip_high_threshold", "dual_clip")


def _numbers(cfg: dict) -> dict:
    """cfg with each numeric option a finite float, or one clear error naming the key (a client's wrong value is
    its own error, not the server's)."""
    out = dict(cfg)
    for key in _NUMBERS:
        if key not in cfg:
            continue
        v = cfg[key]
        try:
            number = float(v) if not isinstance(v, bool) else None
        except (TypeError, ValueError, OverflowError):
            number = None
        if number is None or not np.isfinite(number):
            shown = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
            raise ShardfitError(f"{key}={shown} is not a finite number", where=f"loss_fn_config.{key}",
                                fix="pass a number")
        out[key] = number
    return out


def resolve_loss(loss_fn, loss_fn_config: dict | None) -> LossSpec:
    """The loss and its configuration, checked: an unknown name or key, or a value of the wrong kind, is one clear
    error naming it."""
    cfg = dict(loss_fn_config or {})
    if callable(loss_fn):
        name, fn, required, allowed = getattr(loss_fn, "__name__", "custom"), loss_fn, ("target_tokens",), None
    elif isinstance(loss_fn, str) and loss_fn in BUILT_IN:
        name, fn, required, allowed = loss_fn, BUILT_IN[loss_fn], _REQUIRED[loss_fn], _CONFIG[loss_fn] | _COMMON
    elif isinstance(loss_fn, str) and loss_fn in PAIR_LOSSES:  # checked by rl/preference.py objective_of
        return LossSpec(loss_fn, None, cfg, PAIR_LOSSES[loss_fn])
    else:
        raise ShardfitError(f"unknown loss_fn {loss_fn!r}", where="loss_fn",
                            fix=f"use one of {', '.join([*BUILT_IN, *PAIR_LOSSES])}, or a Python callable (logp, "
                            "inputs) -> loss")
    if allowed is not None:
        unknown = sorted(set(cfg) - allowed, key=str)
        if unknown:
            raise ShardfitError(f"{name} takes no option {unknown[0]!r}", where="loss_fn_config",
                                fix=f"options: {', '.join(sorted(allowed))}")
    cfg = _numbers(cfg)
    spec = LossSpec(name, fn, {k: v for k, v in cfg.items() if k not in _COMMON}, required,
                    str(cfg.get("normalize", "sum")), cfg.get("normalize_constant", 1.0),
                    cfg.get("kl_coef", 0.0), cfg.get("entropy_coef", 0.0), str(cfg.get("logprobs_at", "all")))
    if spec.logprobs_at not in LOGPROBS_AT:
        raise ShardfitError(f"logprobs_at={spec.logprobs_at!r} is not known", where="loss_fn_config.logprobs_at",
                            fix="use 'all' (every token) or 'counted' (the tokens of mask != 0, else weights != 0)")
    if spec.normalize not in NORMALIZE:
        raise ShardfitError(f"normalize={spec.normalize!r} is not known", where="loss_fn_config.normalize",
                            fix=f"use one of {', '.join(NORMALIZE)}")
    if spec.normalize == "constant" and not spec.constant > 0:
        raise ShardfitError("normalize_constant must be > 0", where="loss_fn_config.normalize_constant",
                            fix="e.g. the maximum response length")
    lo, hi = spec.config.get("clip_low_threshold", 0.8), spec.config.get("clip_high_threshold", 1.2)
    if name == "ppo" and not lo <= 1.0 <= hi:  # outside [lo, hi] the clipped term is a constant: no gradient at r=1
        raise ShardfitError(f"clip_low_threshold={lo:g}, clip_high_threshold={hi:g}: the clip range must hold the "
                            "ratio 1", where="loss_fn_config.clip_low_threshold",
                            fix="pass ratio bounds such as 0.8 and 1.2 (1 - eps, 1 + eps), low <= 1 <= high")
    if spec.kl_coef:
        spec.required = (*spec.required, "ref_logprobs")
    return spec


def counted(d: Datum) -> np.ndarray:
    """[L] bool: the datum's tokens that count for normalisation."""
    if "mask" in d.inputs:
        return d.inputs["mask"] != 0
    if "weights" in d.inputs:
        return d.inputs["weights"] != 0
    return np.ones(len(d.tokens), dtype=bool)


def sampled(d: Datum) -> np.ndarray:
    """[L] bool: the counted tokens the sampler gave a log-prob for. Tinker's RL datums hold 0 at the prompt's
    positions (no mask input: its cookbook strips it); a sampled token's log-prob is exactly 0 only where its
    probability rounds to 1, where sampler and trainer agree anyway."""
    return counted(d) & (d.inputs["logprobs"] != 0)


def coefficients(datums: list[Datum], spec: LossSpec) -> list[np.ndarray]:
    """c_t per datum ([L] float32 each), from the global list: the same on every rank, no collective."""
    masks = [d.inputs["mask"].astype(np.float64) if "mask" in d.inputs else np.ones(len(d.tokens)) for d in datums]
    counts = [int(counted(d).sum()) for d in datums]
    if spec.normalize == "sum":
        scale = [1.0] * len(datums)
    elif spec.normalize == "token_mean":
        scale = [1.0 / max(sum(counts), 1)] * len(datums)
    elif spec.normalize == "sequence_mean":
        n_seq = max(sum(1 for c in counts if c > 0), 1)
        scale = [1.0 / (c * n_seq) if c > 0 else 0.0 for c in counts]
    else:
        scale = [1.0 / spec.constant] * len(datums)
    if spec.logprobs_at == "counted":  # the loss is then over the scored tokens alone, whatever the inputs say
        masks = [m * counted(d) for m, d in zip(masks, datums)]
    return [(m * s).astype(np.float32) for m, s in zip(masks, scale)]


def lossless(d: Datum, coef: np.ndarray, spec: LossSpec) -> np.ndarray:
    """[L] bool: the datum's tokens whose log-prob moves no loss term (what rl/prefix_trees.py may compute once for
    several datums). A built-in loss's term is its own token's alone: coefficient 0, or, with no KL or entropy
    term, weight 0 (cross_entropy: -w logp) or advantage 0 (importance_sampling, ppo: the ratio times A, both clip
    branches). A callable loss sees every token's log-prob and datum index and may combine a datum's tokens (a mean
    over them, a sequence's sum): none is lossless, whatever its coefficient (a trunk laid once would be one datum's
    tokens alone)."""
    if spec.name not in BUILT_IN or spec.fn is not BUILT_IN[spec.name]:
        return np.zeros(len(coef), dtype=bool)
    zero = coef == 0
    if spec.kl_coef or spec.entropy_coef:
        return zero
    key = "weights" if spec.name == "cross_entropy" else "advantages"
    return zero | (d.inputs[key] == 0) if key in d.inputs else zero


def token_loss(spec: LossSpec, logp: torch.Tensor, entropy: torch.Tensor | None,
               x: dict[str, torch.Tensor]) -> torch.Tensor:
    """l [n] of one micro-batch's tokens (padding included: its coefficient is 0)."""
    loss = spec.fn(logp, x, spec.config)
    if loss.shape != logp.shape:
        raise ShardfitError(f"loss_fn {spec.name} returned shape {tuple(loss.shape)} for {tuple(logp.shape)} tokens",
                            where="loss_fn", fix="return one loss value per token")
    if spec.kl_coef:
        d = x["ref_logprobs"] - logp  # k3 = e^d - d - 1 >= 0, an unbiased estimate of KL(policy || reference)
        loss = loss + spec.kl_coef * (torch.exp(d) - d - 1)
    if spec.entropy_coef:
        loss = loss - spec.entropy_coef * entropy
    return loss


def sampler_gap(datums: list[Datum], logprobs: list[np.ndarray]) -> dict[str, float]:
    """The train/sample mismatch where datums carry the sampler's log-probs: over sampled tokens, mean and max
    |logp_train - logp_sampler| and a KL(sampler || trainer) estimate (k3). Empty when none carries them."""
    deltas = [(lp - d.inputs["logprobs"])[sampled(d)] for d, lp in zip(datums, logprobs) if "logprobs" in d.inputs]
    if not deltas:
        return {}
    delta = np.concatenate(deltas).astype(np.float64)  # log(p_train / p_sampler)
    if delta.size == 0:
        return {}
    return {"sampler_logprob_gap:mean": float(np.abs(delta).mean()),
            "sampler_logprob_gap:max": float(np.abs(delta).max()),
            "sampler_kl:mean": float((np.exp(delta) - delta - 1).mean())}


def ppo_clip_fraction(datums: list[Datum], logprobs: list[np.ndarray], spec: LossSpec) -> dict[str, float]:
    if spec.name != "ppo":
        return {}
    lo, hi = float(spec.config.get("clip_low_threshold", 0.8)), float(spec.config.get("clip_high_threshold", 1.2))
    r = [np.exp(lp - d.inputs["logprobs"])[sampled(d)] for d, lp in zip(datums, logprobs)]
    r = np.concatenate(r) if r else np.zeros(0)
    return {"clip_fraction:mean": float(((r < lo) | (r > hi)).mean())} if r.size else {}
