"""Preference losses over pairs of sequences (chosen, rejected): DPO, IPO and SimPO, one micro-batch at a time,
exact over the global batch.

A pair's loss is a non-linear function of whole-sequence sums of token log-probabilities, so both sequences of a
pair sit in the same [1, T] row (rl/pack.py plans pairs, never splits one across rows or ranks) and the sums are
segment sums over the row's documents, on the device (index_add: no host sync). Per-token inputs of a micro-batch:

  datum          [n] the sequence's index in the global list (pair k: 2k chosen, 2k + 1 rejected), -1 in padding
  ref_logprobs   [n] the reference model's log-prob of each label (DPO, IPO; SimPO needs none)
  coef           [n] c_t = (1 / P) / (n_c + n_r) on the pair's counted tokens, 0 elsewhere (P: pairs of the global
                 step, known on every rank from the datum list: no collective). The counted tokens are those c_t > 0
                 marks; a segment sum of c gives the pair's weight 1/P, and the MoE load-balancing term is weighted by
                 the micro-batch's share of the pairs, as a per-token loss's is by its share of the tokens.

The micro-batch's loss is sum_k w_k loss_k (w_k: 1/P for its own pairs, 0 for the others); the Engine
backpropagates it as a coefficient loss (the sum over ranks and micro-batches is the mean over the global batch's
pairs). With s = sum of the policy's log-probs of a sequence's counted tokens, r the reference's, n its count:

  dpo    -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h),   h = (s_c - r_c) - (s_r - r_r)
         (eps = label_smoothing: conservative DPO; 0: Rafailov et al.)
  ipo    (h' - 1 / (2 beta))^2,  h' the same with per-token means s/n, r/n (Azar et al.; TRL averages them too)
  simpo  -(1 - eps) log sigmoid(g) - eps log sigmoid(-g),   g = beta (s_c/n_c - s_r/n_r) - gamma (no reference)

Rewards (TRL's metrics): beta (s - r) for DPO, beta (s/n - r/n) for IPO, beta s/n for SimPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardfit.engine.batch import DeviceBatch
from shardfit.engine.losses import Loss, scored_logprobs, with_router_aux

OBJECTIVES = ("dpo", "ipo", "simpo")
NEEDS_REFERENCE = ("dpo", "ipo")


@dataclass(frozen=True)
class PairObjective:
    name: str  # one of OBJECTIVES
    beta: float = 0.1
    label_smoothing: float = 0.0  # dpo and simpo
    gamma: float = 0.5  # simpo's target margin

    @property
    def needs_reference(self) -> bool:
        return self.name in NEEDS_REFERENCE


def pair_loss(obj: PairObjective, s: torch.Tensor, r: torch.Tensor | None,
              n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [P], rewards [P, 2]) from per-sequence sums s, r and counts n, each [P, 2] (column 0 chosen, 1
    rejected). The one definition: the device loss and the host's metrics both call it."""
    if obj.name == "simpo":
        mean = s / n.clamp(min=1)
        g = obj.beta * (mean[:, 0] - mean[:, 1]) - obj.gamma
        eps = obj.label_smoothing
        return -(1 - eps) * F.logsigmoid(g) - eps * F.logsigmoid(-g), obj.beta * mean
    ratio = s - r if obj.name == "dpo" else (s - r) / n.clamp(min=1)  # [P, 2]: the policy over the reference
    h = ratio[:, 0] - ratio[:, 1]
    if obj.name == "dpo":
        eps = obj.label_smoothing
        loss = -(1 - eps) * F.logsigmoid(obj.beta * h) - eps * F.logsigmoid(-obj.beta * h)
    else:
        loss = (h - 1 / (2 * obj.beta)) ** 2
    return loss, obj.beta * ratio


class PairLoss(Loss):
    """One micro-batch's sum_k w_k loss_k over the pairs of its row (module docstring). `sequences`: the datums of
    the global list (2 x P), the size of the segment sums; outputs the per-token log-probs (the host's metrics)."""

    outputs = ("logprobs",)

    def __init__(self, objective: PairObjective, sequences: int):
        self.objective, self.sequences = objective, sequences

    def __call__(self, model: torch.nn.Module, b: DeviceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp, _ = scored_logprobs(model, b)  # [n]
        D = self.sequences
        counted = b.coef > 0
        seg = torch.where(counted, b.inputs["datum"].long(), D)  # [n]: the other tokens go to slot D, dropped

        def segment_sum(x: torch.Tensor) -> torch.Tensor:  # [n] -> [P, 2]
            return x.new_zeros(D + 1).index_add(0, seg, x)[:D].view(-1, 2)

        s = segment_sum(logp)
        n = segment_sum(counted.float())
        w = segment_sum(b.coef).sum(1)  # [P]: 1/P for this row's pairs, 0 for the others
        r = segment_sum(b.inputs["ref_logprobs"].float()) if self.objective.needs_reference else None
        loss, _ = pair_loss(self.objective, s, r, n)
        return with_router_aux(model, b, (w * loss).sum()), {"logprobs": logp}
