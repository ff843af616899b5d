"""The Tinker REST listings (tinker 0.38.0's RestClient): what the server serves, its training runs, their checkpoints
and a checkpoint's weights info. Each is answered at once from rank 0's state and the run directory: no command is
queued and no rank is involved.

Checkpoints are read from disk, from the META file that serve writes beside a checkpoint once its files are complete,
so every listing survives a restart and a half-written checkpoint is never listed. A training run is a model of this
server (ServerState.models). After a restart it is also any run that has checkpoints on disk; its record then comes
from its newest META (base model, LoRA rank and layers, as saved). The paginated listings take the SDK's
`limit` / `offset` query parameters and answer Tinker's `cursor` {offset, limit, total_count}, newest first.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from shardfit.errors import ShardfitError
from shardfit.serve import schemas as s
from shardfit.serve.routes import json_body
from shardfit.serve.security import KINDS, SEGMENT, checkpoint_dir, parse_tinker_path
from shardfit.serve.state import ServerState, read_meta

V1 = "/api/v1"
MAX_LIMIT = 1000  # one page: the SDK asks for 20 runs or 100 checkpoints by default
ADAPTS = ("train_attn", "train_mlp", "train_unembed")


def add_listing_routes(app: FastAPI, st: ServerState) -> None:
    @app.get(V1 + "/get_server_capabilities")
    async def capabilities():
        """Every model this server serves: the trained one's base, then the frozen extra models (--serve.models),
        which sampling clients name as base_model."""
        return {"supported_models": [{"model_name": f.base_model, "max_context_length": f.max_seq_len,
                                      "trainable": f.trainable, "sampleable": True}
                                     for f in [st.facts, *st.served]]}

    @app.get(V1 + "/training_runs")
    async def list_training_runs(request: Request):
        runs = training_runs(st, request.query_params.get("project_id"))
        page, cursor = paginate(request, runs, 20, "/training_runs")
        return {"training_runs": page, "cursor": cursor}

    @app.get(V1 + "/training_runs/{run}")
    async def training_run(run: str):
        """A model of this server, or (after a restart) a run that has checkpoints on disk."""
        with st.lock:
            known = run in st.models
        if not known and (saved := scan_checkpoints(st, run)):
            return run_record(st, run, None, saved)
        m = st.model(run, f"/training_runs/{run[:80]}")  # unknown, or replaced (no LoRA): one line
        return run_record(st, run, m, scan_checkpoints(st, run))

    @app.get(V1 + "/training_runs/{run}/checkpoints")
    async def list_checkpoints(run: str):
        return {"checkpoints": [public(c) for c in scan_checkpoints(st, run)], "cursor": None}

    @app.get(V1 + "/checkpoints")
    async def list_user_checkpoints(request: Request):
        page, cursor = paginate(request, [public(c) for c in scan_checkpoints(st)], 100, "/checkpoints")
        return {"checkpoints": page, "cursor": cursor}

    @app.post(V1 + "/weights_info")
    async def weights_info(request: Request):
        body = await json_body(s.WeightsInfoBody)(request)
        where = "/weights_info tinker_path"
        run, kind, name = parse_tinker_path(body.tinker_path, where)
        meta = read_meta(checkpoint_dir(st.run_dir, run, kind, name))
        if meta is None:
            raise ShardfitError(f"no checkpoint at '{body.tinker_path}'", where=where,
                                fix="give a path save_state or save_weights_for_sampler returned "
                                    "(list_user_checkpoints lists them)")
        return {"base_model": meta.get("base_model", st.facts.base_model), **lora_facts(st, meta)}


def paginate(request: Request, items: list, default_limit: int, where: str) -> tuple[list, dict]:
    """items[offset : offset + limit] and Tinker's cursor; a bad limit or offset is one line naming it."""
    limit = _int_param(request, "limit", default_limit, 1, MAX_LIMIT, where)
    offset = _int_param(request, "offset", 0, 0, None, where)
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def _int_param(request: Request, key: str, default: int, low: int, high: int | None, where: str) -> int:
    raw = request.query_params.get(key)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < low or (high is not None and int(raw) > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise ShardfitError(f"{key}={raw[:40]!r} is not an integer {span}", where=f"{where} ?{key}",
                            fix=f"pass {key} in {span}")
    return int(raw)


def scan_checkpoints(st: ServerState, run: str | None = None) -> list[dict]:
    """Every complete checkpoint under the run directory (of `run` alone if given), newest first: Tinker's Checkpoint
    fields plus `_meta` (the META as saved) and `_run`. A name that is not a segment, or a link out of the run
    directory, is skipped, never followed."""
    root = st.run_dir / "checkpoints"
    runs = [run] if run is not None else (sorted(p.name for p in root.iterdir()) if root.is_dir() else [])
    out = []
    for r in runs:
        if not SEGMENT.fullmatch(r):
            continue
        for kind in KINDS:
            kind_dir = root / r / kind
            if not kind_dir.is_dir():
                continue
            for d in sorted(kind_dir.iterdir()):
                try:
                    directory = checkpoint_dir(st.run_dir, r, kind, d.name)
                except ShardfitError:
                    continue
                if (meta := read_meta(directory)) is None:
                    continue
                size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
                out.append({"checkpoint_id": f"{kind}/{d.name}", "checkpoint_type": meta.get("checkpoint_type"),
                            "time": meta.get("time"), "tinker_path": meta["tinker_path"], "size_bytes": size,
                            "public": False, "expires_at": meta.get("expires_at"), "training_run_id": r,
                            "_meta": meta})
    out.sort(key=lambda c: (str(c["time"]), c["tinker_path"]), reverse=True)
    return out


def public(checkpoint: dict) -> dict:
    """A scanned checkpoint as the SDK reads it (training_run_id is extra: the SDK ignores it, curl users see it)."""
    return {k: v for k, v in checkpoint.items() if not k.startswith("_")}


def lora_facts(st: ServerState, meta: dict | None) -> dict:
    """is_lora, lora_rank and the adapted layers: as saved in a checkpoint's META, else this server's own."""
    if meta is not None and "is_lora" in meta:
        return {k: meta.get(k) for k in ("is_lora", "lora_rank", *ADAPTS)}
    return st.facts.lora_fields()


def run_record(st: ServerState, run: str, model: dict | None, saved: list[dict]) -> dict:
    """Tinker's TrainingRun of `run`: from its model (None: a run known from its checkpoints on disk alone) and its
    checkpoints (`saved`, newest first)."""
    newest = {t: next((public(c) for c in saved if c["checkpoint_type"] == t), None) for t in ("training", "sampler")}
    if model is not None:
        base, seen, user_metadata, lora = (model["base_model"], model["seen"], model["user_metadata"],
                                           lora_facts(st, None))
    else:
        meta = saved[0]["_meta"]
        base, seen, user_metadata, lora = (meta.get("base_model", st.facts.base_model), saved[0]["time"], None,
                                           lora_facts(st, meta))
    return {"training_run_id": run, "base_model": base, "model_owner": "shardfit", "is_lora": lora["is_lora"],
            "lora_rank": lora["lora_rank"], "corrupted": False, "last_request_time": seen,
            "last_checkpoint": newest["training"], "last_sampler_checkpoint": newest["sampler"],
            "user_metadata": user_metadata}


def training_runs(st: ServerState, project_id: str | None = None) -> list[dict]:
    """This server's models, newest first by creation, then the runs on disk that no model of this process holds,
    newest first by their newest checkpoint. `project_id`: the models whose session named that project alone (a run
    known from disk alone has no project)."""
    saved: dict[str, list[dict]] = {}
    for c in scan_checkpoints(st):
        saved.setdefault(c["training_run_id"], []).append(c)
    with st.lock:
        models = dict(st.models)
        projects = {sid: sess.get("project_id") for sid, sess in st.sessions.items()}
    live = sorted(models.items(), key=lambda kv: kv[1]["created"], reverse=True)
    out = [run_record(st, run, m, saved.get(run, [])) for run, m in live
           if project_id is None or projects.get(m["session_id"]) == project_id]
    if project_id is not None:
        return out
    gone = sorted((r for r in saved if r not in models), key=lambda r: saved[r][0]["time"], reverse=True)
    return out + [run_record(st, r, None, saved[r]) for r in gone]
