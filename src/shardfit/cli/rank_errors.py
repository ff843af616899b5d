"""A rank's failure under torchrun: said once per job, not once per rank.

torchrun gives each worker an error file (TORCHELASTIC_ERROR_FILE, under a directory of its own for each launch and
restart attempt) and reads it when the worker fails. A rank that fails writes its error there, in torchrun's format
plus a `shardfit` entry the launcher reads. Under `shardfit train --nproc N` (SHARDFIT_LAUNCHER_PID names the
launcher, which is the rank's parent) the launcher prints the one line; under a torchrun the user started, the first
failing rank of the launch prints it and the others stay silent (they claim the printing with an O_EXCL file next to
the error files). Without an error file there is nothing to coordinate through: every rank prints, as before.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback

from shardfit.errors import LAUNCHER_PID, ShardfitError, Stopped

STOP_NOTE = "SHARDFIT_STOP_NOTE"  # where rank 0 leaves its stop line for a launcher stopped by a signal (launch.py)
# A rank of several that fails with an exception (not a ShardfitError) waits this long before it prints: when another
# rank died first (killed, out of memory), this one's collective fails with a connection error that is only an echo,
# and torchrun stops it within its monitor interval (0.1 s by default) without a traceback from it.
CRASH_GRACE_S = 3.0


def torchrun_worker() -> bool:
    """This process is a rank torchrun started (its launcher variables are checked by init_distributed)."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def quiet_interrupts() -> None:
    """Under torchrun, SIGINT ends the rank at once and silently: torchrun forwards the user's Ctrl-C to every rank,
    and a KeyboardInterrupt traceback per rank (or a collective's error from a rank whose peer already left) would
    bury the launcher's one line. SIGTERM already does this (Python leaves it at the default)."""
    if torchrun_worker():
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def report_error(e: ShardfitError) -> int:
    """The CLI's handling of a ShardfitError: print its line (once per job under torchrun); the exit code."""
    if not torchrun_worker():
        print(e.cli_line(), file=sys.stderr)
        return e.exit_code
    written = _write_error_file({
        "message": str(e), "timestamp": int(time.time()),
        "shardfit": {"kind": "error", "message": str(e), "exit_code": e.exit_code}})
    note = os.environ.get(STOP_NOTE, "")
    if isinstance(e, Stopped) and note and os.environ.get("RANK") == "0":
        try:
            with open(note + ".tmp", "w", encoding="utf-8") as f:
                f.write(str(e))
            os.replace(note + ".tmp", note)
        except OSError:
            pass
    launcher_prints = written and os.environ.get(LAUNCHER_PID) == str(os.getppid())
    if not launcher_prints and _claim_printing():
        print(e.cli_line(), file=sys.stderr)
    return e.exit_code


def report_crash(exc: BaseException) -> int:
    """An exception that is not a user error on a torchrun rank: its traceback once per job, and exit code 1."""
    text = traceback.format_exc()
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        time.sleep(CRASH_GRACE_S)  # torchrun ends this rank here if another one failed first
    summary = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    _write_error_file({  # torchrun's own format (errors.ErrorHandler.record_exception): a direct torchrun shows it
        "message": {"message": summary, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}},
        "shardfit": {"kind": "crash", "message": summary}})
    if _claim_printing():
        sys.stderr.write(text)
    return 1


def read_error_file(path: str) -> dict | None:
    """The `shardfit` entry a rank wrote to its error file (None: none, or not a shardfit rank's)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    entry = data.get("shardfit") if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) and isinstance(entry.get("message"), str) else None


def _write_error_file(data: dict) -> bool:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    if not path or not os.path.isdir(os.path.dirname(path)):  # unset, or left from a launch that is gone
        return False
    try:
        with open(path, "w") as f:  # read by torchrun once this process has exited
            json.dump(data, f)
        return True
    except OSError:
        return False


def _claim_printing() -> bool:
    """True for the first rank of this launch to ask (and for every rank when there is no launch directory)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    attempt_dir = os.path.dirname(os.path.dirname(path)) if path else ""
    if not attempt_dir or not os.path.isdir(attempt_dir):
        return True
    # Named after the ranks' parent (torchrun's agent): a directory left from an earlier launch cannot hold it.
    try:
        os.close(os.open(os.path.join(attempt_dir, f".shardfit-printed-{os.getppid()}"),
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        return True
    except FileExistsError:
        return False
    except OSError:
        return True
