"""Profile one training step (`--logging.profile_step=N`): a Chrome trace and the summary of where GPU time went.

Every rank runs step N under torch.profiler (so the step stays symmetric: no rank waits on a slower profiled peer
more than the others do); rank 0 writes its Chrome trace to <run_dir>/profile/step{N}_rank0.json.gz (open it in
Perfetto) and a summary next to it, step{N}_summary.json, made by doctor/profile_trace.py (`shardfit profile`
prints the same summary for any saved trace). Both files are written under a temporary name and renamed: never
half-written. On a CPU run there are no kernels; the summary then lists the operators with the most self time.
"""

from __future__ import annotations

import gzip
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from shardfit.doctor.profile_trace import format_summary, summarize_trace


class StepProfiler:
    """Wraps one step (1-based number `step`; 0: never) in torch.profiler; rank 0 writes trace and summary."""

    def __init__(self, step: int, out_dir: Path, is_main: bool, device: torch.device):
        self.step, self.out_dir, self.is_main, self.device = step, out_dir, is_main, device
        self.summary: str | None = None  # one line, set after the profiled step (rank 0)

    @contextmanager
    def around(self, step: int):
        if step != self.step:
            yield
            return
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            yield
        if self.is_main:
            self.summary = self._write(prof)

    def _write(self, prof) -> str:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        raw = self.out_dir / f".step{self.step}_rank0.json"
        prof.export_chrome_trace(str(raw))
        data = raw.read_bytes()  # read once: compressed below, parsed for the summary
        raw.unlink()
        events = json.loads(data).get("traceEvents", [])
        trace = self.out_dir / f"step{self.step}_rank0.json.gz"
        with gzip.open(f"{trace}.tmp", "wb") as f:  # temp name, then rename: never a half-written trace
            f.write(data)
        os.replace(f"{trace}.tmp", trace)
        s = summarize_trace(events)
        if not s:
            ops = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:8]
            s = {"top_ops_ms": [[a.key, round(a.self_cpu_time_total / 1e3, 2)] for a in ops]}
        s["trace"] = str(trace)
        summary = self.out_dir / f"step{self.step}_summary.json"
        summary.with_suffix(".tmp").write_text(json.dumps(s, indent=1))
        os.replace(summary.with_suffix(".tmp"), summary)
        return format_summary(self.step, s) + f"; trace {trace}"
