"""Engine.sample with sampling.logprobs = "trainer": the returned log-probs are the trainer's own (issue 36 item 6).

    results = engine.sample(prompts, SamplingParams(max_tokens=256), num_samples=16, logprobs="trainer")
    # (or --sampling.logprobs=trainer: the default of every call, serve's /asample included)

The decode model (sampling/: a plain CausalLM, KV cache, one token at a time) and Engine.forward (the FSDP model,
packed [1, T] rows, document-masked attention, the fused head) compute a sampled token's log-prob with other
kernels, shapes and reduction orders: in bf16 on a GPU they differ by rounding (the train/sample gap,
`sampler_logprob_gap:mean` / `:max` of an RL step; measured by benchmarks/bench_logprob_gap.py). With "trainer" the
Sampler still chooses the tokens; then the samples become the datums an RL loop builds from them (the cookbook's:
model input prompt + completion[:-1], targets shifted by one: `sample_datums`) and ONE Engine.forward (DatumEngine's
forward, "cross_entropy": rl/step.py, the same code path, no second implementation) per model or version of the
call scores them, over that model's prompts in call order, each prompt's samples in sample order, under the same
weights that sampled them (the same model name or version id in the slot: `using`, a full-parameter version's
weights swapped in once for both the sampling and the scoring). Its outputs replace the sampled tokens' log-probs
and, where asked, the prompt's (read from the prompt's first sample's datum). Top-k log-probs
(topk_prompt_logprobs, topk_sample_logprobs) stay the decode model's: the fused head does not materialise the
logits whose top-k they are.

Where "bit for bit" holds: the returned log-probs equal Engine.forward and forward_backward over the same datums
in the same order (the same plan, rows, kernels: rl/pack.py), on every rank count. Another grouping (a loop that
drops or reorders datums before its forward_backward) places a datum at another column of another row: under
sampling.logprobs=trainer the Engine's document-masked attention is then varlen where compute.doc_attention=auto
(Engine.doc_kernel), whose result for a document does not depend on its place in the row, where flex (auto's
choice otherwise) does (both measured against the same datums reversed and halved: benchmarks/README.md#logprob-gap).
An explicit compute.doc_attention is kept. On the CPU in fp32 the gap is
rounding of fp32 (~1e-6) either way.

What it costs: one no-grad forward over the samples (prompt + completion tokens), and the kept Sampler is dropped
before it (the pass's activations need its memory; the next sample call builds its pool and graphs again) unless
sampling.keep_kv. A sample longer than the trainer's micro-batch (train.micro_batch_tokens) cannot be one datum:
such a prompt (prompt + max_tokens - 1 tokens) is refused before anything decodes, one line naming the fix.

Collectives: every rank calls Engine.sample with the same arguments and gets the same results (its all-gather), so
every rank builds the same datums and makes the same Engine.forward calls in the same order; the refusals here are
decided from the arguments alone (no collective).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shardfit.engine.registry import BASE
from shardfit.engine.sample_run import per_prompt
from shardfit.errors import ShardfitError
from shardfit.rl.datum import Datum, make_datum

LOGPROBS = ("decode", "trainer")
# Engine.sample's options given one per prompt (a list) or one for all, and their defaults
_PER_PROMPT = {"model": None, "version": None, "num_samples": 1, "prompt_logprobs": False, "topk_prompt_logprobs": 0,
               "topk_sample_logprobs": 0}


def logprobs_mode(engine, logprobs: str | None) -> str:
    """The call's setting: `logprobs`, else the config's sampling.logprobs; one line for another value."""
    mode = engine.cfg.sampling.logprobs if logprobs is None else logprobs
    if mode not in LOGPROBS:
        raise ShardfitError(f"logprobs={mode!r} is not known", where="sampling.logprobs",
                            fix="use 'decode' (the sampler's own) or 'trainer' (Engine.forward over the samples)")
    return mode


def sample_datums(prompt: list[int], result) -> list[Datum | None]:
    """The datums an RL loop builds from one prompt's SampleResult, one per sample in order: tokens prompt +
    completion[:-1] [L], target_tokens shifted by one [L], L = len(prompt) + len(completion) - 1; None for a sample
    with no token to score (a one-token prompt and an empty completion)."""
    out: list[Datum | None] = []
    for s in result.samples:
        seq = list(prompt) + list(s.tokens)
        out.append(make_datum(seq[:-1], target_tokens=seq[1:]) if len(seq) > 1 else None)
    return out


def sample_scored_by_trainer(engine, forward: Callable[[list[Datum], str | None], list[np.ndarray]],
                             prompts: list, params, *, refused: str = "raise", **options) -> list:
    """Engine.sample(prompts, params, refused=refused, **options), then each result's log-probs replaced by
    `forward(datums, name)`'s (the per-datum [L] log-probs of DatumEngine.forward with `name` in the slot); see the
    module docstring. Refused prompts come back (or raise) as Engine.sample's do."""
    prompts, each, each_params, errors, names = _prepared(engine, prompts, params, options)
    if errors and refused == "raise":
        raise errors[min(errors)]
    n = len(prompts)
    keep = [i for i in range(n) if i not in errors]
    back = engine.models.current
    try:
        full = {names[i] for i in keep}
        if not engine.models.lora and len(full) == 1:
            # a full-parameter version swapped in once, for the sampling (Engine.sample then leaves it) and the scoring
            engine.using(full.pop())
        got = engine.sample([prompts[i] for i in keep], [each_params[i] for i in keep], refused=refused,
                            **{k: [v[i] for i in keep] for k, v in each.items()}, **options) if keep else []
        out: list = [errors.get(i) for i in range(n)]
        for i, r in zip(keep, got):
            out[i] = r
        _rescore(out, prompts, names, forward)
    finally:
        _restore(engine, back)
    return out


def _prepared(engine, prompts: list, params, options: dict) -> tuple:
    """(prompts as ints, the per-prompt options popped from `options` as lists, params per prompt, the prompts too
    long to score {index: error}, each prompt's scored name)."""
    prompts = [[int(t) for t in p] for p in prompts]
    n = len(prompts)
    each = {k: per_prompt(options.pop(k, default), n, k) for k, default in _PER_PROMPT.items()}
    each_params = per_prompt(params, n, "params")
    errors = _too_long(prompts, each_params, engine.datum_budget())
    names = [_scored_name(engine, each["model"][i], each["version"][i]) for i in range(n)]
    return prompts, each, each_params, errors, names


class ScoredRun:
    """Engine.sample_run (engine/sample_run.py) under sampling.logprobs=trainer, the same calls: requests join and
    decode as in `run`, and their log-probs are the trainer's, computed at the run's END: `collect` returns nothing
    and `close` ends the run (its Sampler dropped or kept first: the forward's activations need the memory) and then
    scores every request of the run, one forward per model or version as sample_scored_by_trainer does, and returns
    them all. (Scored as each ends instead, every forward would meet the Sampler's KV pool in memory.)"""

    answers_at_end = True

    def __init__(self, engine, forward: Callable[[list[Datum], str | None], list[np.ndarray]], run):
        self.engine, self.forward, self.run = engine, forward, run
        self.back = engine.models.current
        self._asked: dict[int, tuple[list[int], str]] = {}  # ticket -> (prompt, its scored name)
        self._done: list[tuple[int, object]] = []

    def submit(self, prompts: list, params, **options) -> list:
        """SampleRun.submit's, a prompt too long to score refused alone first (_too_long)."""
        prompts, each, each_params, errors, names = _prepared(self.engine, prompts, params, options)
        keep = [i for i in range(len(prompts)) if i not in errors]
        got = self.run.submit([prompts[i] for i in keep], [each_params[i] for i in keep],
                              **{k: [v[i] for i in keep] for k, v in each.items()}) if keep else []
        out: list = [errors.get(i) for i in range(len(prompts))]
        for i, t in zip(keep, got):
            out[i] = t
            if isinstance(t, int):
                self._asked[t] = (prompts[i], names[i])
        return out

    def step(self, steps: int | None = None) -> None:
        self.run.step(steps)

    def collect(self, failed: bool = False) -> list:
        self._done += self.run.collect(failed)
        return []

    @property
    def busy(self) -> bool:
        return self.run.busy

    @property
    def rows(self) -> int:
        return self.run.rows

    def close(self, failed: bool = False) -> list[tuple[int, object]]:
        """End the run, then score what it sampled; (ticket, SampleResult) of every request collected (none when
        the run `failed`)."""
        self._done += self.run.collect()
        self.run.close(failed)
        # in submission order: the one forward over the same datums as Engine.sample's in the same order would score
        done, self._done = ([], []) if failed else (sorted(self._done, key=lambda d: d[0]), [])
        try:
            _rescore([r for _, r in done], [self._asked[t][0] for t, _ in done], [self._asked[t][1] for t, _ in done],
                     self.forward)
        finally:
            _restore(self.engine, self.back)
        return done


def _scored_name(engine, model, version) -> str:
    """What a prompt sampled, as a name `using` takes: its version, else its model, else the one in the slot now
    (Engine.sample's _sample_key resolves the same arguments to the same weights)."""
    if version is not None:
        return version
    return model if model is not None else engine.models.current


def _too_long(prompts: list[list[int]], params: list, budget: int) -> dict[int, ShardfitError]:
    """Prompts whose longest sample (prompt + max_tokens - 1 tokens as a datum) would not fit the trainer's row."""
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        longest = len(p) + int(sp.max_tokens) - 1
        if longest > budget:
            out[i] = ShardfitError(
                f"a sample of this prompt is up to {longest:,} tokens as a datum (prompt {len(p):,} + max_tokens "
                f"{sp.max_tokens:,} - 1), more than the trainer's micro-batch of {budget:,}: sampling.logprobs=trainer "
                "scores each sample in one row", where="sampling_params.max_tokens",
                fix=f"raise train.micro_batch_tokens to at least {longest}, ask for fewer tokens, or set "
                "sampling.logprobs=decode")
    return out


def _rescore(results: list, prompts: list[list[int]], names: list[str],
             forward: Callable[[list[Datum], str | None], list[np.ndarray]]) -> None:
    """One forward per name, in order of first appearance, over its prompts' sample datums; results updated."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        if not isinstance(r, BaseException):
            groups.setdefault(names[i], []).append(i)
    for name, members in groups.items():
        datums, where = [], []  # where: (prompt index, sample index) of each datum
        for i in members:
            for j, d in enumerate(sample_datums(prompts[i], results[i])):
                if d is not None:
                    datums.append(d)
                    where.append((i, j))
        if not datums:
            continue
        first: set[int] = set()
        for (i, j), lp in zip(where, forward(datums, name)):
            P = len(prompts[i])
            s = results[i].samples[j]
            s.logprobs = [float(x) for x in lp[P - 1:]]  # the completion's tokens: targets P-1 .. of the datum
            if i not in first:
                first.add(i)
                if results[i].prompt_logprobs is not None:  # None for the first token (no context), then prompt[1:]
                    results[i].prompt_logprobs = [None] + [float(x) for x in lp[:P - 1]]


def _restore(engine, back: str) -> None:
    """The slot's model as before the call (the scoring put each scored name in it), where that is still held."""
    reg = engine.models
    if reg.current != back and (back in reg.models or back in reg.versions or (back == BASE and reg.lora)):
        engine.using(back)
