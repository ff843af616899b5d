"""`shardfit <command>`: one console script, one subcommand per face of the tool, and one error path.

Each command is the function of the same name in its own module, cli/<command>.py, taking the arguments after the
command's name. A ShardfitError from any command is one line, `shardfit: error: ...`, and exit code 2 (or the error's
own code); under torchrun once per job (cli.rank_errors). Ctrl-C is `shardfit: interrupted` and exit 130. Output
whose reader has gone (`shardfit generate ... | head`) ends the command quietly, as Unix tools end: exit 141 (128 +
SIGPIPE), no traceback.
"""

from __future__ import annotations

import difflib
import os
import signal
import sys

from shardfit import __version__
from shardfit.cli import rank_errors
from shardfit.cli.args import ArgumentParser
from shardfit.cli.doctor import doctor
from shardfit.cli.export import export
from shardfit.cli.generate import generate
from shardfit.cli.plan import plan
from shardfit.cli.plot import plot
from shardfit.cli.profile import profile
from shardfit.cli.recipes import recipes
from shardfit.cli.serve import serve
from shardfit.cli.tokenize import tokenize
from shardfit.cli.train import train
from shardfit.errors import ShardfitError

COMMANDS = {"train": train, "doctor": doctor, "plan": plan, "recipes": recipes, "generate": generate,
            "tokenize": tokenize, "profile": profile, "serve": serve, "export": export, "plot": plot}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(prog="shardfit", description="FSDP2 LLM training that fits, runs fast, and "
                            "explains its memory.")
    parser.add_argument("--version", action="version", version=f"shardfit {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), help="train: sharded training (shardfit train --help); "
                        "doctor: explain CUDA memory snapshots (shardfit doctor --help); plan: predict peak memory and "
                        "the largest micro-batch that fits (shardfit plan --help); recipes: the ready-made configs "
                        "(--config recipe:NAME); generate: text from a trained model or checkpoint (shardfit generate "
                        "--help); tokenize: text to token shards for data.path (shardfit tokenize --help); "
                        "profile: where a profiled step's GPU time went (shardfit profile --help); serve: the Tinker "
                        "API for training and sampling (shardfit serve --help); export: a checkpoint as a Hugging Face "
                        "model directory (shardfit export --help); plot: a run's metrics as a PNG (shardfit plot "
                        "--help)")
    try:
        if not argv or argv[0] in ("-h", "--help", "--version"):
            parser.parse_args(argv or ["--help"])
            return 0
        command, rest = argv[0], argv[1:]
        if command not in COMMANDS:
            close = difflib.get_close_matches(command, COMMANDS, n=1)
            raise ShardfitError(f"unknown command '{command}'" + (f" (did you mean '{close[0]}'?)" if close else ""),
                                fix=f"use one of {', '.join(COMMANDS)} (shardfit --help)")
        return COMMANDS[command](rest)
    except ShardfitError as e:
        return rank_errors.report_error(e)
    except BrokenPipeError:
        if not stdout_gone():
            raise  # another pipe (a socket, a child's): a bug, with its traceback
        return quiet_broken_pipe()
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM outside the training loop (cli/train.py)
        sig = getattr(e, "signum", signal.SIGINT)
        print("shardfit: interrupted" if sig == signal.SIGINT else f"shardfit: stopped by {signal.Signals(sig).name}"
              + " before training started: nothing was trained", file=sys.stderr)
        return 128 + int(sig)
    except Exception as e:
        if rank_errors.torchrun_worker():
            return rank_errors.report_crash(e)  # a bug keeps its traceback, printed once per job
        raise


def stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or no real stdout
        return False


def quiet_broken_pipe() -> int:
    """Stdout's reader has gone: point stdout at /dev/null, so that the exit's flush of what is still buffered
    does not fail again ("Exception ignored ... BrokenPipeError"), and leave as SIGPIPE would have ended us."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def entry() -> None:
    """The console script and `python -m shardfit`: main(), then the exit.

    A process that trained leaves with os._exit once its output is flushed. After training, the gloo process group
    outlived destroy_process_group (DTensor's caches hold its DeviceMesh; parallel/dist.py's
    shutdown_distributed now clears them, and this exit stays as the guard for caches on other threads), so its
    worker threads were still running when the interpreter finalized. A
    worker that then drops the last reference to a collective's tensor (a finished barrier holds the all-gather
    before it) needs the GIL, which a finalizing interpreter answers with pthread_exit: a C++ 'terminate called
    without an active exception' abort (SIGABRT) after a run that had finished (rare, and more frequent on a
    loaded host). Everything the run writes is written and renamed by
    then: skipping finalization loses nothing (metrics, W&B and TensorBoard are closed by the trainer).
    """
    rank_errors.quiet_interrupts()  # first: a torchrun rank's Ctrl-C must not become a traceback, even in imports
    try:
        rc = main()
    except SystemExit as e:  # argparse's --help and --version leave from inside main
        rc = e.code
    try:
        sys.stdout.flush()  # what a block-buffered pipe still holds (`shardfit recipes | head -1`)
    except BrokenPipeError:
        rc = quiet_broken_pipe()
    from shardfit.cli import train as train_command

    if train_command.trained_here:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    raise SystemExit(rc)


if __name__ == "__main__":
    entry()
