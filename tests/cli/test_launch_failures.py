"""How the launcher turns torchrun's report into one line, and how a rank reports its error (in-process: the
failures are made here as torchrun makes them; tests/cli/test_launcher.py runs the real thing)."""

import os
import signal

import pytest

from shardfit.cli import rank_errors
from shardfit.errors import LAUNCHER_PID, ShardfitError
from tests.cli.test_cli import TINY


class _Halted(ShardfitError):
    exit_code = 3


@pytest.fixture
def attempt(tmp_path, monkeypatch):
    """A torchrun attempt directory (<attempt>/<local rank>/error.json) and a function that makes rank r fail
    the way a shardfit rank does: ('error', exc) through the CLI's path, ('crash', exc), or nothing."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for var in ("TORCHELASTIC_ERROR_FILE", LAUNCHER_PID):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "1")  # no crash grace period in-process
    monkeypatch.setenv(LAUNCHER_PID, str(os.getppid()))  # as if our launcher started this process

    def fail(rank: int, exitcode: int, how: str = "", exc: Exception | None = None) -> ProcessFailure:
        path = tmp_path / str(rank) / "error.json"
        path.parent.mkdir(exist_ok=True)
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        if how == "error":
            assert rank_errors.report_error(exc) == exc.exit_code
        elif how == "crash":
            try:
                raise exc
            except Exception as e:
                assert rank_errors.report_crash(e) == 1
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))

    return fail


ERR = ShardfitError("no such file", where="/d/x.jsonl", fix="check data.path")
TERM, KILL, SEGV = -int(signal.SIGTERM), -int(signal.SIGKILL), -int(signal.SIGSEGV)


@pytest.mark.parametrize("ranks, rc, line", [
    # Every rank found the same mistake: the line as the ranks wrote it, no rank named.
    ({0: (2, "error", ERR), 1: (2, "error", ERR)}, 2, "/d/x.jsonl: no such file; fix: check data.path"),
    # One rank found it; torchrun then stopped the other (SIGTERM): that rank named.
    ({0: (TERM, "", None), 1: (2, "error", ERR)}, 2, "rank 1: /d/x.jsonl: no such file; fix: check data.path"),
    ({0: (2, "error", ERR), 1: (TERM, "", None)}, 2, "rank 0: /d/x.jsonl: no such file"),
    # A ShardfitError with its own exit code keeps it.
    ({0: (3, "error", _Halted("too many non-finite steps")), 1: (TERM, "", None)}, 3, "too many non-finite steps"),
    # The user's error wins over a rank killed at the same time (the kill is likely its echo).
    ({0: (KILL, "", None), 1: (2, "error", ERR)}, 2, "rank 1: /d/x.jsonl"),
    # Signals: named, with what to check; exit 1.
    ({0: (TERM, "", None), 1: (KILL, "", None)}, 1, "rank 1 was killed by SIGKILL (signal 9, exit code -9, pid 1001); "
                                                    "fix: check the kernel log for the out-of-memory killer"),
    ({0: (SEGV, "", None), 1: (TERM, "", None)}, 1, "rank 0 crashed with SIGSEGV (signal 11"),
    ({0: (TERM, "", None), 1: (TERM, "", None)}, 1, "rank 0 was stopped by SIGTERM from outside this launcher"),
    ({0: (-200, "", None)}, 1, "rank 0 was stopped by signal 200"),  # not a signal Python knows by name
    # A bug: named with its exception; its traceback was printed by the rank.
    ({0: (TERM, "", None), 1: (1, "crash", RuntimeError("boom\nsecond line"))}, 1,
     "rank 1 failed with RuntimeError: boom (its traceback is above); fix: this is a bug"),
    # A bare exit code: passed on (the watchdog's is named).
    ({0: (7, "", None), 1: (TERM, "", None)}, 7, "rank 0 exited with code 7 (its output is above)"),
    ({1: (5, "", None)}, 5, "rank 1 made no progress and was stopped by the watchdog"),
    ({0: (255, "", None)}, 1, "rank 0 exited with code 255"),
])
def test_failures_become_one_line(attempt, capsys, ranks, rc, line):
    from shardfit.cli.launch import explain_failures

    failures = {r: attempt(r, code, how, exc) for r, (code, how, exc) in ranks.items()}
    capsys.readouterr()
    e = explain_failures(failures, nproc=2)
    assert e.exit_code == rc and line in e.cli_line() and e.cli_line().startswith("shardfit: error: ")
    assert len(e.cli_line().splitlines()) == 1


def test_a_rank_prints_only_when_no_launcher_will(attempt, monkeypatch, capsys):
    """Under shardfit's launcher a rank's error goes to its error file only; under a torchrun run by hand the first
    rank of the launch prints it and the next does not; with no error file to share, every rank prints."""
    attempt(0, 2, "error", ERR)
    assert capsys.readouterr().err == ""  # the launcher will print it
    monkeypatch.setenv(LAUNCHER_PID, "1")  # another launcher's: not our parent
    attempt(0, 2, "error", ERR)
    attempt(1, 2, "error", ERR)
    assert capsys.readouterr().err.splitlines() == [ERR.cli_line()]  # once for the two ranks
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "")
    assert rank_errors.report_error(ERR) == 2
    assert rank_errors.report_error(ERR) == 2
    assert capsys.readouterr().err.splitlines() == [ERR.cli_line()] * 2
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not a torchrun rank at all
    assert rank_errors.report_error(ERR) == 2 and capsys.readouterr().err.splitlines() == [ERR.cli_line()]


def test_an_error_file_left_from_an_old_launch_does_not_silence_a_rank(tmp_path, monkeypatch, capsys):
    old = tmp_path / "attempt_0" / "0"
    old.mkdir(parents=True)
    (old.parent / f".shardfit-printed-{os.getppid() + 1}").touch()  # a claim by another launch's agent
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "gone" / "0" / "error.json"))  # directory gone
    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    assert rank_errors.report_error(ERR) == 2 and capsys.readouterr().err.splitlines() == [ERR.cli_line()]
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(old / "error.json"))
    assert rank_errors.report_error(ERR) == 2 and capsys.readouterr().err.splitlines() == [ERR.cli_line()]


def _raise(exc):
    def fake_torchrun(args):
        raise exc
    return fake_torchrun


@pytest.mark.parametrize("endpoint, exc, rc, line", [
    ("nosuchhost.invalid:29400", "connection", 2, "--rdzv-endpoint=nosuchhost.invalid:29400: host "
                                                  "'nosuchhost.invalid' does not resolve"),
    ("127.0.0.1:29400", "connection", 2, "the rendezvous store was not reached within torchrun's read_timeout (60 s"),
    ("127.0.0.1:29400", "timeout", 2, "not all 2 nodes joined within torchrun's wait (600 s by default)"),
    ("127.0.0.1:29400", "closed", 2, "the rendezvous failed: closed"),
    ("127.0.0.1:29400", "SIGINT", 130, "shardfit: interrupted: the ranks were stopped"),
    ("127.0.0.1:29400", "SIGTERM", 143, "shardfit: stopped by SIGTERM: the ranks were stopped"),
    ("127.0.0.1:29400", "SIGHUP", 129, "shardfit: stopped by SIGHUP"),
])
def test_launcher_failures_are_one_line(monkeypatch, capsys, tmp_path, endpoint, exc, rc, line):
    """What torchrun raises in the launcher itself (rendezvous, signals): one line, without torchrun's own logs."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    from shardfit.cli.main import main

    made = {"connection": RendezvousConnectionError("The connection to the C10d store has failed."),
            "timeout": RendezvousTimeoutError(), "closed": RendezvousClosedError("closed")}.get(exc) or \
        SignalException(f"got {exc}", getattr(signal, exc))
    monkeypatch.setattr(torch.distributed.run, "main", _raise(made))
    monkeypatch.delenv("LOGLEVEL", raising=False)
    got = main(["train", *TINY, "--nproc=1", "--nnodes=2", f"--rdzv-endpoint={endpoint}",
                f"--logging.run_dir={tmp_path}/run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert got == rc and len(err) == 1 and line in err[0], err
    assert LAUNCHER_PID not in os.environ  # the launcher's marker does not outlive the launch
