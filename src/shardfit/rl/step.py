"""The RL API (Tinker's) on the Engine's one step path: datums -> packed batches -> Engine -> per-datum outputs.

    result = forward_backward(engine, datums, "ppo", {"clip_low_threshold": 0.8})   # ForwardBackwardResult
    metrics = optim_step(engine, AdamParams(learning_rate=1e-5))                   # Tinker's metric names
    forward_backward(engine, pairs, "dpo", {"beta": 0.1})   # datums in pairs, chosen then rejected (rl/preference.py)
    forward_backward(engine, examples, "kto", {"desirable": [True, False, ...], "kl": 0.3})  # labelled datums

Every rank passes the same datum list (docs/rl.md); each rank packs its own share (rl/pack.py) and the Engine runs
the pass with the loss built from the spec (rl/losses.py): the same forward_backward, optim_step, MoE balancing,
timings, watchdog beat and OOM report as `shardfit train`. Cross-entropy averaged over the global batch's tokens
(normalize=token_mean, weights 0 or 1, no mask, KL or entropy term) is the trainer's own loss: it runs as the
Engine's CrossEntropy (the fused head, the mean taken after the pass's collective), bit for bit `shardfit train` on
the same rows, when it is the first pass since the last optim_step.
"""

from __future__ import annotations

import hashlib

import numpy as np

from shardfit.engine import AdamParams, CrossEntropy, Engine, TokenLoss
from shardfit.engine.batch import LazyBatches
from shardfit.engine.multi_model import check_models
from shardfit.rl.datum import Datum, ForwardBackwardResult, check_datums
from shardfit.rl.losses import (
    BUILT_IN,
    PAIR_LOSSES,
    LossSpec,
    coefficients,
    counted,
    lossless,
    ppo_clip_fraction,
    resolve_loss,
    sampler_gap,
    token_loss,
)
from shardfit.rl.pack import DatumPlan, datum_batches, plan_shared, unpack
from shardfit.rl.preference import objective_of, pair_pass, pair_pass_many
from shardfit.rl.prefix_trees import prefix_groups, shares_prefixes
from shardfit.rl.trainer_logprobs import ScoredRun, logprobs_mode, sample_scored_by_trainer


class DatumEngine:
    """The Engine seen through datums: what `shardfit serve` and in-process RL loops call. Everything else (model,
    save_state, load_state, weights, ...) is the Engine's own."""

    def __init__(self, engine: Engine):
        object.__setattr__(self, "engine", engine)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value) -> None:  # gather_once, on_micro_batch, ...: the Engine's
        setattr(self.engine, name, value)

    @classmethod
    def start(cls, *args, **kwargs) -> DatumEngine:
        """Engine.start's arguments (every rank calls it)."""
        return cls(Engine.start(*args, **kwargs))

    # model: a LoRA model's name or a frozen version's id (engine/registry.py); None: the one in the slot
    def forward(self, datums: list[Datum], loss_fn="cross_entropy", loss_fn_config: dict | None = None,
                model: str | None = None) -> ForwardBackwardResult:
        """Per-token log-probabilities of every datum's target tokens (and the loss's value), no gradients."""
        self.engine.using(model)
        return _run(self.engine, datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, datums: list[Datum], loss_fn="cross_entropy", loss_fn_config: dict | None = None,
                         model: str | None = None) -> ForwardBackwardResult:
        """Accumulate the gradient of sum_t c_t x loss_t (rl/losses.py) over every datum; optim_step applies it."""
        self.engine.using(model)
        return _run(self.engine, datums, loss_fn, loss_fn_config, backward=True)

    def forward_many(self, groups: dict[str, list[Datum]] | list[tuple[str, list[Datum]]],
                     loss_fn="cross_entropy", loss_fn_config: dict | None = None) -> dict[str, ForwardBackwardResult]:
        """Several LoRA models' datums scored in ONE forward over the shared base (forward_backward_many's pass
        without its backward): each model gets the result forward(datums, model=name) gives it alone."""
        return self._many(groups, loss_fn, loss_fn_config, backward=False)

    def forward_backward_many(self, groups: dict[str, list[Datum]] | list[tuple[str, list[Datum]]],
                              loss_fn="cross_entropy", loss_fn_config: dict | None = None
                              ) -> dict[str, ForwardBackwardResult]:
        """Several LoRA models' datums ({model: datums}, or a list of (model, datums)) in ONE forward and backward
        over the shared base (engine/multi_model.py), under one loss: each model gets the result it gets alone (its
        loss normalised over its own datums, a pair loss over its own pairs, its log-probs, its gradients only),
        pending for its own optim_step(model=...). One model is forward_backward(datums, model=name), bit for bit."""
        return self._many(groups, loss_fn, loss_fn_config, backward=True)

    def _many(self, groups, loss_fn, loss_fn_config: dict | None, backward: bool) -> dict[str, ForwardBackwardResult]:
        pairs = list(groups.items()) if isinstance(groups, dict) else [tuple(g) for g in groups]
        check_models(self.engine, [m for m, _ in pairs])
        if len(pairs) == 1:
            (name, datums), = pairs
            call = self.forward_backward if backward else self.forward
            return {name: call(datums, loss_fn, loss_fn_config, model=name)}
        return dict(zip((m for m, _ in pairs), _run_many(self.engine, pairs, loss_fn, loss_fn_config, backward)))

    def sample(self, prompts: list[list[int]], params, *, logprobs: str | None = None, **kwargs) -> list:
        """Engine.sample's (engine/sampling.py: the same arguments and results), with logprobs = "decode" (the
        decode model's log-probs) or "trainer" (the samples scored by this forward afterwards: rl/trainer_logprobs.py);
        None: the config's sampling.logprobs."""
        if logprobs_mode(self.engine, logprobs) == "decode":
            return self.engine.sample(prompts, params, **kwargs)
        return sample_scored_by_trainer(self.engine, self._scored, prompts, params, **kwargs)

    def sample_run(self, *, logprobs: str | None = None, tokenizer=None, **sampler_options):
        """Engine.sample_run's streaming form (engine/sample_run.py), with `logprobs` as sample's: under
        "trainer" a ScoredRun (rl/trainer_logprobs.py: every request scored by this forward when the run closes)."""
        run = self.engine.sample_run(tokenizer, **sampler_options)
        if logprobs_mode(self.engine, logprobs) == "decode":
            return run
        return ScoredRun(self.engine, self._scored, run)

    def _scored(self, datums: list[Datum], name: str | None) -> list[np.ndarray]:
        """The trainer's log-probs [L] of each datum with `name` in the slot (sampling.logprobs=trainer)."""
        return [o["logprobs"] for o in self.forward(datums, model=name).outputs]

    def optim_step(self, adam: AdamParams | None = None, model: str | None = None) -> dict[str, float]:
        """One AdamW step on the gradients accumulated since the last one, Tinker's metrics back."""
        adam = adam or AdamParams()
        self.engine.using(model)
        self.engine.release_sampler()  # the kept Sampler's KV pool: the step's memory (engine/sampling.py)
        rec = self.engine.optim_step(adam)
        return {"grad_norm:mean": rec.grad_norm, "skipped:max": float(rec.skipped),
                "learning_rate:mean": adam.learning_rate}


def forward(engine: Engine, datums: list[Datum], loss_fn="cross_entropy",
            loss_fn_config: dict | None = None) -> ForwardBackwardResult:
    return DatumEngine(engine).forward(datums, loss_fn, loss_fn_config)


def forward_backward(engine: Engine, datums: list[Datum], loss_fn="cross_entropy",
                     loss_fn_config: dict | None = None) -> ForwardBackwardResult:
    return DatumEngine(engine).forward_backward(datums, loss_fn, loss_fn_config)


def optim_step(engine: Engine, adam: AdamParams | None = None) -> dict[str, float]:
    return DatumEngine(engine).optim_step(adam)


def fingerprint(datums: list[Datum]) -> int:
    """52 bits of a hash of the datums (tokens and every input), the same on ranks given the same list: compared in
    the pass's one collective (Engine.forward_backward), so a loop that sampled on one rank only is refused instead of
    training each rank on other data. ~1 ms per 100k tokens on the host."""
    h = hashlib.blake2b(digest_size=8)
    for d in datums:
        h.update(np.ascontiguousarray(d.tokens).tobytes())
        for k in sorted(d.inputs):
            h.update(k.encode())
            h.update(np.ascontiguousarray(d.inputs[k]).tobytes())
    return int.from_bytes(h.digest(), "little") >> 12  # exact in the collective's float64


def is_token_mean_cross_entropy(spec: LossSpec, datums: list[Datum]) -> bool:
    """The trainer's objective: mean cross-entropy over the tokens of weight 1 of the global batch."""
    plain = (spec.fn is BUILT_IN["cross_entropy"] and spec.normalize == "token_mean" and not spec.kl_coef
             and not spec.entropy_coef and spec.logprobs_at == "all")
    return plain and all("mask" not in d.inputs and np.isin(d.inputs.get("weights", 1.0), (0.0, 1.0)).all()
                         for d in datums)


def _run(engine: Engine, datums: list[Datum], loss_fn, loss_fn_config: dict | None,
         backward: bool) -> ForwardBackwardResult:
    spec = resolve_loss(loss_fn, loss_fn_config)
    check_datums(datums, engine.cfg.model.vocab_size, spec.required)
    engine.release_sampler()  # the kept Sampler's KV pool and graphs: the pass's activations (engine/sampling.py)
    # every rank must have been given these datums: checked in the pass's collective, hashed by the Engine once the
    # pass's micro-batches are queued (engine.py _pass: the hash's host time under their GPU work)
    given = lambda: fingerprint(datums)  # noqa: E731
    if spec.name in PAIR_LOSSES and not callable(loss_fn):  # datums in pairs, chosen then rejected
        return _pair_result(*pair_pass(engine, datums, objective_of(spec.name, spec.config), backward, given,
                                       spec.config))
    mean_ce = backward and not engine.pending and is_token_mean_cross_entropy(spec, datums)
    plan, batches = _packed(engine, [datums], spec, backward, mean_ce=mean_ce)
    loss = CrossEntropy(logprobs=True) if mean_ce else _token_loss(spec)
    call = engine.forward_backward if backward else engine.forward
    stats = call(batches, loss, fingerprint=given)
    outputs = _outputs(plan, datums, stats.outputs, loss)
    # Tinker's loss:sum is sum_t c_t l_t; the mean's is the summed cross-entropy over its N tokens
    loss_sum = stats.loss_sum / max(stats.loss_tokens, 1.0) if mean_ce else stats.loss_sum
    return _result(datums, outputs, loss_sum, spec)


def _packed(engine: Engine, groups: list[list[Datum]], spec: LossSpec, backward: bool, mean_ce: bool = False,
            slots: bool = False) -> tuple[DatumPlan, LazyBatches]:
    """The pass's plan and this rank's micro-batches (rl/pack.py) of the datums of `groups`, in order: each group's
    coefficients made from its own datums alone (normalised as if it ran alone) and its prefix trees never across
    groups (one group: a pass of one model; several: one per model, each token's model in the batches' slots when
    `slots`). mean_ce: the trainer's mean cross-entropy (is_token_mean_cross_entropy), one group, no coefficients."""
    layout, budget = engine.layout, engine.datum_budget()
    kernel = engine.doc_kernel(budget, grad=backward)
    own = [None if mean_ce else coefficients(group, spec) for group in groups]
    coefs = None if mean_ce else [c for cs in own for c in cs]
    mine = [_trees(engine, kernel, group, cs, spec, budget) for group, cs in zip(groups, own)]
    trees = None if any(t is None for t in mine) else [t for ts in mine for t in ts]  # None: no trees this pass
    datums = [d for group in groups for d in group]
    plan = plan_shared(datums, budget, layout.data_size, layout.sequence, trees=trees)
    scored = [counted(d) for d in datums] if spec.logprobs_at == "counted" else None  # None: every token
    models = [j for j, group in enumerate(groups) for _ in group] if slots else None
    return plan, datum_batches(plan, datums, coefs, scored, layout.data_rank, layout.sequence_rank, kernel,
                               engine.device, models=models)


def _trees(engine: Engine, kernel: str, datums: list[Datum], coefs: list[np.ndarray] | None, spec: LossSpec,
           budget: int) -> list[tuple[int, int]] | None:
    """Runs of datums sharing their first tokens as prefix trees (rl/prefix_trees.py), where this pass may pack them.
    A token has loss unless rl/losses.py lossless says otherwise (the mean cross-entropy: its weight). Under
    logprobs_at="counted" a counted token is scored, an uncounted one reports 0: a trunk's tokens must be alike in
    all of its datums, so only uncounted ones are shared (a prompt one datum counts and another does not is not)."""
    if not shares_prefixes(engine, kernel):
        return None
    if coefs is None:  # the mean (is_token_mean_cross_entropy: no mask): the tokens of weight != 0
        lossy = [counted(d) for d in datums]
    else:
        lossy = [~lossless(d, c, spec) for d, c in zip(datums, coefs)]
    if spec.logprobs_at == "counted":
        lossy = [x | counted(d) for x, d in zip(lossy, datums)]
    return prefix_groups(datums, lossy, budget)


def _token_loss(spec: LossSpec) -> TokenLoss:
    return TokenLoss(lambda logp, ent, x: token_loss(spec, logp, ent, x), entropy=spec.entropy_coef != 0)


def _outputs(plan, datums: list[Datum], gathered, loss) -> list[dict[str, np.ndarray]]:
    """Per datum {"logprobs": [L]} (and "entropy") from the pass's gathered outputs [world, n_out, M x local]."""
    outputs = [{"logprobs": lp} for lp in unpack(plan, datums, gathered[:, 0])]
    if "entropy" in loss.outputs:
        for o, e in zip(outputs, unpack(plan, datums, gathered[:, 1])):
            o["entropy"] = e
    return outputs


def _result(datums: list[Datum], outputs: list[dict], loss_sum: float, spec: LossSpec) -> ForwardBackwardResult:
    logprobs = [o["logprobs"] for o in outputs]
    metrics = {"loss:sum": loss_sum, **sampler_gap(datums, logprobs), **ppo_clip_fraction(datums, logprobs, spec)}
    return ForwardBackwardResult(outputs, metrics)


def _pair_result(stats, logprobs: list[np.ndarray], metrics: dict[str, float]) -> ForwardBackwardResult:
    return ForwardBackwardResult([{"logprobs": lp} for lp in logprobs],
                                 {"loss:sum": stats.loss_sum, **{f"{k}:mean": v for k, v in metrics.items()}})


def _run_many(engine: Engine, pairs: list[tuple[str, list[Datum]]], loss_fn, loss_fn_config: dict | None,
              backward: bool) -> list[ForwardBackwardResult]:
    """K >= 2 models' datums packed together (each token's model in the batch's slots), each model's coefficients
    made from its own datums alone (normalised as if it ran alone; a pair loss's over its own pairs:
    rl/preference.py pair_pass_many), one pass (Engine.forward(_backward)(model=[...]))."""
    spec = resolve_loss(loss_fn, loss_fn_config)
    for _, group in pairs:
        check_datums(group, engine.cfg.model.vocab_size, spec.required)
    datums = [d for _, group in pairs for d in group]
    grouping = hashlib.blake2b(repr([(m, len(g)) for m, g in pairs]).encode(), digest_size=8).digest()
    # the datums and whose they are, hashed once the pass's micro-batches are queued (as _run's)
    given = lambda: fingerprint(datums) ^ (int.from_bytes(grouping, "little") >> 12)  # noqa: E731
    names = [m for m, _ in pairs]
    if spec.name in PAIR_LOSSES and not callable(loss_fn):  # each model's pairs, chosen then rejected
        return [_pair_result(*out) for out in pair_pass_many(engine, [g for _, g in pairs],
                                                             objective_of(spec.name, spec.config), backward, given,
                                                             spec.config, models=names)]
    plan, batches = _packed(engine, [group for _, group in pairs], spec, backward, slots=True)
    loss = _token_loss(spec)
    call = engine.forward_backward if backward else engine.forward
    stats = call(batches, loss, fingerprint=given, model=names)
    outputs = _outputs(plan, datums, stats[0].outputs, loss)
    results, start = [], 0
    for (_, group), own in zip(pairs, stats):
        results.append(_result(group, outputs[start:start + len(group)], own.loss_sum, spec))
        start += len(group)
    return results
