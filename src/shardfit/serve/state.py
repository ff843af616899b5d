"""What rank 0's HTTP side knows: the served model's facts, sessions, training models, sampling sessions, the
checkpoints listing and the idempotency cache. No torch here: the HTTP threads never touch the Engine.

One Engine serves one set of weights: every training model created on it trains those weights (LoRA adapters of
the server's --lora.rank, or every parameter when it was started without one, which get_info and the first
create_model say), and a sampling session samples them as they are when its request runs. A model's seq_id order
is kept by ordering.Scheduler. Each model counts its optimizer steps since its last save_state (or load), for the
line a stopped server prints: training nobody saved is said to be lost, never silently dropped.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.serve.futures import FutureStore
from shardfit.serve.ordering import Scheduler
from shardfit.serve.security import KINDS, check_segment, checkpoint_dir

META = ".tinker.json"  # beside a saved checkpoint's files: what the checkpoints listing shows


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
    token_budget: int = 0  # the Engine's micro-batch of datum tokens (a longer datum is refused); 0: none

    def check_lora_rank(self, rank: int | None, where: str) -> None:
        """A LoRA server trains adapters of its own rank only: a client asking for another would get different
        numbers of trainable parameters than it asked for, silently."""
        if self.lora_rank and rank is not None and rank != self.lora_rank:
            raise ShardfitError(f"this server trains LoRA adapters of rank {self.lora_rank}, not {rank}", where=where,
                                fix=f"pass rank={self.lora_rank}, or start shardfit serve with --lora.rank={rank}")

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
                 poll_s: float = 20.0):
        self.facts, self.run_dir, self.api_key, self.max_body = facts, run_dir, api_key, max_body
        self.scheduler = Scheduler()
        self.futures = FutureStore(poll_s=poll_s)
        self.lock = threading.Lock()
        self.sessions: dict[str, dict] = {}
        self.models: dict[str, dict] = {}
        self.samplers: dict[str, dict] = {}
        self._idem: OrderedDict[str, dict] = OrderedDict()
        self.bugs = 0  # requests that raised what no check foresaw (app.py answers them 400, never 5xx)

    # ------------------------------------------------------------------ sessions and models
    def new_session(self, body: dict) -> str:
        sid = "sess-" + secrets.token_hex(16)
        with self.lock:
            self.sessions[sid] = {"created": time.time(), "seen": time.time(),
                                  "user_metadata": body.get("user_metadata")}
        return sid

    def session(self, sid: str, where: str) -> dict:
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            raise ShardfitError(f"unknown session '{sid[:80]}'", where=where,
                                fix="create a session first (the SDK's ServiceClient does)")
        s["seen"] = time.time()
        return s

    def check_base_model(self, name: str, where: str) -> None:
        if not self.facts.accepts(name):
            raise ShardfitError(f"this server serves '{self.facts.base_model}', not '{name[:200]}'", where=where,
                                fix=f"pass base_model='{self.facts.base_model}', or start shardfit serve with "
                                "--model.name=PRESET or --model.path=HF_DIR")

    def add_model(self, session_id: str, model_seq_id: int, base_model: str, user_metadata: dict | None,
                  lora_rank: int | None) -> str:
        model_id = check_segment(f"{session_id}:train:{model_seq_id}", "model_id")  # the SDK rebuilds this id itself
        with self.lock:
            self.models[model_id] = {"base_model": base_model, "created": now_iso(), "seen": now_iso(),
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
        m["seen"] = now_iso()
        return m

    def new_sampler(self, model_path: str | None, model_id: str | None) -> str:
        sid = "samp-" + secrets.token_hex(16)
        with self.lock:
            self.samplers[sid] = {"base_model": self.facts.base_model, "model_path": model_path,
                                  "model_id": model_id}
        return sid

    def sampler(self, sid: str, where: str) -> dict:
        with self.lock:
            s = self.samplers.get(sid)
        if s is None:
            raise ShardfitError(f"unknown sampling session '{str(sid)[:80]}'", where=where,
                                fix="create it with create_sampling_client or save_weights_and_get_sampling_client")
        return s

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
            lost = {m: d["unsaved"] for m, d in self.models.items() if d.get("unsaved")}
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

    def checkpoint_meta(self, tinker_path: str, kind: str, model_id: str) -> str:
        return json.dumps({"tinker_path": tinker_path, "checkpoint_type": "training" if kind == "weights"
                           else "sampler", "time": now_iso(), "model_id": model_id})

    def list_checkpoints(self, run: str) -> list[dict]:
        check_segment(run, "run")
        out = []
        for kind in KINDS:
            root = checkpoint_dir(self.run_dir, run, kind, "x").parent
            if not root.is_dir():
                continue
            for d in sorted(root.iterdir()):
                meta = d / META
                if not meta.is_file():
                    continue  # being written, or not ours
                m = json.loads(meta.read_text(encoding="utf-8"))
                size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
                out.append({"checkpoint_id": f"{kind}/{d.name}", "checkpoint_type": m["checkpoint_type"],
                            "time": m["time"], "tinker_path": m["tinker_path"], "size_bytes": size})
        return out

    def training_run(self, run: str) -> dict:
        m = self.model(run, f"/training_runs/{run[:80]}")
        return {"training_run_id": run, "base_model": m["base_model"], "model_owner": "shardfit",
                "is_lora": bool(self.facts.lora_rank), "lora_rank": self.facts.lora_rank or None,
                "last_request_time": m["seen"], "corrupted": False,
                "user_metadata": m["user_metadata"]}
