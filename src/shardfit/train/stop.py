"""SIGINT and SIGTERM during training: finish the step, save a checkpoint every rank agrees on, exit 130 / 143.

A signal reaches the ranks at different times (a scheduler's SIGTERM to every process, torchrun forwarding its own,
a terminal's Ctrl-C to the whole job) or only some of them. The handler only records it (`Engine.stop_requested`);
the step's one stats all-gather (engine/engine.py, `_collect`) carries every rank's record, so all ranks read the same
verdict after the same step and stop together: no collective of its own. The loop then saves (checkpoint.on_signal)
and raises `Stopped`, one line naming the checkpoint, or what was lost and the key that keeps it.

A second signal more than GRACE_S after the first stops at once (a terminal's Ctrl-C and torchrun's copy of it
arrive together and count once): a single process raises KeyboardInterrupt (reported as not saved), a torchrun rank
dies of the signal as before; so does a torchrun rank whose loop fails after a signal (torchrun's teardown once a
peer died). Handlers are installed only from the main thread, for the loop's duration.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from shardfit.errors import ShardfitError, Stopped

GRACE_S = 2.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Record SIGINT / SIGTERM on `engine.stop_requested` (the signal number) while installed."""

    def __init__(self, engine):
        self.engine = engine
        self.first: float | None = None
        self.previous: dict[int, object] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def die_if_stopping(self) -> None:
        """The loop failed (a collective broken by a peer's exit) after a signal arrived: under torchrun that signal is
        its teardown of this rank, so die of it, silently, as without the handler (the launcher names the rank that
        failed first; this one is its echo)."""
        sig = self.engine.stop_requested
        if sig and os.environ.get("TORCHELASTIC_RUN_ID"):
            self.uninstall()
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            self.engine.stop_requested = int(signum)
            return
        if now - self.first < GRACE_S:
            return  # the same request, delivered twice
        if os.environ.get("TORCHELASTIC_RUN_ID"):  # a torchrun rank: die of the signal, as without this handler
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        raise KeyboardInterrupt


def name(signum: int) -> str:
    return signal.Signals(signum).name


def last_checkpoint(ckpt_dir: Path, run_id: str, step: int) -> Path | None:
    """This run's newest complete checkpoint at or before `step`."""
    from shardfit.weights.checkpoint import complete_checkpoints, run_id_of, step_of

    ours = [p for p in complete_checkpoints(ckpt_dir) if step_of(p) <= step and run_id_of(p) == run_id]
    return ours[-1] if ours else None


def lost(ckpt_dir: Path, run_id: str, step: int) -> str:
    """Which steps a stop at `step` without a save loses."""
    from shardfit.weights.checkpoint import step_of

    last = last_checkpoint(ckpt_dir, run_id, step)
    first = step_of(last) + 1 if last is not None else 1
    if first > step:
        return f"nothing is lost (the last checkpoint, {last}, is of step {step})"
    where = f"the last checkpoint is {last}" if last is not None else "no checkpoint of this run exists"
    return f"steps {first}-{step} are lost ({where})"


def stopped(signum: int, step: int, total: int, trainer, on_signal: bool) -> Stopped:
    """Save (when asked) and say so: the error every rank raises after the step at which the ranks agreed to stop."""
    head = f"stopped by {name(signum)} after step {step} of {total}"
    code = 128 + int(signum)
    if not on_signal:
        return Stopped(f"{head}: no checkpoint saved (checkpoint.on_signal=false): "
                       f"{lost(trainer.ckpt_dir, trainer.engine.run_id, step)}",
                       fix="leave checkpoint.on_signal=true to save one when stopped", exit_code=code)
    try:
        path = trainer.save()
    except ShardfitError as e:  # raised on every rank alike (the save's own agreement)
        return Stopped(f"{head}: the checkpoint could not be saved ({e.what}); "
                       f"{lost(trainer.ckpt_dir, trainer.engine.run_id, step)}", fix=e.fix, exit_code=code)
    return Stopped(f"{head}: saved checkpoint {path}; the same command resumes it", exit_code=code)


def interrupted(step: int, total: int, trainer) -> Stopped:
    """A second Ctrl-C (a single process): the loop was left wherever it was."""
    return Stopped(f"interrupted again during step {step + 1} of {total}, before a checkpoint was saved: "
                   f"{lost(trainer.ckpt_dir, trainer.engine.run_id, step)}",
                   fix="press Ctrl-C once: the run saves a checkpoint after the step (checkpoint.on_signal)",
                   exit_code=130)
