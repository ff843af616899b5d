"""What rank 0's HTTP side knows: the served models' facts, sessions, training models, sampling sessions, what
a checkpoint's META records (its listing entry: serve/listings.py reads it) and the idempotency cache. No torch
here: the HTTP threads never touch the Engine.

With --lora.rank every training model is a model of the Engine's registry (engine/registry.py: its own adapters and
optimizer state on the one frozen base), named by its model_id, up to --serve.max_models; without it the server
holds one training model that trains every parameter: a second, and a client asking for LoRA (a rank > 0), are
refused in one line naming --lora.rank. A sampling session samples what it was made from (new_sampler's `weights`):
a frozen version of a model (save_weights_for_sampler, or a saved path loaded into one; without LoRA a copy of every
weight), the base alone, a frozen extra model (--serve.models: `served`), or a model's live weights (the SDK's
kind="inflight"). Versions are held up to --serve.versions (ModelFacts.max_versions): past it a new one is refused,
never a silent sample of the live weights. The version ids live on every rank's executor (the same commands make the
same ids); rank 0's HTTP side knows only which sampling sessions exist, whose they are and when they expire, and
asks for their release (a `release_samplers` command) when their session finishes or their ttl_seconds pass. A
model's seq_id order is kept by ordering.Scheduler.
Each model counts its optimizer steps since its last save_state (or load), for the
line a stopped server prints: training nobody saved is said to be lost, never silently dropped.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from shardfit.errors import ShardfitError, shown
from shardfit.serve.futures import FutureStore
from shardfit.serve.ordering import Scheduler
from shardfit.serve.security import check_segment, checkpoint_dir, parse_tinker_path

META = ".tinker.json"  # beside a saved checkpoint's files: what the listings show (serve/listings.py)
VERSION, BASE, LIVE = "version", "base", "live:"  # what a sampling session reads (new_sampler)


@dataclass
class ModelFacts:
    """The served model, as requests are checked against it."""

    base_model: str  # the name clients pass: a preset (tiny) or the HF directory given at start
    vocab_size: int
    max_seq_len: int
    eos_ids: set[int] = field(default_factory=set)
    tokenizer_id: str | None = None  # what get_info reports (an HF directory), or None
    has_tokenizer: bool = False
    arch: str = ""
    lora_rank: int = 0  # the Engine's lora.rank: 0 trains every parameter
    lora_targets: str = ""  # the Engine's lora.targets: which layers a LoRA model adapts
    token_budget: int = 0  # the Engine's micro-batch of datum tokens (a longer datum is refused); 0: none
    max_versions: int = 0  # frozen versions held at most (serve.versions, resolved); 0: no limit
    max_models: int = 0  # LoRA training models held at most (serve.max_models); 0: no limit
    trainable: bool = True  # False: a frozen extra model (--serve.models), sampled and scored only
    quantize: str = "none"  # the Engine's model.quantize: a quantized base trains and scores, and is not sampled

    def check_lora_rank(self, rank: int | None, where: str) -> None:
        """A LoRA server trains adapters of its own rank only: a client asking for another would get different
        numbers of trainable parameters than it asked for, silently. A server without LoRA trains every parameter:
        a client asking for LoRA (a rank > 0; the SDK always sends one) would train every parameter with the learning
        rate it chose for adapters, silently; rank=0 asks for every parameter."""
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
            # raw JSON may send "8" or true: compared below as a number it reads as a rank it is not
            raise ShardfitError(f"rank={shown(rank)} is not an integer >= 0", where=where,
                                fix=f"send rank as a JSON integer ({self.lora_rank} on this server)")
        if not self.lora_rank and rank:
            raise ShardfitError(f"this server trains every parameter (started without --lora.rank), not LoRA "
                                f"adapters of rank {rank}", where=where,
                                fix=f"pass rank=0 to train every parameter, or start shardfit serve with "
                                f"--lora.rank={rank}")
        if self.lora_rank and rank is not None and rank != self.lora_rank:
            raise ShardfitError(f"this server trains LoRA adapters of rank {self.lora_rank}, not {rank}", where=where,
                                fix=f"pass rank={self.lora_rank}, or start shardfit serve with --lora.rank={rank}")

    def adapts(self) -> dict[str, bool]:
        """What the server's adapters cover, as the SDK's lora_config names it (train_mlp, train_attn,
        train_unembed)."""
        names = {t.strip() for t in self.lora_targets.split(",") if t.strip()}
        every = "all-linear" in names
        return {"train_attn": every or bool(names & {"q_proj", "k_proj", "v_proj", "o_proj"}),
                "train_mlp": every or bool(names & {"gate_proj", "up_proj", "down_proj"}) or any(
                    n.startswith("experts") for n in names),
                "train_unembed": "lm_head" in names}

    def check_lora_config(self, config: dict, where: str) -> None:
        """The SDK's lora_config against what this server trains: one line naming the field that cannot be served.
        train_unembed=True (the SDK's default) is accepted without lm_head adapters (it is what every default
        client sends; get_info's lora_rank and the server's start line say what is trained); asking for none
        where the server adapts lm_head is refused, as are train_mlp / train_attn that differ."""
        self.check_lora_rank(config.get("rank"), f"{where}.rank")
        if not self.lora_rank:
            return
        have = self.adapts()
        for key in ("train_attn", "train_mlp", "train_unembed"):
            want = config.get(key)
            if want is None or bool(want) == have[key] or (key == "train_unembed" and want):
                continue
            raise ShardfitError(f"{key}={bool(want)}: this server's adapters (--lora.targets={self.lora_targets}) "
                                f"{'cover' if have[key] else 'leave out'} those layers", where=f"{where}.{key}",
                                fix=f"pass {key}={have[key]}, or start shardfit serve with --lora.targets naming the "
                                "layers you train")

    def check_sampling(self, where: str) -> None:
        """A quantized base (model.quantize) is not sampled: the decode model holds no quantized layer
        (sampling/source.py), and compute_logprobs is a sample of one token. Refused here, before the request is
        queued, in one line that names what scores instead (the training client's forward runs the Engine)."""
        if self.quantize != "none":
            raise ShardfitError(f"sampling from a quantized base (model.quantize={self.quantize}) is not served, nor "
                                "compute_logprobs (a sample of one token)", where=where,
                                fix="score with a training client's forward (its loss_fn_outputs' logprobs; a frozen "
                                "reference: a training client created from its saved state); sample the merged model "
                                "(shardfit export) in an inference engine, or serve with --model.quantize=none")

    def lora_fields(self) -> dict:
        """What this server trains, as Tinker's TrainingRun and WeightsInfoResponse name it."""
        adapts = self.adapts() if self.lora_rank else dict.fromkeys(("train_attn", "train_mlp", "train_unembed"))
        return {"is_lora": bool(self.lora_rank), "lora_rank": self.lora_rank or None, **adapts}

    def accepts(self, name: str) -> bool:
        if name == self.base_model:
            return True
        try:
            return Path(name).resolve() == Path(self.base_model).resolve() and Path(name).is_dir()
        except (OSError, ValueError):
            return False


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


class ServerState:
    def __init__(self, facts: ModelFacts, run_dir: Path, api_key: str | None, *, max_body: int = 256 << 20,
                 poll_s: float = 20.0, served: list[ModelFacts] = (), seq_gap_s: float = 0.0):
        self.facts, self.run_dir, self.api_key, self.max_body = facts, run_dir, api_key, max_body
        self.served = list(served)  # the frozen extra models (--serve.models), sampled and scored only
        self.scheduler = Scheduler(gap_s=seq_gap_s)
        self.futures = FutureStore(poll_s=poll_s)
        self.lock = threading.Lock()
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self._idem: OrderedDict[str, dict] = OrderedDict()
        self.held = dict  # () -> the Engine's models and versions held (the executor's registry summary)
        self.sampling = dict  # () -> one rank's sample-run counters (serve/sample_joining.py); {} on N ranks
        self.bugs = 0  # requests that raised what no check foresaw (app.py answers them 400, never 5xx)

    # ------------------------------------------------------------------ sessions and models
    def new_session(self, body: dict) -> str:
        sid = "sess-" + secrets.token_hex(16)
        with self.lock:
            self.sessions[sid] = {"created": time.time(), "seen": time.time(),
                                  "user_metadata": body.get("user_metadata"), "project_id": body.get("project_id")}
        return sid

    def session(self, sid: str, where: str) -> dict:
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            raise ShardfitError(f"unknown session '{sid[:80]}'", where=where,
                                fix="create a session first (the SDK's ServiceClient does)")
        s["seen"] = time.time()
        return s

    def check_base_model(self, name: str, where: str, sampling: bool = False) -> ModelFacts:
        """The served model `name` names (the trained one's base, or with `sampling` a frozen extra model too), or
        one line naming what is served."""
        if self.facts.accepts(name):
            return self.facts
        extra = next((f for f in self.served if f.accepts(name)), None)
        if extra is not None and sampling:
            return extra
        if extra is not None:
            raise ShardfitError(f"'{extra.base_model}' is served for sampling and scoring only (--serve.models): "
                                "training clients train the server's model", where=where,
                                fix=f"pass base_model='{self.facts.base_model}', or sample '{extra.base_model}' "
                                "with create_sampling_client(base_model=...)")
        names = ", ".join(f"'{f.base_model}'" for f in [self.facts, *self.served])
        raise ShardfitError(f"this server serves {names}, not '{name[:200]}'", where=where,
                            fix=f"pass base_model='{self.facts.base_model}'" + (" (or a --serve.models one to sample)"
                                                                                if self.served else "")
                            + ", or start shardfit serve with --model.name=PRESET or --model.path=HF_DIR")

    def add_model(self, session_id: str, model_seq_id: int, base_model: str, user_metadata: dict | None,
                  lora_rank: int | None, where: str = "/create_model") -> str:
        """A training model's id and record (the Engine's model is made by its create_model / load_state command).
        Without LoRA the Engine holds one model: a second create_model would train the first one's weights, so it is
        refused; a model made from a saved state (/load_weights) takes the one model over, and the model it
        replaces is refused from then on (its client would train the loaded weights)."""
        if model_seq_id < 0:  # the SDK numbers its training clients 0, 1, ...: a negative one is a hand-made request
            raise ShardfitError(f"model_seq_id={model_seq_id} is negative", where=f"{where} model_seq_id",
                                fix="send a model_seq_id >= 0 (the SDK numbers its training clients itself)")
        model_id = check_segment(f"{session_id}:train:{model_seq_id}", "model_id")  # the SDK rebuilds this id itself
        with self.lock:
            if model_id in self.models:  # the Engine refuses it too, after this record was overwritten
                raise ShardfitError(f"model_seq_id {model_seq_id} of this session is taken (model '{model_id}')",
                                    where=f"{where} model_seq_id", fix="send a new model_seq_id (the SDK numbers its "
                                    "training clients itself)")
            cap = self.facts.max_models
            if self.facts.lora_rank and cap and len(self.models) >= cap:
                raise ShardfitError(f"this server holds {len(self.models)} training models, its limit "
                                    f"(--serve.max_models={cap})", where=where,
                                    fix="train on an existing client, or start shardfit serve with a larger "
                                    "--serve.max_models (shardfit plan --models N says how many fit)")
            if not self.facts.lora_rank:
                live = [m for m, d in self.models.items() if not d.get("replaced_by")]
                if live and where != "/load_weights":
                    raise ShardfitError("this server trains every parameter of one model, and it has one already",
                                        where=where, fix="start shardfit serve with --lora.rank=R (e.g. 16) to train "
                                        "several models on one base")
                for m in live:
                    self.models[m]["replaced_by"] = model_id
            self.models[model_id] = {"base_model": base_model, "session_id": session_id, "created": now_iso(),
                                     "seen": now_iso(),
                                     "user_metadata": user_metadata, "requested_lora_rank": lora_rank,
                                     "unsaved": 0}
        self.scheduler.add_model(model_id)
        return model_id

    def model(self, model_id: str, where: str) -> dict:
        with self.lock:
            m = self.models.get(model_id)
        if m is None:
            raise ShardfitError(f"unknown model_id '{str(model_id)[:120]}'", where=where,
                                fix="create the model first (ServiceClient.create_lora_training_client)")
        if m.get("replaced_by"):
            raise ShardfitError(f"model '{model_id}' was replaced by '{m['replaced_by']}', loaded from a saved state: "
                                "this server trains every parameter of one model", where=where,
                                fix="use the client create_training_client_from_state returned, or start shardfit "
                                "serve with --lora.rank=R to hold several models")
        m["seen"] = now_iso()
        return m

    def new_sampler(self, session_id: str, weights: str, model_path: str | None = None,
                    ttl_s: float | None = None, served: str | None = None, where: str = "/save_weights_for_sampler"
                    ) -> str:
        """A sampling session of `session_id` reading `weights`: VERSION (the version its command freezes or loads,
        kept by the executors under the sampler's id), BASE (`served`: of that frozen extra model), or LIVE + a
        model_id. A VERSION past max_versions is refused in one line naming --serve.versions."""
        sid = "samp-" + secrets.token_hex(16)
        with self.lock:
            held, cap = sum(s["weights"] == VERSION for s in self.samplers.values()), self.facts.max_versions
            if weights == VERSION and cap and held >= cap:
                what = "adapters" if self.facts.lora_rank else "copies of every weight"
                raise ShardfitError(f"this server holds {held} frozen versions ({what}), its limit "
                                    f"(--serve.versions={cap})", where=where,
                                    fix="let a sampling client go (its session's close(), or ttl_seconds on the "
                                    "save), sample the live weights (kind='inflight'), or start shardfit serve with a "
                                    "larger --serve.versions (shardfit plan --versions K counts them)")
            self.samplers[sid] = {"base_model": served or self.facts.base_model, "model_path": model_path,
                                  "weights": weights, "session_id": session_id, "served": served,
                                  "expires": time.monotonic() + ttl_s if ttl_s else None}
        return sid

    def sampler(self, sid: str, where: str) -> dict:
        with self.lock:
            s = self.samplers.get(sid)
        if s is None:
            raise ShardfitError(f"unknown sampling session '{str(sid)[:80]}' (never made, or freed: its session "
                                "finished or its ttl_seconds passed)", where=where,
                                fix="create it with create_sampling_client or save_weights_and_get_sampling_client")
        return s

    def drop_samplers(self, session_id: str | None = None) -> list[str]:
        """Forget the sampling sessions of `session_id` (None: those past their ttl); their ids, whose versions the
        caller releases on every rank (a release_samplers command)."""
        now = time.monotonic()
        with self.lock:
            gone = [sid for sid, s in self.samplers.items()
                    if (s["session_id"] == session_id if session_id is not None
                        else s["expires"] is not None and s["expires"] <= now)]
            for sid in gone:
                del self.samplers[sid]
        return gone

    # ------------------------------------------------------------------ idempotency (the SDK's retries)
    def remembered(self, owner: str | None, key: str | None) -> dict | None:
        """The first answer to a POST retried with the same X-Idempotency-Key, by the same principal only (another
        key replaying it must not learn the request id)."""
        if not key:
            return None
        with self.lock:
            return self._idem.get(f"{owner}\0{key}")

    def remember(self, owner: str | None, key: str | None, response: dict) -> None:
        if not key:
            return
        with self.lock:
            self._idem[f"{owner}\0{key}"] = response
            while len(self._idem) > 10000:
                self._idem.popitem(last=False)

    # ------------------------------------------------------------------ unsaved training, said at stop
    def note_done(self, cmd, result) -> None:
        """After each command (the loop's thread, rank 0): a model's optimizer steps since its last save or load."""
        if result.error is not None:
            return
        model_id = cmd.model_id or cmd.args.get("model_id", "")
        with self.lock:
            m = self.models.get(model_id)
            if m is None:
                return
            if cmd.kind == "optim_step":
                m["unsaved"] += 1
            elif cmd.kind == "load_state" or (cmd.kind == "save_state" and cmd.args.get("optimizer")):
                m["unsaved"] = 0  # what a resume needs: weights and optimizer (save_state, not a sampler's save)

    def stop_line(self, signum: int) -> str:
        """What a server stopped by a signal says, once: which training was never saved, now lost."""
        how = "interrupted (SIGINT)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        with self.lock:
            lost = {m: d["unsaved"] for m, d in self.models.items() if d.get("unsaved") and not d.get("replaced_by")}
        if not lost:
            return f"serve {how}: no model had optimizer steps since its last save_state"
        names = ", ".join(f"{m} ({n})" for m, n in list(lost.items())[:3]) + (", ..." if len(lost) > 3 else "")
        n = len(lost)
        return (f"serve {how}: {n} model{'s' if n > 1 else ''} had unsaved steps since {'their' if n > 1 else 'its'} "
                f"last save, {sum(lost.values())} optimizer steps now lost: {names}; save_state before stopping keeps "
                "them")

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_target(self, run: str, kind: str, name: str) -> tuple[Path, str]:
        """(directory, tinker path) of a checkpoint named by a request, inside the run directory."""
        return checkpoint_dir(self.run_dir, run, kind, name), f"tinker://{run}/{kind}/{name}"

    def saved_checkpoint(self, path: str, where: str) -> tuple[Path, str]:
        """(directory, tinker path) of a checkpoint a request names to load (create_sampling_client(model_path),
        load_state, create_training_client_from_state), or one line: no such checkpoint, one of another model, or
        one this server cannot load (LoRA adapters on a server that trains every parameter, every weight on a LoRA
        server, adapters of another rank or other layers), as its META says."""
        directory, tinker_path = self.checkpoint_target(*parse_tinker_path(path, where))
        meta = read_meta(directory)
        if meta is None:
            raise ShardfitError(f"no checkpoint at '{tinker_path}'", where=where,
                                fix="give a path save_state or save_weights_for_sampler returned "
                                "(list_user_checkpoints lists them)")
        f, base = self.facts, meta.get("base_model", self.facts.base_model)
        if not f.accepts(str(base)):
            raise ShardfitError(f"'{tinker_path}' holds weights of '{str(base)[:200]}', this server serves "
                                f"'{f.base_model}'", where=where, fix="load it on a server of that model (shardfit "
                                "serve --model.name or --model.path as it was saved), or give a checkpoint of this one")
        if "is_lora" not in meta:
            return directory, tinker_path
        rank = meta.get("lora_rank") if meta["is_lora"] else 0
        if (rank or 0) != f.lora_rank:
            held = f"LoRA adapters of rank {rank}" if rank else "every weight (saved without --lora.rank)"
            here = f"LoRA adapters of rank {f.lora_rank}" if f.lora_rank else "every parameter (no --lora.rank)"
            raise ShardfitError(f"'{tinker_path}' holds {held}; this server trains {here}", where=where,
                                fix="load it on a server started " + (f"with --lora.rank={rank}" if rank else
                                                                        "without --lora.rank"))
        adapts = f.lora_fields()
        other = [k for k in ("train_attn", "train_mlp", "train_unembed") if k in meta and meta[k] != adapts[k]]
        if rank and other:
            saved = ", ".join(f"{k}={meta[k]}" for k in other)
            raise ShardfitError(f"'{tinker_path}' holds adapters of other layers ({saved}) than this server's "
                                f"(--lora.targets={f.lora_targets})", where=where,
                                fix="load it on a server started with the --lora.targets it was saved with")
        return directory, tinker_path

    def checkpoint_meta(self, tinker_path: str, kind: str, model_id: str, ttl_s: float | None = None) -> str:
        """The listings' entry of a checkpoint (serve/listings.py), written beside its files once they are complete:
        what get_weights_info_by_tinker_path and a training run listed after a restart report. With ttl_s, Tinker's
        expires_at: a wall-clock time, as the checkpoint outlives the server (read_meta expires it)."""
        with self.lock:
            base_model = self.models.get(model_id, {}).get("base_model", self.facts.base_model)
        expires = {"expires_at": (datetime.now(timezone.utc) + timedelta(seconds=ttl_s)).isoformat()} if ttl_s else {}
        return json.dumps({"tinker_path": tinker_path, "checkpoint_type": "training" if kind == "weights"
                           else "sampler", "time": now_iso(), "model_id": model_id, "base_model": base_model,
                           **self.facts.lora_fields(), **expires})


def read_meta(directory: Path) -> dict | None:
    """A checkpoint's META, or None where there is none (being written, deleted, not ours), it lacks the fields
    every listing shows, or its ttl_seconds have passed: every listing and load looks a checkpoint up here, so an
    expired one is deleted when it is next looked at, as sampling sessions past their ttl are (no thread of its own)."""
    # TypeError: an expires_at without a time zone (not one serve wrote) cannot be compared with now
    with contextlib.suppress(OSError, ValueError, TypeError):
        meta = json.loads((directory / META).read_text(encoding="utf-8"))
        if (isinstance(meta, dict) and isinstance(meta.get("tinker_path"), str) and isinstance(meta.get("time"), str)
                and meta.get("checkpoint_type") in ("training", "sampler")):
            expires = meta.get("expires_at")
            if expires is not None and not isinstance(expires, str):
                return None  # not one serve wrote
            if expires is not None and datetime.fromisoformat(expires) <= datetime.now(timezone.utc):
                remove_checkpoint(directory)
                return None
            return meta  # else not one serve wrote: a listing the SDK could not read is never answered
    return None


def remove_checkpoint(directory: Path) -> None:
    (directory / META).unlink(missing_ok=True)  # out of the listing first: a half-deleted checkpoint is never listed
    shutil.rmtree(directory, ignore_errors=True)
