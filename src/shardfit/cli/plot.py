"""`shardfit plot RUN_DIR [RUN_DIR ...]`: a run's metrics.jsonl as a PNG (train/curves.py); several runs overlay."""

from __future__ import annotations

from pathlib import Path

from shardfit.cli.args import ArgumentParser
from shardfit.errors import ShardfitError


def plot(argv: list[str]) -> int:
    parser = ArgumentParser(prog="shardfit plot", description=(
        "Draw training and validation loss, learning rate, tokens/s and memory against steps and tokens from "
        "each run directory's metrics.jsonl, into one PNG."))
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (several: overlaid)")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/metrics.png; needed for several runs)")
    args = parser.parse_args(argv)
    runs = [Path(r) for r in args.runs]
    for run in runs:
        if not (run / "metrics.jsonl").is_file():
            raise ShardfitError("not a run directory (no metrics.jsonl)", where=str(run),
                                fix="give the logging.run_dir of a run that has logged a step")
    if args.out is None and len(runs) > 1:
        raise ShardfitError(f"{len(runs)} runs and no --out", where="--out", fix="give --out FILE.png")
    from shardfit.train.curves import PNG, plot_run

    print(f"plotted {plot_run(runs, Path(args.out) if args.out else runs[0] / PNG)}")
    return 0
