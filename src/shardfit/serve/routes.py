"""The Tinker API's routes (as tinker 0.38.0 calls them), each a check and then a queued command or an answer.

Requests of a training model carry a seq_id: the scheduler releases them in that order. A request refused after its
model and seq_id were read gives its seq_id up (Scheduler.skip) so the model's later requests do not wait for it.
A POST retried by the SDK carries the same X-Idempotency-Key and gets the first answer again, not a second command.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from shardfit.errors import ShardfitError
from shardfit.serve import schemas as s
from shardfit.serve.commands import Command, datums_to_json
from shardfit.serve.futures import Result
from shardfit.serve.protocol import check_forward_backward, loss_config, parse_forward_backward
from shardfit.serve.security import check_segment, parse_tinker_path
from shardfit.serve.state import META, ServerState

V1 = "/api/v1"
PROTO = "application/x-protobuf"


async def _json(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise ShardfitError("the body is not JSON", where=request.url.path,
                            fix="send a JSON object (the tinker SDK does)") from None
    if not isinstance(data, dict):
        raise ShardfitError("the body is not a JSON object", where=request.url.path, fix="send a JSON object")
    return model.model_validate(data) if model is not None else data


def add_routes(app: FastAPI, st: ServerState) -> None:  # noqa: C901 - one route table
    facts = st.facts
    said_full = []

    def queue(request: Request, kind: str, args: dict, model_id: str | None = None, seq_id: int | None = None,
              extra: dict | None = None) -> dict:
        rid = st.futures.create(kind)
        answer = {"request_id": rid, **(extra or {})}
        st.remember(request.headers.get("x-idempotency-key"), answer)
        st.scheduler.submit(Command(kind, rid, args), model_id, seq_id)
        return answer

    def done_now(request: Request, kind: str, result: dict, extra: dict | None = None) -> dict:
        rid = st.futures.create(kind)
        st.futures.complete(rid, Result(json=result))
        answer = {"request_id": rid, **(extra or {})}
        st.remember(request.headers.get("x-idempotency-key"), answer)
        return answer

    def ordered(model_id: str, seq_id: int, where: str):
        """Check the model and seq_id; the returned context gives the seq_id up if what follows refuses."""
        st.model(model_id, where)
        st.scheduler.check_seq(model_id, seq_id, where)

        class _GiveUp:
            def __enter__(self):
                return self

            def __exit__(self, kind, _e, _tb):
                if kind is not None:
                    st.scheduler.skip(model_id, seq_id)
                return False

        return _GiveUp()

    # ------------------------------------------------------------------ client and sessions
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
            return JSONResponse({"detail": "unknown session"}, status_code=410)  # the SDK stops beating
        st.session(body.session_id, "/session_heartbeat")
        return {"type": "session_heartbeat"}

    @app.post(V1 + "/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # not kept: the SDK's telemetry is for Thinking Machines' servers

    @app.post(V1 + "/sessions/{session_id}/finish")
    async def finish(session_id: str):
        return {}

    # ------------------------------------------------------------------ training models
    @app.post(V1 + "/create_model")
    async def create_model(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        body = await _json(request, s.CreateModelBody)
        st.session(body.session_id, "/create_model session_id")
        st.check_base_model(body.base_model, "/create_model base_model")
        rank = (body.lora_config or {}).get("rank")
        facts.check_lora_rank(rank, "/create_model lora_config.rank")
        model_id = st.add_model(body.session_id, body.model_seq_id, body.base_model, body.user_metadata, rank)
        if not said_full and not facts.lora_rank:
            said_full.append(True)
            print(f"shardfit serve: {model_id}: LoRA (rank {rank}) was asked for; this server trains every parameter "
                  "(get_info says is_lora=false): start it with --lora.rank=R to train adapters",
                  file=sys.stderr, flush=True)
        return done_now(request, "create_model", {"model_id": model_id, "type": "create_model"},
                        {"model_id": model_id})

    @app.post(V1 + "/get_info")
    async def get_info(request: Request):
        body = await _json(request, s.ModelBody)
        st.model(body.model_id, "/get_info model_id")
        return {"type": "get_info", "model_id": body.model_id, "model_name": facts.base_model,
                "model_data": {"model_name": facts.base_model, "arch": facts.arch,
                               "tokenizer_id": facts.tokenizer_id},
                "is_lora": bool(facts.lora_rank), "lora_rank": facts.lora_rank or None}

    @app.post(V1 + "/forward_backward")
    async def forward_backward(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        if request.headers.get("content-encoding", "identity") not in ("identity", ""):
            raise ShardfitError("compressed bodies are not accepted", where="/forward_backward",
                                fix="send it uncompressed (this server leaves proto_compress_fwdbwd off)")
        msg = parse_forward_backward(await request.body())
        with ordered(msg.model_id, msg.seq_id, "/forward_backward"):
            datums = check_forward_backward(msg, facts.vocab_size, facts.max_seq_len)
            args = {"datums": datums_to_json(datums), "loss_fn": msg.loss_fn, "loss_fn_config": loss_config(msg),
                    "forward_only": bool(msg.forward_only)}
        return queue(request, "forward_backward", args, msg.model_id, msg.seq_id)

    @app.post(V1 + "/optim_step")
    async def optim_step(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        body = await _json(request, s.OptimStepBody)
        with ordered(body.model_id, body.seq_id, "/optim_step"):
            adam = s.adam_args(body)
        return queue(request, "optim_step", {"adam": adam}, body.model_id, body.seq_id)

    def save_command(model_id: str, kind: str, name: str, optimizer: bool, response_type: str) -> dict:
        directory, tinker_path = st.checkpoint_target(model_id, kind, check_segment(name, "path"))
        return {"dir": str(directory), "tinker_path": tinker_path, "optimizer": optimizer,
                "response_type": response_type, "meta_file": str(directory / META),
                "meta": st.checkpoint_meta(tinker_path, kind, model_id)}

    @app.post(V1 + "/save_weights")
    async def save_weights(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        body = await _json(request, s.SaveWeightsBody)
        with ordered(body.model_id, body.seq_id, "/save_weights"):
            if not body.path:
                raise ShardfitError("path is missing", where="/save_weights", fix="name the checkpoint")
            args = save_command(body.model_id, "weights", body.path, True, "save_weights")
        return queue(request, "save_state", args, body.model_id, body.seq_id)

    @app.post(V1 + "/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        body = await _json(request, s.SaveWeightsBody)
        with ordered(body.model_id, body.seq_id, "/save_weights_for_sampler"):
            if body.path:
                args = save_command(body.model_id, "sampler_weights", body.path, False, "save_weights_for_sampler")
                return queue(request, "save_state", args, body.model_id, body.seq_id)
            sid = st.new_sampler(None, body.model_id)
        return queue(request, "sampler_snapshot", {"sampling_session_id": sid}, body.model_id, body.seq_id)

    @app.post(V1 + "/load_weights")
    async def load_weights(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        body = await _json(request, s.LoadWeightsBody)

        def target() -> dict:
            run, kind, name = parse_tinker_path(body.path, "/load_weights path")
            directory, tinker_path = st.checkpoint_target(run, kind, name)
            return {"dir": str(directory), "tinker_path": tinker_path, "optimizer": body.optimizer}

        if body.model_id is not None:  # load_state on an existing TrainingClient: in its order
            if body.seq_id is None:
                raise ShardfitError("seq_id is missing", where="/load_weights", fix="send the request's seq_id")
            with ordered(body.model_id, body.seq_id, "/load_weights"):
                args = target()
            return queue(request, "load_state", {**args, "model_id": body.model_id}, body.model_id, body.seq_id)
        if body.session_id is None or body.model_seq_id is None:  # create_training_client_from_state
            raise ShardfitError("neither model_id nor session_id + model_seq_id", where="/load_weights",
                                fix="send the fields the tinker SDK sends")
        st.session(body.session_id, "/load_weights session_id")
        if body.base_model is not None:
            st.check_base_model(body.base_model, "/load_weights base_model")
        args = target()
        model_id = st.add_model(body.session_id, body.model_seq_id, facts.base_model, None, None)
        return queue(request, "load_state", {**args, "model_id": model_id})

    # ------------------------------------------------------------------ sampling
    @app.post(V1 + "/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await _json(request, s.SamplingSessionBody)
        st.session(body.session_id, "/create_sampling_session session_id")
        if body.model_path is not None:
            parse_tinker_path(body.model_path, "/create_sampling_session model_path")
        elif body.base_model is not None:
            st.check_base_model(body.base_model, "/create_sampling_session base_model")
        else:
            raise ShardfitError("neither base_model nor model_path", where="/create_sampling_session",
                                fix="name what to sample from")
        return {"type": "create_sampling_session", "sampling_session_id": st.new_sampler(body.model_path, None)}

    @app.get(V1 + "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        sp = st.sampler(sampler_id, "/samplers")
        return {"sampler_id": sampler_id, "base_model": sp["base_model"], "model_path": sp["model_path"]}

    @app.post(V1 + "/asample")
    async def asample(request: Request):
        if (seen := st.remembered(request.headers.get("x-idempotency-key"))) is not None:
            return seen
        body = await _json(request, s.SampleBody)
        if body.sampling_session_id is not None:
            st.sampler(body.sampling_session_id, "/asample sampling_session_id")
        elif body.base_model is not None:
            st.check_base_model(body.base_model, "/asample base_model")
        elif body.model_path is not None:
            parse_tinker_path(body.model_path, "/asample model_path")
        else:
            raise ShardfitError("no sampling_session_id", where="/asample", fix="create a sampling client first")
        args = s.sample_args(body, facts.vocab_size, facts.max_seq_len, facts.eos_ids, facts.has_tokenizer)
        rid = st.futures.create("sample")
        answer = {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(args.num_samples)]}
        st.remember(request.headers.get("x-idempotency-key"), answer)
        st.scheduler.submit(Command("sample", rid, dataclasses.asdict(args)))
        return answer

    # ------------------------------------------------------------------ futures
    @app.post(V1 + "/retrieve_future")
    async def retrieve_future(request: Request):
        body = await _json(request, s.RetrieveBody)
        state = st.futures.state(body.request_id)
        if state == "unknown":
            return JSONResponse({"detail": f"unknown request_id '{body.request_id[:80]}'"}, status_code=404)
        if state == "expired":
            return JSONResponse({"detail": "the result expired"}, status_code=410)
        result = await st.futures.wait(body.request_id)
        if result is None:
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        out = result.body()
        return Response(out, media_type=PROTO) if isinstance(out, bytes) else out

    # ------------------------------------------------------------------ runs and checkpoints
    @app.get(V1 + "/training_runs/{run}")
    async def training_run(run: str):
        return st.training_run(run)

    @app.get(V1 + "/training_runs/{run}/checkpoints")
    async def list_checkpoints(run: str):
        return {"checkpoints": st.list_checkpoints(run), "cursor": None}

    @app.delete(V1 + "/training_runs/{run}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(run: str, kind: str, name: str):
        if kind not in ("weights", "sampler_weights"):
            return JSONResponse({"detail": f"unknown checkpoint kind '{kind[:40]}'"}, status_code=404)
        directory, _ = st.checkpoint_target(run, kind, name)
        if not (directory / META).is_file():
            return JSONResponse({"detail": "no such checkpoint"}, status_code=404)
        (directory / META).unlink()  # out of the listing first: a half-deleted checkpoint is never listed
        shutil.rmtree(directory, ignore_errors=True)
        return {}

    @app.get(V1 + "/shardfit/status")
    async def status():
        return {"queue": st.scheduler.depth(), **st.futures.snapshot()}
