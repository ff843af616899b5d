"""Rank-0 progress: a live bar on a terminal, one line per log step elsewhere, and metrics.jsonl always.

Every metrics.jsonl record says its kind: "train" (a step's log line) or "eval" (a validation loss; also tagged
"eval": true). The first record a process writes carries "start_step", the step it started from: records of an
earlier process with a later step are of steps this one redoes (a resume from an older checkpoint, or a new run
from scratch), and readers (train/curves.py) drop them.

Trackers receive the same records as metrics.jsonl, every numeric field of them, at the record's step: TensorBoard
(logging.tensorboard) and Weights & Biases (logging.wandb). Only rank 0 makes a Progress that is enabled, so only
rank 0 ever opens a tracker. The W&B settings and the run config it shows come from <run_dir>/config.toml, the
resolved config the trainer writes before it makes the Progress (or from the `logging` argument).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import time
from pathlib import Path

from shardfit.engine.timing import PHASES


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_line(rec: dict) -> str:
    """One log line. On the CPU: tokens/s per process (no GPU), the host's peak resident set (there is no allocator),
    and with one process no communication time (there is none to wait for)."""
    cpu, world = rec.get("device") == "cpu", rec.get("world", 1)
    per = ("/process" if world > 1 else "") if cpu else "/gpu"
    parts = [f"step {rec['step']}/{rec['total_steps']}", f"loss {rec['loss']:.4f}", f"gnorm {rec['grad_norm']:.3f}",
             f"lr {rec['lr']:.2e}", f"{rec['tokens_per_s_per_gpu']:,.0f} tok/s{per}"]
    if rec.get("mfu") is not None:
        parts.append(f"mfu {rec['mfu']:.3f}")
    if cpu:
        parts.append(f"host rss {rec['peak_allocated_max']:.2f} GiB" + (" (max process)" if world > 1 else ""))
    elif "peak_allocated_max" in rec:
        parts.append(f"mem {rec['peak_allocated_max']:.2f}/{rec['peak_reserved_max']:.2f} GiB (alloc/resv, max rank)")
    if "time_forward_s" in rec:
        phases = [k for k in PHASES if not (k == "comm_wait" and world == 1)]
        names = "/".join({"forward": "fwd", "backward": "bwd", "optimizer": "opt", "comm_wait": "comm"}[k]
                         for k in phases)
        parts.append(f"{names} " + "/".join(f"{rec[f'time_{k}_s']:.3f}" for k in phases) + " s")
    if "moe_load_max_over_mean" in rec:
        parts.append(f"expert load max/mean {rec['moe_load_max_over_mean']:.2f} (layer {rec['moe_load_worst_layer']})")
    if "rewards/accuracies" in rec:  # preference training (train/preference.py): TRL's two headline figures
        parts.append(f"rewards acc {rec['rewards/accuracies']:.2f} margin {rec['rewards/margins']:.3f}")
    elif "kl" in rec:  # KTO: its reference point, and the margin when the step's examples held both kinds
        margin = f" margin {rec['rewards/margins']:.3f}" if "rewards/margins" in rec else ""
        parts.append(f"kl {rec['kl']:.3f}{margin}")
    if rec.get("skipped_steps"):
        parts.append(f"skipped {rec['skipped_steps']}")
    if rec.get("compile_fallbacks"):  # compiled functions now partly eager (parallel/compile_watch.py)
        parts.append(f"compile fallbacks {rec['compile_fallbacks']}")
    parts.append(f"eta {_fmt_eta(rec['eta_s'])}")
    return " | ".join(parts)


def scalars(rec: dict) -> dict[str, float]:
    """The numeric fields of a record, as trackers take them (the step is their x axis; None and text are left out)."""
    return {k: v for k, v in rec.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "start_step")}


def _read_config(run_dir: Path) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised only on Python 3.10
        import tomli as tomllib
    path = run_dir / "config.toml"
    return tomllib.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def open_wandb(run_dir: Path, logging: dict, config: dict):
    """A W&B run for this run directory: the same id every time (a resumed run continues it), files under
    <run_dir>/wandb, the resolved config attached."""
    try:
        import wandb
    except ImportError:
        from shardfit.errors import ShardfitError

        raise ShardfitError("logging.wandb needs the wandb package", where="logging.wandb",
                            fix="pip install 'shardfit[wandb]', or logging.wandb=false") from None
    name = logging.get("wandb_name") or run_dir.resolve().name
    run_id = re.sub(r"[^A-Za-z0-9_-]", "-", name)[:48] + "-" + \
        hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]
    return wandb.init(project=logging.get("wandb_project", "shardfit"), name=name, id=run_id, resume="allow",
                      dir=str(run_dir), mode=logging.get("wandb_mode", "online"), config=config)


class Progress:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, mode: str, enabled: bool,
                 tensorboard: bool = False, debug: bool = False, logging: dict | None = None,
                 config: dict | None = None):
        """logging: the [logging] settings (wandb, wandb_project, wandb_name, wandb_mode); config: the whole
        resolved config (W&B shows it); with neither, both are read from <run_dir>/config.toml."""
        self.enabled, self.debug = enabled, debug
        self.total, self.start = total_steps, start_step
        self.t0 = time.perf_counter()
        self.file = None
        self.first = True  # the next record is this process's first: it carries start_step
        self.bar = None
        self.tb = None
        self.wandb = None
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
        if config is None:
            config = _read_config(run_dir) if logging is None else {"logging": logging}
        settings = config.get("logging", {})
        if settings.get("wandb"):
            self.wandb = open_wandb(run_dir, settings, config)

    def _write(self, rec: dict) -> None:
        if self.first:
            rec = {**rec, "start_step": self.start}
            self.first = False
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()

    def _track(self, rec: dict) -> None:
        values = scalars(rec)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, rec["step"])
            self.tb.flush()  # a reader (TensorBoard, a test) sees every record by the time it is printed
        if self.wandb is not None:
            self.wandb.log(values, step=rec["step"])

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
        self._write({"kind": "train", **rec})
        self._track(rec)
        if self.bar is not None:
            self.bar.update(self.task, completed=rec["step"], status=format_line(rec).split(" | ", 1)[1])
        elif self.mode == "lines":
            print(format_line(rec), flush=True)

    def log_eval(self, rec: dict) -> None:
        """A validation record ({"step", "val_loss", "val_tokens", ...}): metrics.jsonl (kind "eval", and "eval":
        true, so that step records and evaluations are told apart), TensorBoard, and one printed line."""
        if not self.enabled:
            return
        self._write({"kind": "eval", **rec, "eval": True})
        self._track(rec)
        pref = (f" | rewards acc {rec['eval_rewards/accuracies']:.2f} margin {rec['eval_rewards/margins']:.3f}"
                if "eval_rewards/accuracies" in rec else "")  # preference training: TRL's two headline figures
        if "eval_kl" in rec:  # KTO's: its reference point, and the margin when the held-out set has both kinds
            pref = f" | kl {rec['eval_kl']:.3f}" + (f" margin {rec['eval_rewards/margins']:.3f}"
                                                   if "eval_rewards/margins" in rec else "")
        self.message(f"eval step {rec['step']}: val_loss {rec['val_loss']:.4f} over {rec['val_tokens']:,} tokens "
                     f"({rec['val_s']:.1f} s){pref}")

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
        if self.wandb is not None:
            self.wandb.finish()
