"""User-facing errors.

Every mistake a user can make (a bad config key, a missing file, an undecodable line) raises `ShardfitError` with
one line that names what and where, and how to fix it. The CLI prints that line and exits with code 2; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations


class ShardfitError(Exception):
    """A problem with the user's input, reported as one line (exit code 2)."""

    exit_code = 2

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None):
        parts = [f"{where}: {message}" if where else message]
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("; ".join(parts))
