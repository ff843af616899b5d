"""Serve's worker: sample requests join the running decode batch, each answered when its rows end.

The loop (commands.Loop, `join`) hands the first ready sample to `SampleJoining`, which runs it as a SampleRun
(engine/sample_run.py, through the RL API's sample_run: rl/step.py) and, between chunks of decode steps (the
Sampler's check_every), takes the samples that became ready since (`take`: Scheduler.take_ready) and submits them
into the run, and files the answer of every request whose rows ended (its future completed: the client's poll
returns it at once, whatever still decodes beside it).

On N ranks every rank runs the same run (the loop broadcast the first `sample`); rank 0 alone takes from the queue
and files answers. Collectives per chunk, the same on every rank in this order:
1. rank 0's word (`_agree`, commands.broadcast_command: the length int64 [1], then the JSON bytes uint8 [n]): the
   requests taken since the last chunk, whether the run ends (nothing taken and no request in flight on any rank:
   the exchange told rank 0), and whether rank 0's own part failed (`broken`: its intake or filing);
2. when requests were taken, SampleRun.submit's: every rank prepares ALL of them (the verdicts' all-reduce, an
   all-gather per adapter tensor loaded into a bank slot) and adds its share (ticket t, a run-wide counter of good
   requests, on rank t % world);
3. no collective: each rank steps its own Sampler one chunk (an empty share: a no-op);
4. SampleRun.collect's exchange (engine/sample_results.py): one all-gather of each rank's (ended, floats, failed),
   then, when one ended, one all-gather of the packed results; every rank learns which requests ended.
Decisions that must agree come from 1 and 4, never from one rank's own state. A rank whose step raised still takes
part in 4 with failed=1: every rank then fails the run (its requests answered with the error) and the loop goes on
in step. A Sampler that one rank alone cannot build (out of memory sizing its KV pool) is said in 2's all-reduce:
every rank raises there and fails the run. What is left: an exception on one rank only inside a collective itself
(the adapters' all-gather) leaves the others waiting there, as Engine.sample (sample_batch) does.
With serve.join=false, and on N ranks under sampling.logprobs=trainer, samples run as batches instead (commands.py's
sample_batch, server.py's `joins`).

The intake's order rules (take_together's, and stricter): it walks the ready queue from its head and
- stops at the first command that is not a sample (a forward_backward, optim_step, snapshot, load or release: of the
  sampled model or any other). The intake then ends for good: the run finishes its rows, then that command runs (a
  sample sent after an optim_step is of the weights after it; one sent before is of the weights before, as Tinker
  orders them), and a stream of samples never starves training;
- stops at a sample that would take the rows in flight past BATCH_ROWS (it joins once rows end, still first);
- passes a sample of other weights than the run's (another served model; without LoRA another version: the group
  of sample_batch), which is the next run's, and ends the intake after that walk, so that it is not starved either;
- takes the others, every model and version of the trained Engine with LoRA, in queue order. A request whose
  adapter finds no free bank slot beside the run's (SampleRun.submit's None) waits for the next run, which starts
  right after this one with it first.
A request refused (its session's weights not held, or bad input only the Sampler can tell) fails alone with its
line; a failure of the run itself (a bug, out of memory) fails the requests it holds, and the loop goes on.
sampling.logprobs=trainer on one rank (rl/trainer_logprobs.py's ScoredRun): the run's requests are scored by the
trainer's forward at the run's END, and answered then; so that none waits on requests that came after it, the intake
ends as soon as one request of the run has ended.
Counters (GET /api/v1/shardfit/status, "sampling"): runs, requests, joined (submitted into a run that had already
decoded), rows in flight now.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from shardfit.errors import ShardfitError
from shardfit.serve.commands import BATCH_ROWS, SAMPLE, Command, broadcast_command, failure_result
from shardfit.serve.futures import Result
from shardfit.serve.protocol import encode_sample

JOIN = "sample_join"  # rank 0's word between chunks (never queued): {"commands", "end", "broken"}


class SampleJoining:
    """`loop.join`: run(first, take, file) from the loop's thread; counts() from the HTTP threads."""

    def __init__(self, executor, device=None):
        self.executor = executor
        dist = executor.engine.dist
        self.rank, self.world = dist.rank, dist.world_size
        self.device = device  # where the broadcasts run (server.py's comm_device)
        self._lock = threading.Lock()
        self._counts = {"runs": 0, "requests": 0, "joined": 0, "rows_in_flight": 0}

    def counts(self) -> dict:
        with self._lock:
            return dict(self._counts)

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self._counts[k] += v

    def _set_rows(self, rows: int) -> None:
        with self._lock:
            self._counts["rows_in_flight"] = rows

    def __call__(self, first: Command, take: Callable, file: Callable) -> None:
        """Runs until the run started by `first` (and any run of requests it deferred) has answered everything."""
        waiting = [first]
        while waiting:
            waiting = _Run(self, take, file).run(waiting)


class _Run:
    """One sample run: its group (served model, full-parameter weights), its requests and its intake. Every rank
    makes the same run (module docstring); rank 0 alone takes from the queue and files answers."""

    def __init__(self, joining: SampleJoining, take: Callable, file: Callable):
        self.joining, self.ex, self.take, self._file_to = joining, joining.executor, take, file
        self.rank, self.world, self.device = joining.rank, joining.world, joining.device
        self.key = None  # the group the run decodes: sample_member's
        self.number = 0  # which run of the server (from 1)
        self.sampling = None  # the SampleRun (or ScoredRun)
        self.asking: list[Command] = []  # being submitted: failed with the run if its submit raises
        self.open = True  # the intake goes on
        self.decoded = False  # a step ran: later requests join a running batch
        self.tickets: dict[int, tuple[Command, float]] = {}  # ticket -> (its request, when it was submitted)
        self.deferred: list[Command] = []  # taken but not joinable: the next run's, first
        self.resolved: dict[str, tuple | Exception] = {}  # request id -> sample_member's (key, member), or its error
        self.broken: BaseException | None = None  # rank 0: its intake or filing failed; the run ends on every rank

    def run(self, first: list[Command]) -> list[Command]:
        """Decode `first` and what joins it; the requests to start the next run with (the same on every rank)."""
        members = [m for m in (self._resolved(c) for c in first) if m is not None]
        if not members:
            return self.deferred
        self.key = members[0][0]
        self.deferred += [m[1][0] for m in members if m[0] != self.key]
        self.asking = [m[1][0] for m in members if m[0] == self.key]  # failed with the run if it cannot start
        e = None
        try:
            e, tokenizer, rl = self.ex.sampling_engine(self.key[0])
            if self.key[0]:  # one Sampler at a time: the trained Engine's KV pool is not the served model's memory
                self.ex.engine.release_sampler(training=False)
            self.sampling = rl.sample_run(tokenizer=tokenizer)
            self.joining._count(runs=1)
            self.number = self.joining.counts()["runs"]  # the log line of each of its requests names it
            self._submit([m for m in members if m[0] == self.key])
            while (taken := self._agree(self._intake())) is not None:
                members = [m for m in (self._resolved(c) for c in taken) if m is not None]
                if members:
                    self._submit(members)
                self._chunk()
            self._answer(self.sampling.close())
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - the run's requests fail, the server goes on
            self._fail(err)
        finally:
            self._rows()
            if self.key[0] and e is not None:  # a frozen extra model keeps none: it would hold the step's memory
                e.release_sampler(training=False)
        return self.deferred

    def _agree(self, taken: list[Command]) -> list[Command] | None:
        """Rank 0's word on every rank (N ranks: broadcast_command's two broadcasts): the requests that join now,
        or None: the run ends (nothing taken and no request in flight on any rank: `busy` counts every rank's).
        A failure of rank 0's own part (`broken`) ends it on every rank, each raising."""
        end = not taken and not self.sampling.busy
        if self.world > 1:
            said = f"{type(self.broken).__name__}: {self.broken}" if self.broken is not None else ""
            cmd = Command(JOIN, args={"commands": [asdict(c) for c in taken], "end": end, "broken": said})
            cmd = broadcast_command(cmd if self.rank == 0 else None, self.rank, self.world, self.device)
            if cmd.args["broken"]:
                raise self.broken if self.rank == 0 else RuntimeError(f"rank 0's sample run: {cmd.args['broken']}")
            if self.rank != 0:
                end, taken = cmd.args["end"], [Command.from_dict(d) for d in cmd.args["commands"]]
        elif self.broken is not None:
            raise self.broken
        return None if end else taken

    def _chunk(self) -> None:
        """One chunk of decode steps of this rank's share (none: a no-op), then the answers of the requests ended
        since the last chunk (N ranks: on every rank, from the exchange). A rank whose step failed still joins the
        exchange, so that every rank leaves the run from it (engine/sample_run.py's RankFailed)."""
        err = None
        try:
            self.sampling.step()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - re-raised after the exchange
            err = e
        done = self.sampling.collect(failed=err is not None)
        if err is not None:
            raise err
        self.decoded = True
        self._answer(done)
        if self.sampling.answers_at_end and self.sampling.rows < sum(
                int(c.args["num_samples"]) for c, _ in self.tickets.values()):
            self.open = False  # a request ended: it waits for no later one (scored at the run's end)

    def file(self, c: Command, result: Result, phases: dict, run: int | None = None) -> None:
        """Rank 0: one answer filed; a failure to file it ends the run on every rank at the next _agree, never
        in the middle of the ranks' collectives."""
        try:
            self._file_to(c, result, phases, run=run)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - said at the next _agree
            self.broken = self.broken or e

    def _resolved(self, c: Command) -> tuple | None:
        """(group key, member) of a request, or None after filing its failure (weights not held)."""
        got = self.resolved.pop(c.request_id, None) or self._resolve(c)
        if isinstance(got, Exception):
            self.file(c, failure_result(got, c, self.rank), {})
            return None
        return got

    def _resolve(self, c: Command):
        try:
            return self.ex.sample_member(c)
        except Exception as err:  # noqa: BLE001 - a ShardfitError (its line), else a bug: the request fails alone
            return err

    def _decide(self, c: Command, rows: list[int]) -> str:
        """Scheduler.take_ready's verdict on a ready command (module docstring); `rows` counts what it takes."""
        if c.kind != SAMPLE or rows[0] + int(c.args["num_samples"]) > BATCH_ROWS:
            if c.kind != SAMPLE:
                self.open = False
            return "stop"
        if c.request_id not in self.resolved:
            self.resolved[c.request_id] = self._resolve(c)
        got = self.resolved[c.request_id]
        if not isinstance(got, Exception) and got[0] != self.key:
            return "pass"
        rows[0] += int(c.args["num_samples"])
        return "take"

    def _intake(self) -> list[Command]:
        """Rank 0: the ready samples that join the run now (none on the other ranks: they get rank 0's)."""
        if self.rank != 0 or not self.open or self.deferred or self.broken is not None:
            return []
        rows = [self.sampling.rows]
        try:
            taken, passed = self.take(lambda c: self._decide(c, rows))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - said at the next _agree
            self.broken = e
            return []
        ids = {c.request_id for c in taken}
        self.resolved = {r: v for r, v in self.resolved.items() if r in ids}  # a passed one: resolved by its own run
        if passed:
            self.open = False
        return taken

    def _submit(self, members: list[tuple]) -> None:
        from shardfit.serve.executor import sample_arguments

        prompts, params, options = sample_arguments([m for _, m in members])
        self.asking = [c for _, (c, *_) in members]
        got = self.sampling.submit(prompts, params, **options)
        self.asking = []
        now = time.perf_counter()
        for (_, (c, *_)), t in zip(members, got):
            if isinstance(t, ShardfitError):
                self.file(c, failure_result(t, c, self.rank), {})
            elif t is None:  # no bank slot beside the run's: the next run's
                self.deferred.append(c)
                self.open = False
            else:
                self.tickets[t] = (c, now)
                self.joining._count(requests=1, joined=int(self.decoded))
        self._rows()

    def _answer(self, done: list) -> None:
        now = time.perf_counter()
        for t, res in done:
            c, t0 = self.tickets.pop(t)
            self.file(c, Result(proto=encode_sample(res) if self.rank == 0 else None), {"sample": now - t0},
                      run=self.number)
        if done:
            self._rows()

    def _fail(self, err: BaseException) -> None:
        for c in [c for c, _ in self.tickets.values()] + self.asking:
            self.file(c, failure_result(err, c, self.rank), {})
        self.tickets, self.asking = {}, []
        try:
            if self.sampling is not None:
                self.sampling.close(failed=True)
        except Exception:  # noqa: BLE001 - its requests are answered; the next run starts from a fresh Sampler
            self.ex.engine.release_sampler(training=False)

    def _rows(self) -> None:
        self.joining._set_rows(sum(int(c.args["num_samples"]) for c, _ in self.tickets.values()))
