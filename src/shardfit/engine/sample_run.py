"""SampleRun: the streaming form of Engine.sample (issue 36 item 2): requests join the running decode batch.

    run = engine.sample_run(tokenizer=tok)
    tickets = run.submit(prompts, params, num_samples=4, model="policy")  # per prompt: a ticket, its refusal, or None
    while run.busy:
        run.step()                               # a chunk of decode steps (the Sampler's check_every), outputs read
        for ticket, result in run.collect():     # the requests whose rows ended, as Engine.sample returns them
            ...
        run.submit(more_prompts, params)         # they join the decode batch between chunks
    run.close()

One run is one Sampler (the Engine's kept one, engine/sampling.py `_sampler`: the same decode model, bank and
options as Engine.sample's) that requests are submitted into between steps; each request is collected when its own
rows end, whatever still decodes beside it. Seeded requests get what they get alone (the Sampler's noise is a
function of the seed, sample, position and token: sampling/sample.py).

What may join a run: a request of any model or version whose adapter is in a bank slot, or can be loaded into one
that no request of the run holds (the run's models and versions keep their slots until it closes). A request that
needs a slot when every slot is the run's, or without LoRA other weights than the run's (a full-parameter version is
swapped into the model for the whole run), gets None from submit: it cannot join this run; submit it to the next one.
The bank never grows during a run (a bigger bank is a new Sampler: engine/sampling.py's _sampling_state).
No training call on the Engine while a run is open: on one rank the decode model is a view of the trained weights
(a full-parameter step would change them under the running rows) and the RL API drops the kept Sampler before a
pass; serve's worker ends a run's intake before a training command (serve/sample_joining.py).

On N ranks (issue 36 item 5) every rank makes the same calls in the same order (serve/sample_joining.py: rank 0
broadcasts what joins): `submit` prepares every request on every rank (prepare's collectives: the verdicts'
all-reduce, adapters loaded by all-gathers) and numbers the good ones with a run-wide counter, the same on every
rank; request t decodes on rank t % world alone (data-parallel: no collective inside a decode step; a rank with no
share steps as a no-op). `collect` is then the exchange (engine/sample_results.py `exchange`: one all-gather of
each rank's counts, then, when one ended, one of the packed results), and returns every rank's ended requests on
every rank; `busy` and `rows` count the requests of the whole run not collected yet, the same on every rank.
A rank whose `step` failed calls collect(failed=True): every other rank raises RankFailed from the same exchange, so
that none waits for it in a collective (a failure inside `submit`'s collectives on one rank only still leaves the
others waiting there, as Engine.sample's would). Engine.sample is this class's one-shot form on every rank count:
`prepare` (the decode model, the slots, the checks; on N ranks their verdicts agreed in one all-reduce), `add` each
of this rank's requests, `wait`.
"""

from __future__ import annotations

import torch

from shardfit.engine.sample_results import exchange
from shardfit.errors import ShardfitError


def per_prompt(value, n: int, name: str) -> list:
    """`value` as one entry per prompt: a list of n as is (one line if it has another length), else n copies."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ShardfitError(f"{name} has {len(value)} entries for {n} prompts", where=name,
                                fix="give one per prompt, or one for all")
        return list(value)
    return [value] * n


class SampleRun:
    """A run of the Engine's Sampler that requests join between steps (module docstring). Engine.sample_run makes
    one; Engine._sample uses prepare / add / wait."""

    answers_at_end = False  # collect answers each request as it ends (rl/trainer_logprobs.py's ScoredRun: at close)

    def __init__(self, engine, tokenizer=None, sampler_options: dict | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.options = dict(sampler_options or {})
        self.state = self.sampler = None  # the SamplingState and the Sampler, from the first prepare on
        self.full: str | None = None  # without LoRA: the weights (model or version) the run samples, swapped in
        self.keys: set[tuple] = set()  # the adapters the run's requests use: their bank slots are the run's
        self.back = engine.models.current  # the slot's model before the run (close puts it back)
        self._handles: dict[int, object] = {}  # ticket -> SampleHandle of this rank's, while not collected
        self._asked: dict[int, object] = {}  # ticket -> SampleRequest of every rank's, submitted and not collected
        self._tickets = 0  # the run-wide counter: submit's tickets are the same on every rank

    # ------------------------------------------------------------------ the streaming form
    def submit(self, prompts: list[list[int]], params, **options) -> list:
        """Requests into the running batch (Engine.sample's arguments but tokenizer and refused); per prompt a
        ticket (collect returns its result under it), the ShardfitError that refuses it alone, or None: it cannot
        join this run (its weights need a bank slot that the run's requests hold, or other full-parameter weights;
        submit it to the next run). On N ranks every rank submits the same requests; ticket t decodes on rank
        t % world (module docstring)."""
        reqs, errors, later = self.prepare(prompts, params, **options)
        rank, world = self.engine.dist.rank, self.engine.dist.world_size
        out: list = []
        for i, r in enumerate(reqs):
            if i in errors or i in later:
                out.append(errors.get(i))
                continue
            t, self._tickets = self._tickets, self._tickets + 1
            self._asked[t] = r
            if t % world == rank:
                self.add(r, t)
            out.append(t)
        return out

    def step(self, steps: int | None = None) -> None:
        """Up to `steps` of the Sampler's steps (default its check_every), stopping once it has read its outputs
        back (its flush: the requests whose rows ended are answered), or when nothing is left to decode."""
        s = self.sampler
        if s is None:
            return
        for _ in range(steps or s.check_every):
            if s.sched.idle:  # every row ended: what is left to answer is in the outputs not read yet
                s.drain(list(self._handles.values()))
                return
            s.step()
            if not s.pending:  # it has just read its outputs back
                return

    def collect(self, failed: bool = False) -> list[tuple[int, object]]:
        """(ticket, SampleResult) of each request whose rows have ended since the last collect, in ticket order; on
        N ranks every rank's, on every rank (the exchange: a collective, every rank calls it after each step).
        failed: this rank's step raised (N ranks: the others raise RankFailed from here; this one gets [])."""
        done = [] if failed else [t for t, h in self._handles.items() if h.done]
        out = [(t, self._handles.pop(t).result) for t in done]
        if self.engine.dist.world_size > 1:
            out = exchange(self._asked, out, failed, self.engine.device)
        for t, _ in out:
            self._asked.pop(t, None)
        return out

    @property
    def busy(self) -> bool:
        """Whether a request submitted (on N ranks: on any rank) is not collected yet."""
        return bool(self._asked)

    @property
    def rows(self) -> int:
        """The samples of the requests not collected yet (the rows in flight, or waiting for their prefill; on N
        ranks of every rank)."""
        return sum(r.num_samples for r in self._asked.values())

    def close(self, failed: bool = False) -> list:
        """End the run: the Sampler is kept for the next call unless requests are left in it or the run `failed`
        (dropped, so that what it held never meets the next call's requests), and without LoRA the slot's model put
        back. Returns the results it still holds: none here (collect gave them), ScoredRun's all."""
        if self._handles or failed:
            self._handles, self._asked = {}, {}
            self.engine.release_sampler(training=False)
        reg = self.engine.models
        if not reg.lora and reg.current != self.back:
            self.engine.using(self.back)
        return []

    # ------------------------------------------------------------------ what Engine.sample is made of
    def prepare(self, prompts: list[list[int]], params, *, model=None, version=None, num_samples=1,
                prompt_logprobs=False, topk_prompt_logprobs=0, topk_sample_logprobs=0, refused: str = "return"):
        """(SampleRequests, {prompt index: its ShardfitError}, indices that cannot join this run): each prompt's
        weights resolved, the run's decode model and Sampler made on the first call, adapters loaded into free bank
        slots, every request checked (on N ranks the verdicts agreed in one all-reduce: _check_requests).
        refused="raise": an unknown model or version raises its line here (Engine.sample's refused)."""
        from shardfit.sampling.params import SampleRequest

        e, n = self.engine, len(prompts)
        each = {name: per_prompt(value, n, name) for name, value in (
            ("params", params), ("num_samples", num_samples), ("prompt_logprobs", prompt_logprobs),
            ("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs))}
        errors: dict[int, ShardfitError] | None = {} if refused == "return" else None
        keys, full = e._sample_keys(per_prompt(model, n, "model"), per_prompt(version, n, "version"), errors)
        errors = errors or {}
        later: set[int] = set()
        if full is not None and self.sampler is not None and full != self.full:
            later = {i for i in range(n) if i not in errors}  # other full-parameter weights: the next run
        elif full is not None and self.sampler is None:
            e.using(full)  # its one-line refusal for what is not held; a version's weights swapped in
            self.full = full
        if self.sampler is None:
            e.finish()  # the weights after the last optim_step, every parameter its shard (no gathered copy)
            if e.device.type == "cuda" and e._sampling_sampler is None:
                torch.cuda.empty_cache()  # the training step's cached blocks: free memory for the model, the pool
            self.state = e._sampling_state(len({k for i, k in enumerate(keys) if k is not None and i not in errors}))
        later |= self._no_slot(keys, errors, later)
        ok = [keys[i] for i in range(n) if i not in errors and i not in later]
        slot_of = e._load_slots(self.state, ok, pinned=self.keys)
        self.keys |= {k for k in ok if k is not None}
        reqs = [None if i in later else
                SampleRequest([t.item() if hasattr(t, "item") else t for t in p], each["params"][i],
                              each["num_samples"][i], slot_of.get(keys[i], -1), each["prompt_logprobs"][i],
                              each["topk_prompt_logprobs"][i], each["topk_sample_logprobs"][i])
                for i, p in enumerate(prompts)]
        broke = None
        if self.sampler is None:
            try:  # the KV pool is sized from this GPU's free memory: it may fail (out of memory) on one rank only
                self.sampler = e._sampler(self.state, self.tokenizer, self.options)
            except Exception as err:  # noqa: BLE001 - raised on every rank alike from the verdicts' all-reduce
                broke = err
        e._check_requests(self.sampler, reqs, errors, broke)
        return reqs, errors, later

    def _no_slot(self, keys: list, errors: dict, later: set) -> set[int]:
        """The prompts whose adapter is not the run's and finds no bank slot beside the run's (first-seen order)."""
        held, out = set(self.keys), set()
        for i, k in enumerate(keys):
            if k is None or i in errors or i in later or k in held:
                continue
            if len(held) < self.state.capacity:
                held.add(k)
            else:
                out.add(i)
        return out

    def add(self, req, ticket: int | None = None) -> int:
        """A prepared request into this rank's Sampler (it decodes from the next step); its ticket (submit's, or
        the next of the counter)."""
        handle = self.sampler.submit(req)
        if ticket is None:
            ticket, self._tickets = self._tickets, self._tickets + 1
        self._handles[ticket] = handle
        return ticket

    def wait(self, tickets: list[int]) -> list:
        """Step until every one of `tickets` is answered; their SampleResults in that order (collected)."""
        self.sampler.wait([self._handles[t] for t in tickets])
        return [self._handles.pop(t).result for t in tickets]
