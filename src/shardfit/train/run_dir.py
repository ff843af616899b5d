"""A run's claim on its directories, made before any training it could lose.

At start-up, before the data or the model: the run directory (and a separate checkpoint directory) is locked, so
that a second run on it stops at once instead of corrupting the first; every rank checks that it can write where
it will save; an export target that holds someone else's files is refused. After the resume point is known, a
run that would overwrite another run's complete checkpoints (a fresh run in a directory of checkpoints) is refused
too. Each verdict is agreed in one collective, so every rank raises
the same error or none does.

The lock is flock(2) on `<dir>/.shardfit.lock`, held by rank 0 for the life of the process: the kernel drops it
when the process dies, however it dies, so a lock is never stale; the file records who holds it (host, pid,
start time) for the message a second run prints.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

import torch

from shardfit.errors import ShardfitError
from shardfit.parallel.agreement import agree
from shardfit.weights.hf_export import export_problem

LOCK = ".shardfit.lock"


class DirLock:
    """flock on <directory>/.shardfit.lock (module docstring); `shardfit serve` holds its run directory with it too."""

    def __init__(self, directory: Path):
        self.path, self.fd = directory / LOCK, None

    def acquire(self) -> str | None:
        """None once held, else why not (who holds it)."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                return f"another run is using it ({holder or 'holder unknown'})"
            return None  # a filesystem without locks: no protection to offer, no reason to refuse
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "since": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (removing it would race a new holder)
            self.fd = None


def _probe_writable(directory: Path, rank: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".write-probe-{socket.gethostname()}-{os.getpid()}-{rank}"
    probe.write_bytes(b"")
    probe.unlink()


class RunClaim:
    """The locks and checks of one run (see the module docstring); `release` at the end or on a failed start.

    Two agreed steps: rank 0 makes the directories, takes the locks and checks the export target; then every other
    rank checks that it can write there too (on a filesystem of its own it makes them: it removes what it made if
    the start fails). Ordered so that only the rank that made a directory removes it."""

    def __init__(self, run_dir: Path, ckpt_dir: Path, exports: dict[str, str], rank: int, device: torch.device):
        """exports: {config key: directory} of the export targets (checkpoint.export_hf, export_merged)."""
        self.created: list[Path] = []
        self.locks: list[DirLock] = []
        dirs = list(dict.fromkeys((run_dir, ckpt_dir)))
        for first in (True, False):
            problem, where = None, str(run_dir)
            fix = "choose directories this run can write (logging.run_dir, checkpoint.dir)"
            if (rank == 0) == first:
                try:
                    for d in dirs:
                        where = str(d)
                        self.created += [d] if not d.exists() else []
                        _probe_writable(d, rank)  # every rank writes its own shards and RNG state here
                        # the run dir's lock covers checkpoints inside it; one elsewhere gets its own
                        if rank == 0 and (d == run_dir or run_dir.resolve() not in d.resolve().parents):
                            problem = self._lock(d)
                            if problem:
                                break
                    for key, target in exports.items():
                        if problem is None and target and rank == 0:
                            where, fix = key, "export to a new or empty directory, or remove it first"
                            problem = export_problem(Path(target))
                            problem = problem and f"{target} {problem}"
                except OSError as e:
                    problem = f"cannot write here ({e.strerror or e})"
            try:
                agree(problem, where, fix, device)
            except ShardfitError:
                self.release(failed=True)
                raise

    def _lock(self, d: Path) -> str | None:
        lock = DirLock(d)
        held = lock.acquire()
        if held:
            return f"run directory is locked: {held}"
        self.locks.append(lock)
        return None

    def release(self, failed: bool = False) -> None:
        for lock in self.locks:
            lock.release()
        self.locks = []
        if failed:  # a start that failed leaves no directory it made
            for d in reversed(self.created):
                with contextlib.suppress(OSError):  # never made, or not empty: something else lives there
                    (d / LOCK).unlink(missing_ok=True)
                    d.rmdir()


def check_no_overwrite(ckpt_dir: Path, resume: Path | None, rank: int, device: torch.device,
                       notices: list[str]) -> None:
    """Refuse to start a run whose saves would replace whole checkpoints of another run: those past the resume
    point (a corrupt one may be replaced: resume passed over it). Later checkpoints of the run being resumed (ranks
    agreed on an older step, or the user picked one) are replaced as the run passes them, with a notice."""
    from shardfit.weights.checkpoint import complete_checkpoints, run_id_of, step_of
    from shardfit.weights.checkpoint_verify import check_files

    problem, start = None, step_of(resume) if resume else 0
    if rank == 0:
        later = [p for p in complete_checkpoints(ckpt_dir) if step_of(p) > start and check_files(p) is None]
        ours = [p for p in later if resume is not None and run_id_of(p) == run_id_of(resume)]
        names = ", ".join(p.name for p in [q for q in later if q not in ours][:3])
        if len(ours) < len(later):
            what = "a new run" if resume is None else f"a run resumed from step {start}"
            problem = f"{what} would overwrite complete checkpoints of another run ({names})"
        elif ours:
            notices.append(f"resumed from step {start}: this run's later checkpoints "
                           f"({', '.join(p.name for p in ours[:3])}) are replaced as it passes them")
    agree(problem, str(ckpt_dir), "resume them (checkpoint.resume=auto), or give this run its own directory "
          "(logging.run_dir or checkpoint.dir)", device)
