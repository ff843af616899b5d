"""Preference losses over sequences of the global batch, one micro-batch at a time, exact over the global batch:
pairs (chosen, rejected) for DPO, IPO, SimPO and ORPO; single sequences labelled desirable or not for KTO.

A unit's loss (a pair's, or a KTO example's) is a non-linear function of whole-sequence sums of token
log-probabilities, so the sequences of a unit sit in the same [1, T] row (rl/pack.py plans pairs, never splits one
across rows or ranks) and the sums are segment sums over the row's documents, on the device (index_add: no host
sync). Per-token inputs of a micro-batch:

  datum          [n] the sequence's index in the global list (pair k: 2k chosen, 2k + 1 rejected; KTO: example k
                 is datum k), -1 in padding
  ref_logprobs   [n] the reference model's log-prob of each label (DPO, IPO, KTO; SimPO and ORPO need none)
  coef           [n] c_t = (1 / U) / (tokens of the unit) on the unit's counted tokens, 0 elsewhere (U: units of the
                 global step, known on every rank from the datum list: no collective). The counted tokens are those
                 c_t > 0 marks; a segment sum of c gives the unit's weight 1/U, and the MoE load-balancing term is
                 weighted by the micro-batch's share of the units, as a per-token loss's is by its share of the tokens.

The micro-batch's loss is sum_k w_k loss_k (w_k: 1/U for its own units, 0 for the others); the Engine
backpropagates it as a coefficient loss (the sum over ranks and micro-batches is the mean over the global batch's
units). With s = sum of the policy's log-probs of a sequence's counted tokens, r the reference's, n its count, and
m = s/n the per-token mean:

  dpo    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h),   h = (s_c - r_c) - (s_r - r_r)
         (eps = label_smoothing: conservative DPO; 0: Rafailov et al.)
  ipo    (h' - 1 / (2 beta))^2,  h' the same with per-token means s/n, r/n (Azar et al.; TRL averages them too)
  simpo  -(1 - eps) log sigmoid(g) - eps log sigmoid(-g),   g = beta (m_c - m_r) - gamma (no reference)
  orpo   -s_c (U / N_c) - beta log sigmoid(o),   o = (m_c - m_r) - (log(1 - e^m_c) - log(1 - e^m_r)) (Hong et
         al.; no reference). N_c: the chosen answers' tokens of the global batch, so the first term's mean over
         pairs is the NLL averaged over those tokens (TRL's nll_loss); beta is TRL's lambda.
  kto    desirable: w_d (1 - sigmoid(beta ((s - r) - z))), undesirable: w_u (1 - sigmoid(beta (z - (s - r))))
         (Ethayarajh et al.), z the batch's KL reference point, a constant of the step (BatchTerms: measured by
         the caller on mismatched prompt/answer sequences before the pass, detached as TRL's is)

Rewards (TRL's metrics): beta (s - r) for DPO and KTO, beta (s/n - r/n) for IPO, beta s/n for SimPO and ORPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardfit.engine.batch import DeviceBatch
from shardfit.engine.losses import Loss, scored_logprobs, with_router_aux

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")
NEEDS_REFERENCE = ("dpo", "ipo", "kto")
UNPAIRED = ("kto",)  # a unit is one sequence labelled desirable or not; the others' units are pairs


@dataclass(frozen=True)
class PairObjective:
    name: str  # one of OBJECTIVES
    beta: float = 0.1  # ORPO: TRL's lambda, the odds-ratio term's weight
    label_smoothing: float = 0.0  # dpo and simpo
    gamma: float = 0.5  # simpo's target margin
    desirable_weight: float = 1.0  # kto
    undesirable_weight: float = 1.0  # kto

    @property
    def needs_reference(self) -> bool:
        return self.name in NEEDS_REFERENCE

    @property
    def group(self) -> int:
        """Sequences per unit: 2 (chosen, rejected) for pairs, 1 for KTO's examples."""
        return 1 if self.name in UNPAIRED else 2


@dataclass(frozen=True)
class BatchTerms:
    """The global batch's constants of a loss, made on the host from the whole datum list (the same on every rank,
    no collective): nll_share, ORPO's U / N_c (pairs over the chosen answers' tokens); kl, KTO's reference point z;
    desirable [U] bool, KTO's labels. In a pass of several models (join_terms) nll_share and kl are per unit [U],
    each its own model's."""

    nll_share: float | torch.Tensor = 0.0
    kl: float | torch.Tensor = 0.0
    desirable: torch.Tensor | None = None


NO_TERMS = BatchTerms()  # DPO, IPO and SimPO read none


def join_terms(parts: list[BatchTerms], units: list[int]) -> BatchTerms:
    """Several models' batch constants in one pass (rl/preference.py pair_pass over groups): each unit keeps its own
    model's, as per-unit tensors [U] (ORPO's nll_share, KTO's kl; KTO's labels end to end)."""

    def per_unit(values: list[float]) -> torch.Tensor:
        return torch.cat([torch.full((u,), v, dtype=torch.float64) for v, u in zip(values, units)])

    desirable = [t.desirable for t in parts]
    return BatchTerms(per_unit([t.nll_share for t in parts]), per_unit([t.kl for t in parts]),
                      torch.cat(desirable) if all(d is not None for d in desirable) else None)


def _on(x, like: torch.Tensor):
    """A batch constant where it meets `like`: a float as it is, a per-unit tensor on like's device and dtype."""
    return x.to(like.device, like.dtype) if isinstance(x, torch.Tensor) else x


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, stable at both ends (Maechler's split at -log 2); x is clamped below 0 so that a
    per-token mean log-prob of exactly 0 gives a large finite value, not -inf (TRL's is -inf there)."""
    x = x.clamp(max=-1e-6)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_loss(obj: PairObjective, s: torch.Tensor, r: torch.Tensor | None, n: torch.Tensor,
              terms: BatchTerms = NO_TERMS) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [U], rewards [U, g]) from per-sequence sums s, r and counts n, each [U, g] (pairs: g = 2, column 0
    chosen, 1 rejected; KTO: g = 1). The one definition: the device loss and the host's metrics both call it."""
    eps, beta = obj.label_smoothing, obj.beta
    mean = s / n.clamp(min=1)
    if obj.name == "simpo":
        g = beta * (mean[:, 0] - mean[:, 1]) - obj.gamma
        return -(1 - eps) * F.logsigmoid(g) - eps * F.logsigmoid(-g), beta * mean
    if obj.name == "orpo":
        log_odds = (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))
        return -s[:, 0] * _on(terms.nll_share, s) - beta * F.logsigmoid(log_odds), beta * mean
    if obj.name == "kto":
        ratio = (s - r)[:, 0]
        good = terms.desirable.to(ratio.device)
        kl = _on(terms.kl, ratio)
        loss = torch.where(good, obj.desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                           obj.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
        return loss, beta * (s - r)
    ratio = s - r if obj.name == "dpo" else (s - r) / n.clamp(min=1)  # [P, 2]: the policy over the reference
    h = ratio[:, 0] - ratio[:, 1]
    if obj.name == "dpo":
        loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    else:
        loss = (h - 1 / (2 * beta)) ** 2
    return loss, beta * ratio


def orpo_log_odds(s: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """ORPO's log odds ratio o [P] of each pair (TRL's log_odds_chosen metric averages it)."""
    mean = s / n.clamp(min=1)
    return (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))


class PairLoss(Loss):
    """One micro-batch's sum_k w_k loss_k over the units of its row (module docstring). `sequences`: the datums of
    the global list (g x U), the size of the segment sums; outputs the per-token log-probs (the host's metrics)."""

    outputs = ("logprobs",)

    def __init__(self, objective: PairObjective, sequences: int, terms: BatchTerms = NO_TERMS):
        self.objective, self.sequences, self.terms = objective, sequences, terms

    def __call__(self, model: torch.nn.Module, b: DeviceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, _ = scored_logprobs(model, b)  # [n]
        D, g = self.sequences, self.objective.group
        counted = b.coef > 0
        seg = torch.where(counted, b.inputs["datum"].long(), D)  # [n]: the other tokens go to slot D, dropped

        def segment_sum(x: torch.Tensor) -> torch.Tensor:  # [n] -> [U, g]
            return x.new_zeros(D + 1).index_add(0, seg, x)[:D].view(-1, g)

        s = segment_sum(logp)
        n = segment_sum(counted.float())
        w = segment_sum(b.coef).sum(1)  # [U]: 1/U for this row's units, 0 for the others
        r = segment_sum(b.inputs["ref_logprobs"].float()) if self.objective.needs_reference else None
        loss, _ = pair_loss(self.objective, s, r, n, self.terms)
        # per token c_t x (its unit's loss): each unit's coefficients sum to its w, so the terms sum to the total; a
        # pass of several models sums them per model (engine/multi_model.py)
        terms = b.coef * torch.cat([loss.detach(), loss.new_zeros(1)])[seg // g]  # [n]; seg = D -> unit U: 0
        return with_router_aux(model, b, (w * loss).sum()), {"logprobs": logp, "terms": terms}
