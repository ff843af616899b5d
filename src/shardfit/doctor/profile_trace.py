"""Where a profiled step's GPU time went, from the Chrome trace torch.profiler exports (`shardfit profile`).

summarize_trace sorts the GPU kernels into kinds by name (matmul, attention, compiled fusions, communication,
optimizer, copies, other) and, on the compute stream (the stream with the most kernel time), reports how much of
the step's span it was busy and how much it sat idle: idle compute-stream time is what the CPU (launch overhead,
host syncs) or exposed communication cost. explain_idle splits it so: a gap whose next kernel the CPU had not yet
launched when the stream ran dry is the CPU's (summed by the host operators that launched it, and by host syncs in
the gap); any other gap is a wait on another stream (a collective, a copy). Each kind of collective has its time and
its exposed part (no other kernel running on any stream meanwhile: what the step waited for it). phase_split gives
forward, backward and optimizer their busy time against their span. read_trace reads a trace with bounded work
(limits.py) and checks every field the summary reads: a bad file is one ShardfitError naming the file and the
field. Times in the summary are milliseconds (trace events carry microseconds). The in-run profiler that writes
these traces is train/profile.py.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from shardfit.doctor.limits import a_type

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
    return sum(b - a for a, b in _merged(intervals))


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The same intervals as disjoint ones, sorted."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


_COLLECTIVES = (("all-to-all", ("sendrecv", "alltoall", "all_to_all")), ("all-gather", ("allgather",)),
                ("reduce-scatter", ("reducescatter",)), ("all-reduce", ("allreduce",)), ("broadcast", ("broadcast",)))


def communication_exposure(gpu: list[dict]) -> dict[str, dict[str, float]]:
    """Per collective (by NCCL kernel name): its GPU time (overlaps counted once) and the part of it during which no
    other kernel ran on any stream, i.e. what the step waited for it. A collective may run on its own stream or, as
    torch 2.11 runs a synchronous c10d call (observed), on the compute stream itself: either way only compute
    elsewhere hides it. Times in ms."""
    comm = [e for e in gpu if kernel_kind(e["name"], e["cat"]) == "communication"]
    work = _merged([(e["ts"], e["ts"] + e["dur"]) for e in gpu if kernel_kind(e["name"], e["cat"]) != "communication"])
    out = {}
    for kind, keys in _COLLECTIVES:
        mine = _merged([(e["ts"], e["ts"] + e["dur"]) for e in comm if any(k in e["name"].lower() for k in keys)])
        if not mine:
            continue
        hidden, j = 0.0, 0
        for a, b in mine:  # both lists sorted and disjoint: one sweep
            while j < len(work) and work[j][1] <= a:
                j += 1
            k = j
            while k < len(work) and work[k][0] < b:
                hidden += min(b, work[k][1]) - max(a, work[k][0])
                k += 1
        total = sum(b - a for a, b in mine)
        out[kind] = {"ms": round(total * 1e-3, 2), "exposed_ms": round((total - hidden) * 1e-3, 2)}
    return out


_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
_RUNTIME = ("cuda_runtime", "cuda_driver")


def _launch_stacks(events: list[dict]) -> dict[int, tuple[list[str], str]]:
    """correlation id -> (names of every host operator or annotation open on the launching thread when the CPU
    launched it, outermost first; the runtime call's own name): one sweep per thread with a stack of open events."""
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", *_RUNTIME):
            by_tid[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[int, tuple[list[str], str]] = {}
    for evs in by_tid.values():
        stack: list[dict] = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if e["cat"] in _RUNTIME:
                if "correlation" in e.get("args", {}):
                    out[e["args"]["correlation"]] = ([x["name"] for x in stack], e["name"])
            else:
                stack.append(e)
    return out


def _launch_context(events: list[dict]) -> dict[int, str]:
    """correlation id -> "outer > inner" names of the (at most 3 innermost) host operators or annotations open on the
    launching thread when the CPU launched it."""
    return {c: " > ".join(x[:60] for x in names[-3:]) or call for c, (names, call) in _launch_stacks(events).items()}


def _launches(events: list[dict]) -> dict[int, dict]:
    """correlation id -> the host runtime call (cudaLaunchKernel, a copy) that enqueued that GPU event."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("ph") == "X" and e.get("cat") in _RUNTIME and "correlation" in e.get("args", {})}


def explain_idle(events: list[dict], on_compute: list[dict], launches: dict[int, dict],
                 min_gap_us: float = 5.0) -> dict:
    """The compute stream's idle time split into waits for the CPU and waits on other streams (module docstring),
    the CPU's part by the host context that launched the kernel after each gap, and the host syncs (count, time)."""
    context = _launch_context(events)
    syncs = [e for e in events if e.get("ph") == "X" and e.get("cat") in _RUNTIME
             and e["name"].startswith(_SYNCS) and "Async" not in e["name"]]
    kernels = sorted(on_compute, key=lambda e: e["ts"])
    cpu = wait = 0.0
    by_context: dict[str, float] = defaultdict(float)
    end = kernels[0]["ts"] + kernels[0]["dur"]
    for k in kernels[1:]:
        gap = k["ts"] - end
        if gap > min_gap_us:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] >= end:  # the CPU launched it after the stream ran dry
                cpu += gap
                by_context[context.get(launch["args"]["correlation"], launch["name"])] += gap
            else:
                wait += gap
        end = max(end, k["ts"] + k["dur"])
    ms = 1e-3
    return {"cpu_ms": round(cpu * ms, 2), "other_stream_ms": round(wait * ms, 2),
            "host_syncs": len(syncs), "host_sync_ms": round(sum(e["dur"] for e in syncs) * ms, 2),
            "cpu_by_launch_context_ms": [[c, round(v * ms, 2)] for c, v in
                                         sorted(by_context.items(), key=lambda kv: -kv[1])[:15]]}


def phase_split(events: list[dict], on_compute: list[dict], launches: dict[int, dict]) -> dict:
    """The compute stream's kernels by the phase whose host code launched them: forward until the first autograd
    engine call, backward until the optimizer's step, then the optimizer (the rest of the step). Per phase, the GPU
    span of those kernels and how much of it they kept the stream busy: a phase with a span far above its busy time
    is bound by the host (or by waits on other streams) rather than by the GPU."""
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    backward = min((e["ts"] for e in host if e["name"].startswith("autograd::engine")), default=None)
    if backward is None:
        return {}
    optimizer = min((e["ts"] for e in host if e["name"].startswith("Optimizer.step") and e["ts"] > backward),
                    default=float("inf"))
    phases: dict[str, list[dict]] = {"forward": [], "backward": [], "optimizer": []}
    for k in on_compute:
        launch = launches.get(k.get("args", {}).get("correlation"))
        if launch is not None:
            t = launch["ts"]
            phases["forward" if t < backward else "backward" if t < optimizer else "optimizer"].append(k)
    ms = 1e-3
    return {name: {"span_ms": round((max(k["ts"] + k["dur"] for k in ks) - min(k["ts"] for k in ks)) * ms, 2),
                   "busy_ms": round(_union([(k["ts"], k["ts"] + k["dur"]) for k in ks]) * ms, 2)}
            for name, ks in phases.items() if ks}


def summarize_trace(events: list[dict]) -> dict:
    """GPU time by kernel kind, the compute stream's busy and idle time over the span of all GPU work, and the
    longest kernels; times in milliseconds (Chrome trace events carry microseconds)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    if not gpu:
        return {}
    launches = _launches(events)
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
        "communication_exposure_ms": communication_exposure(gpu),
        "kernels": sum(1 for e in on_compute if e["cat"] == "kernel"),
        "top_kernels_ms": [[n[:120], round(v * ms, 2)] for n, v in by_time[:25]],
        "top_kernels_by_kind_ms": {k: [[n[:120], round(v * ms, 2)] for n, v in by_time if kind_of[n] == k][:6]
                                   for k in kinds},  # names the small kernels of each kind ("other" above all)
        "idle": explain_idle(events, on_compute, launches),
        "phases": phase_split(events, on_compute, launches),
    }


def time_by_region(events: list[dict], regions: list[tuple[str, tuple[str, ...]]]) -> dict[str, dict[str, float]]:
    """The compute stream's kernel time (ms; the stream summarize_trace picks) by region, then by kernel kind. A
    kernel is in the first region one of whose name prefixes begins a host operator or annotation open, at any depth,
    on the thread that launched it (record_function labels such as FSDP's "FSDP::pre_forward (...)"); else in
    "elsewhere". Each region also has its "total"; kernels whose launch the trace lacks are "elsewhere"."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    if not gpu:
        return {}
    by_stream: dict[object, float] = defaultdict(float)
    for e in gpu:
        by_stream[e.get("args", {}).get("stream", e.get("tid"))] += e["dur"]
    compute = max(by_stream, key=by_stream.get)
    stacks = _launch_stacks(events)
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e in gpu:
        if e.get("args", {}).get("stream", e.get("tid")) != compute:
            continue
        names = stacks.get(e.get("args", {}).get("correlation"), ([], ""))[0]
        region = next((label for label, prefixes in regions
                       if any(n.startswith(prefixes) for n in names)), "elsewhere")
        out[region][kernel_kind(e["name"], e["cat"])] += e["dur"]
    return {r: {**{k: round(v * 1e-3, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
                "total": round(sum(kinds.values()) * 1e-3, 2)}
            for r, kinds in sorted(out.items(), key=lambda kv: -sum(kv[1].values()))}


def format_summary(step: int, s: dict) -> str:
    return f"profile of step {step}: " + _summary_line(s)


def _summary_line(s: dict) -> str:
    if "span_ms" not in s:
        return ", ".join(f"{n} {t:.1f} ms" for n, t in s.get("top_ops_ms", []))
    kinds = ", ".join(f"{k} {v:.0f}" for k, v in s["compute_kinds_ms"].items())
    return (f"GPU span {s['span_ms']:.0f} ms, compute stream busy {s['compute_busy_ms']:.0f} "
            f"ms, idle {s['compute_idle_ms']:.0f} ms (CPU {s['idle']['cpu_ms']:.0f}, other streams "
            f"{s['idle']['other_stream_ms']:.0f}; {s['idle']['host_syncs']} host syncs) ({s['kernels']} kernels); "
            f"by kind (ms): {kinds}; "
            f"communication {s['communication_ms']:.0f} ms"
            + "".join(f", {k} {v['ms']:.0f} ({v['exposed_ms']:.0f} exposed)"
                      for k, v in s.get("communication_exposure_ms", {}).items())
            + ("; GPU busy of span by phase (ms): " + ", ".join(f"{n} {p['busy_ms']:.0f}/{p['span_ms']:.0f}"
                                                                 for n, p in s["phases"].items())
               if s.get("phases") else ""))


def read_trace(path: str) -> list[dict]:
    """The events of a Chrome trace torch.profiler exported (.json, or .json.gz as shardfit keeps them), read with
    bounded work (doctor/limits.py) and checked where the summary reads them; a missing, unreadable or malformed
    file is one line naming the file and the field (exit 2)."""
    from shardfit.doctor.limits import TRACE_EVENTS, TRACE_MIB, read_capped
    from shardfit.errors import ShardfitError

    fix = "pass a trace torch.profiler exported (export_chrome_trace), .json or .json.gz"
    raw = read_capped(Path(path), TRACE_MIB, "Chrome trace")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # invalid JSON or UTF-8, NaN, or arrays nested past the parser's stack
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0][:200]
        raise ShardfitError(f"cannot read a Chrome trace from it: {what}", where=path, fix=fix) from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        found = f"traceEvents is {a_type(events)}" if isinstance(data, dict) else f"{a_type(data)} at the top"
        raise ShardfitError(f"holds no traceEvents list ({found})", where=path, fix=fix)
    if len(events) > TRACE_EVENTS.value():
        raise TRACE_EVENTS.refuse(path, f"it holds {len(events):,} events")
    for i, e in enumerate(events):
        problem = _event_problem(e)
        if problem:
            raise ShardfitError(f"traceEvents[{i}]{problem}", where=path, fix=fix)
    return events


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a trace holds")


_TEXT_KEYS = ("ph", "cat", "name")
_MAX_US = 1e15  # about 30 years in microseconds: past it a time is not one a profiled step has


def _event_problem(e) -> str | None:
    """What is wrong with one event where the summary reads it (None: nothing): the keys are text, a complete ("X")
    event's ts and dur finite numbers of microseconds, args a dict of scalars, pid and tid scalars (dict keys)."""
    if type(e) is not dict:
        return f" is {a_type(e)}, not an event (a dict)"
    for key in _TEXT_KEYS:
        if key in e and type(e[key]) is not str:
            return f".{key} is {a_type(e[key])}, not text"
    for key in ("pid", "tid"):
        if key in e and type(e[key]) not in (int, str):
            return f".{key} is {a_type(e[key])}, not an id"
    args = e.get("args", {})
    if type(args) is not dict:
        return f".args is {a_type(args)}, not a dict"
    for key in ("stream", "correlation"):
        if key in args and type(args[key]) not in (int, str):
            return f".args.{key} is {a_type(args[key])}, not an id"
    if e.get("ph") != "X":
        return None
    for key in ("ts", "dur"):
        v = e.get(key)
        if type(v) not in (int, float):
            return f".{key} is {'missing' if v is None else a_type(v)}, not a number of microseconds"
        if not (-_MAX_US < v < _MAX_US) or (key == "dur" and v < 0):
            return f".{key} is {v:g}, outside {'[0' if key == 'dur' else '(-1e15'}, 1e15) microseconds"
    if "name" not in e:
        return " (a complete event) has no name"
    return None


def explain(s: dict) -> str:
    """The summary as a few lines for a reader: format_summary's line, then where the CPU-bound idle time was."""
    lines = [_summary_line(s)]
    contexts = s.get("idle", {}).get("cpu_by_launch_context_ms", [])
    if contexts:
        lines.append("idle waiting for the CPU, by the host code that launched the next kernel (ms):")
        lines += [f"  {ms:8.2f}  {where}" for where, ms in contexts]
    return "\n".join(lines) + "\n"
