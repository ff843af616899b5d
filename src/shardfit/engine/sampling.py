"""Engine.sample: rollouts from the trainer's own weights in the same process, with no weight sync (issue 36).

    results = engine.sample(prompts, SamplingParams(max_tokens=256, temperature=1.0), num_samples=16,
                            model="policy")     # or version=engine.freeze("policy"), or per prompt: lists

The decode model is a plain CausalLM over the Engine's weights (sampling/source.py): on one rank views of the
sharded model's storage (no copy: the decode model is free and follows every optimizer step), on N ranks each
parameter gathered once (one all-gather per tensor) and kept: a LoRA model's base is frozen, so never again; a
full-parameter model's after each optim_step (the Engine's weights epoch). Its LoRA layers hold a bank of adapter
slots (sampling/lora_bank.py): each distinct model or version a call asks for is loaded into a slot (its adapters
read from the registry's slot: a swap, and on N ranks one all-gather per adapter tensor), and kept there for later
calls while nothing changes it (a version never; a live model until the next optim_step). Rows of every model and
version of the call decode in one continuous batch (sampling/'s Sampler). The log-probs returned are the decode
model's; `shardfit.Engine`'s sample (the RL API, rl/step.py) replaces them with the trainer's forward over the
samples under sampling.logprobs=trainer (rl/trainer_logprobs.py), serve's calls included.

The Sampler (its paged KV pool and CUDA graphs) is kept between calls while no training command needs the memory:
the next call with the same decode model, bank and options reuses it (no pool allocation, no graph capture: on CUDA
a graph per batch-size bucket is captured once, not once per call), and the RL API (rl/step.py) drops it before
every forward, forward_backward and optim_step (release_sampler), so that the pass has its activations' memory
again. What that costs: the first sample call after a training command allocates the pool again (sized from the
memory free after the weights: sampling.kv_fraction of it, the allocator's cache emptied first) and captures its
graphs again (a few decode steps' time per bucket). With sampling.keep_kv the Sampler is kept across training
commands too: nothing is rebuilt, but the pool's memory is not the training step's (lower sampling.kv_fraction so
that both fit). A call with other options (kv_blocks, max_rows, ...) or a grown bank builds a new Sampler.

Requests joining a running batch: Engine.sample_run (engine/sample_run.py's SampleRun, on any rank count) is the
streaming form, and sample is its one-shot form (prepare, add, wait: one implementation).

Several ranks: every rank is given the same prompts (as every Engine call); the i-th request not refused decodes on
rank i % world (data-parallel, no collective per token), and the results travel once at the end: each rank's
results packed into a float64 vector whose length every rank computes from the requests alone (tokens and fp32
log-probs are exact in float64), padded to the longest rank's, one all-gather (all_gather_rows). No pickling.
Collectives of a call on N ranks, the same on every rank in this order: building the decode model (the first call;
a full-parameter model's refresh after a step) one all-reduce of the room on CUDA and one all-gather per parameter;
per adapter loaded into a slot, one all-gather per adapter tensor; one all-reduce of the requests' verdicts ([n]:
a request refused on any rank is refused on all, raised or, with refused="return", left out alone); one all-gather
of the results of the requests not refused. On one rank, none.
"""

from __future__ import annotations

import torch

from shardfit.engine.sample_results import gather_results
from shardfit.engine.sample_run import SampleRun
from shardfit.errors import ShardfitError
from shardfit.sampling.lora_bank import BANK_SLOTS


class SamplingState:
    """What Engine.sample keeps between calls: the decode model, its bank and which adapter is in which slot."""

    def __init__(self, model, bank, epoch: int, capacity: int):
        self.model, self.bank, self.epoch, self.capacity = model, bank, epoch, capacity
        self.slots: dict[tuple, int] = {}  # (kind, name, epoch) -> bank slot


class EngineSampling:
    """Mixed into Engine (engine/engine.py): needs its cfg, model, dist, device, models (the registry), using(),
    finish() and weights_epoch."""

    _sampling: SamplingState | None = None

    def sample(self, prompts: list[list[int]], params, **kwargs) -> list:
        """_sample's (below). A full-parameter version is swapped into the model for the call and the weights that
        were there are swapped back after it (a copy of the shards: the host's fp32 values), so that the next
        training call trains what it trained before."""
        back = self.models.current
        try:
            return self._sample(prompts, params, **kwargs)
        finally:
            if not self.models.lora and self.models.current != back:
                self.using(back)

    def _sample(self, prompts: list[list[int]], params, *, model=None, version=None, num_samples=1,
                prompt_logprobs=False, topk_prompt_logprobs=0, topk_sample_logprobs=0, tokenizer=None,
                refused: str = "raise", **sampler_options) -> list:
        """num_samples continuations of each prompt (list of token ids) under `params` (a SamplingParams), from
        `model` (a LoRA model's name: its live adapters; None: the one in the slot now) or `version` (a frozen
        version's id, or registry.BASE: the base alone); each of these (and num_samples, prompt_logprobs, the top-k
        widths) may be a list, one per prompt. Returns a SampleResult per prompt, in order. Every rank calls it with
        the same arguments. refused="raise": a prompt the Engine or the Sampler refuses raises its one line before
        anything decodes; "return": its entry is that ShardfitError instead and the other prompts decode as if it
        had not been given (serve's batches of requests: each fails alone).
        sampler_options: the Sampler's (kv_fraction, kv_blocks, block_size, max_rows, prefill_chunk, attention,
        cuda_graphs); the Sampler is kept for the next call with the same options (_sampler)."""
        if refused not in ("raise", "return"):
            raise ValueError(f"refused={refused!r}")  # a caller's bug, not input
        run = SampleRun(self, tokenizer, sampler_options)
        reqs, errors, _ = run.prepare(prompts, params, model=model, version=version, num_samples=num_samples,
                                      prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs,
                                      topk_sample_logprobs=topk_sample_logprobs, refused=refused)
        if refused == "raise" and errors:
            raise errors[min(errors)]
        n = len(prompts)
        good = [i for i in range(n) if i not in errors]
        rank, world = self.dist.rank, self.dist.world_size
        mine = [i for j, i in enumerate(good) if j % world == rank]
        try:
            done = run.wait([run.add(reqs[i]) for i in mine])
        except BaseException:
            self.release_sampler(training=False)  # what it held half-decoded must not meet the next call's requests
            raise
        if world > 1:
            done = gather_results([reqs[i] for i in good], dict(zip(range(rank, len(good), world), done)), rank,
                                   world, self.device)
            mine = good
        out: list = [errors.get(i) for i in range(n)]
        for i, res in zip(mine, done):
            out[i] = res
        return out

    def sample_run(self, tokenizer=None, **sampler_options):
        """The streaming form of sample: a SampleRun (engine/sample_run.py) that requests are submitted into
        between decode steps and collected from as their rows end (on N ranks every rank makes the same calls).
        tokenizer and sampler_options as sample's. Close it before the next training call."""
        return SampleRun(self, tokenizer, sampler_options)

    # ------------------------------------------------------------------ the Sampler kept between calls
    _sampling_sampler = None  # (the Sampler, what it was built for) while kept

    def _sampler(self, state: SamplingState, tokenizer, options: dict):
        """The Sampler of the last call when it was built for the same decode model, bank and options (its KV pool
        and CUDA graphs reused: no allocation or capture), else a new one (the old one dropped first)."""
        from shardfit.sampling.runner import Sampler

        options = {"kv_fraction": self.cfg.sampling.kv_fraction, "prefill_chunk": self.cfg.sampling.prefill_chunk,
                   **options}
        key = (id(state.model), id(state.bank), tuple(sorted(options.items())))
        kept = self._sampling_sampler
        if kept is not None and kept[1] == key:
            kept[0].tokenizer = tokenizer  # stop strings are decoded with this call's
            return kept[0]
        # this frame's reference too: while `kept` held the old Sampler, its pool stayed allocated and the new
        # pool was sized from what was left (a third of it on the H100: benchmarks/README.md#sampler-s21, item 4)
        del kept
        self.release_sampler(training=False)  # its pool first: the new one is sized from the memory then free
        sampler = Sampler(state.model, bank=state.bank, tokenizer=tokenizer, **options)
        self._sampling_sampler = (sampler, key)
        return sampler

    def release_sampler(self, training: bool = True) -> None:
        """Drop the kept Sampler: its KV pool and its CUDA graphs' pool go back to the allocator (and on CUDA to the
        device: the training step's activations need them). training=True (the RL API calls it before every forward,
        forward_backward and optim_step): kept instead when sampling.keep_kv says so."""
        if self._sampling_sampler is None or (training and self.cfg.sampling.keep_kv):
            return
        self._sampling_sampler = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_requests(self, sampler, reqs: list, errors: dict, broke: Exception | None = None) -> None:
        """Every request not refused yet checked on every rank (one line naming the field, into `errors`), and on N
        ranks the verdicts agreed in one all-reduce of a [n + 1] vector before any rank decodes: a rank never waits
        in the results' gather for one that refused (their KV pools, sized from each GPU's free memory, may
        differ). `broke`: this rank could not build its Sampler (sample_run.prepare); the last element tells every
        rank, and every rank raises (the one that broke its own error, the others RankFailed) from the same
        collective instead of the others waiting in the next one."""
        from shardfit.engine.sample_results import RankFailed

        for i, r in enumerate(reqs):
            if broke is None and i not in errors and r is not None:  # None: waits for the next run (sample_run)
                try:
                    sampler.check(r)
                except ShardfitError as e:
                    errors[i] = e
        if self.dist.world_size > 1:
            bad = torch.tensor([float(i in errors) for i in range(len(reqs))] + [float(broke is not None)],
                               device=self.device)
            torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
            if bad[-1].item() and broke is None:
                raise RankFailed("another rank could not build its sampler (see its log): the run ends on every rank")
            for i in bad[:-1].nonzero().flatten().tolist():
                errors.setdefault(i, ShardfitError(
                    "another rank refused this request (its KV cache holds fewer tokens)", where="Engine.sample",
                    fix="ask for fewer new tokens, or give kv_blocks"))
        if broke is not None:
            raise broke

    # ------------------------------------------------------------------ the decode model and its slots
    def _sample_keys(self, models: list, versions: list, errors: dict | None = None) -> tuple[list, str | None]:
        """(Per prompt: what its rows decode with, as a cache key, None: the base alone (slot -1); without LoRA the
        one weights the call samples, for `using`, else None). A prompt that names what is not held raises its one
        line, or with `errors` (prompt index -> error) is recorded there."""
        out: list[tuple | None] = []
        full: set = set()
        for i, (m, v) in enumerate(zip(models, versions)):
            try:
                out.append(self._sample_key(m, v, full))
            except ShardfitError as e:
                if errors is None:
                    raise
                errors[i] = e
                out.append(None)
        if len(full) > 1:
            raise ShardfitError(f"one call samples {sorted(map(str, full))}: a full-parameter model's weights and "
                                "versions are swapped into the model one at a time", where="Engine.sample",
                                fix="sample each version (and the live weights) in a call of its own")
        return out, (full.pop() if full else None)

    def _sample_key(self, m, v, full: set) -> tuple | None:
        """One prompt's key (_sample_keys); a full-parameter model's name goes into `full` (key None)."""
        from shardfit.engine.registry import BASE

        reg = self.models
        if v == BASE:
            v, m = None, BASE
        if v is not None and m is not None:
            raise ShardfitError("a prompt names both a model and a version", where="version",
                                fix="give model= (its live weights) or version= (frozen), not both")
        name = v if v is not None else m
        if not reg.lora:  # full-parameter: the live weights or one frozen version, swapped into the model
            full.add(name if name is not None else reg.current)
            return None
        if v is not None:
            if v not in reg.versions:
                reg.release(v)  # its one line: not held (freed, or never saved)
            return ("version", v, 0)
        name = name if name is not None else reg.current
        if name == BASE:
            return None
        if name not in reg.models:
            if name in reg.versions:
                return ("version", name, 0)
            raise reg._unknown(name)
        return ("model", name, self.weights_epoch)

    def _sampling_state(self, needed: int) -> SamplingState:
        """The decode model (built once; a full-parameter model's copy refreshed after optim_step) with a bank of
        at least `needed` slots (a call that needs more gets a new bank, twice as large, on the same decode model)."""
        from shardfit.parallel.parallelize import mixed_precision
        from shardfit.sampling.lora_bank import LoRABank
        from shardfit.sampling.source import decode_model, gathers, refresh

        st = self._sampling
        dtype = mixed_precision(self.cfg.compute, self.device).param_dtype  # the training forward's compute dtype
        if st is None:
            plain, bank, _ = decode_model(self.model, dtype, capacity=max(BANK_SLOTS, needed),
                                          live_adapters=False)
            # the weights it holds: (epoch, what is in the slot): a full-parameter version is swapped in by copy
            held = (self.weights_epoch, self.models.current)
            st = self._sampling = SamplingState(plain, bank, held, max(BANK_SLOTS, needed))
        elif st.bank is not None and st.capacity < needed:  # a bigger bank on the same decode model, empty
            self.release_sampler(training=False)  # its KV pool (built for the old bank) before the bank's memory
            old = st.bank
            st.capacity = max(2 * st.capacity, needed)
            st.bank = LoRABank(st.model, list(old.targets), st.capacity, old.rank, old.dtype, old.device)
            st.slots = {}
        elif st.bank is None and st.epoch != (self.weights_epoch, self.models.current):
            if gathers(self.model, dtype):
                refresh(st.model, self.model)  # full-parameter weights changed: copied in place
            st.epoch = (self.weights_epoch, self.models.current)
        return st

    def _load_slots(self, st: SamplingState, keys: list[tuple | None], pinned: set = frozenset()) -> dict[tuple, int]:
        """Each distinct key of the call in a bank slot: kept ones where they are, the others loaded (the
        registry's slot swapped to them and back; every rank the same loads in the same order). pinned: keys whose
        slots are not to be taken (a SampleRun's requests decode with them)."""
        from shardfit.sampling.source import adapter_scale, adapter_tensors

        wanted = list(dict.fromkeys(k for k in keys if k is not None))  # first-seen order: the same on every rank
        missing = [k for k in wanted if k not in st.slots]
        if missing:
            # slots to fill: empty ones, then those of adapters that can never be asked for again (a live model's
            # before its last step, a freed version), then the least recently loaded of the others
            dead = [k for k in st.slots if k not in pinned and ((k[0] == "model" and k[2] != self.weights_epoch)
                    or (k[0] == "version" and k[1] not in self.models.versions))]
            others = [k for k in st.slots if k not in wanted and k not in dead and k not in pinned]
            empty = [s for s in range(st.capacity) if s not in st.slots.values()]
            free = empty + [st.slots[k] for k in dead + others]
            back = self.models.current
            scale = adapter_scale(self.model)
            for k in missing:
                slot = free.pop(0)
                st.slots = {old: s for old, s in st.slots.items() if s != slot}
                self.using(k[1])
                st.bank.load(slot, adapter_tensors(self.model), scale)
                st.slots[k] = slot
            if back:
                self.using(back)
        return {k: st.slots[k] for k in wanted}
