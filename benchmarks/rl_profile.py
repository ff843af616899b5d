"""Issue 24's profiles, kernel class by kernel class (bench_rl.py --prof-out): where one GPU's time goes in a step of
shardfit's Engine and in the same step of the anchor hf_rl_step.py, read from the Chrome trace torch.profiler exports
(recorded with record_shapes=True). No torch here: pure functions of the trace's events, tested on synthetic traces
(tests/rl/test_rl_profile_bench.py).

analyse(events, vocab, lora_rank) sorts every kernel of the compute stream (the stream with the most kernel time,
as memory/profile_trace.summarize_trace picks it) into one row of ROWS, so that the rows sum to the stream's busy
time, and gives each matmul its FLOPs from the shapes of the aten operator that launched it:
  - the host context of a kernel is every host operator or annotation open on the launching thread, plus, for a
    kernel launched in backward (under autograd::engine::evaluate_function: X, sequence number s), those of the
    forward operator with sequence number s: so a backward kernel belongs to the region its forward ran in
    (e.g. the log-prob head, which each side labels: shardfit::logprob_head, anchor::logprob_head);
  - phase: backward (recompute of checkpointed blocks included) when launched under evaluate_function, optimizer
    under Optimizer.step / zero_grad labels, else forward;
  - a matmul is a kernel of kind matmul (cuBLAS nvjet / CUTLASS / xmma: profile_trace.kernel_kind) or an Inductor
    mm template; its FLOPs come from the innermost of GEMM_OPS on its launch stack (2*M*K*N; batched and grouped
    forms in gemm_flops), counted once per operator call, and a class's TFLOP/s is its FLOPs over the time of its
    kernels whose FLOPs are known (ms_with_shapes); it is the head's when in the head region or when one of
    its dimensions is the vocabulary, the experts' for aten::_grouped_mm (or a grouped kernel launched without
    one: an Inductor template), LoRA's when one of its dimensions is the adapter rank, else the blocks'; any other
    matmul kernel whose launch has no such operator is "GEMM without shapes" (its time counted, its FLOPs not).
bounds(...) turns two analyses and the two sides' step times into how far 2x is (see its docstring).
"""

from __future__ import annotations

import math
from collections import defaultdict

EVAL = "autograd::engine::evaluate_function"
HOST = ("cpu_op", "user_annotation")
RUNTIME = ("cuda_runtime", "cuda_driver")
GPU = {"kernel": None, "gpu_memcpy": "copy", "gpu_memset": "copy"}
HEAD_LABELS = ("shardfit::logprob_head", "anchor::logprob_head")
REGIONS = [("fsdp", ("FSDP::",)), ("head", HEAD_LABELS), ("optimizer", ("Optimizer.step", "Optimizer.zero_grad"))]
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::_scaled_mm",
            "aten::_scaled_grouped_mm", "aten::addmm_", "aten::mm_", "aten::addbmm"}

# one row per kernel, in this order of precedence (first match): the rows sum to the compute stream's busy time
ROWS = [
    "GEMM blocks: forward",
    "GEMM blocks: backward + recompute",
    "GEMM experts (grouped): forward",
    "GEMM experts (grouped): backward + recompute",
    "GEMM LoRA adapters",
    "GEMM log-prob head",
    "GEMM without shapes",
    "attention: forward",
    "attention: backward + recompute",
    "log-prob head: softmax/gather/other",
    "optimizer + grad clip",
    "FSDP cast/copy",
    "communication",
    "compiled elementwise/norm/rope",
    "eager elementwise",
    "memcpy/memset",
]
GEMM_CLASSES = ["blocks: forward", "blocks: backward + recompute", "experts (grouped): forward",
                "experts (grouped): backward + recompute", "LoRA adapters", "log-prob head", "without shapes"]


def kind_of(name: str, cat: str = "kernel") -> str:
    """profile_trace.kernel_kind, with Inductor's mm templates (triton_tem_fused_mm..., _grouped_mm) as matmuls."""
    from shardfit.doctor.profile_trace import kernel_kind

    k = kernel_kind(name, cat)
    low = name.lower()
    if k == "compiled fusion" and low.startswith("triton_tem") and "mm" in low and "attention" not in low:
        return "matmul"
    return k


def gemm_flops(name: str, dims) -> float | None:
    """FLOPs (2 per multiply-add) of one matmul operator call from its "Input Dims"; None when not readable."""
    try:
        if name in ("aten::addmm", "aten::addmm_", "aten::baddbmm", "aten::addbmm"):
            a, b = dims[1], dims[2]
        else:
            a, b = dims[0], dims[1]
        a, b = [int(x) for x in a], [int(x) for x in b]
    except (TypeError, ValueError, IndexError):
        return None
    if name in ("aten::_grouped_mm", "aten::_scaled_grouped_mm"):
        if len(a) == 2 and len(b) == 3:  # tokens [M, K] x experts [G, K, N]: each row meets one expert
            return 2.0 * a[0] * a[1] * b[2]
        if len(a) == 2 and len(b) == 2:  # [M, Ktot] x [Ktot, N], K split by offsets (weight gradients): [G, M, N]
            return 2.0 * a[0] * a[1] * b[1]
        if len(a) == 3 and len(b) == 3:
            return 2.0 * a[0] * a[1] * a[2] * b[2]
        return None
    if len(a) == 3 and len(b) == 3:  # [B, M, K] x [B, K, N]
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2.0 * a[0] * a[1] * b[1]
    return None


def _stacks(events: list[dict]):
    """(correlation -> tuple of the host events open on the launching thread, outermost first;
        forward sequence number -> names of the host events open around the forward operator, itself last)."""
    by_tid: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in (*HOST, *RUNTIME):
            by_tid[(e.get("pid"), e.get("tid"))].append(e)
    launch: dict[object, tuple] = {}
    forward: dict[object, tuple] = {}
    for evs in by_tid.values():
        stack: list[dict] = []
        in_bwd: list[bool] = []  # per stack entry: evaluate_function open at or above it
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
                in_bwd.pop()
            args = e.get("args") or {}
            if e["cat"] in RUNTIME:
                if "correlation" in args:
                    launch[args["correlation"]] = tuple(stack)
                continue
            bwd = (in_bwd[-1] if in_bwd else False) or e["name"].startswith(EVAL)
            seq = args.get("Sequence number")
            if seq is not None and not bwd and seq not in forward:
                forward[seq] = (*(x["name"] for x in stack), e["name"])
            stack.append(e)
            in_bwd.append(bwd)
    return launch, forward


def analyse(events: list[dict], vocab: int = 0, lora_rank: int = 0, regions=REGIONS) -> dict:
    """The compute stream's kernel time by ROWS (ms), the matmuls' FLOPs and rates by class, and the kernel time on
    other streams; {} for a trace without GPU work (a CPU run)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU]
    if not gpu:
        return {}
    by_stream: dict[object, float] = defaultdict(float)
    for e in gpu:
        by_stream[(e.get("args") or {}).get("stream", e.get("tid"))] += e["dur"]
    compute = max(by_stream, key=by_stream.get)
    launch, forward = _stacks(events)
    rows: dict[str, float] = {r: 0.0 for r in ROWS}
    g_ms: dict[str, float] = {c: 0.0 for c in GEMM_CLASSES}
    g_flop: dict[str, float] = {c: 0.0 for c in GEMM_CLASSES}
    g_ops: dict[str, int] = {c: 0 for c in GEMM_CLASSES}
    g_shaped: dict[str, float] = {c: 0.0 for c in GEMM_CLASSES}
    counted: set[int] = set()
    unlaunched = 0.0
    for e in gpu:
        if (e.get("args") or {}).get("stream", e.get("tid")) != compute:
            continue
        args = e.get("args") or {}
        stack = launch.get(args.get("correlation"))
        if stack is None:
            unlaunched += e["dur"]
            stack = ()
        names = [x["name"] for x in stack]
        ev = next((x for x in reversed(stack) if x["name"].startswith(EVAL)), None)
        if ev is not None:
            names += forward.get((ev.get("args") or {}).get("Sequence number"), ())
        region = next((r for r, prefixes in regions if any(n.startswith(prefixes) for n in names)), "elsewhere")
        phase = "backward" if ev is not None else "optimizer" if region == "optimizer" else "forward"
        kind = kind_of(e["name"], e["cat"])
        dur = e["dur"]
        if region == "fsdp":
            rows["FSDP cast/copy"] += dur
        elif kind == "communication":
            rows["communication"] += dur
        elif kind == "matmul":
            op = next((x for x in reversed(stack) if x["name"] in GEMM_OPS), None)
            dims = (op.get("args") or {}).get("Input Dims") if op is not None else None
            flat = [d for arg in (dims or []) if isinstance(arg, list) for d in arg]
            bwd = phase == "backward"
            if region == "head" or (vocab and vocab in flat):
                cls = "log-prob head"
            elif op is None and "group" not in e["name"].lower():
                cls = "without shapes"
            elif op is None or op["name"] in ("aten::_grouped_mm", "aten::_scaled_grouped_mm"):
                cls = "experts (grouped): " + ("backward + recompute" if bwd else "forward")
            elif lora_rank and lora_rank in flat:
                cls = "LoRA adapters"
            else:
                cls = "blocks: " + ("backward + recompute" if bwd else "forward")
            g_ms[cls] += dur
            f = gemm_flops(op["name"], dims) if op is not None else None
            if f is not None:
                g_shaped[cls] += dur  # the rate's time: the kernels whose FLOPs are known
                if id(op) not in counted:
                    counted.add(id(op))
                    g_flop[cls] += f
                    g_ops[cls] += 1
            rows["GEMM " + cls] += dur
        elif kind == "attention":
            rows["attention: " + ("backward + recompute" if phase == "backward" else "forward")] += dur
        elif region == "head":
            rows["log-prob head: softmax/gather/other"] += dur
        elif kind == "optimizer" or region == "optimizer":
            rows["optimizer + grad clip"] += dur
        elif kind == "compiled fusion":
            rows["compiled elementwise/norm/rope"] += dur
        elif kind == "copy":
            rows["memcpy/memset"] += dur
        else:
            rows["eager elementwise"] += dur
    ms = 1e-3
    def rate(flop: float, us: float) -> float | None:
        return round(flop / (us * 1e-6) * 1e-12, 1) if us and flop else None

    gemm = {c: {"ms": round(g_ms[c] * ms, 2), "TFLOP": round(g_flop[c] * 1e-12, 3), "ops": g_ops[c],
                "ms_with_shapes": round(g_shaped[c] * ms, 2), "TFLOPs": rate(g_flop[c], g_shaped[c])}
            for c in GEMM_CLASSES}
    tot_flop, shaped = sum(g_flop.values()), sum(g_shaped.values())
    gemm["total"] = {"ms": round(sum(g_ms.values()) * ms, 2), "TFLOP": round(tot_flop * 1e-12, 3),
                     "ms_with_shapes": round(shaped * ms, 2), "TFLOPs": rate(tot_flop, shaped)}
    return {"rows_ms": {r: round(v * ms, 1) for r, v in rows.items()}, "gemm": gemm,
            "busy_sum_ms": round(sum(rows.values()) * ms, 1),
            "other_streams_ms": round(sum(v for s, v in by_stream.items() if s != compute) * ms, 1),
            "kernels_without_launch_ms": round(unlaunched * ms, 1)}


def table(summary: dict, an: dict) -> dict:
    """ROWS (ms) then the idle time split as profile_trace does it (waiting for the CPU, on other streams, gaps
    under 5 us) and the span: one column of the side-by-side table."""
    return {**an.get("rows_ms", {}), **idle_rows(summary), "busy": summary.get("compute_busy_ms", 0.0),
            "span": summary.get("span_ms", 0.0)}


def idle_rows(summary: dict) -> dict:
    """The compute stream's idle time of a profile_trace summary, split: waiting for the CPU, on other streams, and
    the gaps under 5 us (the rest)."""
    idle = summary.get("idle", {})
    cpu, other = idle.get("cpu_ms", 0.0), idle.get("other_stream_ms", 0.0)
    return {"idle: waiting for the CPU": cpu, "idle: waiting on other streams": other,
            "idle: gaps under 5 us": round(summary.get("compute_idle_ms", 0.0) - cpu - other, 1)}


def compare(sf: dict, hf: dict) -> dict:
    """Row by row: {row: [shardfit ms, anchor ms, anchor / shardfit]} of two tables."""
    out = {}
    for row in dict.fromkeys([*sf, *hf]):
        a, b = sf.get(row, 0.0), hf.get(row, 0.0)
        out[row] = [a, b, round(b / a, 2) if a else None]
    return out


def bounds(sf: dict, hf: dict, sf_step_s: float, hf_step_s: float, ceiling_tflops: float | None) -> dict:
    """How far 2x is, from the profile of one shardfit step (sf: analyse + table under "table") and the anchor's
    wall time of the same step (hf_step_s, unprofiled, same data). With G our matmul FLOPs (from shapes), C the
    card's measured bf16 GEMM ceiling, R our non-GEMM GPU time (rows other than GEMM) and I our idle time:
      gemm_at_ceiling_rest_free   = hf_step_s / (G / C)            no shardfit step doing our matmuls can beat this
      gemm_at_ceiling_rest_as_now = hf_step_s / (G / C + R + I)    the matmuls perfect, everything else unchanged
      gemm_as_now_rest_free       = hf_step_s / (our GEMM time)    everything else free, the matmuls as they run
      gemm_TFLOPs_for_2x          = G / (hf_step_s / 2 - R - I)    the matmul rate 2x needs with the rest unchanged
                                                                   (None: the rest alone is over half the anchor's)
    and the same first two without the blocks' recompute (full checkpointing; its FLOPs taken as those of the
    forward's block and LoRA matmuls, which it repeats)."""
    ts, th = sf.get("table", {}), hf.get("table", {})
    gs, gh = sf.get("gemm", {}), hf.get("gemm", {})
    if not ts or not gs:
        return {}
    tf = gs["total"]["TFLOP"]  # G
    gemm_s = sum(v for k, v in ts.items() if k.startswith("GEMM")) / 1e3
    rest_s = sum(v for k, v in ts.items() if k in ROWS and not k.startswith("GEMM")) / 1e3
    idle_s = sum(v for k, v in ts.items() if k.startswith("idle")) / 1e3
    out = {"ratio_now": round(hf_step_s / sf_step_s, 3), "shardfit_step_s": sf_step_s, "anchor_step_s": hf_step_s,
           "shardfit_gemm_s": round(gemm_s, 3), "shardfit_rest_s": round(rest_s, 3),
           "shardfit_idle_s": round(idle_s, 3),
           "shardfit_gemm_TFLOP": tf, "shardfit_gemm_TFLOPs": gs["total"]["TFLOPs"]}
    if th and gh:
        hg = sum(v for k, v in th.items() if k.startswith("GEMM")) / 1e3
        out.update(anchor_gemm_s=round(hg, 3), anchor_gemm_TFLOP=gh["total"]["TFLOP"],
                   anchor_gemm_TFLOPs=gh["total"]["TFLOPs"],
                   anchor_gemm_over_shardfit_gemm=round(hg / gemm_s, 3) if gemm_s else None,
                   anchor_rest_s=round(sum(v for k, v in th.items() if k in ROWS and not k.startswith("GEMM")) / 1e3,
                                       3),
                   anchor_idle_s=round(sum(v for k, v in th.items() if k.startswith("idle")) / 1e3, 3))
    out["gemm_as_now_rest_free"] = round(hf_step_s / gemm_s, 3) if gemm_s else None
    if ceiling_tflops:
        at_c = tf / ceiling_tflops
        recompute = gs.get("blocks: forward", {}).get("TFLOP", 0.0) + (
            gs.get("LoRA adapters", {}).get("TFLOP", 0.0) / 4)  # LoRA: fwd 2 + recompute 2 + backward 4 of 8 units
        out.update(ceiling_TFLOPs=ceiling_tflops,
                   shardfit_gemm_share_of_ceiling=round(gs["total"]["TFLOPs"] / ceiling_tflops, 3)
                   if gs["total"]["TFLOPs"] else None,
                   gemm_at_ceiling_rest_free=round(hf_step_s / at_c, 3) if at_c else None,
                   gemm_at_ceiling_rest_as_now=round(hf_step_s / (at_c + rest_s + idle_s), 3),
                   no_recompute_gemm_at_ceiling_rest_free=round(hf_step_s / ((tf - recompute) / ceiling_tflops), 3)
                   if tf > recompute else None,
                   no_recompute_gemm_at_ceiling_rest_as_now=round(
                       hf_step_s / ((tf - recompute) / ceiling_tflops + rest_s + idle_s), 3))
    left = hf_step_s / 2 - rest_s - idle_s
    out["gemm_TFLOPs_for_2x"] = round(tf / left, 1) if left > 0 else None
    return out


def dense_flops(shape: dict, tokens: int, head_rows: int, lora_rank: int = 0, head_passes: int = 3,
                recompute: bool = True) -> dict:
    """The matmul TFLOP of one PPO step by the model's sizes (a check on the shapes' count): blocks 2N a token
    forward, 2N recompute (full checkpointing), 2N input gradient (the base is frozen under LoRA: no weight
    gradient); LoRA 2 forward + 2 recompute + 4 backward (input and adapter gradients) per adapter parameter and
    token; the head 2 V D a row per pass (head_passes: shardfit 3 = logits, logits again in backward, the input
    gradient; the anchor 2 = logits, input gradient). N = the 7 linear layers' weights of every block."""
    d, h, kv, hd, f, L, V = (shape[k] for k in ("dim", "heads", "kv", "head_dim", "ffn", "layers", "vocab"))
    n_lin = L * (d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f)
    n_lora = L * lora_rank * ((d + h * hd) + 2 * (d + kv * hd) + (h * hd + d) + 3 * (d + f))
    blocks = (6 if recompute else 4) * n_lin * tokens
    lora = (8 if recompute else 6) * n_lora * tokens
    head = head_passes * 2 * V * d * head_rows
    return {"blocks_TFLOP": round(blocks * 1e-12, 2), "lora_TFLOP": round(lora * 1e-12, 3),
            "head_TFLOP": round(head * 1e-12, 2), "total_TFLOP": round((blocks + lora + head) * 1e-12, 2),
            "block_linear_params": n_lin, "lora_params": n_lora, "tokens": tokens, "head_rows": head_rows,
            "formula": f"({6 if recompute else 4} N + {8 if recompute else 6} N_lora) tokens + {head_passes} x 2 V D "
                       "head_rows"}


def attention_flops(lengths: list[int], heads: int, head_dim: int, layers: int) -> float:
    """Causal attention's useful forward FLOPs over sequences of these lengths (QK^T and PV, half the square):
    2 * 2 * L^2 / 2 * heads * head_dim a layer. Backward is 2.5x it (five matmuls to two)."""
    return float(sum(2 * n * n for n in lengths) * heads * head_dim * layers)


def fmt(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.1f}" if isinstance(x, float) \
        else str(x)


# the shapes bench_rl profiles: the anchor's SHAPES["8b"] and rl_worker_setup.MOE["big"], key for key
QWEN3_8B = dict(dim=4096, heads=32, kv=8, head_dim=128, ffn=12288, layers=36, vocab=151936)
QWEN3_30B_A3B = dict(dim=2048, heads=32, kv=4, head_dim=128, experts=128, topk=8, inner=768, vocab=151936)


def moe_forward_flops(m: dict, layers: int, tokens: int, head_rows: int) -> dict:
    """The matmul TFLOP of one forward of the MoE shape: per token and layer q, k, v, o (2 D (2 H hd + 2 KV hd)),
    the router (2 D E) and topk experts of three D x I matrices (2 x 3 D I each); the head 2 V D a row."""
    d, h, kv, hd = m["dim"], m["heads"], m["kv"], m["head_dim"]
    attn = 2 * d * (2 * h * hd + 2 * kv * hd) * layers * tokens
    router = 2 * d * m["experts"] * layers * tokens
    experts = m["topk"] * 3 * 2 * d * m["inner"] * layers * tokens
    head = 2 * m["vocab"] * d * head_rows
    return {"attention_proj_TFLOP": round(attn * 1e-12, 2), "router_TFLOP": round(router * 1e-12, 3),
            "experts_TFLOP": round(experts * 1e-12, 2), "head_TFLOP": round(head * 1e-12, 2),
            "total_TFLOP": round((attn + router + experts + head) * 1e-12, 2), "tokens": tokens,
            "head_rows": head_rows}
