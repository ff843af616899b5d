"""Profile one training step and say where the GPU's time went (`--logging.profile_step=N`).

Every rank runs step N under torch.profiler (so the step stays symmetric: no rank waits on a slower profiled peer
more than the others do); rank 0 writes its Chrome trace to <run_dir>/profile/step{N}_rank0.json.gz (open it in
Perfetto) and a summary next to it. The summary sorts the GPU kernels into kinds by name (matmul, attention,
compiled fusions, communication, optimizer, copies, other) and, on the compute stream (the stream with the most
kernel time), reports how much of the step's span it was busy and how much it sat idle: idle compute-stream time is
what the CPU (launch overhead, host syncs) or exposed communication cost. On a CPU run there are no kernels; the
summary then lists the operators with the most self time.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

# Kernel kind by substring of the lower-cased kernel name, first match wins. cuBLAS's Hopper kernels are named
# nvjet_* or sm90_xmma_gemm_*; SDPA's flash, memory-efficient and cuDNN kernels name flash/fmha/sdpa.
_KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "splitk")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("compiled fusion", ("triton",)),
)
_GPU_CATS = {"kernel": None, "gpu_memcpy": "copy", "gpu_memset": "copy"}


def kernel_kind(name: str, cat: str = "kernel") -> str:
    if _GPU_CATS.get(cat):
        return _GPU_CATS[cat]
    low = name.lower()
    return next((kind for kind, keys in _KINDS if any(k in low for k in keys)), "other")


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize_trace(events: list[dict]) -> dict:
    """GPU time by kernel kind, the compute stream's busy and idle time over the span of all GPU work, and the
    longest kernels; times in milliseconds (Chrome trace events carry microseconds)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    if not gpu:
        return {}
    by_stream: dict[object, float] = defaultdict(float)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))] += e["dur"]
    compute = max(by_stream, key=by_stream.get)
    span = max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)
    on_compute = [e for e in gpu if e.get("args", {}).get("stream", e.get("tid")) == compute]
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in on_compute])
    kinds: dict[str, float] = defaultdict(float)
    names: dict[str, float] = defaultdict(float)
    kind_of: dict[str, str] = {}
    for e in on_compute:
        kind_of[e["name"]] = kernel_kind(e["name"], e["cat"])
        kinds[kind_of[e["name"]]] += e["dur"]
        names[e["name"]] += e["dur"]
    by_time = sorted(names.items(), key=lambda kv: -kv[1])
    comm = [e for e in gpu if kernel_kind(e["name"], e["cat"]) == "communication"]
    ms = 1e-3
    return {
        "span_ms": round(span * ms, 2), "compute_busy_ms": round(busy * ms, 2),
        "compute_idle_ms": round((span - busy) * ms, 2),
        "compute_kinds_ms": {k: round(v * ms, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "communication_ms": round(_union([(e["ts"], e["ts"] + e["dur"]) for e in comm]) * ms, 2),
        "kernels": sum(1 for e in on_compute if e["cat"] == "kernel"),
        "top_kernels_ms": [[n[:120], round(v * ms, 2)] for n, v in by_time[:25]],
        "top_kernels_by_kind_ms": {k: [[n[:120], round(v * ms, 2)] for n, v in by_time if kind_of[n] == k][:6]
                                   for k in kinds},  # names the small kernels of each kind ("other" above all)
    }


def format_summary(step: int, s: dict) -> str:
    if "span_ms" not in s:
        return f"profile of step {step}: " + ", ".join(f"{n} {t:.1f} ms" for n, t in s.get("top_ops_ms", []))
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in s["compute_kinds_ms"].items())
    return (f"profile of step {step}: GPU span {s['span_ms']:.0f} ms, compute stream busy {s['compute_busy_ms']:.0f} "
            f"ms, idle {s['compute_idle_ms']:.0f} ms ({s['kernels']} kernels); by kind (ms): {kinds}; "
            f"communication {s['communication_ms']:.0f} ms on its own streams")


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
