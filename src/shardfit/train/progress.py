"""Rank-0 progress: a live bar on a terminal, one line per log step elsewhere, and metrics.jsonl always."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from shardfit.train.timing import PHASES


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_line(rec: dict) -> str:
    parts = [f"step {rec['step']}/{rec['total_steps']}", f"loss {rec['loss']:.4f}", f"gnorm {rec['grad_norm']:.3f}",
             f"lr {rec['lr']:.2e}", f"{rec['tokens_per_s_per_gpu']:,.0f} tok/s/gpu"]
    if rec.get("mfu") is not None:
        parts.append(f"mfu {rec['mfu']:.3f}")
    if rec.get("device") == "cpu":
        parts.append(f"host rss {rec['peak_allocated_max']:.2f} GiB (max rank)")
    elif "peak_allocated_max" in rec:
        parts.append(f"mem {rec['peak_allocated_max']:.2f}/{rec['peak_reserved_max']:.2f} GiB (alloc/resv, max rank)")
    if "time_forward_s" in rec:
        parts.append("fwd/bwd/opt/comm " + "/".join(f"{rec[f'time_{k}_s']:.3f}" for k in PHASES) + " s")
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    parts.append(f"eta {_fmt_eta(rec['eta_s'])}")
    return " | ".join(parts)


class Progress:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, mode: str, enabled: bool,
                 tensorboard: bool = False, debug: bool = False):
        self.enabled, self.debug = enabled, debug
        self.total, self.start = total_steps, start_step
        self.t0 = time.perf_counter()
        self.file = None
        self.bar = None
        self.tb = None
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        if mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                    TextColumn("{task.fields[status]}"), transient=False)
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, status="")
            self.bar.start()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def eta(self, step: float) -> float:
        """Seconds left once `step` steps are done (a fraction counts the micro-batches of the current step)."""
        done = step - self.start
        return (time.perf_counter() - self.t0) / done * (self.total - step) if done > 0 else 0.0

    def micro_batch(self, step: int, done: int, count: int) -> None:
        """Debug level: a line before each micro-batch of `step` (1-based), `done` of `count` finished."""
        if not (self.enabled and self.debug):
            return
        eta = self.eta(step - 1 + done / count)
        self.message(f"debug: step {step}/{self.total} micro-batch {done + 1}/{count} | eta {_fmt_eta(eta)}")

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def log(self, rec: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], status=format_line(rec).split(" | ", 1)[1])
        elif self.mode == "lines":
            print(format_line(rec), flush=True)

    def log_eval(self, rec: dict) -> None:
        """A validation record ({"step", "val_loss", "val_tokens", ...}): metrics.jsonl (with "eval": true, so that
        step records and evaluations are told apart), TensorBoard, and one printed line."""
        if not self.enabled:
            return
        self.file.write(json.dumps({**rec, "eval": True}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])
        self.message(f"eval step {rec['step']}: val_loss {rec['val_loss']:.4f} over {rec['val_tokens']:,} tokens "
                     f"({rec['val_s']:.1f} s)")

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
