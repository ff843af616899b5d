"""Preference pairs on the Engine's one step path: datums given in pairs (chosen, then rejected) -> rows that hold
both sequences of a pair -> engine/preference.py's PairLoss -> per-datum log-probs and TRL's metrics.

The RL API's loss_fn="dpo" | "ipo" | "simpo" (rl/step.py) and `shardfit train` with preference.objective
(train/preference.py) both run `pair_pass`. A datum's counted tokens are the completion's (its `mask` input, else
`weights`, else every token: rl/losses.py counted); DPO and IPO read its `ref_logprobs` input, the reference
model's log-prob of each target token. The coefficients (engine/preference.py) are made here from the whole list,
the same on every rank; the metrics are computed on the host from the per-token log-probs that came back in the
pass's one collective: no collective of their own.
"""

from __future__ import annotations

import numpy as np
import torch

from shardfit.engine import Engine, StepStats
from shardfit.engine.preference import OBJECTIVES, PairLoss, PairObjective, pair_loss
from shardfit.errors import ShardfitError
from shardfit.rl.datum import Datum
from shardfit.rl.losses import counted
from shardfit.rl.pack import datum_batches, plan_datums, unpack

CONFIG = {"beta", "label_smoothing", "gamma"}


def objective_of(name: str, cfg: dict) -> PairObjective:
    """The pair objective `name` with the RL API's loss_fn_config (beta, label_smoothing, gamma), checked."""
    unknown = sorted(set(cfg) - CONFIG)
    if unknown:
        raise ShardfitError(f"{name} takes no option {unknown[0]!r}", where="loss_fn_config",
                            fix=f"options: {', '.join(sorted(CONFIG))}")
    obj = PairObjective(name, float(cfg.get("beta", 0.1)), float(cfg.get("label_smoothing", 0.0)),
                        float(cfg.get("gamma", 0.5)))
    check_objective(obj, "loss_fn_config")
    return obj


def check_objective(obj: PairObjective, where: str) -> None:
    if obj.name not in OBJECTIVES:
        raise ShardfitError(f"unknown preference objective {obj.name!r}", where=where,
                            fix=f"use one of {', '.join(OBJECTIVES)}")
    if not (np.isfinite(obj.beta) and obj.beta > 0):
        raise ShardfitError(f"beta={obj.beta} must be a number > 0", where=f"{where}.beta", fix="e.g. 0.1")
    if not 0 <= obj.label_smoothing < 0.5:
        raise ShardfitError(f"label_smoothing={obj.label_smoothing} is outside [0, 0.5)",
                            where=f"{where}.label_smoothing", fix="0 for DPO, e.g. 0.1 for conservative DPO")
    if not np.isfinite(obj.gamma):
        raise ShardfitError("gamma must be finite", where=f"{where}.gamma", fix="e.g. 0.5")


def pair_coefficients(datums: list[Datum], where: str = "data") -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(coefficients, counted tokens) per datum: c_t = (1 / P) / (n_c + n_r) on a pair's counted tokens."""
    if len(datums) % 2:
        raise ShardfitError(f"{len(datums)} datums: a preference loss takes pairs", where=where,
                            fix="send datums in pairs: chosen, then rejected, for every prompt")
    masks = [counted(d) for d in datums]
    for i, m in enumerate(masks):
        if not m.any():
            raise ShardfitError(f"datum {i} has no counted token ({'chosen' if i % 2 == 0 else 'rejected'} of pair "
                                f"{i // 2})", where=f"{where}[{i}]", fix="mark the completion's tokens with mask 1")
    P = len(datums) // 2
    coefs = []
    for k in range(P):
        w = 1.0 / (P * (int(masks[2 * k].sum()) + int(masks[2 * k + 1].sum())))
        coefs += [(masks[2 * k] * w).astype(np.float32), (masks[2 * k + 1] * w).astype(np.float32)]
    return coefs, masks


def pair_pass(engine: Engine, datums: list[Datum], obj: PairObjective, backward: bool,
              fingerprint: int | None = None) -> tuple[StepStats, list[np.ndarray], dict[str, float]]:
    """One forward (or forward_backward) over the pairs: (the pass's stats, per-datum log-probs, 0 outside the
    counted tokens, TRL's metrics). fingerprint: of the datums, checked the same on every rank (rl/step.py)."""
    layout = engine.layout
    if layout.sequence > 1:
        raise ShardfitError("a preference loss sums each sequence's log-probs within one rank's row; sequence "
                            "parallelism splits the row", where="parallel.sequence_parallel",
                            fix="set parallel.sequence_parallel=1 for preference training")
    coefs, masks = pair_coefficients(datums)
    plan = plan_datums(datums, engine.datum_budget(), layout.data_size, layout.sequence, pairs=True)
    # the head scores the counted tokens alone (a prompt's log-probs are never read): logprobs_at="counted"
    batches = datum_batches(plan, datums, coefs, masks, layout.data_rank, layout.sequence_rank,
                            engine.doc_kernel(plan.budget, grad=backward), engine.device)
    loss = PairLoss(obj, len(datums))
    call = engine.forward_backward if backward else engine.forward
    stats = call(batches, loss, fingerprint=fingerprint)
    logprobs = unpack(plan, datums, stats.outputs[:, 0])
    return stats, logprobs, pair_metrics(obj, datums, logprobs, masks)


def pair_metrics(obj: PairObjective, datums: list[Datum], logprobs: list[np.ndarray],
                 masks: list[np.ndarray]) -> dict[str, float]:
    """TRL's names, means over the pairs: rewards/chosen, rewards/rejected, rewards/accuracies (chosen's reward
    above rejected's), rewards/margins, logps/chosen, logps/rejected (sums over the counted tokens)."""
    def sums(values: list[np.ndarray]) -> torch.Tensor:  # [P, 2] float64
        return torch.tensor([float(v[m].astype(np.float64).sum()) for v, m in zip(values, masks)],
                            dtype=torch.float64).view(-1, 2)

    s = sums(logprobs)
    n = torch.tensor([float(m.sum()) for m in masks], dtype=torch.float64).view(-1, 2)
    r = sums([d.inputs["ref_logprobs"] for d in datums]) if obj.needs_reference else None
    _, rewards = pair_loss(obj, s, r, n)
    return {"rewards/chosen": float(rewards[:, 0].mean()), "rewards/rejected": float(rewards[:, 1].mean()),
            "rewards/accuracies": float((rewards[:, 0] > rewards[:, 1]).double().mean()),
            "rewards/margins": float((rewards[:, 0] - rewards[:, 1]).mean()),
            "logps/chosen": float(s[:, 0].mean()), "logps/rejected": float(s[:, 1].mean())}
