"""Caps on the work a file given to `shardfit doctor` or `shardfit profile` may cause.

A snapshot or a trace is read whole into memory, and a small file can declare a huge one: a gzip member of zeros
inflates ~1000x, a pickle can build millions of objects from a few bytes each. Each cap is well above what a real
file needs (the figures in the defaults' comments) and is named in the refusal together with the environment
variable that raises it, so a legitimate giant file is one `export` away, and a hostile one is refused after bounded
work: decompression stops at the cap instead of inflating the declared size.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from shardfit.errors import ShardfitError


@dataclass(frozen=True)
class Limit:
    what: str  # what is counted, for the message ("MiB decompressed")
    env: str  # the environment variable that raises it
    default: int

    def value(self) -> int:
        raw = os.environ.get(self.env)
        if raw is None:
            return self.default
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n <= 0:
            raise ShardfitError(f"'{raw}' is not a positive whole number", where=self.env,
                                fix=f"unset it (default {self.default:,}) or give a larger whole number")
        return n

    def refuse(self, where: str, found: str) -> ShardfitError:
        """The one-line refusal: what was found, the cap, and how to raise it for a file that is legitimate."""
        cap = self.value()
        return ShardfitError(f"{found}: more than the limit of {cap:,} {self.what}", where=where,
                             fix=f"if the file is legitimate, raise the limit: export {self.env}={cap * 4}")


# A snapshot of 1,000,000 events is ~50 MiB as a pickle; shardfit records 200,000 by default.
SNAPSHOT_MIB = Limit("MiB of pickle (decompressed)", "SHARDFIT_DOCTOR_MAX_MIB", 1024)
# Objects the pickle builds (containers, numbers, strings, marks): a few dozen per trace event with Python stacks,
# so over a million events (shardfit records 200,000 by default; PyTorch's own default ring holds 100,000).
SNAPSHOT_OBJECTS = Limit("objects built by the pickle", "SHARDFIT_DOCTOR_MAX_OBJECTS", 50_000_000)
# Containers open at once while unpickling; a real snapshot nests about 6 deep (snapshot, traces, event, frames).
SNAPSHOT_DEPTH = Limit("containers nested while unpickling", "SHARDFIT_DOCTOR_MAX_DEPTH", 200)
# A profiled training step's Chrome trace is tens of MiB of JSON.
TRACE_MIB = Limit("MiB of JSON (decompressed)", "SHARDFIT_PROFILE_MAX_MIB", 1024)
TRACE_EVENTS = Limit("trace events", "SHARDFIT_PROFILE_MAX_EVENTS", 20_000_000)


def a_type(value) -> str:
    """'an int', 'a str': a value's type for a refusal (never its contents, which may be huge or nested deep)."""
    name = type(value).__name__
    return ("an " if name[0] in "aeiou" else "a ") + name


def read_capped(path: Path, limit: Limit, kind: str) -> bytes:
    """The file's bytes, gunzipped when they start with the gzip magic (every member of a multi-member file), never
    more than the limit's MiB: a larger file or one that inflates past it is refused without reading further."""
    cap = limit.value() << 20
    where = str(path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            raise ShardfitError("is a directory", where=where, fix=f"pass {kind} files")
        with path.open("rb") as f:
            head = f.read(2)
            if head != b"\x1f\x8b":
                if size > cap:
                    raise limit.refuse(where, f"the file is {size / 2**20:,.0f} MiB")
                return head + f.read(cap + 1 - len(head))
            return _gunzip_capped(f, head, cap, limit, where, kind)
    except FileNotFoundError:
        raise ShardfitError(f"{kind} file not found", where=where, fix="check the path") from None
    except (PermissionError, IsADirectoryError) as e:
        raise ShardfitError(f"cannot read it ({e.strerror})", where=where, fix="check the path and its permissions") \
            from None


def _gunzip_capped(f, head: bytes, cap: int, limit: Limit, where: str, kind: str) -> bytes:
    out = bytearray()
    d, fed = zlib.decompressobj(wbits=31), False
    chunk = head
    while chunk:
        fed = True
        while chunk:
            try:  # at most what the cap still allows: the rest stays compressed in unconsumed_tail
                out += d.decompress(chunk, cap + 1 - len(out))
            except zlib.error as e:
                raise ShardfitError(f"cannot read a {kind} from it: corrupt gzip data ({e})", where=where,
                                   fix="re-copy the file") from None
            if len(out) > cap:
                raise limit.refuse(where, f"it inflates past {cap >> 20:,} MiB")
            if d.eof:  # another member may follow (cat a.gz b.gz is one valid gzip file)
                chunk = d.unused_data
                d, fed = zlib.decompressobj(wbits=31), bool(chunk)
            else:
                chunk = d.unconsumed_tail
        chunk = f.read(1 << 20)
    if fed and not d.eof:
        raise ShardfitError(f"cannot read a {kind} from it: corrupt gzip data (truncated)", where=where,
                            fix="re-copy the file")
    return out  # bytes-like: json and the pickle reader take it as is, without a second copy
