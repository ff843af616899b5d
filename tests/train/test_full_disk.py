"""A full disk at a checkpoint save, as a user meets it (`shardfit train` in a subprocess): one line naming the
directory and the space needed, exit 2, nothing half-written, the previous checkpoint intact; the same command
resumes and saves once space is freed. The disk: tests/_disk.py (a small tmpfs, else RLIMIT_FSIZE)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from shardfit.weights.checkpoint import complete_checkpoints
from shardfit.weights.checkpoint_verify import check_files
from tests._disk import small_disk
from tests._dist import run_ranks
from tests.helpers import EXTEND, SMALL, small_config

ROOT = Path(__file__).resolve().parents[2]


def _train(run: Path, ckpt: Path, steps: int, preexec) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    args = [*SMALL, f"--logging.run_dir={run}", f"--checkpoint.dir={ckpt}", f"--train.steps={steps}",
            "--checkpoint.every=2", "--checkpoint.final=true", EXTEND]
    return subprocess.run([sys.executable, "-m", "shardfit", "train", *args], capture_output=True, text=True,
                          env=env, timeout=300, preexec_fn=preexec)


def test_a_full_disk_at_a_save_is_one_line_and_the_previous_checkpoint_stays(tmp_path):
    with small_disk(tmp_path / "disk", 16 << 20) as disk:
        ckpt = disk.path / "checkpoints"
        first = _train(tmp_path / "run", ckpt, 2, disk.preexec())
        assert first.returncode == 0, first.stderr
        disk.fill()
        full = _train(tmp_path / "run", ckpt, 4, disk.preexec(64 << 10))
        errors = [ln for ln in full.stderr.splitlines() if ln.strip()]
        assert full.returncode == 2 and len(errors) == 1, full.stderr
        line = errors[0]
        assert line.startswith(f"shardfit: error: {ckpt}: could not write checkpoint step_00000004 on rank 0: the "
                               "disk is full ("), line
        assert "it needs about " in line and " MiB free there" in line and "step_00000002 is intact" in line, line
        assert "fix: free space" in line and "Traceback" not in full.stderr
        assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == ["step_00000002"]
        assert check_files(ckpt / "step_00000002") is None  # whole, and what a resume reads
        disk.free()
        again = _train(tmp_path / "run", ckpt, 4, disk.preexec())
        assert again.returncode == 0, again.stderr
        assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000002", "step_00000004"]


def _wrapped_failures(rank, world, root):
    """What the writers raise on a full disk, each in turn: DCP's CheckpointException (not an Exception) around a
    RuntimeError whose context is the OSError; safetensors' error that only says "(os error 28)"."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    import shardfit.weights.checkpoint as ck
    from shardfit.errors import DiskFull
    from shardfit.train import Trainer

    t = Trainer(small_config("--train.steps=2", "--checkpoint.final=true", run_dir=root))
    t.fit()

    def dcp_full(*a, **k):
        try:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                # the OSError as its context, not its cause: as torch's stream writer leaves it
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
        except RuntimeError as e:
            raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (e, None)}) from None

    class SafetensorError(Exception):
        pass

    def rng_full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    out = {}
    for name, target, fake in (("dcp", ck.dcp, dcp_full), ("safetensors", ck, rng_full)):
        attr = "save" if name == "dcp" else "save_file"
        real = getattr(target, attr)
        setattr(target, attr, fake)
        t.step += 1
        try:
            t.save()
            out[name] = None
        except DiskFull as e:
            out[name] = str(e)
        finally:
            setattr(target, attr, real)
    out["left"] = sorted(p.name for p in (Path(root) / "checkpoints").iterdir())
    return out


def test_each_writers_full_disk_is_named(tmp_path):
    r = run_ranks(_wrapped_failures, 1, str(tmp_path / "run"))[0]
    for name, step in (("dcp", 3), ("safetensors", 4)):
        assert f"could not write checkpoint step_0000000{step} on rank 0: the disk is full (No space left on " \
               "device); it needs about " in r[name], r[name]
        assert "step_00000002 is intact" in r[name]
    assert r["left"] == ["step_00000002"]  # no .tmp left
