"""A directory that runs out of space on demand, for the full-disk tests (a server's save, a training checkpoint,
`shardfit tokenize`).

Where the tests run as root and may mount: a small tmpfs; `fill()` writes a ballast file that leaves `slack` bytes,
`free()` deletes it. Elsewhere: the limit on file size (RLIMIT_FSIZE) of a subprocess, which then fails a write
beyond `slack` bytes with EFBIG (Python ignores SIGXFSZ); `preexec(limit)` sets it in a subprocess about to start,
`fill(pid)` / `free(pid)` change it in a running one (prlimit). The writers name either errno as a full disk.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

UNLIMITED = resource.RLIM_INFINITY


class SmallDisk:
    def __init__(self, path: Path, tmpfs: bool):
        self.path, self.tmpfs = path, tmpfs
        self.ballast = path / ".ballast"

    def preexec(self, limit: int | None = None) -> Callable[[], None] | None:
        """For subprocess.Popen(preexec_fn=...): on a tmpfs nothing; else the file-size limit (None: unlimited)."""
        if self.tmpfs:
            return None
        soft = UNLIMITED if limit is None else limit
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, UNLIMITED))

    def fill(self, pid: int | None = None, slack: int = 64 << 10) -> None:
        if self.tmpfs:
            left = shutil.disk_usage(self.path).free - slack
            with open(self.ballast, "ab") as f:  # written, not sparse: tmpfs counts written pages
                while left > 0:
                    f.write(b"\0" * min(left, 1 << 20))
                    left -= 1 << 20
        elif pid is not None:  # else the next subprocess's preexec(limit) sets it
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (slack, UNLIMITED))

    def free(self, pid: int | None = None) -> None:
        if self.tmpfs:
            self.ballast.unlink(missing_ok=True)
        elif pid is not None:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (UNLIMITED, UNLIMITED))


def _mount(path: Path, size: int) -> bool:
    if os.environ.get("SHARDFIT_TEST_NO_TMPFS") or os.geteuid() != 0 or not shutil.which("mount"):
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@contextlib.contextmanager
def small_disk(path: Path, size: int = 64 << 20) -> Iterator[SmallDisk]:
    """`path` (made here) on a tmpfs of `size` bytes when one can be mounted, else a plain directory whose writers
    are limited through RLIMIT_FSIZE (SHARDFIT_TEST_NO_TMPFS=1 forces that)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = _mount(path, size)
    try:
        yield SmallDisk(path, mounted)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)
