"""Issue 22, classes 2 and 3: no run loses the user's work, and no garbage is saved.

Each case is a way work used to be lost: an export over someone's files, pruning another run's checkpoints (or
the one just saved), two runs on one directory, a directory found unwritable only at the first save, a save that
fails on one rank, weights gone non-finite saved as a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardfit.errors import ShardfitError
from shardfit.train.run_dir import LOCK, DirLock
from shardfit.weights.checkpoint import complete_checkpoints, prune
from tests._dist import run_ranks
from tests.helpers import EXTEND, small_config

ARGS = ["--train.steps=4", "--checkpoint.every=2", "--checkpoint.final=true"]


def _fake_checkpoint(root: Path, step: int, run_id: str | None) -> Path:
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "complete.json").write_text(json.dumps({"step": step, "world_size": 1}))
    (d / "trainer.json").write_text(json.dumps({"step": step, **({"run_id": run_id} if run_id else {})}))
    return d


@pytest.mark.parametrize("keep, newest, left", [
    (1, 6, ["step_00000002", "step_00000006", "step_00000100"]),  # only "ours" older than 6 go; 100 is another's
    (2, 6, ["step_00000002", "step_00000004", "step_00000006", "step_00000100"]),
    (1, 4, ["step_00000002", "step_00000004", "step_00000006", "step_00000100"]),  # never past the newest saved
])
def test_keep_prunes_only_this_runs_older_checkpoints(tmp_path, keep, newest, left):
    _fake_checkpoint(tmp_path, 2, None)  # an older shardfit's (no run id): never touched
    for step in (4, 6):
        _fake_checkpoint(tmp_path, step, "ours")
    _fake_checkpoint(tmp_path, 100, "theirs")
    if newest == 4:
        _fake_checkpoint(tmp_path, 3, "theirs")
        left = sorted([*left, "step_00000003"])
    prune(tmp_path, keep, "ours", newest)
    assert [p.name for p in complete_checkpoints(tmp_path)] == left


def test_stale_lock_of_a_killed_process_is_taken_over(tmp_path):
    """flock dies with its holder: a SIGKILLed run leaves a lock file but no lock."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from shardfit.train.run_dir import DirLock; "
        f"assert DirLock(Path({str(tmp_path)!r})).acquire() is None; print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    busy = DirLock(tmp_path).acquire()
    assert busy is not None and f'"pid": {holder.pid}' in busy  # who holds it is named
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lock = DirLock(tmp_path)
    assert lock.acquire() is None and (tmp_path / LOCK).is_file()
    lock.release()


def _two_trainers_on_one_directory(rank, world, root):
    from shardfit.train import Trainer

    first = Trainer(small_config(*ARGS, run_dir=root))
    try:
        Trainer(small_config(*ARGS, run_dir=root))
        second = "started"
    except ShardfitError as e:
        second = str(e)
    first.fit()
    # the first has finished: free again
    third = Trainer(small_config(*ARGS, "--train.steps=6", EXTEND, run_dir=root))
    return {"second": second, "third_step": third.step}


def test_a_second_run_on_a_locked_directory_stops_at_once(tmp_path):
    r = run_ranks(_two_trainers_on_one_directory, 1, str(tmp_path / "run"))[0]
    assert "run directory is locked: another run is using it" in r["second"]
    assert r["third_step"] == 4


def _start(rank, world, args, root):
    from shardfit.train import Trainer

    try:
        Trainer(small_config(*args, run_dir=root))
    except ShardfitError as e:
        return {"error": str(e)}
    return {"error": None}


def _make_files(root: Path) -> None:
    (root / "a_file").write_text("x")
    (root / "someones_model").mkdir()
    (root / "someones_model" / "notes.txt").write_text("keep me")
    (root / "previous_export").mkdir()
    for name in ("config.json", "model.safetensors"):
        (root / "previous_export" / name).write_text("{}")


def _start_cases(root: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (the run's arguments, what its error must say; "" where the start must succeed)."""
    a_file, foreign, previous = root / "a_file", root / "someones_model", root / "previous_export"
    return {
        "export over foreign files": ([f"--checkpoint.export_hf={foreign}"],
                                      "holds files an export would delete (notes.txt)"),
        "export onto a file": ([f"--checkpoint.export_hf={a_file}"], "is a file, not a directory"),
        "checkpoint dir under a file": ([f"--checkpoint.dir={a_file}/ckpt"], "cannot write here"),
        "run dir is a file": ([f"--logging.run_dir={a_file}"], "cannot write here"),
        "export over a previous export": ([f"--checkpoint.export_hf={previous}"], ""),
    }


def _run_start_cases(rank, world, root):
    out = {}
    for i, (name, (args, _needle)) in enumerate(_start_cases(Path(root)).items()):
        run = [a.split("=", 1)[1] for a in args if a.startswith("--logging.run_dir")]
        out[name] = _start(rank, world, [a for a in args if not a.startswith("--logging.run_dir")],
                           run[0] if run else f"{root}/run_{i}")["error"]
    return out


def test_start_up_refuses_what_would_lose_work_before_training(tmp_path):
    _make_files(tmp_path)
    got = run_ranks(_run_start_cases, 2, str(tmp_path))
    for name, (_args, needle) in _start_cases(tmp_path).items():
        for rank in (0, 1):  # every rank stops alike (the check is agreed), or none does
            if needle:
                assert got[rank][name] and (needle in got[rank][name] or "rank 0 stopped" in got[rank][name]), name
            else:
                assert got[rank][name] is None, (name, got[rank][name])
    assert (tmp_path / "someones_model" / "notes.txt").read_text() == "keep me"
    assert not any((tmp_path / f"run_{i}").exists() for i in range(4))  # failed starts leave no directory


def _fresh_run_over_checkpoints(rank, world, root):
    from shardfit.train import Trainer

    Trainer(small_config(*ARGS, run_dir=root)).fit()
    out = _start(rank, world, [*ARGS, "--checkpoint.resume=none"], root)
    resumed = _start(rank, world, [*ARGS, "--train.steps=6", EXTEND,
                                   f"--checkpoint.resume={root}/checkpoints/step_00000002"], root)
    return {"fresh": out["error"], "older_step_of_same_run": resumed["error"]}


def test_a_new_run_never_overwrites_another_runs_checkpoints(tmp_path):
    r = run_ranks(_fresh_run_over_checkpoints, 1, str(tmp_path / "run"))[0]
    assert "a new run would overwrite complete checkpoints of another run (step_00000002, step_00000004)" in \
        r["fresh"]
    assert r["older_step_of_same_run"] is None  # the same run going back: replaced as it passes them, with a notice


def _save_fails_on_rank_1(rank, world, root):
    import errno

    import shardfit.weights.checkpoint as ck
    from shardfit.train import Trainer

    t = Trainer(small_config(*ARGS, run_dir=root))
    t.fit()  # steps 2 and 4 saved
    if rank == 1:
        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        ck.save_file = full
    t.step = 6
    try:
        t.save()
        return {"error": None}
    except ShardfitError as e:
        return {"error": str(e), "left": sorted(p.name for p in (Path(root) / "checkpoints").iterdir())}


def test_a_save_that_fails_on_one_rank_stops_every_rank_and_keeps_the_previous(tmp_path):
    res = run_ranks(_save_fails_on_rank_1, 2, str(tmp_path / "run"))
    assert "could not write checkpoint step_00000006 on rank 1: the disk is full (No space left on device)" \
        in res[1]["error"]
    assert "rank 1 stopped" in res[0]["error"]
    for r in res:
        assert "the previous checkpoint" in r["error"] and "step_00000004 is intact" in r["error"]
    assert res[0]["left"] == ["step_00000002", "step_00000004"]  # no step_00000006.tmp left behind


@pytest.mark.parametrize("final, refused", [("true", "saving a checkpoint refused"),
                                           ("false", "ending the run with them refused")])
def test_non_finite_weights_are_never_saved_and_the_cli_says_so(tmp_path, final, refused):
    """The update of step 3 leaves a NaN in the weights (tests/train/nan_weights.py): the step-4 save is refused,
    exit 3, the last good checkpoint named and intact; run as a user would."""
    run = tmp_path / "run"
    args = [f"--logging.run_dir={run}", "--logging.progress=none", "--train.steps=4", "--checkpoint.every=2",
            f"--checkpoint.final={final}", "--model.n_layers=1", "--data.seq_len=32", "--train.global_batch=2",
            "--train.micro_batch=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    bad = subprocess.run([sys.executable, str(Path(__file__).parent / "nan_weights.py"), *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode == 3, (bad.returncode, bad.stderr)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("shardfit: error:")]
    assert len(errors) == 1 and f"the weights are not finite after step 4: {refused}" in errors[0], bad.stderr
    assert "step_00000002, is intact" in errors[0] and "Traceback" not in bad.stderr
    assert [p.name for p in complete_checkpoints(run / "checkpoints")] == ["step_00000002"]
