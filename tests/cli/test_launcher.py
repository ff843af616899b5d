"""The launcher as a user meets it: `shardfit train --nproc 2`, torchrun run by hand, stale launcher variables.

Every failure is one `shardfit: error:` line (or `shardfit: interrupted`), no traceback from torchrun or from a rank
that only echoed another's failure, and no rank left running. Faults are planted in one rank through
tests/cli/rank_faults/sitecustomize.py (on the ranks' PYTHONPATH), or sent from outside as a user or the kernel
would (SIGKILL, Ctrl-C, SIGTERM).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_cli import TINY

ROOT = Path(__file__).parents[2]
FAULTS = Path(__file__).parent / "rank_faults"
# The launcher variables of the test's own environment (a parent torchrun, an earlier in-process test).
SCRUB = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
         "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
         "TORCHELASTIC_ERROR_FILE", "SHARDFIT_LAUNCHER_PID", "LOGLEVEL", "SHARDFIT_TEST_FAULT")


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    paths = [str(FAULTS), str(ROOT / "src"), env.get("PYTHONPATH", "")]
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in paths if p), **extra}


def _ranks_of(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the processes the launcher started (torchrun puts each in a session of its own)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SHARDFIT_LAUNCHER_PID={launcher_pid}".encode() in env:
            rank = next((int(x[5:]) for x in env if x.startswith(b"RANK=")), -1)
            out[rank] = int(d.name)
    return out


def _one_line(p, rc: int, needle: str, tracebacks: int = 0) -> str:
    lines = [x for x in p.stderr.splitlines() if x.startswith("shardfit:")]
    assert p.returncode == rc, p.stderr[-3000:]
    assert len(lines) == 1 and needle in lines[0], p.stderr[-3000:]
    assert p.stderr.count("Traceback") == tracebacks, p.stderr[-3000:]
    return lines[0]


def _train(tmp_path, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "shardfit", "train", *TINY, f"--logging.run_dir={tmp_path}/run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or _env(), cwd=ROOT)


@pytest.mark.parametrize("fault, rc, needle, tracebacks", [
    # A config mistake every rank finds: the ranks' line, printed once by the launcher.
    pytest.param(None, 2, "/nonexistent.jsonl: no such file", 0, marks=pytest.mark.slow),
    # A mistake one rank alone finds, after the group formed: that rank named.
    ("1:error", 2, "rank 1: planted.key: a value only this rank sees; fix: remove the fault", 0),
    # A rank killed as the OOM killer would: named with the signal and what to check; exit 1.
    # slow: the real launcher's report of one failed rank is 1:error's, a SIGKILLed rank's line (no error file, the
    # other rank's SIGTERM echo) test_launch_failures.py's test_failures_become_one_line (in-process); ~8 s
    pytest.param("1:kill", 1, "rank 1 was killed by SIGKILL (signal 9, exit code -9", 0, marks=pytest.mark.slow),
    # A bug on one rank: its traceback once (not its peer's echo), and the line naming it; exit 1.
    pytest.param("1:crash", 1, "rank 1 failed with RuntimeError: planted bug (its traceback is above)", 1,
                 marks=pytest.mark.slow),
    pytest.param("0:kill", 1, "rank 0 was killed by SIGKILL", 0, marks=pytest.mark.slow),
])
def test_nproc_failures_are_one_line(tmp_path, fault, rc, needle, tracebacks):
    args = ["--data.path=/nonexistent.jsonl"] if fault is None else []
    env = _env(**({"SHARDFIT_TEST_FAULT": fault} if fault else {}))
    p = _train(tmp_path, "--nproc=2", "--train.steps=4", "--checkpoint.final=false", *args, env=env)
    line = _one_line(p, rc, needle, tracebacks)
    if fault and fault.endswith("kill"):
        assert "out-of-memory killer" in line


@pytest.mark.parametrize("sig, rc, line", [
    # slow: the launcher stopped by a signal (cli/launch.py's _stopped: rank 0's line, 128 + the signal, no rank left
    # behind) is tests/train/test_stop.py's [15-2-launcher], a rank's SIGINT its [2-1-process]; ~8 s
    pytest.param(signal.SIGINT, 130, r"shardfit: stopped by SIGINT after step \d+ of 100000: saved checkpoint "
                 r".*/run/checkpoints/step_\d{8}; the same command resumes it", marks=pytest.mark.slow),
    pytest.param(signal.SIGTERM, 143, r"shardfit: stopped by SIGTERM after step \d+ of 100000: saved checkpoint .*",
                 marks=pytest.mark.slow),
])
def test_nproc_stopped_by_a_signal_says_so_once(tmp_path, sig, rc, line):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) or SIGTERM in the middle of training:
    the ranks stop after the same step without a traceback, save a checkpoint (train/stop.py; also with
    checkpoint.final=false), and the launcher exits 128 + the signal with one line: rank 0's, naming it."""
    cmd = [sys.executable, "-m", "shardfit", "train", *TINY, "--nproc=2", "--train.steps=100000",
           "--checkpoint.final=false", f"--logging.run_dir={tmp_path}/run"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                         start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        for out in p.stdout:  # training has started once a step is logged
            if "step 2/" in out or time.monotonic() > deadline:
                break
        ranks = _ranks_of(p.pid)
        assert sorted(ranks) == [0, 1], ranks
        os.killpg(p.pid, sig) if sig == signal.SIGINT else p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == rc, err[-3000:]
    said = [x for x in err.splitlines() if x.startswith("shardfit:")]
    assert len(said) == 1 and re.fullmatch(line, said[0]), err[-3000:]
    assert "Traceback" not in err
    time.sleep(0.5)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks.values())  # no rank left behind


@pytest.mark.slow
def test_torchrun_by_hand_prints_the_error_once(tmp_path):
    """A user's own torchrun: torchrun's report is its own, but of the ranks only one prints the line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "shardfit",
           "train", *TINY, "--data.path=/nonexistent.jsonl", f"--logging.run_dir={tmp_path}/run"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT)
    assert p.returncode != 0
    lines = [x for x in p.stderr.splitlines() if x.startswith("shardfit: error:")]
    assert lines == ["shardfit: error: /nonexistent.jsonl: no such file or directory; fix: check "
                     "data.path"], p.stderr[-3000:]


TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "old-job", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}


# Every variable's message is launch_env's, checked in-process case by case (tests/parallel/test_dist.py:
# test_launch_env_table, test_unreachable_store_is_one_line_within_a_bound): here the plain run's wiring, one process
# each (exit 2, one line, nothing written); the variables beyond the first run with the slow tests.
STALE_SLOW = pytest.mark.slow


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, "environment variable WORLD_SIZE: WORLD_SIZE=2 is set, but torchrun did not"),
    pytest.param({"WORLD_SIZE": "8", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}, "WORLD_SIZE=8 is set",
                 marks=STALE_SLOW),
    pytest.param({"LOCAL_RANK": "3"}, "environment variable LOCAL_RANK: LOCAL_RANK=3 is set", marks=STALE_SLOW),
    pytest.param({"RANK": "one"}, "environment variable RANK: 'one' is not a whole number", marks=STALE_SLOW),
    pytest.param({"TORCHELASTIC_RUN_ID": "old-job"},
                 "environment variable RANK: is not set, though TORCHELASTIC_RUN_ID", marks=STALE_SLOW),
    pytest.param({**TORCHRUN_ENV, "RANK": "5"}, "RANK=5 is out of range (must be from 0 to WORLD_SIZE-1=1)",
                 marks=STALE_SLOW),
    pytest.param({**TORCHRUN_ENV, "MASTER_PORT": "99999"}, "MASTER_PORT=99999 is out of range", marks=STALE_SLOW),
    # A torchrun environment whose agent is gone: said at once, not after the store's timeout.
    ({**TORCHRUN_ENV, "MASTER_PORT": "PORT"}, "the process group's store does not answer"),
])
def test_stale_launcher_variables_in_a_plain_run(tmp_path, env, needle):
    if env.get("MASTER_PORT") == "PORT":
        from tests.parallel.test_dist import _free_port

        env = {**env, "MASTER_PORT": str(_free_port())}
    start = time.monotonic()
    p = _train(tmp_path, env=_env(**env), timeout=120)
    line = _one_line(p, 2, needle)
    assert "fix: " in line and "unset RANK WORLD_SIZE" in line
    assert time.monotonic() - start < 60  # never the store's wait, let alone a hang
    assert not (tmp_path / "run").exists()


def test_neutral_launcher_variables_train_in_one_process(tmp_path):
    """Values that mean one process anyway (a shell that exported them after a 1-process torchrun) are fine."""
    p = _train(tmp_path, "--train.steps=1", env=_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                                     MASTER_ADDR="nowhere.invalid", MASTER_PORT="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "step 1/1" in p.stdout


@pytest.mark.slow
def test_unreachable_rendezvous_is_one_line_after_torchrun_s_wait(tmp_path):
    """192.0.2.1 (TEST-NET-1) is never routed: the second node waits torchrun's read_timeout (60 s, plus a retry
    within it) and then says so in one line, without the store's C++ retry logs."""
    start = time.monotonic()
    p = _train(tmp_path, "--nproc=1", "--nnodes=2", "--rdzv-endpoint=192.0.2.1:29400", timeout=300)
    _one_line(p, 2, "--rdzv-endpoint=192.0.2.1:29400: the rendezvous store was not reached within torchrun's "
                    "read_timeout")
    assert p.stderr.strip().count("\n") == 0, p.stderr[-3000:]  # nothing else on stderr
    assert time.monotonic() - start < 200


def test_the_cli_imports_no_torch_before_the_launcher_does():
    """`shardfit train --nproc` imports torch itself with the C++ log at FATAL (import_torch_quietly: the rendezvous
    store's retries, a stack trace each, would bury the one line about the endpoint); c10 reads the level once, so
    no command module may import torch when cli/main.py imports them all (generate did: the slow test above failed)."""
    p = subprocess.run([sys.executable, "-c", "import sys, shardfit.cli.main; print(sorted(m for m in sys.modules "
                        "if m == 'torch' or m.startswith('torch.')))"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout[:500]
