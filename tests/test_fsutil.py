"""fsutil: a full disk told apart from other failures whatever the writer wrapped it in, and a file written whole or
not at all (no .tmp left when the disk fills)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardfit.errors import DiskFull
from shardfit.fsutil import full_disk, full_disk_error
from tests._disk import small_disk

ROOT = Path(__file__).resolve().parents[1]


def _chained(outer: type[BaseException], inner: BaseException, cause: bool = False) -> BaseException:
    try:
        raise inner
    except BaseException as e:
        wrapped = outer("wrapped")
        if cause:
            wrapped.__cause__ = e
        else:
            wrapped.__context__ = e
        return wrapped


class _DCPLike(BaseException):  # torch.distributed.checkpoint's CheckpointException: failures {rank: (exc, trace)}
    def __init__(self, failures):
        super().__init__("checkpoint failed")
        self.failures = failures


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), errno.EDQUOT),
    (OSError(errno.EFBIG, "File too large"), errno.EFBIG),
    (_chained(RuntimeError, OSError(errno.ENOSPC, "full")), errno.ENOSPC),  # torch's stream writer
    (_chained(ValueError, _chained(RuntimeError, OSError(errno.EDQUOT, "q")), cause=True), errno.EDQUOT),
    (_DCPLike({0: (None, None), 1: (_chained(RuntimeError, OSError(errno.ENOSPC, "x")), None)}), errno.ENOSPC),
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    (type("Group", (Exception,), {"exceptions": (ValueError("v"), OSError(errno.ENOSPC, "full"))})(), errno.ENOSPC),
    (OSError(errno.EACCES, "Permission denied"), None),
    (RuntimeError("unexpected pos 704 vs 598"), None),
    (Exception("I/O error: Permission denied (os error 13)"), None),
])
def test_full_disk_is_found_in_any_wrapping(exc, code):
    assert full_disk(exc) == code


def test_the_error_names_the_directory_the_space_and_the_fix(tmp_path):
    e = full_disk_error(_chained(RuntimeError, OSError(errno.ENOSPC, "full")), tmp_path, "checkpoint x", "free it",
                        needed=3 << 20)
    assert isinstance(e, DiskFull) and e.where == str(tmp_path)
    assert str(e).startswith(f"{tmp_path}: could not write checkpoint x: the disk is full (No space left on device); "
                             "it needs about 3.0 MiB, ") and str(e).endswith(" MiB free there; fix: free it")
    assert full_disk_error(ValueError("x"), tmp_path, "y", "z") is None


def test_write_atomic_on_a_full_disk_leaves_the_old_file_and_no_tmp(tmp_path):
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        target = disk.path / "f.json"
        target.write_text("old")
        disk.fill(slack=16 << 10)
        code = ("import sys; from shardfit.fsutil import write_atomic, full_disk\n"
                "try:\n    write_atomic(sys.argv[1], b'x' * (4 << 20))\n"
                "except BaseException as e:\n    print(full_disk(e))\n")
        r = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, preexec_fn=disk.preexec(16 << 10))
        assert r.stdout.strip() in (str(errno.ENOSPC), str(errno.EFBIG)), r.stderr
        assert target.read_text() == "old" and [p.name for p in disk.path.iterdir() if p != disk.ballast] == ["f.json"]


def test_a_failed_write_where_less_than_needed_is_free_is_a_full_disk(tmp_path):
    """DCP pickles each rank's exception to gather it, and the OSError's context is lost: what is left is torch's
    "unexpected pos". Where the writer knows what it needed, the space left decides."""
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    free = shutil.disk_usage(tmp_path).free
    assert full_disk(lost, tmp_path, needed=free + (1 << 30)) == errno.ENOSPC
    assert full_disk(lost, tmp_path, needed=1) is None and full_disk(lost) is None
