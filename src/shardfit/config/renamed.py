"""Old spellings of config keys that moved, accepted for one release with one notice line each.

The keys of [compute] (activation checkpointing, compile, dtypes, attention and loss kernels, FP8, NUMA binding)
lived in [parallel] before 0.2: `--parallel.compile=true`, and `[parallel] compile = true` in a TOML file (a saved
run's config.toml included), still load as `compute.compile`. Each old spelling used gets one line on stderr per
run, printed once the config has loaded (a bad config stays one error line), by the launching process only: not
again by the ranks `shardfit train --nproc` starts, nor by ranks other than 0 under a torchrun the user started.
Both spellings of one key in the same file, or both on the command line, is an error naming both: which one was
meant cannot be told. data.format named the file format before 0.2 and names the record layout now (sharegpt,
alpaca, ...): its file-format values jsonl and parquet move to data.file_format the same way (auto and text mean
the same under both keys).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from shardfit.config.schema import ComputeConfig
from shardfit.errors import ShardfitError

UNTIL = "0.3"  # the release that drops the old spellings
NEW_IN_COMPUTE = frozenset({"ac_blocks"})  # [compute] keys added after the split: never in [parallel]
RENAMED: dict[str, str] = {f"parallel.{f.name}": f"compute.{f.name}" for f in dataclasses.fields(ComputeConfig)
                           if f.name not in NEW_IN_COMPUTE}
# a key whose old meaning is told by its value: (the key those values belong to now, the values)
MOVED_VALUES: dict[str, tuple[str, frozenset[str]]] = {"data.format": ("data.file_format",
                                                                       frozenset({"jsonl", "parquet"}))}
_announced: set[str] = set()  # old spellings already named by this process


class Spellings:
    """The keys of one source (a TOML file, or the command line): old spellings mapped to their new key, and a key
    given under both spellings refused."""

    def __init__(self, where: str):
        self.where = where
        self.given: dict[str, str] = {}  # new key -> the spelling this source used
        self.old: list[str] = []  # old spellings used, in order

    def key(self, section: str, key: str, value: object = None) -> tuple[str, str]:
        """(section, key) as the schema names it now; value tells a MOVED_VALUES key's meaning."""
        name = f"{section}.{key}"
        new, label = RENAMED.get(name, name), name
        moved = MOVED_VALUES.get(name)
        if moved and isinstance(value, str) and value.strip().lower() in moved[1]:
            new, label = moved[0], f"{name}={value.strip()}"
        first = self.given.setdefault(new, name)
        if first != name:
            old = first if first != new else name
            raise ShardfitError(f"{old} and {new} are both given ({old} is the old spelling of {new})",
                                where=self.where, fix=f"keep {new} only")
        if new != name and label not in self.old:
            self.old.append(label)
        new_section, _, new_key = new.partition(".")
        return new_section, new_key


def notice(old: str) -> str:
    name, eq, value = old.partition("=")
    if eq:
        return (f"shardfit: {old} is now {MOVED_VALUES[name][0]}={value} ({name} names the record layout: "
                f"messages, sharegpt, alpaca, prompt_completion or text); the old spelling is accepted until {UNTIL}")
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
