"""The worker processes of benchmarks/bench_rl.py (issue 24): each prints JSON lines {"rlbench": KIND, ...}.

  sf      shardfit's Engine in process: forward, the PPO step (forward_backward + optim_step), weights(), export_hf,
          and (prof) the forward now against session 14's settings, timed and profiled (profile_forward)
  hf-moe  transformers' Qwen3MoeForCausalLM through the anchor hf_rl_step.py's own run_forward / run_ppo (with
          --prof-out, one forward of the first layout profiled)
  hf-lora the anchor's part D (PEFT LoRA PPO step) through its own functions, then one step profiled (--prof-out)
  sdk     the PPO step through the official tinker SDK against a running `shardfit serve`

Shapes: the anchor's SHAPES, key for key, as Engine overrides (bench_rl.py's JSON compares the parameter counts);
MOE the Qwen3-30B-A3B shape (bench_moe.py's constants) and a tiny one for CPU checks. Timing: one warm-up call over
the longest and the shortest sequence, then --reps calls between device syncs; tokens/s counts the anchor's real
tokens (prompt + response).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rl_profile as rp  # noqa: E402
import rollouts as ro  # noqa: E402

QWEN3 = ["--model.qk_norm=true", "--model.rope_theta=1000000", "--model.norm_eps=1e-6"]
BIG = [*QWEN3, "--model.vocab_size=151936", "--model.n_kv_heads=8", "--model.head_dim=128"]
# the anchor's SHAPES, key for key (the part's JSON compares the parameter counts), plus 4b for --serve-shape
SHAPES = {
    "8b": [*BIG, "--model.dim=4096", "--model.n_layers=36", "--model.n_heads=32", "--model.ffn_dim=12288",
           "--model.tie_embeddings=false"],
    "4b": [*BIG, "--model.dim=2560", "--model.n_layers=36", "--model.n_heads=32", "--model.ffn_dim=9728",
           "--model.tie_embeddings=true", "--compute.activation_checkpoint=full"],  # 60 GiB of states: AC on H100
    "1.7b": [*BIG, "--model.dim=2048", "--model.n_layers=28", "--model.n_heads=16", "--model.ffn_dim=6144",
             "--model.tie_embeddings=true"],
    "tiny": [*QWEN3, "--model.vocab_size=3000", "--model.dim=256", "--model.n_layers=2", "--model.n_heads=4",
             "--model.n_kv_heads=2", "--model.head_dim=64", "--model.ffn_dim=512", "--model.tie_embeddings=false"],
}
MOE = {"big": dict(vocab=151936, hidden=2048, heads=32, kv=4, head_dim=128, experts=128, topk=8, inner=768),
       "tiny": dict(vocab=3000, hidden=64, heads=4, kv=2, head_dim=16, experts=8, topk=2, inner=32)}
PPO_CFG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "normalize": "token_mean"}
ADAM = dict(learning_rate=1e-6, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)  # E's AdamW
TAG = "rlbench"  # workers' JSON lines: {"rlbench": KIND, ...}


def vocab_of(shape: str) -> int:
    return 3000 if shape == "tiny" else 151936


def moe_overrides(layers: int, tiny: bool) -> list[str]:
    m = MOE["tiny" if tiny else "big"]
    out = ["--model.name=qwen3-30b-a3b", f"--model.n_layers={layers}"]
    if tiny:
        out += [f"--model.vocab_size={m['vocab']}", f"--model.dim={m['hidden']}", f"--model.n_heads={m['heads']}",
                f"--model.n_kv_heads={m['kv']}", f"--model.head_dim={m['head_dim']}", "--model.ffn_dim=128",
                f"--model.n_experts={m['experts']}", f"--model.experts_per_token={m['topk']}",
                f"--model.moe_ffn_dim={m['inner']}"]
    return out


def lora_overrides(rank: int) -> list[str]:
    """LoRA of rank `rank` on the 7 linear layers of every block (alpha 2 x rank), with full checkpointing as the
    anchor's part D runs it (17k-token rows of the 8B shape do not fit without: 73 GB of activations); none for 0."""
    return [f"--lora.rank={rank}", f"--lora.alpha={2 * rank}", "--compute.activation_checkpoint=full"] if rank else []


def engine_overrides(a, shape: str, T: int, run_dir: Path, lora: int = 0) -> list[str]:
    """The Engine's config for a shape (`moe` or a SHAPES key), LoRA of rank `lora` (0: every parameter trains): the
    same list for in-process and `shardfit serve`."""
    gpu = a.device == "cuda"
    ov = moe_overrides(a.moe_layers, not gpu) if shape == "moe" else list(SHAPES[shape])
    ov += [f"--train.micro_batch_tokens={T}", f"--data.seq_len={min(T, 4096)}", f"--model.max_seq_len={max(T, 40960)}",
           f"--train.device={a.device}", f"--logging.run_dir={run_dir}", "--logging.progress=none"]
    if gpu:
        ov.append("--compute.compile=true")
        if shape == "moe":
            ov.append("--parallel.overlap_optimizer=true")  # moe1's fastest shardfit case
    return [*ov, *lora_overrides(lora), *a.sf_extra.split()]


def emit(kind: str, **kw) -> None:
    print(json.dumps({TAG: kind, **kw}), flush=True)


def guarded(kind: str, fn) -> None:
    """fn(), a profile after the worker's figures: a failure is one line of `kind` with its error, not the
    worker's end."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (recorded)
        emit(kind, error=f"{type(e).__name__}: {str(e)[:300]}")



# ---------------------------------------------------------------------------------------------- workers
def _cuda():
    import torch

    on = torch.cuda.is_available()

    def sync():
        if on:
            torch.cuda.synchronize()

    def reset():
        if on:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peaks() -> dict:
        if not on:
            return {}
        return dict(peak_alloc_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                    peak_reserved_GiB=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    return sync, reset, peaks


def timed(fn, warm, reps: int, sync, reset) -> tuple[object, float, list[float]]:
    """warm() once, then reps x fn() between syncs: (last result, warm-up seconds, timed seconds)."""
    t = time.perf_counter()
    warm()
    sync()
    warm_s = time.perf_counter() - t
    reset()
    times, res = [], None
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        res = fn()
        sync()
        times.append(time.perf_counter() - t)
    return res, warm_s, times


def rate(r: ro.Rollouts, times: list[float]) -> dict:
    s = statistics.median(times)
    return dict(times_s=[round(x, 3) for x in times], step_s=round(s, 3), real_tok_s=round(r.real_tokens / s),
                resp_tok_s=round(r.response_tokens / s))


def warm_idx(r: ro.Rollouts) -> list[int]:
    lens = [len(s) for s in r.seqs]
    return [lens.index(max(lens)), lens.index(min(lens))]


def worker_sf(a) -> int:
    """shardfit's Engine in this process: forward, PPO step, weights() and export_hf as --what says."""
    import numpy as np
    import torch

    from shardfit import Engine
    from shardfit.rl import AdamParams

    sync, reset, peaks = _cuda()
    what = set(a.what.split(","))
    r = ro.make_rollouts(vocab_of("tiny" if a.shape == "moe" and a.device == "cpu" else a.shape), scale=a.scale,
                         anchor=a.anchor)
    T = ro.token_budget(r)
    emit("data", **r.summary(), T=T)
    if "ceiling" in what and torch.cuda.is_available():  # before the engine: the whole card's memory is free
        emit("ceiling", **gemm_ceiling())
    tmp = Path(tempfile.mkdtemp(prefix="rlbench-"))
    t = time.perf_counter()
    overrides = engine_overrides(a, a.shape, T, tmp / "run", lora=a.lora)
    engine = Engine.start(overrides=overrides)
    sync()
    emit("engine", shape=a.shape, lora=a.lora, params=engine.n_params, build_s=round(time.perf_counter() - t, 1),
         overrides=overrides, checkpointing=[n for n in engine.notices if "activation_checkpoint" in n], **peaks())
    fwd = ro.to_datums(r)
    w = warm_idx(r)
    res, warm_s, times = timed(lambda: engine.forward(fwd), lambda: engine.forward([fwd[i] for i in w]),
                               a.fwd_reps or a.reps, sync, reset)
    emit("fwd", shape=a.shape, lora=a.lora, warm_s=round(warm_s, 1), **rate(r, times), **peaks())
    if "prof" in what:  # the forward now and with session 14's settings, timed and profiled
        profile_forward(engine, fwd, r, a, sync, reset, peaks, vocab=vocab_of(a.shape))
    if "ppo" in what:
        old, adv = ro.sampler_inputs(r, ro.response_logprobs(r, res.outputs))
        if a.save_inputs:
            np.savez(a.save_inputs, old=np.concatenate(old), adv=np.concatenate(adv))
        data = ro.to_datums(r, old, adv)
        adam = AdamParams(**ADAM)
        box = {}

        def step(d):
            box["fb"] = engine.forward_backward(d, "ppo", PPO_CFG)
            box["opt"] = engine.optim_step(adam)

        _, warm_s, times = timed(lambda: step(data), lambda: step([data[i] for i in w]), a.reps, sync, reset)
        emit("ppo", shape=a.shape, lora=a.lora, warm_s=round(warm_s, 1), **rate(r, times), **peaks(),
             metrics={**box["fb"].metrics, **box["opt"]})
        if "profppo" in what:
            guarded("prof-ppo", lambda: profile_ppo(engine, step, data, a, sync, a.lora))
    if "weights" in what:
        for rep in range(2):  # the first pass also allocates the buckets' blocks in the caching allocator
            sync()
            t, n, k = time.perf_counter(), 0, 0
            for bucket in engine.weights(torch.bfloat16, 1 << 28):
                n += sum(x.nbytes for _, x in bucket)
                k += len(bucket)
            sync()
            dt = time.perf_counter() - t
            emit("weights", rep=rep, tensors=k, GB=round(n / 1e9, 3), s=round(dt, 3), GBps=round(n / 1e9 / dt, 2))
    if "export" in what:
        out = tmp / "hf"
        sync()
        t = time.perf_counter()
        engine.export_hf(str(out), "bfloat16", None)
        dt = time.perf_counter() - t
        os.sync()  # what the page cache still held, written: the export as far as the disk
        dts = time.perf_counter() - t
        n = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        emit("export", GB=round(n / 1e9, 3), s=round(dt, 2), GBps=round(n / 1e9 / dt, 2), with_sync_s=round(dts, 2),
             with_sync_GBps=round(n / 1e9 / dts, 2), where=str(out))
    if "prof1" in what:  # one forward, as it is, profiled: last, after every figure of the worker is out
        vocab = MOE["tiny" if a.device == "cpu" else "big"]["vocab"] if a.shape == "moe" else vocab_of(a.shape)
        guarded("prof", lambda: profile_forward(engine, fwd, r, a, sync, reset, peaks, variants=("now",),
                                                vocab=vocab))
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


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

    from shardfit.memory.profile_trace import summarize_trace, time_by_region

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


def worker_hf_moe(a) -> int:
    """transformers' Qwen3MoeForCausalLM through the anchor's own functions (its data, micro-batching, timing and
    JSON lines): C on a plain bf16 model, then E under FSDP2 (fp32 master, bf16 compute) with HF checkpointing."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    A = ro.load_anchor(a.anchor)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = MOE["big" if device == "cuda" else "tiny"]
    P, R, seqs = A.make_rollouts(64, 1234, m["vocab"], a.scale)
    r = ro.Rollouts(list(P), list(R), [s.numpy() for s in seqs])
    A.emit(dict(part="A", **r.summary()))
    T = ro.token_budget(r)
    cfg = Qwen3MoeConfig(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=3 * m["hidden"],
                         num_hidden_layers=a.moe_layers, num_attention_heads=m["heads"], num_key_value_heads=m["kv"],
                         head_dim=m["head_dim"], num_experts=m["experts"], num_experts_per_tok=m["topk"],
                         moe_intermediate_size=m["inner"], norm_topk_prob=True, max_position_embeddings=40960,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, output_router_logits=False,
                         use_cache=False)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "grouped_mm"  # as benchmarks/anchor_hf_qwen3moe.py (eager is ~10x slower)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)  # HF's own init, in bf16: the anchor's build() for this class
    torch.set_default_dtype(torch.float32)
    A.emit(dict(part="B", shape=f"moe{a.moe_layers}", params=sum(p.numel() for p in model.parameters())))
    old = None
    specs = [x for x in a.hf_fwd.split(",") if x]
    for spec in specs:
        lp = A.run_forward(model, P, R, seqs, spec, T, device, a.reps)
        old = old if old is not None else lp
    if a.prof_out and specs:  # one forward of the first layout (padnm in bench_rl's stages) under the profiler
        undo = label_anchor_head(A, model)
        try:
            s = anchor_profiled(A, lambda: A.run_forward(model, P, R, seqs, specs[0], T, device, 1, tag="profiled"),
                                Path(a.prof_out), "moe_fwd_hf", m["vocab"], 0)
            emit_profile("prof", s, variant=specs[0], side="hf", what="moe_fwd")
        except Exception as e:  # noqa: BLE001 (recorded; the PPO step still runs)
            emit("prof", side="hf", what="moe_fwd", error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            undo()
    del model
    A.reset_mem()
    # a group of one over an in-process store (no port, no launcher variables), as shardfit's one-process runs
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(device, (1,))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)  # norms at 1, as HF's init
        rot = model.model.rotary_emb  # a meta buffer until now
        d = m["head_dim"]
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        rot.inv_freq = inv
        if hasattr(rot, "original_inv_freq"):
            rot.original_inv_freq = inv
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=device == "cuda")
    g = torch.Generator(device=device).manual_seed(7)
    if old is None:
        old = [torch.full((n,), -math.log(m["vocab"]), device=device) for n in R]
    old = [(o.float() + 0.1 * torch.randn(o.shape, generator=g, device=device)).clone() for o in old]
    adv = [torch.randn(n, generator=g, device=device) for n in R]

    def ppo(spec: str) -> bool:
        try:
            A.run_ppo(model, opt, params, P, R, seqs, old, adv, spec, T, device, a.reps, part="E", autocast=False)
            return True
        except Exception as e:  # noqa: BLE001 (recorded; the next layout runs)
            opt.zero_grad(set_to_none=True)
            A.emit(dict(part="E", layout=spec, error=f"{type(e).__name__}: {str(e)[:300]}"))
            return False

    specs = [x for x in a.hf_ppo.split(",") if x]
    if not [ppo(spec) for spec in specs].count(True) and "pad" not in specs:
        ppo("pad")  # the HF default layout, when every one asked for failed
    dist.destroy_process_group()
    return 0


def worker_hf_lora(a) -> int:
    """The anchor's part D (hf_rl_step.py main(), its lines for --lora): Qwen3 of --shape in bf16, PEFT LoRA r=16
    alpha 32 on the 7 linear layers, fp32 adapters, HF checkpointing, fused AdamW, old log-probs -log V + N(0, 0.01)
    (as `--fwd ""` makes them), --reps timed PPO steps in each --hf-ppo layout through its own run_ppo; then, with
    --prof-out, one more step of the first layout profiled (anchor_profiled, the head labelled): what bench_rl's
    lora-ppo/hf runs in place of the anchor script when it profiles, the same calls in the same order."""
    import torch
    from peft import LoraConfig, get_peft_model

    A = ro.load_anchor(a.anchor)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = A.SHAPES[a.shape]["vocab_size"]
    P, R, seqs = A.make_rollouts(64, 1234, vocab, a.scale)
    r = ro.Rollouts(list(P), list(R), [x.numpy() for x in seqs])
    A.emit(dict(part="env", **A.env_info()))
    A.emit(dict(part="A", **r.summary()))
    T = ro.token_budget(r)
    model, cfg = A.build(a.shape, device, torch.bfloat16)
    A.emit(dict(part="B", shape=a.shape, params=sum(p.numel() for p in model.parameters()),
                attn=model.config._attn_implementation))
    # from here the anchor's main(), part D, line for line
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lcfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lcfg)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    A.emit(dict(part="D_model", trainable=sum(p.numel() for p in params)))
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
    g = torch.Generator(device=device).manual_seed(7)
    old = [torch.full((n,), -math.log(cfg.vocab_size), device=device) for n in R]
    old = [(o.float() + 0.1 * torch.randn(o.shape, generator=g, device=device)).clone() for o in old]
    adv = [torch.randn(n, generator=g, device=device) for n in R]
    specs = [x for x in a.hf_ppo.split(",") if x]
    for spec in specs:
        A.run_ppo(model, opt, params, P, R, seqs, old, adv, spec, T, device, a.reps, part="D")
    if a.prof_out and specs:
        undo = label_anchor_head(A, model)
        try:
            s = anchor_profiled(A, lambda: A.run_ppo(model, opt, params, P, R, seqs, old, adv, specs[0], T, device,
                                                     1, tag="profiled", part="D"),
                                Path(a.prof_out), "ppo_hf", vocab, 16)
            emit_profile("prof-ppo", s, side="hf", shape=a.shape, lora=16, layout=specs[0])
        except Exception as e:  # noqa: BLE001 (recorded)
            emit("prof-ppo", side="hf", error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            undo()
    return 0


def worker_sdk(a) -> int:
    """The PPO step through the tinker SDK against a running `shardfit serve` at --url."""
    import numpy as np
    import tinker
    from tinker import types

    r = ro.make_rollouts(vocab_of(a.shape), scale=a.scale, anchor=a.anchor)
    saved = np.load(a.save_inputs)
    cut = np.cumsum(r.responses)[:-1]
    data = ro.to_tinker(ro.to_datums(r, np.split(saved["old"], cut), np.split(saved["adv"], cut)))
    t = time.perf_counter()
    # base_model: the server's model.name (the dense shapes set every size over the default); a LoRA server
    # answers only a client asking its own rank (a full-parameter one any)
    tc = tinker.ServiceClient(base_url=a.url, api_key="tml-local").create_lora_training_client(
        base_model="tiny", rank=a.lora or 8)
    emit("sdk-client", s=round(time.perf_counter() - t, 2))

    def step(d):
        fb = tc.forward_backward(d, "ppo", PPO_CFG)
        op = tc.optim_step(types.AdamParams(**ADAM))  # pipelined: sent before the first result is read
        return fb.result(), op.result()

    t = time.perf_counter()
    step([data[i] for i in warm_idx(r)])
    last = time.perf_counter()
    warm_s, times = last - t, []
    for _ in range(a.reps):
        fb, op = step(data)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    emit("sdk-ppo", shape=a.shape, lora=a.lora, warm_s=round(warm_s, 1), **rate(r, times),
         metrics={**fb.metrics, **op.metrics})
    return 0


WORKERS = {"sf": worker_sf, "hf-moe": worker_hf_moe, "hf-lora": worker_hf_lora, "sdk": worker_sdk}
