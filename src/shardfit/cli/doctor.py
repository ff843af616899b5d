"""`shardfit doctor`: explain CUDA memory snapshots (shardfit/doctor/): fragmentation, other streams' memory,
imbalance, the peak's make-up, why an OOM happened."""

from __future__ import annotations

from shardfit.cli.args import ArgumentParser, fraction, gib


def doctor(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit doctor", description=(
        "Explain CUDA memory snapshots (torch.cuda.memory._dump_snapshot), one per rank: fragmentation, memory "
        "held for other streams, per-rank imbalance, what the peak is made of, why an OOM happened."))
    parser.add_argument("snapshots", nargs="+", help=".pickle / .pickle.gz files, or one directory of them")
    parser.add_argument("--json", action="store_true", help="print the JSON report (schema shardfit.doctor/1; "
                        "findings[].figures holds each finding's numbers in bytes: src/shardfit/doctor/report.py)")
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

    from shardfit.doctor import examine
    from shardfit.doctor.report import to_json, to_text

    gpu_bytes = None if args.gpu_memory is None else int(args.gpu_memory * (1 << 30))
    results, findings = examine(args.snapshots, args.memory_fraction, gpu_bytes)
    print(json.dumps(to_json(results, findings), indent=1) if args.json else to_text(results, findings), end="")
    if args.png or args.html:
        from shardfit.doctor.plot import render_html, render_png
        from shardfit.fsutil import write_atomic

        png = render_png(results, findings)
        for path, data in ((args.png, png), (args.html, render_html(results, findings, png) if args.html else "")):
            if path:
                write_atomic(path, data)
    return 0
