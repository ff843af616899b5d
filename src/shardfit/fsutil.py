"""Files that are complete or absent: write under a temporary name, then rename (atomic on POSIX). A full disk told
apart from other failures, in one place (`full_disk`), for every writer: checkpoints (train and serve), token
shards. And the header of a safetensors file, torch-free: the config loader reads a PEFT adapter's tensor names
before torch is imported (weights/peft_config.py); weights/safetensors.py reads the same header for the loader. And
what a Hugging Face Hub id looks like (ORG/NAME), for the paths users write one into (data/sources.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

from shardfit.errors import DiskFull

# A Hugging Face Hub repository id, as users write one where a local path goes
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")

# No space (ENOSPC), over a quota (EDQUOT), over the file-size limit (EFBIG: RLIMIT_FSIZE, a filesystem's maximum):
# each leaves the write short, and freeing space (or writing elsewhere) is the fix for all three.
FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
# Rust's io::Error as safetensors words it: "... No space left on device (os error 28)"; no errno attribute.
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """`data` at `path`, whole or not at all: written under path.tmp, then renamed; the .tmp goes on failure."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def full_disk(exc: BaseException, directory: str | Path | None = None, needed: int | None = None) -> int | None:
    """The errno (ENOSPC, EDQUOT, EFBIG) when `exc` is a write that failed for want of space, else None.

    Writers wrap the OSError: torch's stream writer raises a RuntimeError whose context is the OSError, DCP a
    CheckpointException (a BaseException, not an Exception) holding each rank's (exception, trace) in `failures`,
    safetensors a SafetensorError that only says "(os error 28)". So the cause and context chains, DCP's failures
    and an exception group's members are all walked. Some lose the errno on the way: DCP pickles each rank's
    exception to gather it (the context is gone), torch's C++ writer to a path keeps only "unexpected pos". For
    those, given the `directory` written and the bytes `needed`: a failed write where less than that is free is a
    full disk too (ENOSPC)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in FULL_DISK_ERRNOS:
            return e.errno
        said = _RUST_OS_ERROR.search(str(e)) if not isinstance(e, OSError) else None
        if said and int(said.group(1)) in FULL_DISK_ERRNOS:
            return int(said.group(1))
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
        todo += [x for x in getattr(e, "exceptions", ()) if isinstance(x, BaseException)]
    if directory and needed:
        free = free_bytes(directory)
        if free is not None and free < needed:
            return errno.ENOSPC
    return None


def free_bytes(directory: str | Path) -> int | None:
    """Free bytes on the filesystem of `directory` (or of its nearest existing parent); None when unknown."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        return shutil.disk_usage(d).free
    except OSError:
        return None


def mib(n: int | float) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def full_disk_error(exc: BaseException, directory: str | Path, what: str, fix: str,
                    needed: int | None = None) -> DiskFull | None:
    """One line for a full disk (None when `exc` is not one): what could not be written, where, the space it needs
    (when the writer knows it) and the space free there. `fix` says how to go on once space is freed."""
    code = full_disk(exc, directory, needed)
    if code is None:
        return None
    need = f"; it needs about {mib(needed)}" if needed else ""
    free = free_bytes(directory) if directory else None
    have = f", {mib(free)} free there" if free is not None else ""
    return DiskFull(f"could not write {what}: the disk is full ({os.strerror(code)}){need}{have}",
                    where=str(directory) if directory else None, fix=fix)


def safetensors_header(f: BinaryIO, size: int) -> tuple[dict, int]:
    """(header {name: {dtype, shape, data_offsets}} without __metadata__, the data's first byte) of the safetensors
    file open as `f` (at its start), `size` bytes long; ValueError for a malformed one."""
    if size < 8:
        raise ValueError("file shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
        raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n
