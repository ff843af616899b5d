"""Old spellings of config keys that moved, accepted for one release with one notice line each.

The keys of [compute] (activation checkpointing, compile, dtypes, attention and loss kernels, FP8, NUMA binding)
lived in [parallel] before 0.2: `--parallel.compile=true`, and `[parallel] compile = true` in a TOML file (a saved
run's config.toml included), still load as `compute.compile`. Each old spelling used gets one line on stderr per
run, printed once the config has loaded (a bad config stays one error line), by the launching process only: not
again by the ranks `shardfit train --nproc` starts, nor by ranks other than 0 under a torchrun the user started.
Both spellings of one key in the same file, or both on the command line, is an error naming both: which one was
meant cannot be told.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from shardfit.config.schema import ComputeConfig
from shardfit.errors import ShardfitError

UNTIL = "0.3"  # the release that drops the old spellings
RENAMED: dict[str, str] = {f"parallel.{f.name}": f"compute.{f.name}" for f in dataclasses.fields(ComputeConfig)}
_announced: set[str] = set()  # old spellings already named by this process


class Spellings:
    """The keys of one source (a TOML file, or the command line): old spellings mapped to their new key, and a key
    given under both spellings refused."""

    def __init__(self, where: str):
        self.where = where
        self.given: dict[str, str] = {}  # new key -> the spelling this source used
        self.old: list[str] = []  # old spellings used, in order

    def key(self, section: str, key: str) -> tuple[str, str]:
        """(section, key) as the schema names it now."""
        name = f"{section}.{key}"
        new = RENAMED.get(name, name)
        first = self.given.setdefault(new, name)
        if first != name:
            old = first if first in RENAMED else name
            raise ShardfitError(f"{old} and {new} are both given ({old} is the old spelling of {new})",
                                where=self.where, fix=f"keep {new} only")
        if name in RENAMED and name not in self.old:
            self.old.append(name)
        new_section, _, new_key = new.partition(".")
        return new_section, new_key


def notice(old: str) -> str:
    return f"shardfit: {old} is now {RENAMED[old]}; the old spelling is accepted until {UNTIL}"


def announce(*sources: Spellings) -> None:
    """One stderr line per old spelling the sources used, once per process and once per run (see the docstring)."""
    from shardfit.cli.rank_errors import LAUNCHER_PID  # the launcher that started this rank has named them already

    quiet = bool(os.environ.get(LAUNCHER_PID)) or os.environ.get("RANK", "0") != "0"
    for old in (name for s in sources for name in s.old):
        if old not in _announced:
            _announced.add(old)
            if not quiet:
                print(notice(old), file=sys.stderr)
