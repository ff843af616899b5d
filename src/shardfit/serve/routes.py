"""The Tinker API's routes (as tinker 0.38.0 calls them), each a check and then a queued command or an answer.

Every POST that becomes a command goes through one decorator, `queued` (said once, not per route): a retry with the
same X-Idempotency-Key from the same principal gets the first answer again, not a second command; a body that names a
model_id has its model and seq_id checked first, and if what follows refuses the request its seq_id is given up
(Scheduler.skip) so that the model's later requests do not wait for it; then the route's Queued becomes a future,
answered {request_id, ...} at once. The scheduler releases a model's commands in seq_id order.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from shardfit.errors import ShardfitError, shown
from shardfit.serve import schemas as s
from shardfit.serve.commands import Command, datums_to_json
from shardfit.serve.futures import Result
from shardfit.serve.protocol import LOSSES, check_forward_backward, loss_config, parse_forward_backward
from shardfit.serve.security import check_segment, parse_tinker_path
from shardfit.serve.state import BASE, LIVE, META, VERSION, ServerState, remove_checkpoint

V1 = "/api/v1"
PROTO = "application/x-protobuf"
MAX_DEPTH = 32  # JSON nesting: the SDK's deepest body is 4; an answer that echoes a body must encode it again
MAX_TTL_S = 10 * 365 * 86400  # a save's ttl_seconds at most: Tinker's documented range ends at 10 years


@dataclass
class Queued:
    """A route's outcome: command `kind` with `args` to queue, or (`now`) its result ready at once; `extra` keys
    join the answer, and `samples` sample ids (rid:i, one per sample, as the SDK asserts)."""

    kind: str
    args: dict = field(default_factory=dict)
    now: dict | None = None
    extra: dict = field(default_factory=dict)
    samples: int = 0


async def _json(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise ShardfitError("the body is not JSON", where=request.url.path,
                            fix="send a JSON object (the tinker SDK does)") from None
    except RecursionError:
        raise ShardfitError("the body's JSON is nested too deeply", where=request.url.path,
                            fix="send the flat objects the tinker SDK sends") from None
    if not isinstance(data, dict):
        raise ShardfitError("the body is not a JSON object", where=request.url.path, fix="send a JSON object")
    if _depth(data) > MAX_DEPTH:
        raise ShardfitError(f"the body's JSON is nested more than {MAX_DEPTH} levels deep", where=request.url.path,
                            fix="send the flat objects the tinker SDK sends")
    return model.model_validate(data) if model is not None else data


def _depth(value) -> int:
    """How deeply objects and arrays nest in a parsed JSON value (iterative: no recursion to exhaust)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def json_body(model) -> Callable[[Request], Awaitable]:
    return lambda request: _json(request, model)


async def proto_body(request: Request):
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise ShardfitError("compressed bodies are not accepted", where=request.url.path,
                            fix="send it uncompressed (this server leaves proto_compress_fwdbwd off)")
    return parse_forward_backward(await request.body())


def queued(app: FastAPI, st: ServerState, path: str, parse: Callable[[Request], Awaitable]):
    """Register `handler(body) -> Queued` as POST `path`, with the prologue every command route shares (module
    docstring)."""
    def wrap(handler: Callable[[object], Queued]):
        async def route(request: Request):
            owner, key = request.state.principal, request.headers.get("x-idempotency-key")
            if (seen := st.remembered(owner, key)) is not None:
                return seen
            try:
                body = await parse(request)
            except (ShardfitError, ValidationError):
                await give_up_seq(request)
                raise
            model_id, seq_id = getattr(body, "model_id", None), getattr(body, "seq_id", None)
            if model_id is None:
                out, seq_id = handler(body), None
            else:
                if seq_id is None:
                    raise ShardfitError("seq_id is missing", where=path, fix="send the request's seq_id")
                st.model(model_id, f"{path} model_id")
                st.scheduler.check_seq(model_id, seq_id, path)
                try:
                    out = handler(body)
                except BaseException:
                    st.scheduler.skip(model_id, seq_id)  # refused: the model's later requests go on
                    raise
            rid = st.futures.create(out.kind, owner)
            answer = {"request_id": rid, **out.extra}
            if out.samples:
                answer["sample_sequence_ids"] = [f"{rid}:{i}" for i in range(out.samples)]
            st.remember(owner, key, answer)
            if out.now is not None:
                st.futures.complete(rid, Result(json=out.now))
            else:
                st.scheduler.submit(Command(out.kind, rid, out.args, model_id or ""), model_id, seq_id)
            return answer

        app.post(V1 + path)(route)
        return handler

    async def give_up_seq(request: Request) -> None:
        """A JSON body refused by its schema (a field of the wrong type) whose model_id and seq_id are readable: that
        seq_id is given up too, or the model's later requests would wait for it forever."""
        with contextlib.suppress(ValueError, RecursionError):
            raw = json.loads(await request.body())
            model_id, seq_id = (raw.get("model_id"), raw.get("seq_id")) if isinstance(raw, dict) else (None, None)
            if isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool):
                with contextlib.suppress(ShardfitError):  # unknown model, or a seq_id in use: nothing to give up
                    st.scheduler.check_seq(model_id, seq_id, path)
                    st.scheduler.skip(model_id, seq_id)

    return wrap


def add_routes(app: FastAPI, st: ServerState) -> None:
    _session_routes(app, st)
    _training_routes(app, st)
    _sampling_routes(app, st)
    _future_and_checkpoint_routes(app, st)


def _session_routes(app: FastAPI, st: ServerState) -> None:
    @app.post(V1 + "/client/config")
    @app.post(V1 + "/client/dynamic_config")
    async def client_config():
        return {}  # the SDK's defaults

    @app.post(V1 + "/create_session")
    async def create_session(request: Request):
        return {"type": "create_session", "session_id": st.new_session(await _json(request, None))}

    @app.post(V1 + "/session_heartbeat")
    async def heartbeat(request: Request):
        body = await _json(request, s.SessionBody)
        if body.session_id not in st.sessions:
            return JSONResponse({"detail": "unknown session"}, 410)  # the SDK stops beating
        st.session(body.session_id, "/session_heartbeat")
        return {"type": "session_heartbeat"}

    @app.post(V1 + "/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # not kept: the SDK's telemetry is for Thinking Machines' servers

    @app.post(V1 + "/sessions/{session_id}/finish")
    async def finish(session_id: str):
        release_expired(st, session_id)  # its sampling clients are gone: so are their versions
        return {}

    @app.post(V1 + "/get_info")
    async def get_info(request: Request):
        body = await _json(request, s.ModelBody)
        st.model(body.model_id, "/get_info model_id")
        f = st.facts
        return {"type": "get_info", "model_id": body.model_id, "model_name": f.base_model,
                "model_data": {"model_name": f.base_model, "arch": f.arch, "tokenizer_id": f.tokenizer_id},
                "is_lora": bool(f.lora_rank), "lora_rank": f.lora_rank or None}


def _training_routes(app: FastAPI, st: ServerState) -> None:
    facts = st.facts

    @queued(app, st, "/create_model", json_body(s.CreateModelBody))
    def create_model(body) -> Queued:
        """A new model of the Engine's registry (LoRA: its own adapters, starting at the base, and optimizer state);
        without LoRA the one model, every parameter (asked for with rank=0: a LoRA rank is refused)."""
        st.session(body.session_id, "/create_model session_id")
        st.check_base_model(body.base_model, "/create_model base_model")
        config = body.lora_config or {}
        facts.check_lora_config(config, "/create_model lora_config")
        seed = config.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ShardfitError(f"seed={shown(seed)} is not an integer >= 0", where="/create_model lora_config.seed",
                                fix="pass an integer seed, or none")
        model_id = st.add_model(body.session_id, body.model_seq_id, body.base_model, body.user_metadata,
                                config.get("rank"))
        return Queued("create_model", {"model_id": model_id, "seed": seed}, extra={"model_id": model_id})

    @queued(app, st, "/forward_backward", proto_body)
    def forward_backward(msg) -> Queued:
        from shardfit.rl.losses import PAIR_LOSSES, resolve_loss
        from shardfit.rl.preference import check_pair_config

        config = loss_config(msg)
        # the Engine's own check of each option, before any rank sees it (an unknown loss_fn: the protocol's line)
        spec = resolve_loss(msg.loss_fn, config) if msg.loss_fn in LOSSES else None
        added = {name: f"send {name} (one value per token) with loss_fn_config.kl_coef, or leave kl_coef out"
                 for name in (spec.required if spec is not None and spec.kl_coef else ())}
        datums = check_forward_backward(msg, facts.vocab_size, facts.max_seq_len, facts.token_budget,
                                        max_values=st.max_body // 4,  # a dense body's float32 values at most
                                        options_need=added)
        if msg.loss_fn in PAIR_LOSSES:  # and a preference loss's (its options, pairs, KTO's labels)
            check_pair_config(msg.loss_fn, config, datums)
        return Queued("forward_backward", {"datums": datums_to_json(datums), "loss_fn": msg.loss_fn,
                                           "loss_fn_config": config, "forward_only": bool(msg.forward_only)})

    @queued(app, st, "/optim_step", json_body(s.OptimStepBody))
    def optim_step(body) -> Queued:
        return Queued("optim_step", {"adam": s.adam_args(body)})

    def save(body, kind: str, optimizer: bool, response_type: str) -> Queued:
        """A named checkpoint; its ttl_seconds (Tinker's: the checkpoint expires then) go into its META."""
        directory, tinker_path = st.checkpoint_target(body.model_id, kind, check_segment(body.path, "path"))
        meta = st.checkpoint_meta(tinker_path, kind, body.model_id, ttl(body, f"/{response_type}"))
        return Queued("save_state", {"dir": str(directory), "tinker_path": tinker_path, "optimizer": optimizer,
                                     "response_type": response_type, "meta_file": str(directory / META),
                                     "meta": meta})

    @queued(app, st, "/save_weights", json_body(s.SaveWeightsBody))
    def save_weights(body) -> Queued:
        if not body.path:
            raise ShardfitError("path is missing", where="/save_weights", fix="name the checkpoint")
        return save(body, "weights", True, "save_weights")

    @queued(app, st, "/save_weights_for_sampler", json_body(s.SaveWeightsBody))
    def save_for_sampler(body) -> Queued:
        """With a path: the checkpoint (create_sampling_client(model_path) loads it into a version). Without: a
        sampling session of a version frozen now (the SDK's kind="snapshot": adapters, or without LoRA a copy of
        every weight, up to --serve.versions), or of the model's live weights (kind="inflight")."""
        if body.path:
            return save(body, "sampler_weights", False, "save_weights_for_sampler")
        if body.kind not in (None, "snapshot", "inflight"):
            raise ShardfitError(f"kind={shown(body.kind)} is not snapshot or inflight",
                                where="/save_weights_for_sampler kind", fix="pass kind='snapshot' (the default)")
        freeze = body.kind != "inflight"
        session = st.model(body.model_id, "/save_weights_for_sampler")["session_id"]
        release_expired(st)  # a version past its ttl makes room before the limit is checked
        sid = st.new_sampler(session, VERSION if freeze else LIVE + body.model_id,
                             ttl_s=ttl(body, "/save_weights_for_sampler"))
        return Queued("sampler_snapshot", {"sampling_session_id": sid, "freeze": freeze})

    @queued(app, st, "/load_weights", json_body(s.LoadWeightsBody))
    def load_weights(body) -> Queued:
        directory, tinker_path = st.saved_checkpoint(body.path, "/load_weights path")
        if body.optimizer and parse_tinker_path(tinker_path, "/load_weights path")[1] == "sampler_weights":
            raise ShardfitError(f"'{tinker_path}' holds weights only (save_weights_for_sampler), no optimizer state",
                                where="/load_weights path", fix="load it without the optimizer (load_state, "
                                "create_training_client_from_state), or give a path save_state returned")
        args = {"dir": str(directory), "tinker_path": tinker_path, "optimizer": body.optimizer}
        if body.model_id is not None:  # load_state on an existing TrainingClient: in its order
            return Queued("load_state", {**args, "model_id": body.model_id})
        if body.session_id is None or body.model_seq_id is None:  # create_training_client_from_state
            raise ShardfitError("neither model_id nor session_id + model_seq_id", where="/load_weights",
                                fix="send the fields the tinker SDK sends")
        st.session(body.session_id, "/load_weights session_id")
        if body.base_model is not None:
            st.check_base_model(body.base_model, "/load_weights base_model")
        model_id = st.add_model(body.session_id, body.model_seq_id, facts.base_model, None, None, "/load_weights")
        return Queued("load_state", {**args, "model_id": model_id, "create": True})


def _sampling_routes(app: FastAPI, st: ServerState) -> None:
    facts = st.facts

    @app.post(V1 + "/create_sampling_session")
    async def create_sampling_session(request: Request):
        """base_model: the base alone (LoRA; without LoRA the one model's live weights), or a frozen extra model
        (--serve.models). model_path: the saved weights (a checkpoint this server can load: st.saved_checkpoint),
        loaded into a version (LoRA adapters, or without LoRA every weight) by a `sampler_load` command queued before
        any of the session's samples, counted against --serve.versions as any version."""
        body = await _json(request, s.SamplingSessionBody)
        st.session(body.session_id, "/create_sampling_session session_id")
        release_expired(st)
        if body.model_path is not None:
            where = "/create_sampling_session model_path"
            directory, tinker_path = st.saved_checkpoint(body.model_path, where)
            sid = st.new_sampler(body.session_id, VERSION, body.model_path, where=where)
            submit(st, "sampler_load", {"sampling_session_id": sid, "dir": str(directory),
                                        "tinker_path": tinker_path}, request.state.principal)
        elif body.base_model is not None:
            served = st.check_base_model(body.base_model, "/create_sampling_session base_model", sampling=True)
            sid = st.new_sampler(body.session_id, BASE, served=None if served is facts else served.base_model)
        else:
            raise ShardfitError("neither base_model nor model_path", where="/create_sampling_session",
                                fix="name what to sample from")
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    @app.get(V1 + "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        sp = st.sampler(sampler_id, "/samplers")
        return {"sampler_id": sampler_id, "base_model": sp["base_model"], "model_path": sp["model_path"]}

    @queued(app, st, "/asample", json_body(s.SampleBody))
    def asample(body) -> Queued:
        release_expired(st)
        served = facts
        if body.sampling_session_id is not None:
            sp = st.sampler(body.sampling_session_id, "/asample sampling_session_id")
            weights = sp["weights"]
            if sp.get("served"):
                served = st.check_base_model(sp["served"], "/asample sampling_session_id", sampling=True)
        elif body.base_model is not None:
            served = st.check_base_model(body.base_model, "/asample base_model", sampling=True)
            weights = BASE
        elif body.model_path is not None:
            parse_tinker_path(body.model_path, "/asample model_path")
            raise ShardfitError("a sample of model_path needs its sampling session", where="/asample model_path",
                                fix="create_sampling_client(model_path=...) and sample from it")
        else:
            raise ShardfitError("no sampling_session_id", where="/asample", fix="create a sampling client first")
        served.check_sampling("/asample")
        args = s.sample_args(body, served.vocab_size, served.max_seq_len, served.eos_ids, served.has_tokenizer)
        return Queued("sample", {**args, "weights": weights, "sampler": body.sampling_session_id,
                                 "served": None if served is facts else served.base_model},
                      samples=args["num_samples"])


def ttl(body: s.SaveWeightsBody, where: str) -> float | None:
    """A save's ttl_seconds: None (or 0 and below, as before) never expires. Tinker's own range ends at 10 years; its
    floor of an hour is the hosted service's storage policy, not kept here (a local run may want minutes)."""
    t = body.ttl_seconds
    if t is not None and not (math.isfinite(t) and t <= MAX_TTL_S):  # a date past the calendar: never a 500
        raise ShardfitError(f"ttl_seconds={shown(t)} is beyond 10 years", where=f"{where} ttl_seconds",
                            fix=f"send at most {MAX_TTL_S} seconds, or none (never expires)")
    return t if t and t > 0 else None


def submit(st: ServerState, kind: str, args: dict, owner: str | None) -> str:
    """Queue a command no client waits for by seq_id (a sampler's load, a release); its request id."""
    rid = st.futures.create(kind, owner)
    st.scheduler.submit(Command(kind, rid, args, ""))
    return rid


def release_expired(st: ServerState, session_id: str | None = None) -> None:
    """Free the versions of the sampling sessions of `session_id` (None: those past their ttl_seconds)."""
    gone = st.drop_samplers(session_id)
    if gone:
        submit(st, "release_samplers", {"sampling_session_ids": gone}, None)


def _future_and_checkpoint_routes(app: FastAPI, st: ServerState) -> None:
    @app.post(V1 + "/retrieve_future")
    async def retrieve_future(request: Request):
        body = await _json(request, s.RetrieveBody)
        state = st.futures.state(body.request_id, request.state.principal)
        if state == "unknown":
            return JSONResponse({"detail": "unknown request_id (never issued to this key)"}, 404)
        if state == "expired":
            return JSONResponse({"detail": "the result expired (nobody read it in time)"}, 410)
        result = await st.futures.wait(body.request_id)
        if result is None:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        out = result.body()
        return Response(out, media_type=PROTO) if isinstance(out, bytes) else out

    @app.delete(V1 + "/training_runs/{run}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run: str, kind: str, name: str):
        if kind not in ("weights", "sampler_weights"):
            return JSONResponse({"detail": "unknown checkpoint kind"}, 404)
        directory, _ = st.checkpoint_target(run, kind, name)
        if not (directory / META).is_file():
            return JSONResponse({"detail": "no such checkpoint"}, 404)
        remove_checkpoint(directory)
        return {}

    @app.get(V1 + "/shardfit/status")
    async def status(request: Request):
        release_expired(st)
        return {"queue": st.scheduler.depth(), "held": st.held(), "sampling": st.sampling(),
                **st.futures.snapshot(request.state.principal)}
