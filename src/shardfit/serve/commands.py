"""Commands and the loop every rank runs: rank 0 takes the next command from the queue and broadcasts it, every
rank executes it on the Engine, rank 0 files the result.

Collectives per command, identical on every rank and in this order: one broadcast of the length (int64 [1]), one of
the JSON bytes (uint8 [n]) -- never pickle: a command is plain JSON, arrays in it base64 -- then the Engine's own.
When the queue stays empty for `idle_s`, rank 0 broadcasts a no-op, so that the other ranks' wait in the broadcast
never reaches the process group's timeout. Whatever a command raises (the Engine checks its input, and agrees on a
save's outcome, the same way on every rank) becomes the request's answer in one place, `failure_result`, and the
loop goes on in step:
- a full disk (fsutil.full_disk anywhere in the exception's chain, or the Engine's own DiskFull): category server,
  naming the directory and the space needed; nothing is listed from the failed save, the previous checkpoint is
  untouched, and the same save works once space is freed;
- a ShardfitError (bad input only the Engine could tell, raised on every rank alike): category user, its line;
- anything else, BaseException subclasses included (DCP's CheckpointException is not an Exception): a server bug,
  its traceback printed once on rank 0, category server.
KeyboardInterrupt and SystemExit are not caught: they end the process.
Sample requests run in batches: when the next ready command is a `sample`, rank 0 takes every `sample` ready right
behind it too (any sampling client, model or version; ordering.take_following: never past another command) up to
BATCH_ROWS rows (num_samples summed), and broadcasts them as one `sample_batch` command, which the executor runs as
one Engine.sample call per Engine (the trained one, each served extra model; without LoRA one per weights, which are
swapped in one at a time); each request's Result is filed under its own request id, and one the Engine refuses
fails alone with its line (Engine.sample's refused="return").
With `join` (server.py sets it on every rank unless serve.join=false, or on N ranks sampling.logprobs=trainer) a
sample instead starts a sample run (serve/sample_joining.py): the samples ready behind it and those that become
ready while it decodes join its decode batch between chunks of steps, each answered when its own rows end; the
run's intake ends at the first ready command that is not a sample. On N ranks the `sample` command is broadcast as
any other, and the run then keeps the ranks in step itself: between chunks rank 0 broadcasts what joins and whether
the run goes on (broadcast_command), and the results that ended travel to rank 0 (sample_joining.py's protocol).
Once the scheduler is closed (SIGINT / SIGTERM), rank 0 broadcasts `stop` after the command in hand, carrying the stop
line every rank raises (server.py): every rank leaves at the same command.
"""

from __future__ import annotations

import base64
import json
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from shardfit.errors import DiskFull, ShardfitError
from shardfit.fsutil import full_disk_error
from shardfit.parallel.compile_watch import FallbackNotes
from shardfit.serve.futures import FutureStore, Result
from shardfit.serve.ordering import Scheduler
from shardfit.serve.protocol import WireDatum

NOOP, STOP, SAMPLE, SAMPLE_BATCH = "noop", "stop", "sample", "sample_batch"
# several models' requests of one kind (forward, or forward_backward) in one pass: args {"parts": [Command]}
MANY = "forward_backward_many"
# Rows (num_samples summed) of one batch of sample requests (or of a sample run's requests in flight): the
# Sampler's max_rows (256, the rows that decode at once) x 4, so that rows finishing make room for waiting ones within
# one call; a request alone may reach it.
BATCH_ROWS = 1024
SPACE_FIX = "free space there: the server and its models keep running, and the same request works once it is freed"


@dataclass
class Command:
    kind: str  # forward_backward | optim_step | save_state | load_state | sampler_snapshot | sample_batch | noop | stop
    request_id: str = ""
    args: dict = field(default_factory=dict)
    model_id: str = ""  # the training model whose seq_id orders it ("" for sampling)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Command:
        return cls.from_dict(json.loads(raw.decode()))

    @classmethod
    def from_dict(cls, d: dict) -> Command:
        return cls(kind=str(d["kind"]), request_id=str(d["request_id"]), args=dict(d["args"]),
                   model_id=str(d.get("model_id", "")))

    def members(self) -> list[Command]:
        """The commands this one answers: a sample_batch's or a forward_backward_many's requests, else itself."""
        if self.kind == SAMPLE_BATCH:
            return [Command.from_dict(d) for d in self.args["commands"]]
        if self.kind == MANY:
            return [Command.from_dict(d) for d in self.args["parts"]]
        return [self]


def batch_samples(first: Command, scheduler: Scheduler) -> Command:
    """`first` (a sample) and the samples ready right behind it, up to BATCH_ROWS rows, as one sample_batch."""
    rows = [int(first.args["num_samples"])]

    def fits(p) -> bool:
        c = p.command
        if c.kind != SAMPLE or rows[0] + int(c.args["num_samples"]) > BATCH_ROWS:
            return False
        rows[0] += int(c.args["num_samples"])
        return True

    cmds = [first] + [p.command for p in scheduler.take_following(fits)]
    return Command(SAMPLE_BATCH, first.request_id, {"commands": [asdict(c) for c in cmds]})


def array_to_json(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def array_from_json(d: dict) -> np.ndarray:
    dtype = np.dtype(d["dtype"])
    if dtype.kind not in "fiu":  # numbers only: an object dtype would be a pickle
        raise ValueError(f"unexpected dtype {dtype}")
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=dtype).reshape(d["shape"]).copy()


def datums_to_json(datums: list[WireDatum]) -> list[dict]:
    return [{"tokens": array_to_json(d.tokens), "inputs": {k: array_to_json(v) for k, v in d.inputs.items()}}
            for d in datums]


def datums_from_json(items: list[dict]) -> list[WireDatum]:
    return [WireDatum(array_from_json(d["tokens"]), {k: array_from_json(v) for k, v in d["inputs"].items()})
            for d in items]


def _what(cmd) -> str:
    path = cmd.args.get("tinker_path") if isinstance(cmd.args, dict) else None
    return f"checkpoint {path}" if path else f"the {cmd.kind} request's files"


def failure_result(e: BaseException, cmd, rank: int, needed: int | None = None) -> Result:
    """The Result of command `cmd` that raised `e`; needed: the bytes its writes take (a save), when known."""
    if isinstance(e, DiskFull):  # the Engine's checkpoint writer named it (every rank agreed)
        return Result(error=str(ShardfitError(e.what, where=e.where, fix=SPACE_FIX)), category="server")
    directory = cmd.args.get("dir", "") if isinstance(cmd.args, dict) else ""
    disk = full_disk_error(e, directory, _what(cmd), SPACE_FIX, needed)
    if disk is not None:
        return Result(error=str(disk), category="server")
    if isinstance(e, ShardfitError):
        return Result(error=str(e), category="user")
    if rank == 0:  # a bug: said once with its traceback, the request failed, the loop goes on
        traceback.print_exception(type(e), e, e.__traceback__)
    said = (str(e).strip().splitlines() or [""])[0][:300]
    return Result(error=f"{type(e).__name__}: {said} (a server bug: see the server's log)", category="server")


def broadcast_command(cmd: Command | None, rank: int, world: int, device: torch.device) -> Command:
    """Rank 0's command on every rank (two broadcasts: the length, then the bytes)."""
    if world == 1:
        return cmd
    import torch.distributed as dist

    raw = cmd.to_bytes() if rank == 0 else b""
    n = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(n, 0)
    buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device) if rank == 0
           else torch.empty(int(n.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, 0)
    return cmd if rank == 0 else Command.from_bytes(buf.cpu().numpy().tobytes())


@dataclass
class Loop:
    """The command loop of one rank. `execute(cmd) -> (Result, phases)` runs the command on the Engine (every rank);
    on rank 0 `scheduler` and `futures` are the server's, elsewhere None. Rank 0's hooks: `needed(cmd)` the bytes a
    command writes (a full disk's message), `done(cmd, result)` after each command, `stop_args()` what `stop`
    carries to every rank."""

    execute: Callable[[Command], tuple[Result, dict[str, float]]]
    rank: int
    world: int
    device: torch.device
    scheduler: Scheduler | None = None
    futures: FutureStore | None = None
    idle_s: float = 30.0
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    needed: Callable[[Command], int | None] | None = None
    done: Callable[[Command, Result], None] | None = None
    stop_args: Callable[[], dict] | None = None
    combine: Callable[[object], Command] | None = None  # rank 0: a ready Pending -> its command, or a MANY of several
    # join(first sample, take_samples, file) runs a sample run that later samples join (sample_joining.py); on N
    # ranks every rank's loop has one (rank 0's broadcast `sample` decides), rank 0's decides what it broadcasts
    join: Callable | None = None
    joining: bool = True  # rank 0: a ready sample starts a run (with `join`), else a sample_batch
    # compiled functions dynamo gave up on (they run eager from then on): each told once, after the request that met it
    fallbacks: FallbackNotes = field(default_factory=FallbackNotes)
    notes: Callable[[], list[str]] | None = None  # rank 0: more lines to tell after a request (the executor's)

    def next_command(self) -> Command:
        """Rank 0: the next ready command, a no-op after idle_s, or stop once the scheduler is closed."""
        pending = self.scheduler.next(self.idle_s)
        if pending is not None:
            if pending.command.kind == SAMPLE:
                if self.join is not None and self.joining:
                    return pending.command
                return batch_samples(pending.command, self.scheduler)
            return self.combine(pending) if self.combine is not None else pending.command
        if self.scheduler.closed:
            return Command(STOP, args=self.stop_args() if self.stop_args is not None else {})
        return Command(NOOP)

    def run(self) -> Command:
        """Commands until `stop`, which is returned (the same on every rank)."""
        while True:
            cmd = broadcast_command(self.next_command() if self.rank == 0 else None, self.rank, self.world,
                                    self.device)
            if cmd.kind == STOP:
                return cmd
            if cmd.kind == NOOP:
                continue
            if cmd.kind == SAMPLE:  # a sample run: on N ranks it keeps the ranks in step itself
                if self.futures is not None:
                    self.futures.started(cmd.request_id)
                self.join(cmd, self.take_samples, self.file)
                continue
            self.step(cmd)

    def step(self, cmd: Command) -> None:
        """Run `cmd` (execute returns a Result, a sample_batch's {request id: Result}, or a forward_backward_many's
        Result with one part per request) and file each answer."""
        members = cmd.members()
        if self.futures is not None:
            for c in members:
                self.futures.started(c.request_id)
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        try:
            out, phases = self.execute(cmd)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is not an Exception
            out = failure_result(e, cmd, self.rank, self.needed(cmd) if self.needed is not None else None)
        phases.setdefault("run", time.perf_counter() - t0)
        for i, c in enumerate(members):
            self.file(c, out[c.request_id] if isinstance(out, dict) else out.parts[i] if out.parts else out, phases,
                      len(members))

    def file(self, cmd: Command, result: Result, phases: dict[str, float], batch: int = 1,
             run: int | None = None) -> None:
        """Rank 0: one request's answer filed (the `done` hook, its future, the log line; nothing on the other
        ranks); `run`: the number of the sample run it decoded in."""
        if self.done is not None:
            self.done(cmd, result)
        if self.futures is not None:
            self.futures.complete(cmd.request_id, result, dict(phases))
            self._log(cmd, result, batch, run)
            for line in [*self.fallbacks.new(), *(self.notes() if self.notes is not None else [])]:
                self.log(f"shardfit serve: {line}")

    def take_samples(self, decide: Callable[[Command], str]) -> tuple[list[Command], bool]:
        """Rank 0: the ready samples a running sample run takes (Scheduler.take_ready: `decide` says
        take, pass or stop of each ready command from the head), marked started; and whether one was passed."""
        if self.scheduler.closed:  # stopping: the run finishes what it holds, then `stop` goes out
            return [], False
        taken, passed = self.scheduler.take_ready(lambda p: decide(p.command))
        for p in taken:
            self.futures.started(p.command.request_id)
        return [p.command for p in taken], passed

    def _log(self, cmd: Command, result: Result, batch: int, run: int | None = None) -> None:
        t = self.futures.timing(cmd.request_id)
        if t is None:
            return
        d = t.as_dict()
        extra = "".join(f", {k[:-2]} {v:.3f} s" for k, v in d.items()
                        if k.endswith("_s") and k not in ("queue_s", "run_s") and v is not None)
        status = f"error ({result.category})" if result.error else "ok"
        together = f", in a batch of {batch}" if batch > 1 else f", in sample run {run}" if run is not None else ""
        self.log(f"shardfit serve: {cmd.kind} {cmd.request_id}: {status}, queue {d['queue_s']:.3f} s, "
                 f"run {d['run_s']:.3f} s{extra}{together}")
