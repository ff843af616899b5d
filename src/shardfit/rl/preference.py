"""Preference losses on the Engine's one step path: datums given in pairs (chosen, then rejected; KTO: one datum an
example, labelled) -> rows that hold a unit's sequences together -> engine/preference.py's PairLoss -> per-datum
log-probs and TRL's metrics.

The RL API's loss_fn="dpo" | "ipo" | "simpo" | "orpo" | "kto" (rl/step.py) and `shardfit train` with
preference.objective (train/preference.py) both run `pair_pass`; several LoRA models' pairs in one pass
(DatumEngine.forward_backward_many / forward_many) run `pair_pass_many`, each model's over its own pairs. A
datum's counted tokens are the completion's (its `mask` input, else `weights`, else every token: rl/losses.py
counted); DPO, IPO and KTO read its `ref_logprobs` input, the reference model's log-prob of each target token.
KTO's loss_fn_config carries `desirable` (one bool per datum, or a string of 0s and 1s: what `shardfit serve` can
carry) and `kl`, the batch's reference point (the caller measures it: train/preference.py does as TRL does). The
coefficients and the batch's constants (engine/preference.py BatchTerms) are made here from the whole list, the same
on every rank; the metrics are computed on the host from the per-token log-probs that came back in the pass's one
collective: no collective of their own.
"""

from __future__ import annotations

import numpy as np
import torch

from shardfit.engine import Engine, StepStats
from shardfit.engine.preference import (
    NO_TERMS,
    OBJECTIVES,
    BatchTerms,
    PairLoss,
    PairObjective,
    join_terms,
    orpo_log_odds,
    pair_loss,
)
from shardfit.errors import ShardfitError
from shardfit.rl.datum import Datum
from shardfit.rl.losses import counted
from shardfit.rl.pack import datum_batches, plan_shared, unpack
from shardfit.rl.prefix_trees import pair_trees, shares_prefixes

CONFIG = {"beta", "label_smoothing", "gamma", "desirable_weight", "undesirable_weight", "desirable", "kl"}


KTO_ONLY = {"desirable", "kl", "desirable_weight", "undesirable_weight"}


def objective_of(name: str, cfg: dict) -> PairObjective:
    """The pair objective `name` with the RL API's loss_fn_config (beta, label_smoothing, gamma; KTO's weights),
    checked. KTO's per-batch `desirable` and `kl` are read by terms_of."""
    allowed = CONFIG if name == "kto" else CONFIG - KTO_ONLY
    unknown = sorted(set(cfg) - allowed, key=str)
    if unknown:
        raise ShardfitError(f"{name} takes no option {unknown[0]!r}", where="loss_fn_config",
                            fix=f"options: {', '.join(sorted(allowed))}")
    numbers = {}
    for key, default in (("beta", 0.1), ("label_smoothing", 0.0), ("gamma", 0.5), ("desirable_weight", 1.0),
                         ("undesirable_weight", 1.0)):
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ShardfitError(f"{key}={v!r} is not a number", where=f"loss_fn_config.{key}", fix="pass a number")
        numbers[key] = float(v)
    obj = PairObjective(name, numbers["beta"], numbers["label_smoothing"], numbers["gamma"],
                        numbers["desirable_weight"], numbers["undesirable_weight"])
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
    for key in ("desirable_weight", "undesirable_weight"):
        v = getattr(obj, key)
        if not (np.isfinite(v) and v > 0):
            raise ShardfitError(f"{key}={v} must be a number > 0", where=f"{where}.{key}",
                                fix="1.0 (TRL's default); raise the rarer kind's weight")


def terms_of(obj: PairObjective, datums: list[Datum], masks: list[np.ndarray], cfg: dict | None = None,
             where: str = "loss_fn_config") -> BatchTerms:
    """The global batch's constants (engine/preference.py BatchTerms) from the whole datum list: ORPO's pairs over
    chosen tokens; KTO's labels and reference point from cfg (`desirable`: a bool per datum, `kl`: a number >= 0)."""
    if obj.name == "orpo":
        return BatchTerms(nll_share=(len(masks) // 2) / sum(float(m.sum()) for m in masks[0::2]))
    if obj.name != "kto":
        return BatchTerms()
    labels, kl = kto_config(cfg or {}, len(datums), where)
    return BatchTerms(kl=kl, desirable=torch.tensor(labels))


def kto_config(cfg: dict, n: int, where: str = "loss_fn_config") -> tuple[list[bool], float]:
    """KTO's labels (a bool per datum, or a string of 0s and 1s) and reference point (a number >= 0), checked."""
    labels = cfg.get("desirable")
    if isinstance(labels, str):  # Tinker's loss_fn_config carries numbers and strings: "1,0,1" or "101"
        labels = [{"1": True, "0": False}.get(c, c) for c in labels if c not in ", "]
    if not isinstance(labels, (list, tuple)) or len(labels) != n or \
            not all(isinstance(x, (bool, np.bool_)) or (isinstance(x, (int, float)) and x in (0, 1)) for x in labels):
        raise ShardfitError(f"kto needs one label a datum ({n} datums)", where=f"{where}.desirable",
                            fix="pass desirable=[true, false, ...] (or the string \"1,0,...\"): true for a good "
                                "completion, false for a bad one")
    v = cfg.get("kl", 0.0)
    kl = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")
    if not (np.isfinite(kl) and kl >= 0):
        raise ShardfitError(f"kl={v!r} must be a number >= 0", where=f"{where}.kl",
                            fix="the batch's KL estimate, mean (policy - reference) log-prob of mismatched "
                                "prompt/completion sequences, clamped at 0 (TRL's); 0 to leave it out")
    return [bool(x) for x in labels], kl


def check_pair_config(name: str, cfg: dict, datums: list) -> None:
    """A pair loss's loss_fn_config, datum count and counted tokens as pair_pass will check them: what `shardfit
    serve` validates on rank 0 before any rank sees the request."""
    obj = objective_of(name, cfg)
    if obj.name == "kto":
        kto_config(cfg, len(datums))
    pair_coefficients(datums, group=obj.group)  # pairs whole, each datum with a counted token


def check_units(n: int, group: int, where: str = "data") -> None:
    if n % group:
        raise ShardfitError(f"{n} datums: a preference loss takes pairs", where=where,
                            fix="send datums in pairs: chosen, then rejected, for every prompt")


def pair_coefficients(datums: list[Datum], where: str = "data",
                      group: int = 2) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(coefficients, counted tokens) per datum: c_t = (1 / U) / (tokens of the unit) on a unit's counted tokens
    (units: pairs, group 2; KTO's examples, group 1)."""
    check_units(len(datums), group, where)
    masks = [counted(d) for d in datums]
    for i, m in enumerate(masks):
        if not m.any():
            what = f"example {i}" if group == 1 else f"{'chosen' if i % 2 == 0 else 'rejected'} of pair {i // 2}"
            raise ShardfitError(f"datum {i} has no counted token ({what})", where=f"{where}[{i}]",
                                fix="mark the completion's tokens with mask 1")
    U = len(datums) // group
    coefs = []
    for k in range(U):
        unit = masks[group * k:group * (k + 1)]
        w = 1.0 / (U * sum(int(m.sum()) for m in unit))
        coefs += [(m * w).astype(np.float32) for m in unit]
    return coefs, masks


def pair_pass(engine: Engine, datums: list[Datum], obj: PairObjective, backward: bool,
              fingerprint: int | None = None, cfg: dict | None = None, where: str = "loss_fn_config",
              with_loss: bool = False) -> tuple[StepStats, list[np.ndarray], dict[str, float]]:
    """One forward (or forward_backward) over the units: (the pass's stats, per-datum log-probs, 0 outside the
    counted tokens, TRL's metrics). fingerprint: of the datums, checked the same on every rank (rl/step.py); cfg:
    KTO's desirable and kl (terms_of); with_loss: the metrics hold "loss", the mean over units (validation)."""
    return pair_pass_many(engine, [datums], obj, backward, fingerprint, cfg, where, with_loss)[0]


def pair_pass_many(engine: Engine, groups: list[list[Datum]], obj: PairObjective, backward: bool,
                   fingerprint: int | None = None, cfg: dict | None = None, where: str = "loss_fn_config",
                   with_loss: bool = False, models: list[str] | None = None
                   ) -> list[tuple[StepStats, list[np.ndarray], dict[str, float]]]:
    """pair_pass per group of datums; models: the groups' LoRA models, all in ONE pass (Engine.forward(_backward)
    model=[...], engine/multi_model.py), each group normalised over its own units (its coefficients 1/U and its
    batch constants its own: join_terms), its datum indices after the previous groups' so that every unit's
    segment sums stay its own. None: one group, the model in the slot."""
    layout = engine.layout
    if layout.sequence > 1:
        raise ShardfitError("a preference loss sums each sequence's log-probs within one rank's row; sequence "
                            "parallelism splits the row", where="parallel.sequence_parallel",
                            fix="set parallel.sequence_parallel=1 for preference training")
    datums, coefs, masks, terms, owner = [], [], [], [], []
    for j, group in enumerate(groups):
        c, m = pair_coefficients(group, group=obj.group)
        terms.append(terms_of(obj, group, m, cfg, where))
        datums += group
        coefs += c
        masks += m
        owner += [j] * len(group)
    budget, pairs = engine.datum_budget(), obj.group == 2
    kernel = engine.doc_kernel(budget, grad=backward)
    # a pair's common prompt computed once (rl/prefix_trees.py) where the attention kernel can mask it and the pass
    # then needs fewer rows (rl/pack.py plan_shared)
    trees = pair_trees(datums, masks) if pairs and shares_prefixes(engine, kernel) else None
    plan = plan_shared(datums, budget, layout.data_size, layout.sequence, pairs=pairs, trees=trees)
    # the head scores the counted tokens alone (a prompt's log-probs are never read): logprobs_at="counted"
    batches = datum_batches(plan, datums, coefs, masks, layout.data_rank, layout.sequence_rank, kernel,
                            engine.device, models=owner if models is not None else None)
    joined = terms[0] if len(groups) == 1 else join_terms(terms, [len(g) // obj.group for g in groups])
    loss = PairLoss(obj, len(datums), joined)
    call = engine.forward_backward if backward else engine.forward
    if models is None:
        stats = [call(batches, loss, fingerprint=fingerprint)]
    else:
        stats = call(batches, loss, fingerprint=fingerprint, model=models)
    logprobs = unpack(plan, datums, stats[0].outputs[:, 0])
    out, start = [], 0
    for group, own, t in zip(groups, stats, terms):
        lp, m = logprobs[start:start + len(group)], masks[start:start + len(group)]
        out.append((own, lp, pair_metrics(obj, group, lp, m, t, with_loss)))
        start += len(group)
    return out


def pair_metrics(obj: PairObjective, datums: list[Datum], logprobs: list[np.ndarray], masks: list[np.ndarray],
                 terms: BatchTerms = NO_TERMS, with_loss: bool = False) -> dict[str, float]:
    """TRL's names, means over the units: rewards/chosen, rewards/rejected, rewards/accuracies (pairs: chosen's
    reward above rejected's), rewards/margins, logps/chosen, logps/rejected (sums over the counted tokens); ORPO's
    nll_loss, log_odds_ratio, log_odds_chosen; KTO's kl, its chosen/rejected the desirable/undesirable examples
    (a kind absent from the batch: its keys left out, as TRL's). with_loss: "loss" too, the mean over units."""
    g = obj.group

    def sums(values: list[np.ndarray]) -> torch.Tensor:  # [U, g] float64
        return torch.tensor([float(v[m].astype(np.float64).sum()) for v, m in zip(values, masks)],
                            dtype=torch.float64).view(-1, g)

    s = sums(logprobs)
    n = torch.tensor([float(m.sum()) for m in masks], dtype=torch.float64).view(-1, g)
    r = sums([d.inputs["ref_logprobs"] for d in datums]) if obj.needs_reference else None
    loss, rewards = pair_loss(obj, s, r, n, terms)
    out = {"loss": float(loss.mean())} if with_loss else {}
    if obj.name == "kto":
        good = terms.desirable
        for kind, rows in (("chosen", good), ("rejected", ~good)):
            if rows.any():
                out[f"rewards/{kind}"] = float(rewards[rows, 0].mean())
                out[f"logps/{kind}"] = float(s[rows, 0].mean())
        if good.any() and (~good).any():
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return {**out, "kl": terms.kl}
    out.update({"rewards/chosen": float(rewards[:, 0].mean()), "rewards/rejected": float(rewards[:, 1].mean()),
                "rewards/accuracies": float((rewards[:, 0] > rewards[:, 1]).double().mean()),
                "rewards/margins": float((rewards[:, 0] - rewards[:, 1]).mean()),
                "logps/chosen": float(s[:, 0].mean()), "logps/rejected": float(s[:, 1].mean())})
    if obj.name == "orpo":
        odds = orpo_log_odds(s, n)
        out.update({"nll_loss": float(-s[:, 0].sum() / n[:, 0].sum()),
                    "log_odds_ratio": float(torch.nn.functional.logsigmoid(odds).mean()),
                    "log_odds_chosen": float(odds.mean())})
    return out
