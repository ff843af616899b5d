"""Command-line values: numbers, counts, sizes and fractions checked once, each mistake one ShardfitError line.

Every command reads its numbers through these helpers (argparse's `type=` included), so `nan`, `inf`, negative
and zero values are refused the same way everywhere, naming the option and what it accepts.
"""

from __future__ import annotations

import argparse
import math
import re

from shardfit.config.options import read_options
from shardfit.errors import ShardfitError

# Far above any real job (processes, nodes, GPUs per node, worker processes), low enough that nothing downstream
# (plans, proposals, process pools) is asked to count towards an absurd number.
MAX_COUNT = 1 << 20


def number(value: str, name: str, kind=float):
    """`value` as an int or a finite float; `name` is the option, for the error line."""
    try:
        n = kind(value.strip() if isinstance(value, str) else value)
    except (ValueError, TypeError, OverflowError):
        what = "a whole number" if kind is int else "a number"
        raise ShardfitError(f"'{value}' is not {what}", where=name, fix=f"give {name} {what}") from None
    if isinstance(n, float) and not math.isfinite(n):
        raise ShardfitError(f"'{value}' is not a finite number", where=name, fix=f"give {name} a finite number")
    return n


def count(value: str, name: str, what: str) -> int:
    """A count (--nproc, --workers, --nnodes): a whole number from 1 to MAX_COUNT."""
    n = number(value, name, int)
    if not 1 <= n <= MAX_COUNT:
        raise ShardfitError(f"{n} is out of range", where=name, fix=f"give 1 or more {what} (at most {MAX_COUNT})")
    return n


# Units a size may carry: binary (what nvidia-smi and free print: MiB, GiB) and decimal (what datasheets print: an
# "80 GB" H100 is 80 x 10**9 bytes nominal). A bare number is GiB.
_UNITS = {"": 2**30, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40,
          "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def gib(value: str, name: str, fix: str) -> float:
    """A memory size in GiB from `80`, `80GiB`, `80GB` (10**9 bytes), `81559MiB`, `1.5TB`: a finite number above 0
    and below 2**30 GiB (2**60 bytes: byte counts stay within int64 with room to add them up)."""
    m = re.fullmatch(r"\s*(.*?[0-9.])\s*([A-Za-z]*)\s*", str(value))  # a number ends in a digit or a point
    digits, unit = (m.group(1), m.group(2)) if m else (str(value), "")
    if unit.lower() not in _UNITS:
        raise ShardfitError(f"'{value}': unknown unit '{unit}'", where=name,
                            fix=fix + "; units: GiB, GB, MiB, MB, TiB, TB (a bare number is GiB)")
    unit = unit.lower()
    size = number(digits, name, float) * _UNITS[unit] / 2**30
    if not 0 < size < 2**30:
        raise ShardfitError(f"{value} is out of range", where=name, fix=fix)
    return size


def fraction(value: str, name: str, what: str) -> float:
    """A fraction in (0, 1]."""
    f = number(value, name, float)
    if not 0 < f <= 1:
        raise ShardfitError(f"{value} is out of range", where=name,
                            fix=f"give {name} above 0 and at most 1 ({what})")
    return f


def take_options(argv: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull `--name VALUE` / `--name=VALUE` for the given names out of argv (the last of a name given twice wins);
    the rest, in order, are config overrides (config/options.py reads both)."""
    opts, rest = {}, []
    for name, value in read_options(argv, set(names).__contains__):
        if name is None:
            rest.append(value)
        else:
            opts[name] = value
    return opts, rest


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are one `shardfit: error:` line (exit 2) instead of a usage block, like every other
    bad input; --help still prints the full usage."""

    def error(self, message: str):
        raise ShardfitError(message, where=self.prog, fix=f"see {self.prog} --help")
