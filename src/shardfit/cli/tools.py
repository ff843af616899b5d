"""The commands around training: doctor (memory snapshots), profile (a trace), tokenize, recipes, generate."""

from __future__ import annotations

from shardfit.cli.args import ArgumentParser, count, fraction, gib
from shardfit.errors import ShardfitError


def doctor(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit doctor", description=(
        "Explain CUDA memory snapshots (torch.cuda.memory._dump_snapshot), one per rank: fragmentation, memory "
        "held for other streams, per-rank imbalance, what the peak is made of, why an OOM happened."))
    parser.add_argument("snapshots", nargs="+", help=".pickle / .pickle.gz files, or one directory of them")
    parser.add_argument("--json", action="store_true", help="print the JSON report (schema shardfit.doctor/1; "
                        "findings[].figures holds each finding's numbers in bytes: src/shardfit/memory/report.py)")
    parser.add_argument("--memory-fraction", metavar="F", type=lambda v: fraction(
        v, "--memory-fraction", "the fraction of the GPU's memory the run could use"), help=(
        "the fraction given to torch.cuda.set_per_process_memory_fraction in the run, which PyTorch's snapshots do "
        "not record: an OOM's verdict then counts the cap (default: shardfit's own record, else "
        "per_process_memory_fraction in the recorded PYTORCH_CUDA_ALLOC_CONF, else unknown)"))
    parser.add_argument("--gpu-memory", metavar="GIB", type=lambda v: gib(
        v, "--gpu-memory", "give the GPU's memory in GiB, e.g. 79 (80 GB H100) or 139 (H200)"), help=(
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


def profile(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit profile", description=(
        "Say where a profiled step's GPU time went, from the Chrome trace torch.profiler exported (shardfit's "
        "--logging.profile_step keeps one per run, or any script's): kernel time by kind, the compute stream's idle "
        "time split into waits for the CPU and waits on other streams, host syncs, and each phase's GPU busy time "
        "against its span."))
    parser.add_argument("trace", help="a .json or .json.gz Chrome trace")
    parser.add_argument("--json", action="store_true", help="print the whole summary as JSON (times in ms)")
    args = parser.parse_args(argv)
    import json

    from shardfit.memory.profile_trace import explain, read_trace, summarize_trace

    s = summarize_trace(read_trace(args.trace))
    if not s:
        raise ShardfitError(f"{args.trace} holds no GPU kernels", where=args.trace,
                            fix="profile with ProfilerActivity.CUDA on a GPU run")
    print(json.dumps(s, indent=1) if args.json else explain(s), end="\n" if args.json else "")
    return 0


def recipes(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("shardfit recipes: list the ready-made configs shipped with shardfit; use one with --config recipe:NAME")
        return 0
    if argv:
        raise ShardfitError(f"unexpected argument '{argv[0]}'", where="shardfit recipes", fix="give no arguments")
    from shardfit.config.recipes import listing

    print(listing())
    return 0


def tokenize(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit tokenize", description=(
        "Tokenize text, JSON lines or Parquet once into token shards that `shardfit train --data.path DIR` "
        "memory-maps. Runs over CPU cores; a re-run after an interruption resumes; DIR is usable once it has "
        "manifest.json."))
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs (as data.path)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the shard directory to write (new or empty)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or the path of a tokenizer.json (default: byte)")
    parser.add_argument("--format", default="auto", choices=("auto", "text", "jsonl", "parquet"),
                        help="input format; auto picks by extension")
    parser.add_argument("--text-field", default="text", help="JSON key or Parquet column of the text")
    parser.add_argument("--workers", type=lambda v: count(v, "--workers", "worker processes"),
                        help="processes (default: the CPU cores available)")
    args = parser.parse_args(argv)
    from shardfit.data.tokenize import tokenize_to_shards

    m = tokenize_to_shards(args.inputs, args.out, args.tokenizer, args.format, args.text_field, args.workers)
    print(f"{args.out}: {m['tokens']:,} tokens ({m['dtype']}) in {m['documents']:,} documents, "
          f"{len(m['pieces'])} shards; train with --data.path={args.out} --data.tokenizer={args.tokenizer}")
    return 0


def generate(argv: list[str]) -> int:
    from shardfit.generate import main as generate_main

    return generate_main(argv)
