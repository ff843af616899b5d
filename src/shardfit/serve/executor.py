"""One command on the Engine, the same call on every rank; rank 0 encodes the answer (a sample_batch's: one per
request, commands.py).

The RL API (rl/step.py DatumEngine): forward / forward_backward(datums, loss_fn, loss_fn_config) -> outputs +
metrics, optim_step(AdamParams) -> metrics; the Engine's save_state / load_state(path, optimizer) and model (the
sharded CausalLM, for sampling). The Engine's registry (engine/registry.py) holds the models and versions: with LoRA
each command runs on its own model, `engine.using(model_id)` first (a swap of adapter shards only when another model
was in the slot); without LoRA every training command runs on its one model ("default"). A sampling session's version
id is kept here, on every rank alike (`versions`: the same commands make the same ids), and a sample runs under
`using(version)`: without LoRA the version's copy of every weight is swapped in, the model's own waiting on the host
until its next command.
forward_backward requests of several LoRA models that are ready together (serve/ordering.py's take_together: each
model's oldest ready request, the same loss) run as ONE pass (`combine` on rank 0 makes a forward_backward_many
command; engine/multi_model.py), each request answered with its own model's result; so do forward requests (the
SDK's `forward`: reference or old-policy log-probs), in passes of their own: one pass is of one kind, forward-only or
forward_backward, never both (a forward's pass has no backward to share, and a model's oldest ready request is the
only one that may join, so neither kind overtakes the other within a model). A pass refused as a whole (bad input of
one request) is run again request by request, so that each gets its own answer.
On one rank sample requests do not come as sample_batch commands: the loop runs them as sample runs that later
requests join (serve/sample_joining.py, with sample_member, sampling_engine and sample_arguments from here).
Paths in a command were resolved inside the run directory by rank 0
(serve.security) before the broadcast. Timings go back with the answer: fwd/bwd metrics carry the server's queue wait
and compute time as "server_queue_s:max" and "server_compute_s:sum" (the SDK sums or maxes them over chunks).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from shardfit.errors import ShardfitError
from shardfit.parallel.compile_watch import fallback_count
from shardfit.serve.commands import MANY, Command, datums_from_json, failure_result
from shardfit.serve.futures import Result
from shardfit.serve.protocol import encode_forward_backward, encode_sample


def metric_key(name: str) -> str:
    """A metric name as the SDK needs it: exactly one colon, 'name:reduction' (the SDK splits each key once)."""
    base, sep, red = name.rpartition(":")
    if sep and red in ("mean", "sum", "min", "max", "slack", "hash2", "unique") and ":" not in base:
        return name
    return name.replace(":", "_") + ":mean"


def _rl_types():
    from shardfit.rl import AdamParams, Datum

    return Datum, AdamParams


def _passes_of_several(engine) -> bool:
    """Whether this Engine can train several LoRA models in one pass (engine/multi_model.py's refusals)."""
    from shardfit.engine.multi_model import check_engine

    try:
        check_engine(engine)
    except ShardfitError:
        return False
    return True


def _datum_engine(engine):
    from shardfit.rl import DatumEngine

    return DatumEngine(engine)


VERSIONS_NOTED = 16  # held frozen versions first told in the log (then at twice the count told before)


class Executor:
    """execute(cmd) -> (Result, phases), a sample_batch's ({request id: Result}, phases). Rank 0's Results are the
    ones filed; the other ranks' are dropped."""

    def __init__(self, engine, *, tokenizer=None, queue_wait: Callable[[str], float] | None = None,
                 rl_types: tuple | None = None, served: dict[str, tuple] | None = None):
        self.engine = engine
        self.tokenizer = tokenizer  # rank 0: stop strings are decoded there
        self.served = served or {}  # a frozen extra model's name -> (its Engine, rank 0's tokenizer or None)
        self.queue_wait = queue_wait or (lambda rid: 0.0)
        self.Datum, self.AdamParams = rl_types or _rl_types()
        self.rl = engine if rl_types is not None else _datum_engine(engine)  # a test's fake engine speaks datums
        self.weights_version = 0  # optimizer steps and loads applied: which weights a sample came from
        self.registry = getattr(engine, "models", None)  # engine/registry.py's ModelRegistry (None: a test's fake)
        self.lora = bool(getattr(self.registry, "lora", False))
        self.versions: dict[str, str] = {}  # sampling session id -> its version id (LoRA)
        self.failed: dict[str, str] = {}  # sampling session id -> why its model_path did not load
        self.summary: dict = {}  # the registry's summary after the last command (GET /api/v1/shardfit/status)
        self.notes: list[str] = []  # lines for rank 0's log after the request that made them (take_notes)
        self._versions_told = VERSIONS_NOTED  # the count of held versions that is told next (then twice it)
        self.together = self.lora and _passes_of_several(engine)  # forward_backward of several models in one pass
        self.handlers = {"create_model": self.create_model, "forward_backward": self.forward_backward,
                         MANY: self.forward_backward_many,
                         "optim_step": self.optim_step, "save_state": self.save_state, "load_state": self.load_state,
                         "sampler_snapshot": self.sampler_snapshot, "sampler_load": self.sampler_load,
                         "release_samplers": self.release_samplers, "sample_batch": self.sample_batch}

    @property
    def rank(self) -> int:
        return self.engine.dist.rank

    def __call__(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        handler = self.handlers.get(cmd.kind)
        if handler is None:  # rank 0 only makes the kinds above: a mismatch is a bug
            raise ValueError(f"unknown command kind '{cmd.kind}'")
        try:
            return handler(cmd)
        finally:
            if self.registry is not None:
                self.summary = self.registry.summary()

    def held(self) -> dict:
        """What the Engine holds (the HTTP thread's view: a copy of plain numbers, never the Engine itself)."""
        return dict(self.summary) if self.registry is not None else {"models": 1, "versions": 0}

    def slot_name(self, model: str) -> str:
        """The registry's name of `model`: a version id or registry.BASE as is; a training model's id with LoRA, the
        one model ("default") without."""
        if self.lora or model in self.registry.versions:
            return model
        return "default"

    def use(self, model: str) -> None:
        """Put `model` (a model id, a version id, or registry.BASE) in the trained parameters' slot."""
        if self.registry is not None:
            self.engine.using(self.slot_name(model))

    def create_model(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        a = cmd.args
        if self.lora:
            self.engine.add_model(a["model_id"], a.get("seed"))  # at the base: B = 0, its own optimizer state
        return Result(json={"model_id": a["model_id"], "type": "create_model"}), {}

    def space_needed(self, cmd: Command) -> int | None:
        """About the bytes a save writes, for a full disk's message: the trained parameters (all ranks' shards),
        and with the optimizer Adam's two fp32 moments of each."""
        if cmd.kind != "save_state":
            return None
        trained = [p for p in self.engine.model.parameters() if p.requires_grad]
        weights = sum(p.numel() * p.element_size() for p in trained)
        return weights + (8 * sum(p.numel() for p in trained) if cmd.args.get("optimizer") else 0)

    def forward_backward(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        a = cmd.args
        datums = self._datums(cmd)
        self.use(cmd.model_id)
        t0 = time.perf_counter()
        call = self.rl.forward if a["forward_only"] else self.rl.forward_backward
        res = call(datums, loss_fn=a["loss_fn"], loss_fn_config=a.get("loss_fn_config") or None)
        compute = time.perf_counter() - t0
        phase = "forward" if a["forward_only"] else "forward_backward"
        return self._answer(cmd, res, compute, 1), {phase: compute}

    def _datums(self, cmd: Command) -> list:
        return [self.Datum(tokens=d.tokens, inputs=d.inputs) for d in datums_from_json(cmd.args["datums"])]

    def _answer(self, cmd: Command, res, compute: float, models: int) -> Result:
        """Rank 0: a forward(_backward) request's answer (the outputs and metrics, the server's timings and the
        number of models its pass ran: "server_pass_models:max"; functions torch.compile gave up on so far, where any:
        "server_compile_fallbacks:max"); the other ranks' is dropped."""
        if self.rank != 0:
            return Result()
        metrics = {metric_key(k): float(v) for k, v in res.metrics.items()}
        metrics["server_queue_s:max"] = self.queue_wait(cmd.request_id)
        metrics["server_compute_s:sum"] = compute
        if models > 1:
            metrics["server_pass_models:max"] = float(models)
        if fallback_count():  # compiled functions now partly eager (parallel/compile_watch.py): a client can see it
            metrics["server_compile_fallbacks:max"] = float(fallback_count())
        outputs = [{k: np.asarray(v) for k, v in out.items()} for out in res.outputs]
        return Result(proto=encode_forward_backward(outputs, metrics))

    @staticmethod
    def _loss_key(cmd: Command) -> tuple | None:
        """What must be equal for requests to share a pass: the kind (forward-only or forward_backward), the loss
        and its config; None: a command that shares none."""
        a = cmd.args
        if cmd.kind != "forward_backward":
            return None
        return bool(a.get("forward_only")), a["loss_fn"], json.dumps(a.get("loss_fn_config") or {}, sort_keys=True)

    def combine(self, first, scheduler) -> Command:
        """Rank 0: the command of the ready Pending `first`, or with other models' ready requests of the same kind
        and loss a forward_backward_many of them all (serve/ordering.py's take_together)."""
        key = self._loss_key(first.command)
        if not self.together or key is None:
            return first.command
        more = scheduler.take_together(first, lambda p: self._loss_key(p.command) == key)
        if not more:
            return first.command
        return Command(MANY, request_id=first.command.request_id,
                       args={"parts": [asdict(p.command) for p in [first, *more]]})

    def forward_backward_many(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        """forward_backward requests of several models (one each) in one pass, or forward requests (all of one
        kind: `combine`); each request its own answer."""
        parts = cmd.members()
        a = parts[0].args
        call = self.rl.forward_many if a["forward_only"] else self.rl.forward_backward_many
        t0 = time.perf_counter()
        try:
            # only a LoRA registry combines (`together`): a model id is its registry name
            res = call([(c.model_id, self._datums(c)) for c in parts], loss_fn=a["loss_fn"],
                       loss_fn_config=a.get("loss_fn_config") or None)
        except ShardfitError:  # refused before the pass (on every rank alike): each request on its own
            return Result(parts=[self._alone(c) for c in parts]), {}
        compute = time.perf_counter() - t0
        return (Result(parts=[self._answer(c, res[c.model_id], compute, len(parts)) for c in parts]),
                {"forward" if a["forward_only"] else "forward_backward": compute})

    def _alone(self, cmd: Command) -> Result:
        try:
            return self.forward_backward(cmd)[0]
        except ShardfitError as e:
            return failure_result(e, cmd, self.rank)

    def optim_step(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        self.use(cmd.model_id)
        t0 = time.perf_counter()
        metrics = self.rl.optim_step(self.AdamParams(**cmd.args["adam"]))
        took = time.perf_counter() - t0
        self.weights_version += 1
        out = {metric_key(k): float(v) for k, v in (metrics or {}).items()}
        out["server_queue_s:max"] = self.queue_wait(cmd.request_id)
        out["server_optimizer_s:sum"] = took
        return Result(json={"metrics": out}), {"optimizer": took}

    def save_state(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        a = cmd.args
        self.use(cmd.model_id)
        t0 = time.perf_counter()
        self.engine.save_state(Path(a["dir"]), optimizer=bool(a["optimizer"]))
        took = time.perf_counter() - t0
        if self.rank == 0 and a.get("meta_file"):
            from shardfit.fsutil import write_atomic

            write_atomic(a["meta_file"], a["meta"])  # the checkpoint's listing entry, once its files are complete
        return Result(json={"path": a["tinker_path"], "type": a["response_type"]}), {"save": took}

    def load_state(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        a = cmd.args
        if not Path(a["dir"]).is_dir():  # every rank sees the same filesystem here (one node, or a shared one)
            raise ShardfitError("no such checkpoint", where=a["tinker_path"],
                                fix="give a path save_state returned (tinker://RUN/weights/NAME)")
        t0 = time.perf_counter()
        if a.get("create") and self.lora:
            self.engine.add_model(a["model_id"])  # create_training_client_from_state: a new model, then its weights
        self.use(a["model_id"])
        self.engine.load_state(Path(a["dir"]), optimizer=bool(a["optimizer"]))
        self.weights_version += 1
        return (Result(json={"path": a["tinker_path"], "model_id": a["model_id"], "type": "load_weights"}),
                {"load": time.perf_counter() - t0})

    def sampler_snapshot(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        """An unnamed save_weights_for_sampler, in order with the model's other requests: a version frozen now
        (`freeze`: LoRA adapters, or without LoRA a copy of every weight), or nothing (kind="inflight": the session
        reads the model's live weights)."""
        sid = cmd.args["sampling_session_id"]
        if cmd.args.get("freeze") and self.registry is not None:
            self.versions[sid] = self.engine.freeze(self.slot_name(cmd.model_id))
            self._note_versions()
        return Result(json={"sampling_session_id": sid, "type": "save_weights_for_sampler"}), {}

    def _note_versions(self) -> None:
        """A line for the log when the versions held reach 16, 32, 64, ...: an SDK client dropped sends nothing the
        server could free its version by, so a loop that makes a snapshot sampler every step (the cookbook's RL
        loop) holds one more version a step, in host memory past memory.versions_gib, until its session closes."""
        s = self.registry.summary()
        if s["versions"] < self._versions_told:
            return
        while self._versions_told <= s["versions"]:
            self._versions_told *= 2
        gib = 1 << 30
        self.notes.append(
            f"{s['versions']} frozen weight versions held ({s['version_device_bytes'] / gib:.2f} GiB on the device, "
            f"{s['version_host_bytes'] / gib:.2f} GiB in host memory; told again at {self._versions_told}): each "
            "snapshot sampler (save_weights_and_get_sampling_client, save_weights_for_sampler) keeps its version "
            "until its session closes or the save's ttl_seconds pass, so a loop that makes one a step holds one "
            "more each step; fix: close() the sessions of samplers no longer used, pass ttl_seconds to the save, or "
            "sample the live weights (kind='inflight') where the loop is synchronous")

    def take_notes(self) -> list[str]:
        """Rank 0: the log lines made since the last call (each told once)."""
        out, self.notes = self.notes, []
        return out

    def sampler_load(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        """create_sampling_client(model_path): the saved weights loaded into a version (Engine.load_version: LoRA
        adapters, or without LoRA every weight in the compute dtype), no model changed. A failure is kept for the
        session's samples to say."""
        a, sid = cmd.args, cmd.args["sampling_session_id"]
        t0 = time.perf_counter()
        try:
            self.versions[sid] = self.engine.load_version(Path(a["dir"]), a["tinker_path"])
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is not an Exception; re-raised
            self.failed[sid] = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise
        self._note_versions()
        return Result(json={"sampling_session_id": sid, "path": a["tinker_path"]}), {"load": time.perf_counter() - t0}

    def release_samplers(self, cmd: Command) -> tuple[Result, dict[str, float]]:
        for sid in cmd.args["sampling_session_ids"]:
            self.failed.pop(sid, None)
            vid = self.versions.pop(sid, None)
            if vid is not None:
                self.registry.release(vid)
        return Result(json={}), {}

    def sampler_weights(self, a: dict) -> str | None:
        """What a sample reads: a version id, registry.BASE or a model id; None on a test's fake Engine. Without LoRA
        the base alone is not kept: a sampler of base_model reads the one model's live weights."""
        weights, sid = a.pop("weights", None), a.pop("sampler", None)
        if self.registry is None:
            return None
        if weights == "version":
            if sid in self.failed:
                raise ShardfitError(f"this sampling session's weights did not load: {self.failed[sid]}",
                                    where="/asample sampling_session_id", fix="create the sampling client again "
                                    "from a path save_weights_for_sampler returned")
            if sid not in self.versions:
                raise ShardfitError("this sampling session's version was freed", where="/asample sampling_session_id",
                                    fix="save the weights again (save_weights_for_sampler) and sample from that")
            return self.versions[sid]
        if weights == "base":
            from shardfit.engine.registry import BASE

            return BASE if self.lora else "default"
        return self.slot_name(weights.removeprefix("live:"))

    def sample_batch(self, cmd: Command) -> tuple[dict[str, Result], dict[str, float]]:
        """A batch of /asample requests (commands.py) through Engine.sample (sampling/: the decode model over the
        Engine's weights, each model's or version's adapter in the LoRA bank, a paged KV cache; on N ranks each its
        share of the rows). Each request's weights are resolved first (a freed session's, or one whose load failed,
        fails alone here); then one Engine.sample call per group that decodes together -- per Engine (the trained
        one, each served extra model) and without LoRA per weights (swapped into the model one at a time) -- with
        refused="return": a request the Engine refuses fails alone with its line, the others decode as if it were
        not there. Every rank groups alike (the same command, the same sessions). One Sampler is kept per server,
        the trained Engine's (engine/sampling.py): a served extra model's is dropped after its call, and the trained
        Engine's before it, so that neither KV pool holds the memory the other's (or a training step) needs. The call
        goes through the RL API's sample (rl/step.py): with sampling.logprobs=trainer (the server's config; the SDK's
        request has no such field) the returned log-probs are the trainer's forward over the samples."""
        results: dict[str, Result] = {}
        groups: dict[tuple, list] = {}  # (served model or "", full-parameter weights or None) -> its requests
        for c in cmd.members():
            try:
                key, member = self.sample_member(c)
            except ShardfitError as e:
                results[c.request_id] = failure_result(e, c, self.rank)
                continue
            groups.setdefault(key, []).append(member)
        t0 = time.perf_counter()
        for (served, _), members in groups.items():
            try:
                out = self._sample_group(served, members)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - the group's requests fail, the batch's others go on
                out = [e] * len(members)
            for (c, *_), res in zip(members, out):
                if isinstance(res, BaseException):
                    results[c.request_id] = failure_result(res, c, self.rank)
                else:
                    results[c.request_id] = Result(proto=encode_sample(res) if self.rank == 0 else None)
        return results, {"sample": time.perf_counter() - t0}

    def sample_member(self, c: Command) -> tuple[tuple, tuple]:
        """(the group it decodes in: (served model or "", full-parameter weights or None), (command, its args, model,
        version) for Engine.sample) of one sample request; a ShardfitError when its weights are not held."""
        from shardfit.engine.registry import BASE

        a = dict(c.args)
        served = a.pop("served", None)
        weights = self.sampler_weights(a)
        model = version = None
        if not served and self.registry is not None:  # an extra served model samples its own (frozen) weights
            if weights == BASE or weights in self.registry.versions:
                version = weights
            else:
                model = weights
        return (served or "", None if served or self.lora else weights), (c, a, model, version)

    def sampling_engine(self, served: str):
        """(the Engine a group samples, rank 0's tokenizer, its RL API: sampling.logprobs=trainer scores with it)."""
        e, tokenizer = self.served[served] if served else (self.engine, self.tokenizer)
        return e, tokenizer, self.rl if e is self.engine else _datum_engine(e)

    def _sample_group(self, served: str, members: list) -> list:
        """One Engine.sample call for the group's requests [(command, args, model, version)]: per request its
        SampleResult, or the ShardfitError that refused it."""
        e, tokenizer, rl = self.sampling_engine(served)
        if served:  # one Sampler kept per server, the trained Engine's: its KV pool would be the served model's memory
            self.engine.release_sampler(training=False)
        try:
            prompts, params, options = sample_arguments(members)
            return rl.sample(prompts, params, **options, tokenizer=tokenizer, refused="return")
        finally:
            if served:  # a frozen extra model keeps none: its pool would hold the training step's memory for good
                e.release_sampler(training=False)


def sample_arguments(members: list) -> tuple[list, list, dict]:
    """(prompts, SamplingParams, the per-prompt options) of Engine.sample (or SampleRun.submit) for requests
    [(command, args, model, version)]."""
    from shardfit.sampling.params import SamplingParams

    args = [a for _, a, _, _ in members]
    params = [SamplingParams(p["max_tokens"], p["temperature"], p["top_k"], p["top_p"], p["seed"],
                             tuple(p["stop_tokens"]), tuple(p["stop_strings"]))
              for p in (a["params"] for a in args)]
    return [a["prompt"] for a in args], params, {
        "model": [m for _, _, m, _ in members], "version": [v for _, _, _, v in members],
        "num_samples": [a["num_samples"] for a in args], "prompt_logprobs": [a["prompt_logprobs"] for a in args],
        "topk_prompt_logprobs": [a["topk_prompt_logprobs"] for a in args],
        "topk_sample_logprobs": [a["topk_sample_logprobs"] for a in args]}
