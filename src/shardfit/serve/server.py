"""`shardfit serve` on each rank: the Engine everywhere, the HTTP server (uvicorn, in a thread) on rank 0 only, and
the command loop (commands.Loop) on every rank in the main thread.

Start-up: rank 0 holds the run directory (flock, as `shardfit train` does: a second server on it is refused in one
line, before any Engine is built); every rank builds the Engine (its own collectives), then one per frozen extra model
(--serve.models, serve/served.py) in the same order; rank 0 then binds the address, writes the API key when one is
needed, and prints `shardfit serve: listening on http://HOST:PORT` once it
accepts connections.
Shut-down (Ctrl-C / SIGTERM, to rank 0 or to every rank from the launcher): every rank holds the signal; rank 0
closes the scheduler and the loop broadcasts `stop` after the command in hand, carrying one line (which models had
optimizer steps since their last save, now lost) that every rank raises as Stopped (exit 128 + the signal): the
launcher prints it once, and no rank is left in a collective with a peer that is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shardfit.errors import ShardfitError, Stopped
from shardfit.serve.app import build_app
from shardfit.serve.commands import Loop
from shardfit.serve.executor import Executor
from shardfit.serve.sample_joining import SampleJoining
from shardfit.serve.security import setup_api_key
from shardfit.serve.served import served_configs, start_served
from shardfit.serve.state import ModelFacts, ServerState
from shardfit.train.run_config import default_run_dir
from shardfit.train.run_dir import DirLock

FULL_VERSIONS = 2  # serve.versions=0 without LoRA: frozen copies of every weight held at most


def serve_run_dir(cfg) -> Path:
    return Path(cfg.logging.run_dir or default_run_dir(cfg, "serve"))


def hold_run_dir(run_dir: Path) -> DirLock:
    """The run directory for this server alone (DirLock: flock, as shardfit train holds its own), or one line."""
    fix = "stop the server (or run) that holds it, or give this one its own --logging.run_dir"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = DirLock(run_dir)
        held = lock.acquire()
    except OSError as e:
        raise ShardfitError(f"cannot write the run directory ({e.strerror or e})", where=str(run_dir),
                            fix="choose a directory this server can write (--logging.run_dir)") from None
    if held:
        raise ShardfitError(f"run directory is locked: {held}", where=str(run_dir), fix=fix)
    return lock


def model_facts(cfg, name: str | None = None) -> tuple[ModelFacts, object]:
    """(what requests are checked against, rank 0's tokenizer or None); `name`: a frozen extra model's, as given in
    --serve.models."""
    from shardfit.data.tokenizer import build_tokenizer
    from shardfit.weights.tokenizer_files import eos_ids

    model_dir = Path(cfg.model.path) if cfg.model.path else None
    hf_tok = model_dir / "tokenizer.json" if model_dir else None
    spec = str(hf_tok) if hf_tok is not None and hf_tok.is_file() else cfg.data.tokenizer
    try:
        tokenizer = build_tokenizer(spec)
    except Exception as e:  # serving goes on without stop strings; said once
        print(f"shardfit serve: no tokenizer ({spec}: {e}); stop strings are refused", file=sys.stderr)
        tokenizer = None
    facts = ModelFacts(base_model=str(model_dir) if model_dir else cfg.model.name, vocab_size=cfg.model.vocab_size,
                       max_seq_len=cfg.model.max_seq_len,
                       eos_ids=eos_ids(tokenizer, model_dir) if tokenizer is not None else set(),
                       tokenizer_id=str(model_dir) if hf_tok is not None and hf_tok.is_file() else None,
                       has_tokenizer=tokenizer is not None, arch=cfg.model.name, lora_rank=cfg.lora.rank,
                       lora_targets=cfg.lora.targets,
                       max_versions=cfg.serve.versions or (0 if cfg.lora.rank else FULL_VERSIONS),
                       max_models=cfg.serve.max_models)
    if name is not None:
        facts.base_model, facts.trainable = name, False
    return facts, tokenizer


def comm_device(engine) -> torch.device:
    """Where the command broadcasts run: the GPU under NCCL, the host under gloo."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "nccl":
        return engine.dist.device
    return torch.device("cpu")


def start_http(state: ServerState, host: str, port: int):
    """uvicorn in a daemon thread; (server, the bound port) once it accepts connections."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_app(state), host=host, port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="shardfit-http", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            from shardfit.errors import ShardfitError

            raise ShardfitError(f"cannot listen on {host}:{port} (in use, or not this machine's address)",
                                where="--port", fix="pick a free port (or 0: any free port) and a local --host")
        time.sleep(0.05)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, bound


@dataclass
class Serving:
    """Rank 0's running parts: run `loop.run()` (blocks), then `stop()`."""

    state: ServerState
    loop: Loop
    server: object
    thread: threading.Thread
    url: str
    lock: DirLock | None = None

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        if self.lock is not None:
            self.lock.release()


def start_rank0(cfg, engine, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                rl_types: tuple | None = None, poll_s: float = 20.0, max_body: int = 256 << 20,
                lock: DirLock | None = None, served: dict | None = None) -> Serving:
    """Rank 0's parts: the run directory held (unless `lock` already holds it), the key, the HTTP thread. served:
    the frozen extra models' Engines by name (start_served)."""
    run_dir = serve_run_dir(cfg)
    lock = lock or hold_run_dir(run_dir)
    facts, tokenizer = model_facts(cfg)
    budget = getattr(engine, "datum_budget", None)  # the Engine's micro-batch of datum tokens
    facts.token_budget = budget() if budget is not None else 0
    extra = {name: model_facts(c, name) for name, c in served_configs(cfg).items()} if served else {}
    state = ServerState(facts, run_dir, setup_api_key(host, run_dir, api_key), poll_s=poll_s,
                        max_body=max_body, served=[f for f, _ in extra.values()], seq_gap_s=cfg.serve.seq_gap_s)

    def queue_wait(rid: str) -> float:
        t = state.futures.timing(rid)
        return (t.started - t.submitted) if t is not None and t.started is not None else 0.0

    executor = Executor(engine, tokenizer=tokenizer, queue_wait=queue_wait, rl_types=rl_types,
                        served={name: (served[name], tok) for name, (_, tok) in extra.items()})
    state.held = executor.held
    loop = Loop(executor, 0, engine.dist.world_size, comm_device(engine), state.scheduler, state.futures,
                needed=executor.space_needed, done=state.note_done, notes=executor.take_notes,
                combine=lambda pending: executor.combine(pending, state.scheduler))
    if hasattr(executor.rl, "sample_run"):  # samples join a running batch (a test's fake Engine may have none)
        loop.join = SampleJoining(executor, comm_device(engine))
        loop.joining = joins(cfg, engine)
        state.sampling = loop.join.counts
    server, thread, bound = start_http(state, host, port)
    return Serving(state, loop, server, thread, f"http://{'[' + host + ']' if ':' in host else host}:{bound}",
                   lock)


def joins(cfg, engine) -> bool:
    """Whether sample requests join a running decode batch (serve/sample_joining.py) rather than run as batches
    (sample_batch): serve.join, and on N ranks only with sampling.logprobs=decode (a ScoredRun scores its requests
    at the run's end on the rank that decoded them: N ranks keep the batch path for it)."""
    from shardfit.rl.trainer_logprobs import logprobs_mode

    return bool(cfg.serve.join) and (engine.dist.world_size == 1 or logprobs_mode(engine, None) == "decode")


def follower(engine, served: dict) -> Loop:
    """The command loop of a rank other than 0: rank 0's commands on its Engine (and the frozen extra models), a
    broadcast `sample` run as rank 0 runs it (SampleJoining: the same calls, in step)."""
    executor = Executor(engine, served={name: (e, None) for name, e in served.items()})
    loop = Loop(executor, engine.dist.rank, engine.dist.world_size, comm_device(engine))
    loop.join = SampleJoining(executor, comm_device(engine))
    return loop


def hold_signals(on_signal: Callable[[int], None]) -> dict:
    """SIGINT and SIGTERM call on_signal(signum) instead of ending the process; the previous handlers."""
    return {sig: signal.signal(sig, lambda signum, _frame: on_signal(signum))
            for sig in (signal.SIGINT, signal.SIGTERM)}


def run(cfg, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
        engine_factory: Callable | None = None) -> int:
    """Every rank: build the Engine, then serve until stopped; a stop by a signal raises Stopped on every rank."""
    if engine_factory is None:
        from shardfit.engine import Engine

        engine_factory = Engine.start
    lock = hold_run_dir(serve_run_dir(cfg)) if os.environ.get("RANK", "0") == "0" else None  # before the Engine
    try:
        engine = engine_factory(cfg)
        served = start_served(cfg, engine_factory)  # the frozen extra models, in the same order on every rank
        rank, world = engine.dist.rank, engine.dist.world_size
        got: list[int] = []
        if rank != 0:  # the signal is held: rank 0's `stop` ends this loop at the same command as its own
            previous = hold_signals(got.append)
            loop = follower(engine, served)
        else:
            serving = start_rank0(cfg, engine, host=host, port=port, api_key=api_key, lock=lock, served=served)
            state, loop = serving.state, serving.loop

            def on_signal(signum: int) -> None:
                got.append(signum)
                state.scheduler.close()

            previous = hold_signals(on_signal)
            loop.stop_args = lambda: {"line": state.stop_line(got[0]), "exit_code": 128 + got[0]} if got else {}
            key_note = (f" (API key in {state.run_dir / 'api_key'})" if state.api_key else
                        " (any tml- key on loopback)")
            for notice in engine.notices:  # what the Engine's build chose (LoRA, offload, FP8, loading), as train
                print(f"shardfit serve: {notice}", flush=True)
            training = (f"LoRA adapters of rank {cfg.lora.rank}" if cfg.lora.rank else
                        "every parameter (start with --lora.rank=R for LoRA adapters)")
            also = "".join(f"; sampling also {name}" for name in served)
            print(f"shardfit serve: listening on {serving.url}{key_note}; {state.facts.base_model}, {world} rank(s); "
                  f"training {training}{also}", flush=True)
        try:
            stop = loop.run()
        finally:
            if rank == 0:
                serving.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        if lock is not None:
            lock.release()
    if stop.args.get("line"):
        raise Stopped(stop.args["line"], exit_code=int(stop.args["exit_code"]))
    return 0
