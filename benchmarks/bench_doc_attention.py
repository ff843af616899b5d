"""Document-masked attention of one layer in Engine.forward's no-grad log-prob recompute (issue 24), on the real
rollout lengths: shardfit's FlexAttention path against its kernel options, cuDNN / FlashAttention SDPA and varlen.

  python benchmarks/bench_doc_attention.py                     # GPU: both shapes, every variant (~3.5 min, one GPU)
  python benchmarks/bench_doc_attention.py --cpu-check         # CPU: tiny shapes, the machinery (~1.5 min, 2 cores)
  python benchmarks/bench_doc_attention.py --shapes moe --variants a,b:tma,c:cudnn   # some variants

Data: the anchor's 64 rollouts (benchmarks/rollouts.py: prompts 256-1024 + log-normal responses, 178,786 tokens,
178,722 as Datums; --scale shrinks them), made into Datums (`to_datums`) and packed as Engine.forward packs them:
`plan_datums` on one rank into rows of T = the longest datum rounded up to 128 (17,408), each `pack_row`'s [1, T]
(documents end to end, the padded tail a document of its own). One "layer" is one attention call per row over all M
rows (11 at scale 1): what Engine.forward spends per decoder layer. q [1, T, H, 128], k/v [1, T, K, 128] per row,
bf16, N(0, 1), no grad. Shapes: moe (Qwen3-30B-A3B: 32 query heads, 4 KV heads) and dense (Qwen3-8B: 32 / 8).

Variants (ids for --variants; a prefix such as "b" selects a group):
  a           shardfit today: DocumentMask.build(pos, "flex") then sdpa_attention(q, k, v, mask), i.e. models/
              attention.py's _flex (torch.compile(flex_attention, dynamic=False), no kernel_options: Inductor's
              default forward config, on sm90 bf16 head_dim 128 BLOCK_M 128 / BLOCK_N 64 / 3 stages / 8 warps).
  b:<name>    the same block masks (document_block_mask) and compiled function with kernel_options (FLEX_OPTIONS):
              tile shapes, warps, stages, USE_TMA, PRESCALE_QK; keys this torch's FlexKernelOptions does not list
              are dropped (recorded). b:docstart keeps the default options but evaluates "same document" inside
              partial tiles as kv >= start[q] (one load per query row, none per key column) instead of
              doc[q] == doc[kv]. Not tried, being wrong for this mask: BLOCKS_ARE_CONTIGUOUS (a query block inside
              a long document lists its partial key blocks as {the document's first block, the diagonal}: not
              contiguous) and ROWS_GUARANTEED_SAFE (a query row whose document starts inside its query block sees
              the first listed key block, the previous document's, fully masked: without the check the kernel
              computes exp2(-inf - -inf), NaN).
  c:<backend> SDPA on each document alone (is_causal, enable_gqa; the tail skipped), a Python loop: the kernels'
              lower bound. c:<backend>+graph replays the same loop from a CUDA graph (no launch overhead).
              Outputs stay per document (no copy back into the packed row: kernels only).
  d:<backend> the anchor's layout: its bins_padded (sorted, n x max_len <= T) over the same documents, right-padded
              [n, L, H, D], SDPA is_causal with enable_gqa: kernels only, inputs gathered beforehand (as the anchor
              holds padded batches). d:cudnn+convert adds what shardfit would pay to use it from its packed rows:
              gather q/k/v into the padded batches and scatter the outputs back (index_select / index_copy_).
  e           shardfit's varlen path: DocumentMask.build(pos, "varlen") then sdpa_attention (torch 2.11's varlen_attn
              has no enable_gqa: K/V repeated to every query head, as compute.doc_attention=varlen runs today).
  f           the same cu_seqlens straight into aten._flash_attention_forward with K/V not repeated (FlashAttention-2
              reads grouped heads itself; varlen_attn only lacks the flag in 2.11).
  g, g:rep    cuDNN's ragged (packed) attention, aten._cudnn_attention_forward with cu_seqlens (what NestedTensor
              SDPA calls), K/V as they are (g) or repeated (g:rep). Causal is top-left per document: exact here, each
              document's queries and keys being the same tokens. g:maxT, g:rep+maxT pass the row length T as
              max_seqlen instead of the longest document: one shape whatever the documents (cuDNN builds a plan
              per shape; a compiled block would guard on the int).
Backends: cudnn, flash (sdpa_kernel with that one backend), default (SDPA's own choice). On the CPU (--cpu-check)
every SDPA variant runs the math backend, flex runs eager (its dense reference: kernel options are accepted and
ignored), and e, f, g are skipped (CUDA only).

Timing: per variant, --warmup untimed layers (compiles, cuDNN plans), then --reps timed layers with CUDA events
around the whole layer (all rows); median ms, min, and the host's time to issue the layer (close to the median:
launch-bound). Speedup = a's median / the variant's. TFLOP/s counts the real documents' causal work only,
4 x head_dim x H x sum(n (n + 1) / 2). Check: every variant's output against a's on the real tokens (the padded tail
excluded: its log-probs are never read): bf16 passes when |x - a| <= 1e-2 + 2e-2 |a| everywhere and the relative RMS
error is under 1e-2 (fp32 on the CPU: 1e-4 / 1e-4 / 1e-4). The block mask's and cu_seqlens' build is timed once
per row apart (bench_attention.time_build): made once per micro-batch, shared by every layer.

The JSON (everything, rewritten after each variant) goes to --out, default $OUT/bench_doc_attention.json ($OUT
defaults to /tmp/out); the table is printed last. --deadline: variants not started by then are skipped (recorded),
in priority order: a, c, d, e, f, g for both shapes, then every b variant (FLEX_OPTIONS' order) on the first shape
(moe), then on the other (dense) the --b-others (3) fastest of them that passed the check: each b variant and shape is
a compilation of its own (seconds each), so the dense shape gets only the candidates.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

T0 = time.time()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # rollouts, bench_attention
sys.path.insert(0, str(HERE.parent / "src"))  # shardfit, when it is not installed

from bench_attention import _sync, time_build  # noqa: E402
from doc_attention_variants import (  # noqa: E402
    CPU_SHAPES,
    CUDA_ONLY_LABELS,
    LAYERS,
    SHAPES,
    VARIANTS,
    Ctx,
    Layout,
    Skipped,
    flex_option_keys,
    rollout_layout,
)
from rollouts import load_anchor  # noqa: E402


# ------------------------------------------------------------------------------------------- timing, checking
def time_layer(run, reps: int, warmup: int, dev: torch.device) -> tuple[dict, object]:
    """Median / min ms of one call of run (one layer: all rows), the host's time to issue it, and the last output."""
    out = None
    for _ in range(warmup):
        out = run()
    _sync(dev)
    gpu, host = [], []
    for _ in range(reps):
        out = None  # the previous output freed before the next call, as in a model
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            out = run()
            t1 = time.perf_counter()
            e1.record()
            e1.synchronize()
            gpu.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            out = run()
            t1 = time.perf_counter()
            gpu.append((t1 - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    return {"ms": round(statistics.median(gpu), 4), "min_ms": round(min(gpu), 4),
            "host_issue_ms": round(statistics.median(host), 4), "runs": len(gpu)}, out


def compare(out: torch.Tensor, ref: torch.Tensor, real: torch.Tensor, dtype: torch.dtype) -> dict:
    """Agreement with a's output on the real tokens, row by row (bounded temporaries)."""
    atol, rtol, rms_tol = (1e-2, 2e-2, 1e-2) if dtype in (torch.bfloat16, torch.float16) else (1e-4, 1e-4, 1e-4)
    max_abs, bad, err2, ref2, n = 0.0, 0, 0.0, 0.0, 0
    for m in range(ref.shape[0]):
        r, o = ref[m][real[m]].float(), out[m][real[m]].float()
        d = (o - r).abs()
        max_abs = max(max_abs, float(d.max()))
        bad += int((d > atol + rtol * r.abs()).sum())
        err2 += float((d * d).sum())
        ref2 += float((r * r).sum())
        n += d.numel()
        if not bool(torch.isfinite(o).all()):
            bad += 1
            max_abs = float("inf")
    rel = math.sqrt(err2 / max(ref2, 1e-30))
    return {"max_abs_err": round(max_abs, 6), "rel_rms_err": float(f"{rel:.3e}"), "out_of_tol": bad,
            "ok": bad == 0 and rel <= rms_tol}


def error_text(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {s[0][:300] if s else ''}"


def build_costs(lay: Layout, dev: torch.device) -> dict:
    """DocumentMask.build per row (host / host + device ms, median over the rows; once per micro-batch)."""
    out = {}
    for kind in ("flex", "varlen"):
        if kind == "varlen" and dev.type != "cuda":
            continue
        host, total = [], []
        for m in range(lay.rows):
            pos = lay.pos[m:m + 1]
            for _ in range(2 if m == 0 else 1):  # the first build warms up
                _, h, t = time_build(pos.clone(), kind, dev)
            host.append(h)
            total.append(t)
        out[kind] = {"host_ms": round(statistics.median(host), 3), "total_ms": round(statistics.median(total), 3)}
    return out


def flex_tiles(ctx: Ctx) -> dict:
    """The 128 x 128 tiles the block masks list (partial, full), and their pairs over the real causal pairs."""
    part = full = 0
    for bm in ctx.block_masks():
        part += int(bm.kv_num_blocks.sum())
        full += int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0
    bs = ctx.block_masks()[0].BLOCK_SIZE[0]
    return {"partial_tiles": part, "full_tiles": full,
            "tile_pairs_over_real": round((part + full) * bs * bs / ctx.layout.stats["causal_pairs"], 4)}


# ---------------------------------------------------------------------------------------------------- main
def env_info(dev: torch.device) -> dict:
    e = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
         "flex_option_keys": sorted(flex_option_keys())}
    try:
        import triton

        e["triton"] = triton.__version__
    except ImportError:
        pass
    if dev.type == "cuda":
        e["cudnn"] = torch.backends.cudnn.version()
        e["capability"] = list(torch.cuda.get_device_capability(dev))
    for mod in ("torch._inductor.template_heuristics.triton", "torch._inductor.template_heuristics"):
        try:  # Inductor's default forward config on sm90 for bf16, head_dim 128 (what a runs with)
            h = __import__(mod, fromlist=["CUDAConfigHeuristic"]).CUDAConfigHeuristic()
            e["inductor_sm90_bf16_d128_fwd_default"] = str(h.h100_default_flex_config.get((torch.bfloat16, 128)))
            break
        except Exception:  # noqa: BLE001 - informative only
            continue
    return e


def select(spec: str) -> list[str]:
    if not spec:
        return list(VARIANTS)
    want = [s.strip() for s in spec.split(",") if s.strip()]
    chosen = [v for v in VARIANTS if any(v == w or v.split(":")[0] == w for w in want)]
    unknown = [w for w in want if not any(v == w or v.split(":")[0] == w for v in VARIANTS)]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if "a" not in chosen:
        chosen.insert(0, "a")  # the reference of every check and speedup
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-check", action="store_true", help="CPU, fp32, --scale 0.02, tiny heads: the machinery")
    ap.add_argument("--shapes", default="moe,dense")
    ap.add_argument("--variants", default="", help="ids or groups (a, b, c, d, e, f, g), comma-separated; default all")
    ap.add_argument("--scale", type=float, default=None, help="rollout length scale (default 1; 0.02 with --cpu-check)")
    ap.add_argument("--budget", type=int, default=0, help="row tokens T (default: the longest datum rounded to 128)")
    ap.add_argument("--reps", type=int, default=None, help="timed layers per variant (default 10; 1 on the CPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed layers first (default 2; 0 on the CPU)")
    ap.add_argument("--deadline", type=float, default=195.0, help="seconds from start after which no variant starts")
    ap.add_argument("--b-others", type=int, default=3, help="b variants run on the shapes after the first: the "
                    "fastest correct ones on the first shape (each is a compilation)")
    ap.add_argument("--anchor", default=None, help="hf_rl_step.py (default: rollouts.find_anchor's places)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    cpu = a.cpu_check or not torch.cuda.is_available()
    if not a.cpu_check and not torch.cuda.is_available():
        ap.error("no CUDA device; use --cpu-check")
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    dtype = torch.float32 if cpu else torch.bfloat16
    scale = a.scale if a.scale is not None else (0.02 if cpu else 1.0)
    reps = a.reps if a.reps is not None else (1 if cpu else 10)
    warmup = a.warmup if a.warmup is not None else (0 if cpu else 2)
    shapes = [s for s in a.shapes.split(",") if s]
    variants = select(a.variants)
    out_path = Path(a.out) if a.out else Path(os.environ.get("OUT") or "/tmp/out") / "bench_doc_attention.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(torch._dynamo.config, "recompile_limit"):  # one compilation per kernel_options set and shape
        torch._dynamo.config.recompile_limit = 64
    if hasattr(torch._dynamo.config, "cache_size_limit"):
        torch._dynamo.config.cache_size_limit = 64

    anchor = load_anchor(a.anchor)
    lay = rollout_layout(scale, anchor, a.budget)
    env = env_info(dev)
    env.update(dtype=str(dtype).removeprefix("torch."), scale=scale, reps=reps, warmup=warmup)
    print(f"[{time.time() - T0:.0f}s] {env['device']}, torch {env['torch']}: {lay.stats['rows']} rows of "
          f"{lay.T}, {lay.stats['docs']} documents, {lay.stats['real_tokens']} real tokens", flush=True)
    res: dict = {"env": env, "layout": lay.stats, "build_ms": build_costs(lay, dev), "shapes": {}}

    def save():
        out_path.write_text(json.dumps(res, indent=1) + "\n")

    g = torch.Generator(device=dev).manual_seed(a.seed)
    ctxs, refs = {}, {}
    real = lay.real(dev)
    for s in shapes:
        H, K, D = (CPU_SHAPES if cpu else SHAPES)[s]
        M, T = lay.rows, lay.T
        q, k, v = (torch.randn(M, T, h, D, generator=g, device=dev, dtype=dtype) for h in (H, K, K))
        ctxs[s] = Ctx(lay, q, k, v, dev, anchor)
        flops = 4 * D * H * lay.stats["causal_pairs"]
        res["shapes"][s] = {"heads": H, "kv_heads": K, "head_dim": D, "real_gflop": round(flops / 1e9, 2),
                            "flex_tiles": flex_tiles(ctxs[s]), "variants": {}}
    # a first (the reference), then tier 0 of every shape, then tier 1 (the b variants) on the first shape; on the
    # other shapes only the --b-others fastest correct ones of the first (appended once the first shape is done)
    order = [(s, "a") for s in shapes]
    order += [(s, v) for s in shapes for v in variants if v != "a" and VARIANTS[v][0] == 0]
    tier1 = [v for v in variants if v != "a" and VARIANTS[v][0] == 1]
    order += [(shapes[0], v) for v in tier1]
    first_done = len(order)
    i = 0
    while True:
        if i == first_done and len(shapes) > 1:
            done = res["shapes"][shapes[0]]["variants"]
            best = sorted((v for v in tier1 if done.get(v, {}).get("ok")), key=lambda v: done[v]["ms"])
            order += [(s, v) for s in shapes[1:] for v in best[:a.b_others]]
        if i == len(order):
            break
        s, name = order[i]
        i += 1
        ctx, rec = ctxs[s], {"what": VARIANTS[name][2]}
        res["shapes"][s]["variants"][name] = rec
        if time.time() - T0 > a.deadline:
            rec["skipped"] = f"deadline ({a.deadline:.0f} s)"
            continue
        if cpu and any(x in name for x in CUDA_ONLY_LABELS):
            rec["skipped"] = "CUDA only"
            continue
        if name != "a" and s not in refs:
            rec["skipped"] = "no reference (a failed)"
            continue
        t_start = time.time()
        try:
            with torch.no_grad():
                run, to_packed, info = VARIANTS[name][1](ctx)
                rec.update(info)
                timing, out = time_layer(run, reps, warmup, dev)
                rec.update(timing)
                packed = to_packed(out)
                del out
                if name == "a":
                    refs[s] = packed
                    rec.update(max_abs_err=0.0, rel_rms_err=0.0, out_of_tol=0, ok=True)
                else:
                    rec.update(compare(packed, refs[s], real, dtype))
                del packed
            base = res["shapes"][s]["variants"]["a"].get("ms")
            if base:
                rec["speedup_vs_a"] = round(base / rec["ms"], 3)
            rec["tflops"] = round(res["shapes"][s]["real_gflop"] / rec["ms"], 1)
        except Skipped as e:
            rec["skipped"] = str(e)
        except Exception as e:  # a kernel this build or GPU refuses (no GQA in cuDNN ragged, smem): say so, go on
            rec["error"] = error_text(e)
        rec["wall_s"] = round(time.time() - t_start, 1)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        state = rec.get("error") or rec.get("skipped") or \
            f"{rec['ms']:.3f} ms, {rec.get('speedup_vs_a', 1.0):.2f}x, ok={rec['ok']}"
        print(f"[{time.time() - T0:.0f}s] {s} {name}: {state} ({rec['wall_s']} s)", flush=True)
        save()

    print(f"\n{env['device']}, torch {env['torch']}, triton {env.get('triton', '-')}, cudnn {env.get('cudnn', '-')}, "
          f"{env['dtype']}; {lay.stats['rows']} rows x {lay.T} tokens, {lay.stats['docs']} documents, "
          f"{lay.stats['real_tokens']:,} real tokens; build ms/row (host/total): "
          + ", ".join(f"{k} {v['host_ms']}/{v['total_ms']}" for k, v in res["build_ms"].items()))
    for s, S in res["shapes"].items():
        print(f"\n{s}: {S['heads']} q heads, {S['kv_heads']} KV heads, head_dim {S['head_dim']}; "
              f"{S['real_gflop']} GFLOP of real causal work a layer; flex tiles over real pairs "
              f"{S['flex_tiles']['tile_pairs_over_real']}")
        n = LAYERS[s]
        print(f"{'variant':<32} {'ms/layer':>9} {'min':>8} {'issue':>8} {f'x{n} layers':>10} {'vs a':>6} "
              f"{'TFLOP/s':>7} {'max err':>8} {'rel rms':>9} {'ok':>3}")
        for name, r in S["variants"].items():
            if "ms" not in r:
                print(f"{name:<32} {(r.get('error') or r.get('skipped', ''))[:100]}")
                continue
            print(f"{name:<32} {r['ms']:>9.3f} {r['min_ms']:>8.3f} {r['host_issue_ms']:>8.2f} {r['ms'] * n:>10.1f} "
                  f"{r.get('speedup_vs_a', 1.0):>5.2f}x {r['tflops']:>7.1f} {r['max_abs_err']:>8.4f} "
                  f"{r['rel_rms_err']:>9.2e} {'yes' if r['ok'] else 'NO':>3}")
    save()
    print(f"\nJSON: {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
