"""`shardfit profile`: where a profiled step's GPU time went, from a Chrome trace (doctor/profile_trace.py)."""

from __future__ import annotations

from shardfit.cli.args import ArgumentParser
from shardfit.errors import ShardfitError


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

    from shardfit.doctor.profile_trace import explain, read_trace, summarize_trace

    s = summarize_trace(read_trace(args.trace))
    if not s:
        raise ShardfitError(f"{args.trace} holds no GPU kernels", where=args.trace,
                            fix="profile with ProfilerActivity.CUDA on a GPU run")
    print(json.dumps(s, indent=1) if args.json else explain(s), end="\n" if args.json else "")
    return 0
