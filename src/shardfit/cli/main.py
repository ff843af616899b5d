"""`shardfit <command>`: one console script, one subcommand per face of the tool."""

from __future__ import annotations

import argparse
import os
import sys

from shardfit import __version__
from shardfit.errors import ShardfitError

TRAIN_HELP = """\
Train a decoder model with FSDP2. With no arguments: the embedded tiny model on the embedded corpus.

  shardfit train [--config FILE.toml | --config recipe:NAME] [--section.key=value ...] [--nproc N]
  shardfit train [...] --nproc N --nnodes M --rdzv-endpoint HOST:PORT [--rdzv-id ID]   (on each of M nodes)
  torchrun --nproc_per_node N -m shardfit train [...]     (multi-node: torchrun's flags as usual)

Ready-made configs: shardfit recipes. Defaults below are those of the model on the command line (add
--model.name=... or --model.path=... before --help to see another model's).

Every key (TOML table [section], or --section.key=value on the command line):
"""

# Set once this process has trained: `entry` then ends it without interpreter finalization (see there).
_TRAINED_HERE = False


def _train(argv: list[str]) -> int:
    from shardfit.config.loader import config_help

    opts, rest = _take_options(argv, ("--config", "--nproc", *_RDZV_FLAGS))
    config_path = opts.get("--config")
    nproc = _count(opts["--nproc"], "--nproc", "processes (omit --nproc for one)") if "--nproc" in opts else 1
    launcher = _rendezvous_flags(opts)  # multi-node: torchrun's rendezvous flags, passed through
    nnodes = int(opts.get("--nnodes", 1))

    from shardfit.config import load_config

    if any(a in ("-h", "--help") for a in rest):
        print(TRAIN_HELP + config_help(load_config(config_path, [a for a in rest if a not in ("-h", "--help")])))
        return 0
    cfg = load_config(config_path, rest)  # validate before starting any process
    if config_path:
        from shardfit.config.recipes import check_needs, read

        recipe = read(config_path)
        if recipe is not None:
            check_needs(recipe, cfg)
    if nproc > 1 or launcher:
        from shardfit.parallel.layout import check_layout

        check_layout(cfg, nproc * nnodes)  # before starting processes: one line, not a traceback per rank
        return _launch_torchrun(nproc, config_path, rest, launcher)

    from shardfit.parallel import shutdown_distributed
    from shardfit.train import Trainer, apply_alloc_conf

    apply_alloc_conf(cfg.memory.alloc_conf)  # before torch touches CUDA
    global _TRAINED_HERE
    try:
        Trainer(cfg).fit()
    finally:
        shutdown_distributed()
        _TRAINED_HERE = True
    return 0


def _doctor(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardfit doctor", description=(
        "Explain CUDA memory snapshots (torch.cuda.memory._dump_snapshot), one per rank: fragmentation, memory "
        "held for other streams, per-rank imbalance, what the peak is made of, why an OOM happened."))
    parser.add_argument("snapshots", nargs="+", help=".pickle / .pickle.gz files, or one directory of them")
    parser.add_argument("--json", action="store_true", help="print the JSON report (schema shardfit.doctor/1; "
                        "findings[].figures holds each finding's numbers in bytes: src/shardfit/memory/report.py)")
    parser.add_argument("--memory-fraction", type=float, metavar="F", help=(
        "the fraction given to torch.cuda.set_per_process_memory_fraction in the run, which PyTorch's snapshots do "
        "not record: an OOM's verdict then counts the cap (default: shardfit's own record, else "
        "per_process_memory_fraction in the recorded PYTORCH_CUDA_ALLOC_CONF, else unknown)"))
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help=(
        "the GPU's total memory in GiB, which the cap is a fraction of (default: shardfit's record, else reserved "
        "plus the driver's free memory at the OOM, a lower bound)"))
    parser.add_argument("--png", help="write the timeline and per-rank chart as a PNG here (needs matplotlib)")
    parser.add_argument("--html", help="write a self-contained HTML report with the pictures here")
    args = parser.parse_args(argv)
    import json

    from shardfit.memory import examine
    from shardfit.memory.report import to_json, to_text

    gpu_bytes = None if args.gpu_memory is None else int(args.gpu_memory * (1 << 30))
    results, findings = examine(args.snapshots, args.memory_fraction, gpu_bytes)
    print(json.dumps(to_json(results, findings), indent=1) if args.json else to_text(results, findings), end="")
    if args.png or args.html:
        from shardfit.fsutil import write_atomic
        from shardfit.memory.plot import render_html, render_png

        png = render_png(results, findings)
        for path, data in ((args.png, png), (args.html, render_html(results, findings, png) if args.html else "")):
            if path:
                write_atomic(path, data)
    return 0


def _profile(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardfit profile", description=(
        "Say where a profiled step's GPU time went, from the Chrome trace torch.profiler exported (shardfit's "
        "--logging.profile_step keeps one per run, or any script's): kernel time by kind, the compute stream's idle "
        "time split into waits for the CPU and waits on other streams, host syncs, and each phase's GPU busy time "
        "against its span."))
    parser.add_argument("trace", help="a .json or .json.gz Chrome trace")
    parser.add_argument("--json", action="store_true", help="print the whole summary as JSON (times in ms)")
    args = parser.parse_args(argv)
    import json

    from shardfit.train.profile import explain, read_trace, summarize_trace

    s = summarize_trace(read_trace(args.trace))
    if not s:
        raise ShardfitError(f"{args.trace} holds no GPU kernels", where=args.trace,
                            fix="profile with ProfilerActivity.CUDA on a GPU run")
    print(json.dumps(s, indent=1) if args.json else explain(s), end="\n" if args.json else "")
    return 0


PLAN_HELP = """\
Predict a rank's peak GPU memory before launch, pick the largest micro-batch that fits, and when the configuration
does not fit, propose configurations that do.

  shardfit plan [--config FILE.toml | --config recipe:NAME] [--section.key=value ...] --nproc N [--gpu-memory GIB]
                [--host-memory GIB] [--gpus-per-node G] [--propose] [--json]

The same config keys as `shardfit train` (model, data.seq_len, parallel.*, memory.keep_grads). --nproc is the
number of GPUs the model is sharded over, all nodes together; --gpu-memory the memory of one GPU in GiB (default:
this machine's GPU, else 80). With --parallel.compile=true dense blocks are counted as the compiled graph saves them.
With --parallel.offload=all the host memory each node needs is printed; --host-memory (one node's, GiB) checks it.

Proposals, printed when the configuration does not fit or always with --propose, cheapest first: expert parallelism
within a node with the overlapped optimizer step (MoE models), checkpointing and micro-batch, sequence parallelism,
CPU offload, more GPUs, HSDP with shard groups of whole nodes (--gpus-per-node, default 8). Each is the flags to
add, re-planned with them; --nproc=N in a proposal is the world size (on several nodes: shardfit train --nproc G
--nnodes N/G). --json prints the plan and the proposals as JSON, every figure in bytes (schema shardfit.plan/1,
described in src/shardfit/memory/propose.py).
"""


def _gib(value: str, name: str, fix: str) -> float:
    """A memory size in GiB given on the command line: a number above 0."""
    gib = _number(value, name, float)
    if not gib > 0:
        raise ShardfitError(f"{value} GiB is out of range", where=name, fix=fix)
    return gib


def _plan(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(PLAN_HELP)
        return 0
    switches = {a for a in argv if a in ("--propose", "--json")}
    opts, rest = _take_options([a for a in argv if a not in switches],
                               ("--config", "--nproc", "--gpu-memory", "--host-memory", "--gpus-per-node"))
    from shardfit.config import load_config
    from shardfit.memory.plan import configured, plan_table
    from shardfit.memory.propose import accepted, plan_json, proposals, proposals_text

    cfg = load_config(opts.get("--config"), rest)
    world = _count(opts.get("--nproc", "1"), "--nproc", "GPUs")
    per_node = _count(opts.get("--gpus-per-node", "8"), "--gpus-per-node", "GPUs per node")
    gpu = opts.get("--gpu-memory")
    if gpu is None:
        import torch

        gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80.0
    else:
        gpu_gib = _gib(gpu, "--gpu-memory", "give one GPU's memory in GiB, e.g. 79 (80 GB H100) or 139 (H200)")
    host_gib = (_gib(opts["--host-memory"], "--host-memory", "give one node's host memory in GiB, e.g. 1900")
                if "--host-memory" in opts else None)
    propose = ("--propose" in switches or not configured(cfg, world, gpu_gib, host_gib, per_node)[1]
               or not accepted(cfg, world))  # e.g. parallel.offload=optimizer: counted, but refused by the trainer
    props, short = proposals(cfg, world, gpu_gib, host_gib, per_node) if propose else ([], [])
    if "--json" in switches:
        import json

        print(json.dumps(plan_json(cfg, world, gpu_gib, host_gib, per_node, props, short), indent=1))
        return 0
    print(plan_table(cfg, world, gpu_gib, host_gib, per_node))
    if propose:
        print("\n" + proposals_text(props, short, gpu_gib, host_gib))
    return 0


def _number(value: str, name: str, kind):
    try:
        return kind(value)
    except ValueError:
        raise ShardfitError(f"'{value}' is not a number", where=name, fix=f"give {name} a number") from None


def _count(value: str, name: str, what: str) -> int:
    """A launcher count (--nproc): a whole number of at least 1."""
    n = _number(value, name, int)
    if n < 1:
        raise ShardfitError(f"{n} is out of range", where=name, fix=f"give 1 or more {what}")
    return n


def _recipes(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("shardfit recipes: list the ready-made configs shipped with shardfit; use one with --config recipe:NAME")
        return 0
    if argv:
        raise ShardfitError(f"unexpected argument '{argv[0]}'", where="shardfit recipes", fix="give no arguments")
    from shardfit.config.recipes import listing

    print(listing())
    return 0


def _take_options(argv: list[str], names: tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """Pull `--name VALUE` / `--name=VALUE` for the given names out of argv; the rest are config overrides."""
    opts, rest, i = {}, [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in names:
            if not eq:
                if i + 1 >= len(argv):
                    raise ShardfitError(f"{name} needs a value", where="command line", fix=f"write {name}=VALUE")
                value = argv[i + 1]
                i += 1
            opts[name] = value
        else:
            rest.append(argv[i])
        i += 1
    return opts, rest


# torchrun's multi-node flags that `shardfit train` passes through (either spelling; docs/multinode.md).
_RDZV_FLAGS = ("--nnodes", "--node-rank", "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
               "--rdzv_endpoint", "--rdzv-id", "--rdzv_id")


def _rendezvous_flags(opts: dict[str, str]) -> list[str]:
    """torchrun flags for a multi-node launch (empty: one node, --standalone)."""
    given = {name.replace("_", "-"): value for name, value in opts.items() if name in _RDZV_FLAGS}
    if not given:
        return []
    nnodes = _count(given.get("--nnodes", "1"), "--nnodes", "nodes (torchrun's elastic MIN:MAX: run torchrun "
                    "directly)")
    if nnodes > 1 and "--rdzv-endpoint" not in given:
        raise ShardfitError(f"--nnodes={nnodes} needs the rendezvous address", where="--rdzv-endpoint",
                            fix="add --rdzv-endpoint=HOST:PORT (the first node's address, the same on every node)")
    given["--nnodes"] = str(nnodes)
    given.setdefault("--rdzv-backend", "c10d")
    return [f"{name}={value}" for name, value in given.items()]


def _launch_torchrun(nproc: int, config_path: str | None, rest: list[str], launcher: list[str] = ()) -> int:
    """`--nproc N`: start N local processes through torchrun, the same launcher users run by hand; on several
    nodes (launcher: --nnodes, --rdzv-*), this node's N processes of the job."""
    from torch.distributed.run import main as torchrun_main

    args = [*(launcher or ["--standalone"]), f"--nproc_per_node={nproc}", "-m", "shardfit", "train"]
    if config_path:
        args.append(f"--config={config_path}")
    torchrun_main(args + rest)
    return 0


def _tokenize(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardfit tokenize", description=(
        "Tokenize text, JSON lines or Parquet once into token shards that `shardfit train --data.path DIR` "
        "memory-maps. Runs over CPU cores; a re-run after an interruption resumes; DIR is usable once it has "
        "manifest.json."))
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs (as data.path)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the shard directory to write (new or empty)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or the path of a tokenizer.json (default: byte)")
    parser.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"),
                        help="input format; auto picks by extension")
    parser.add_argument("--text-field", default="text", help="JSON key or Parquet column of the text")
    parser.add_argument("--workers", help="processes (default: the CPU cores available)")
    args = parser.parse_args(argv)
    from shardfit.data.tokenize import tokenize_to_shards

    workers = _count(args.workers, "--workers", "worker processes") if args.workers else None
    m = tokenize_to_shards(args.inputs, args.out, args.tokenizer, args.format, args.text_field, workers)
    print(f"{args.out}: {m['tokens']:,} tokens ({m['dtype']}) in {m['documents']:,} documents, "
          f"{len(m['pieces'])} shards; train with --data.path={args.out} --data.tokenizer={args.tokenizer}")
    return 0


def _generate(argv: list[str]) -> int:
    from shardfit.generate import main as generate_main

    return generate_main(argv)


COMMANDS = {"train": _train, "doctor": _doctor, "plan": _plan, "recipes": _recipes, "generate": _generate,
            "tokenize": _tokenize, "profile": _profile}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="shardfit", description="FSDP2 LLM training that fits, runs fast, and "
                                     "explains its memory.")
    parser.add_argument("--version", action="version", version=f"shardfit {__version__}")
    parser.add_argument("command", choices=list(COMMANDS), help="train: sharded training (shardfit train --help); "
                        "doctor: explain CUDA memory snapshots (shardfit doctor --help); plan: predict peak memory and "
                        "the largest micro-batch that fits (shardfit plan --help); recipes: the ready-made configs "
                        "(--config recipe:NAME); generate: text from a trained model or checkpoint (shardfit generate "
                        "--help); tokenize: text to token shards for data.path (shardfit tokenize --help); "
                        "profile: where a profiled step's GPU time went (shardfit profile --help)")
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        parser.parse_args([command])  # prints the choices and exits 2
    try:
        return COMMANDS[command](rest)
    except ShardfitError as e:
        print(f"shardfit: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("shardfit: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The console script and `python -m shardfit`: main(), then the exit.

    A process that trained leaves with os._exit once its output is flushed. After training, the gloo process group
    outlived destroy_process_group (DTensor's caches hold its DeviceMesh: benchmarks/NOTES.md, sessions 10-11;
    shutdown_distributed now clears them, and this exit stays as the guard for caches on other threads), so its
    worker threads were still running when the interpreter finalized. A
    worker that then drops the last reference to a collective's tensor (a finished barrier holds the all-gather
    before it) needs the GIL, which a finalizing interpreter answers with pthread_exit: a C++ 'terminate called
    without an active exception' abort (SIGABRT) after a run that had finished (core dump, session 10: 1 run in 180
    of 2-process CPU training, three at a time on 2 cores). Everything the run writes is written and renamed by
    then: skipping finalization loses nothing (metrics, W&B and TensorBoard are closed by the trainer).
    """
    rc = main()
    if _TRAINED_HERE:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    raise SystemExit(rc)


if __name__ == "__main__":
    entry()
