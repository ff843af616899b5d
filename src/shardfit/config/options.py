"""The one reader of command-line options: `--name value` and `--name=value`, for config overrides and launch options.

`read_options` walks argv once, in order, pulling the options a caller accepts and passing every other argument
through untouched; `parse_overrides` takes `--section.key` options (config/loader.py), cli/args.py's `take_options`
the launch options a command names (--config, --nproc, ...), leaving the overrides for the loader. An accepted name
with no value after it is one error line; a value may itself start with `--` (it is taken as given).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from shardfit.config.spellings import foreign_spelling, sectionless
from shardfit.errors import ShardfitError


def read_options(argv: list[str], accepts: Callable[[str], bool]) -> Iterator[tuple[str | None, str]]:
    """(name, value) for each `--name=value` or `--name value` whose name `accepts`, (None, argument) for every
    other argument, in argv's order."""
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if not accepts(name):
            yield None, argv[i]
        else:
            if not eq:
                if i + 1 >= len(argv):
                    raise ShardfitError(f"{name} needs a value", where="command line", fix=f"write {name}=VALUE")
                i += 1
                value = argv[i]
            yield name, value
        i += 1


def is_override(name: str) -> bool:
    return name.startswith("--") and "." in name


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key=value` or `--section.key value` into (section, key, value) triples; dashes in names read as
    underscores."""
    out = []
    for name, value in read_options(args, is_override):
        if name is None:
            raise ShardfitError(f"cannot read argument '{value}'", where="command line",
                                fix=(foreign_spelling(value) or sectionless(value) if value.startswith("--") else None)
                                or "write overrides as --section.key=value (see shardfit train --help)")
        section, _, key = name[2:].partition(".")
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
    return out
