"""`shardfit train --nproc N`: this node's N ranks through torchrun, and what happened to them said in one line.

torchrun (torch.distributed.run.main, in this process) starts the ranks; its own log lines are silenced unless
LOGLEVEL is set (torchrun's switch for them), and its failure report (ChildFailedError, a block per rank with
tracebacks) becomes one line: a rank's ShardfitError as the rank wrote it (shardfit.cli.rank_errors; the rank named
when only some failed) with the rank's exit code; a rank killed by a signal, or crashed, named with what to check
(exit 1). Ctrl-C and SIGTERM stop the ranks (torchrun forwards the signal; they save a checkpoint, train/stop.py)
and exit 128 + the signal number (130, 143) with one line: rank 0's, naming the checkpoint, passed back in the file
SHARDFIT_STOP_NOTE names; torchrun waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s) for them before SIGKILL. A
malformed rendezvous endpoint is refused before anything starts; an unreachable one after torchrun's wait for it
(read_timeout, 60 s by default), in one line.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys

from shardfit.cli.args import count, number
from shardfit.cli.rank_errors import STOP_NOTE, read_error_file
from shardfit.errors import LAUNCHER_PID, ShardfitError, Stopped

# torchrun's multi-node flags that `shardfit train` passes through (either spelling; docs/multinode.md).
RDZV_FLAGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
              "--rdzv_endpoint", "--rdzv-id", "--rdzv_id")
RDZV_BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
# torchrun's c10d rendezvous defaults (--rdzv-conf read_timeout / join_timeout), for the messages.
READ_TIMEOUT_S, JOIN_TIMEOUT_S = 60, 600
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}


def rendezvous_flags(opts: dict[str, str]) -> list[str]:
    """torchrun flags for a multi-node launch (empty: one node, --standalone), each checked."""
    given = {name.replace("_", "-"): value for name, value in opts.items() if name in RDZV_FLAGS}
    if not given:
        return []
    nnodes = count(given.get("--nnodes", "1"), "--nnodes", "nodes (torchrun's elastic MIN:MAX: run torchrun "
                   "directly)")
    if nnodes > 1 and "--rdzv-endpoint" not in given:
        raise ShardfitError(f"--nnodes={nnodes} needs the rendezvous address", where="--rdzv-endpoint",
                            fix="add --rdzv-endpoint=HOST:PORT (the first node's address, the same on every node)")
    if "--rdzv-endpoint" in given:
        check_endpoint(given["--rdzv-endpoint"])
    backend = given.setdefault("--rdzv-backend", "c10d")
    if backend not in RDZV_BACKENDS:
        raise ShardfitError(f"unknown rendezvous backend '{backend}'", where="--rdzv-backend",
                            fix=f"use one of {', '.join(RDZV_BACKENDS)} (c10d needs nothing else)")
    if "--node-rank" in given:
        node_rank = number(given["--node-rank"], "--node-rank", int)
        if not 0 <= node_rank < nnodes:
            raise ShardfitError(f"{node_rank} is out of range for --nnodes={nnodes}", where="--node-rank",
                                fix=f"give each node a rank from 0 to {nnodes - 1}")
    if "--rdzv-id" in given and not re.fullmatch(r"[\w.:-]+", given["--rdzv-id"]):
        raise ShardfitError(f"'{given['--rdzv-id']}' is not a job id", where="--rdzv-id",
                            fix="use letters, digits, '_', '.', ':' or '-' (the same on every node)")
    given["--nnodes"] = str(nnodes)
    return [f"{name}={value}" for name, value in given.items()]


def check_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) as torchrun reads it, with the port required: torchrun's default port is
    silent about which one the nodes meet at."""
    fix = "give the first node's address and a free port, the same on every node, e.g. --rdzv-endpoint=node0:29400"
    text = endpoint.strip()
    if text.startswith("[") and "]" in text:
        host, _, port = text[1:].partition("]")
        port = port[1:] if port.startswith(":") else None
    else:
        host, sep, port = text.rpartition(":")
        host, port = (host, port) if sep else (text, None)
    if not host:
        raise ShardfitError(f"'{endpoint}' has no host", where="--rdzv-endpoint", fix=fix)
    if port is None:
        raise ShardfitError(f"'{endpoint}' has no port", where="--rdzv-endpoint", fix=fix)
    if not re.fullmatch(r"[\w.:-]+", host):
        raise ShardfitError(f"'{host}' is not a host name or address", where="--rdzv-endpoint", fix=fix)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ShardfitError(f"port '{port}' is not a number from 1 to 65535", where="--rdzv-endpoint", fix=fix)
    return host, int(port)


def import_torch_quietly() -> None:
    """Import torch in the launcher with its C++ log at FATAL: the launcher's C++ logs are the rendezvous store's
    connection retries, a stack trace each, which the one line about the endpoint replaces. c10 reads the level once,
    at import; the variable is gone again before the ranks start, so theirs are as the user set them. LOGLEVEL
    (torchrun's switch for its logs) keeps them too."""
    if "torch" in sys.modules or os.environ.get("LOGLEVEL") or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def launch_torchrun(nproc: int, config_path: str | None, rest: list[str], launcher: list[str] = (),
                    command: str = "train") -> int:
    """Start this node's ranks through torchrun and wait for them; the exit code (the line is printed here, or
    raised as a ShardfitError for the CLI to print)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    args = [*(launcher or ["--standalone"]), f"--nproc_per_node={nproc}", "-m", "shardfit", command]
    if config_path:
        args.append(f"--config={config_path}")
    quiet = not os.environ.get("LOGLEVEL")
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks are this process's children: they leave the line to it
    import tempfile

    note = os.path.join(tempfile.gettempdir(), f"shardfit-stop-{os.getpid()}.txt")
    os.environ[STOP_NOTE] = note  # rank 0 writes its stop line there (rank_errors.report_error)
    if quiet:
        logging.disable(logging.CRITICAL)  # torchrun's log lines: each failure is said below, once
    try:
        torchrun.main(args + rest)
    except ChildFailedError as e:
        raise explain_failures(e.failures, nproc) from None
    except SignalException as e:
        return _stopped(e.sigval, note)
    except RendezvousError as e:
        raise _rendezvous_error(e, dict(a.split("=", 1) for a in launcher)) from None
    finally:
        os.environ.pop(LAUNCHER_PID, None)
        os.environ.pop(STOP_NOTE, None)
        if os.path.exists(note):
            os.unlink(note)
        if quiet:
            logging.disable(logging.NOTSET)
    return 0


def _stopped(sig: int, note: str) -> int:
    """This launcher got Ctrl-C or a termination signal: torchrun has passed it to the ranks and waited for them.
    Rank 0's line says what they saved; without one, they were stopped before they could save."""
    try:
        with open(note, encoding="utf-8") as f:
            line = f.read().strip()
    except OSError:
        line = ""
    if line:
        print(f"shardfit: {line}", file=sys.stderr)
        return 128 + int(sig)
    name = signal.Signals(sig).name
    what = "interrupted" if sig == signal.SIGINT else f"stopped by {name}"
    print(f"shardfit: {what}: the ranks were stopped before saving a checkpoint (during start-up, or beyond "
          "torchrun's TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default: raise it to give them time)", file=sys.stderr)
    return 128 + int(sig)


def explain_failures(failures: dict, nproc: int) -> ShardfitError:
    """torchrun's failures (global rank -> ProcessFailure) as the one error to print: a rank's own ShardfitError
    first (lowest rank), then a rank killed by a signal, then a crash, then a bare exit code."""
    errors, signalled, crashed, exited = {}, {}, {}, {}
    attempt_dirs = {os.path.dirname(os.path.dirname(f.error_file)) for f in failures.values()
                    if os.path.isabs(f.error_file)}
    # torchrun stops the other ranks with SIGTERM once one has failed, and lists them too: echoes, unless SIGTERM is
    # all there is (then it came from outside).
    echo = -int(signal.SIGTERM)
    if any(f.exitcode != echo for f in failures.values()):
        failures = {rank: f for rank, f in failures.items() if f.exitcode != echo}
    for rank, f in failures.items():
        entry = read_error_file(f.error_file) if os.path.isabs(f.error_file) else None
        if entry and entry.get("kind") == "error":
            errors[rank] = entry
        elif f.exitcode < 0:
            signalled[rank] = f
        elif entry:
            crashed[rank] = entry
        else:
            exited[rank] = f
    if errors:
        rank = min(errors)
        # Ranks torchrun stopped after the first failure may have written the same error: count them too.
        same = sum(1 for d in attempt_dirs for lr in range(nproc)
                   if (read_error_file(os.path.join(d, str(lr), "error.json")) or {}).get("message")
                   == errors[rank]["message"])
        code = errors[rank].get("exit_code")
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # the ranks stopped on a signal, and said so
            return Stopped(errors[rank]["message"], exit_code=code)
        return ShardfitError(errors[rank]["message"], where=None if same >= nproc else f"rank {rank}",
                             exit_code=code if isinstance(code, int) and 0 < code < 126 else 2)
    if signalled:
        rank = min(signalled)
        f = signalled[rank]
        sig = -f.exitcode
        name = f.signal_name() if f.signal_name() != "<N/A>" else f"signal {sig}"
        if sig == signal.SIGKILL:
            what, fix = "was killed by SIGKILL", ("check the kernel log for the out-of-memory killer (dmesg | grep -i "
                                                  "-e oom -e killed), the node's free host memory, and the job "
                                                  "scheduler's memory and time limits")
        elif sig in _CRASH_SIGNALS:
            what, fix = f"crashed with {name}", ("a crash in native code (CUDA, NCCL, a compiled kernel): the rank's "
                                                 "output above may say where; please report it with that output")
        else:
            what, fix = f"was stopped by {name} from outside this launcher", (
                "check what sent it: the job scheduler (time or memory limit, preemption) or a user")
        return ShardfitError(f"rank {rank} {what} (signal {sig}, exit code {f.exitcode}, pid {f.pid})", fix=fix,
                             exit_code=1)
    if crashed:
        rank = min(crashed)
        return ShardfitError(f"rank {rank} failed with {crashed[rank]['message']} (its traceback is above)",
                             fix="this is a bug in shardfit or a library it uses: please report it with the "
                                 "traceback", exit_code=1)
    rank = min(exited)
    f = exited[rank]
    from shardfit.train.watchdog import EXIT_CODE as WATCHDOG_EXIT

    if f.exitcode == WATCHDOG_EXIT:
        return ShardfitError(f"rank {rank} made no progress and was stopped by the watchdog (train.watchdog_s)",
                             fix="see hang_rank*.txt in the run directory: where each rank "
                             "waited", exit_code=WATCHDOG_EXIT)
    return ShardfitError(f"rank {rank} exited with code {f.exitcode} (its output is above)",
                         exit_code=f.exitcode if 0 < f.exitcode < 126 else 1)


def _rendezvous_error(e: Exception, flags: dict[str, str]) -> ShardfitError:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    endpoint = flags.get("--rdzv-endpoint", "")
    where = f"--rdzv-endpoint={endpoint}" if endpoint else "rendezvous"
    same = "the same --nnodes, --rdzv-endpoint and --rdzv-id on every node"
    if isinstance(e, RendezvousConnectionError):
        host = check_endpoint(endpoint)[0] if endpoint else "localhost"
        try:
            socket.getaddrinfo(host, None)
        except OSError:
            return ShardfitError(f"host '{host}' does not resolve", where=where,
                                 fix="give the first node's host name or IP address as this node sees it")
        return ShardfitError(f"the rendezvous store was not reached within torchrun's read_timeout ({READ_TIMEOUT_S} s "
                             "by default)",
                             where=where, fix="start the first node (the endpoint's host) with " + same +
                             "; check the port is open between the nodes")
    if isinstance(e, RendezvousTimeoutError):
        return ShardfitError(f"not all {flags.get('--nnodes', '?')} nodes joined within torchrun's wait "
                             f"({JOIN_TIMEOUT_S} s by default)", where=where, fix="start shardfit train with " + same)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return ShardfitError(f"the rendezvous failed: {first}", where=where, fix="check " + same)
