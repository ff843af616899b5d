"""User-facing errors.

Every mistake a user can make (a bad config key, a missing file, an undecodable line) raises `ShardfitError` with
one line that names where (a file, file:line, a config key or an option), what is wrong and how to fix it. The CLI
prints that line once, as `shardfit: error: ...`, and exits with the error's code (2 unless a subclass says
otherwise); under torchrun the launcher prints it for the ranks (shardfit.cli.rank_errors). Anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import os

# Set by `shardfit <command> --nproc N` in the environment of the ranks it starts (cli/launch.py): the launcher prints
# the job's one-time lines for them (a rank's error: cli/rank_errors.py; an old key's notice: config/spellings.py).
LAUNCHER_PID = "SHARDFIT_LAUNCHER_PID"


class ShardfitError(Exception):
    """A problem with the user's input, reported as one line (exit code 2).

    where: a file, a config key (`train.lr`), an option (`--nproc`) or an environment variable; with `line` it
    becomes `file:line`. The parts stay readable as attributes (what, where, fix) for the code that passes the
    error between processes.
    """

    exit_code = 2

    def __init__(self, message: str, *, where: str | os.PathLike | None = None, fix: str | None = None,
                 line: int | None = None, exit_code: int | None = None):
        self.what = str(message)
        self.where = None if where is None else os.fspath(where)
        if line is not None:
            self.where = f"{self.where or '<input>'}:{line}"
        self.fix = fix
        if exit_code is not None:
            self.exit_code = exit_code
        parts = [f"{self.where}: {self.what}" if self.where else self.what]
        if fix:
            parts.append(f"fix: {fix}")
        # One line, whatever the message quotes (a file's text, a value with a \r, an exception's own message).
        super().__init__(" ".join("; ".join(parts).splitlines()))

    def cli_line(self) -> str:
        """The line the CLI prints."""
        return f"shardfit: error: {self}"


class DiskFull(ShardfitError):
    """A write that ran out of space (fsutil.full_disk_error): one line naming the directory and the space needed,
    exit 2 like other input problems; the server answers it as its own failure (category server), not the client's."""


class Stopped(ShardfitError):
    """A run stopped on purpose by SIGINT or SIGTERM (train/stop.py): its line says what was saved, or what was lost
    and the key that keeps it. Printed as `shardfit: <line>` (not an error), exit code 128 + the signal."""

    exit_code = 130

    def cli_line(self) -> str:
        return f"shardfit: {self}"


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM outside the training loop of a single process (start-up): reported like Ctrl-C, with its own exit code
    (128 + signum)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def shown(value) -> str:
    """A value as an error message quotes it: its repr, cut short (a long number or string stays a short line; JSON
    itself refuses integers beyond 4,300 digits, which repr could not print)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
