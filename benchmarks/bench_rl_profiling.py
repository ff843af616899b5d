"""The profiles of benchmarks/bench_rl.py's workers (--prof-out, issue 24): torch.profiler over Engine.forward (now
against session 14's settings), over one PPO step, and over the anchor's timed iteration, each finished into a summary
JSON (profile_trace's regions, PROF_ROWS, rl_profile's kernel classes) and a trace; and the card's matmul ceiling.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_profile as rp  # noqa: E402
import rollouts as ro  # noqa: E402
from rl_worker_setup import emit, rate, timed, vocab_of, warm_idx  # noqa: E402

# The forward's GPU time sorted for issue 24's question (where Engine.forward loses time against the GEMM ceiling):
# kernels launched under these host labels first (memory/profile_trace.time_by_region), then the rest by kind.
PROF_REGIONS = [("fsdp", ("FSDP::",)), ("head", ("shardfit::logprob_head",))]
PROF_ROWS = [  # (table row, region, kernel kinds)
    ("GEMM (blocks)", "elsewhere", ("matmul",)),
    ("attention (flex / flash)", "elsewhere", ("attention",)),
    ("log-prob head: GEMM", "head", ("matmul",)),
    ("log-prob head: softmax/gather", "head", ("compiled fusion", "other", "copy")),
    ("compiled elementwise/norm/rope", "elsewhere", ("compiled fusion",)),
    ("eager elementwise (embedding, casts, rope tables)", "elsewhere", ("other", "optimizer", "communication")),
    ("FSDP unshard: fp32->bf16 cast + copy", "fsdp", ("other", "copy", "compiled fusion", "matmul")),
    ("memcpy/memset", "elsewhere", ("copy",)),
]


def forward_profile_table(s: dict) -> dict:
    """{row: ms} of PROF_ROWS from a summary with "regions_ms", plus the compute stream's idle time (its CPU and
    other-stream parts) and the span; rows sum to the busy time."""
    reg = s.get("regions_ms", {})
    rows = {name: round(sum(reg.get(r, {}).get(k, 0.0) for k in kinds), 1) for name, r, kinds in PROF_ROWS}
    return {**rows, **rp.idle_rows(s), "span": s.get("span_ms", 0.0)}


def profiler(record: bool = True):
    """torch.profiler over CPU (and CUDA where there is one), shapes recorded (the matmuls' FLOPs)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=acts, record_shapes=record)


TRACE_KEEP = 15_000_000  # what comes back from the device is at most 16 MiB a file
RAW_GZIP_MAX = 150_000_000  # a raw trace above this is not compressed whole: its .gz (~1/10) would not come back


def finish_profile(prof, out: Path, name: str, wall: float, vocab: int, lora_rank: int) -> dict:
    """A finished profile -> out/{name}_summary.json (profile_trace's summary, its regions, the forward table of
    PROF_ROWS, and rl_profile's class table and matmul FLOPs) and out/{name}_trace.json.gz when under TRACE_KEEP
    compressed, else out/{name}_kernels.json.gz: the GPU events alone (a timeline without the host side). Returns
    the summary."""
    import gzip

    from shardfit.doctor.profile_trace import summarize_trace, time_by_region

    out.mkdir(parents=True, exist_ok=True)
    raw = out / f"{name}.json"
    t = time.perf_counter()
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_bytes()).get("traceEvents", [])
    s = summarize_trace(events)
    s["regions_ms"] = time_by_region(events, PROF_REGIONS)
    s["table_ms"] = forward_profile_table(s)
    an = rp.analyse(events, vocab=vocab, lora_rank=lora_rank)
    s["classes"] = an
    s["class_table_ms"] = rp.table(s, an) if an else {}
    s["wall_s"] = round(wall, 2)
    s["trace"] = {"events": len(events), "raw_MB": round(raw.stat().st_size / 1e6, 1)}
    gz = out / f"{name}_trace.json.gz"
    if raw.stat().st_size < RAW_GZIP_MAX:
        with gzip.open(gz, "wb", compresslevel=6) as f:
            f.write(raw.read_bytes())
    if not gz.is_file() or gz.stat().st_size > TRACE_KEEP:
        gz.unlink(missing_ok=True)
        gz = out / f"{name}_kernels.json.gz"
        with gzip.open(gz, "wt", compresslevel=6) as f:
            json.dump({"traceEvents": [e for e in events if e.get("cat") in rp.GPU]}, f)
        if gz.stat().st_size > TRACE_KEEP:
            gz.unlink()
    s["trace"]["kept"] = gz.name if gz.is_file() else None
    del events
    raw.unlink()
    s["trace"]["analysis_s"] = round(time.perf_counter() - t, 1)
    (out / f"{name}_summary.json").write_text(json.dumps(s, indent=1))
    return s


def emit_profile(kind: str, s: dict, **kw) -> None:
    emit(kind, **kw, wall_s=s.get("wall_s"), table_ms=s.get("table_ms"), class_table_ms=s.get("class_table_ms"),
         gemm=s.get("classes", {}).get("gemm"), other_streams_ms=s.get("classes", {}).get("other_streams_ms"),
         compute_kinds_ms=s.get("compute_kinds_ms"), regions_ms=s.get("regions_ms"), phases=s.get("phases"),
         host_syncs=s.get("idle", {}).get("host_syncs"), kernels=s.get("kernels"), trace=s.get("trace"),
         top_kernels_ms=s.get("top_kernels_ms", [])[:12])


def profile_forward(engine, data: list, r: ro.Rollouts, a, sync, reset, peaks, variants=("now", "s14"),
                    vocab: int = 151936) -> None:
    """--prof-out DIR: Engine.forward as it is now against session 14's settings (every FSDP group gathered again at
    each micro-batch, the log-prob chunks eager; what cannot be switched back, the pinned copies of the block mask,
    stays), --reps timed passes each, then one pass of each under torch.profiler: GPU time by PROF_ROWS and by
    rl_profile's classes, the summary JSON and the trace of each into DIR (finish_profile). With the variant "now"
    alone, the timed passes are the caller's: only the profiled one runs."""
    out = Path(a.prof_out)
    out.mkdir(parents=True, exist_ok=True)
    every = {"now": (True, engine.model.loss_compiled), "s14": (False, False)}
    w = [data[i] for i in warm_idx(r)]  # the longest and the shortest: each variant's first-call costs untimed
    prefix = "moe_fwd" if a.shape == "moe" else "fwd"
    for name in variants if len(variants) > 1 else ():
        once, compiled = every[name]
        engine.gather_once = once
        engine.model.use_compiled_loss(compiled)
        _, _, times = timed(lambda: engine.forward(data), lambda: engine.forward(w), a.reps, sync, reset)
        emit("fwd-variant", variant=name, gather_once=once, compiled_head=compiled, **rate(r, times), **peaks())
    for name in variants:
        once, compiled = every[name]
        engine.gather_once = once
        engine.model.use_compiled_loss(compiled)
        sync()
        t = time.perf_counter()
        with profiler() as prof:
            engine.forward(data)
            sync()
        s = finish_profile(prof, out, f"{prefix}_{name}" if len(variants) > 1 else f"{prefix}_shardfit",
                           time.perf_counter() - t, vocab, 0)
        emit_profile("prof", s, variant=name, side="shardfit", what=prefix)
    engine.gather_once = True
    engine.model.use_compiled_loss(every["now"][1])


def gemm_ceiling(seconds: float = 1.5) -> dict:
    """This card's bf16 matmul rate now (TFLOP/s), each shape run back to back for `seconds` after a warm-up: an
    8192 cube and the 8B step's largest (17,408 tokens x 4,096 -> 12,288, and 12,288 -> 4,096). The bound of
    rl_profile.bounds takes the best."""
    import torch

    out = {}
    for m, k, n in ((8192, 8192, 8192), (17408, 4096, 12288), (17408, 12288, 4096)):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        for _ in range(5):
            x @ y
        torch.cuda.synchronize()
        t, reps = time.perf_counter(), 0
        while time.perf_counter() - t < seconds:
            for _ in range(10):
                x @ y
            reps += 10
            torch.cuda.synchronize()
        out[f"{m}x{k}x{n}"] = round(2 * m * k * n * reps / (time.perf_counter() - t) / 1e12, 1)
        del x, y
    torch.cuda.empty_cache()
    return {"TFLOPs": max(out.values()), "by_shape": out, "gpu": torch.cuda.get_device_name(0)}


def profile_ppo(engine, step, data: list, a, sync, lora: int) -> None:
    """--prof-out DIR: one PPO step (forward_backward + optim_step, after the timed ones) under torch.profiler."""
    sync()
    t = time.perf_counter()
    with profiler() as prof:
        step(data)
        sync()
    s = finish_profile(prof, Path(a.prof_out), "ppo_shardfit", time.perf_counter() - t, vocab_of(a.shape), lora)
    emit_profile("prof-ppo", s, side="shardfit", shape=a.shape, lora=lora)


# ---------------------------------------------------------------------------------------------- the anchor profiled
ANCHOR_HEAD = "anchor::logprob_head"  # rl_profile.HEAD_LABELS


def label_anchor_head(A, model):
    """A host label (record_function) over the anchor's log-prob head: from its lm_head's call to the end of
    token_logprobs (the full logits, the response rows' selection, the fp32 log-softmax chunks); what it computes is
    unchanged. Backward kernels are placed by their forward operator (rl_profile). Returns the undo."""
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    state: dict = {}

    def pre(_mod, _args):
        if "rf" not in state:
            state["rf"] = torch.profiler.record_function(ANCHOR_HEAD)
            state["rf"].__enter__()

    hook = base.lm_head.register_forward_pre_hook(pre)
    orig = A.token_logprobs

    def token_logprobs(*args, **kw):
        try:
            return orig(*args, **kw)
        finally:
            if "rf" in state:
                state.pop("rf").__exit__(None, None, None)

    A.token_logprobs = token_logprobs

    def undo():
        hook.remove()
        A.token_logprobs = orig
    return undo


def anchor_profiled(A, call, out: Path, name: str, vocab: int, lora_rank: int) -> dict:
    """call() runs the anchor's run_forward or run_ppo with warm=1, reps=1; the profiler records the timed iteration
    alone: it starts after that iteration's opening device sync (the anchor's own sync(), the third call) and stops
    after its closing one (the fourth)."""
    prof = profiler()
    orig = A.sync
    n = [0]
    t = [0.0, 0.0]

    def sync():
        orig()
        n[0] += 1
        if n[0] == 3:
            prof.start()
            t[0] = time.perf_counter()
        elif n[0] == 4:
            t[1] = time.perf_counter()
            prof.stop()

    A.sync = sync
    try:
        call()
    finally:
        A.sync = orig
    if n[0] < 4:
        raise RuntimeError(f"the anchor's step synced {n[0]} times, not 4: nothing profiled")
    return finish_profile(prof, out, name, t[1] - t[0], vocab, lora_rank)

