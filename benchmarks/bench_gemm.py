"""The matmul ceiling of one training step: the step's GEMMs timed alone, on one GPU, with nothing else running.

  python benchmarks/bench_gemm.py [--model llama3-8b] [--tokens 16384] [--out FILE.json]
  torchrun --nproc_per_node 2 benchmarks/bench_gemm.py --comm   # also while NCCL all-gathers on a side stream

The profile of a compiled Llama-3-8B step (benchmarks/notes/2026-11-22_s3.md) put the matmuls at 75% of the step and
~652 TFLOP/s. Whether that is the GPU's ceiling for these shapes or something in the step slows them (NCCL kernels
taking multiprocessors, clocks under sustained load) decides where the rest of the 1.2x target can come from. Each
linear layer of a block contributes three GEMMs per micro-batch (forward x @ W^T, input gradient g @ W, weight
gradient g^T @ x); the output head runs them per loss chunk. Timings are CUDA events around many repetitions; the
"step" figure runs every GEMM of one step in order, back to back for several seconds (clocks under sustained load),
and is what to hold against the profile's matmul time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from shardfit.config.schema import PRESETS  # noqa: E402


def linears(p: dict, fused: bool) -> list[tuple[str, int, int]]:
    """(name, in, out) of one block's linear layers; fused: q/k/v as one, gate/up as one."""
    d, f = p["dim"], p["ffn_dim"]
    kv = p["n_kv_heads"] * d // p["n_heads"]
    attn = [("qkv", d, d + 2 * kv)] if fused else [("q", d, d), ("k", d, kv), ("v", d, kv)]
    mlp = [("gate_up", d, 2 * f)] if fused else [("gate", d, f), ("up", d, f)]
    return [*attn, ("o", d, d), *mlp, ("down", f, d)]


def gemm_ops(m: int, k: int, n: int, dev) -> list[tuple[str, float, callable]]:
    """The three GEMMs of a linear layer on m tokens: (kind, FLOPs, thunk)."""
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    g = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    fl = 2.0 * m * k * n
    return [("fwd", fl, lambda: F.linear(x, w)),          # [m, k] @ [k, n]
            ("dgrad", fl, lambda: g.mm(w)),               # [m, n] @ [n, k]
            ("wgrad", fl, lambda: g.t().mm(x))]           # [n, m] @ [m, k]


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def measure(p: dict, tokens: int, chunk: int, fused: bool, dev) -> dict:
    rows, step_ops = [], []
    for name, k, n in linears(p, fused):
        for kind, fl, fn in gemm_ops(tokens, k, n, dev):
            ms = time_ms(fn, 20)
            rows.append({"op": f"{name}.{kind}", "m": tokens, "k": k, "n": n, "ms": round(ms, 3),
                         "tflops": round(fl / ms / 1e9, 1)})
            step_ops += [(fn, fl)] * p["n_layers"]
    for kind, fl, fn in gemm_ops(chunk, p["dim"], p["vocab_size"], dev):  # the output head, per loss chunk
        ms = time_ms(fn, 20)
        rows.append({"op": f"head.{kind}", "m": chunk, "k": p["dim"], "n": p["vocab_size"], "ms": round(ms, 3),
                     "tflops": round(fl / ms / 1e9, 1)})
        step_ops += [(fn, fl)] * (tokens // chunk)
    flops = sum(fl for _, fl in step_ops)
    sum_ms = sum(r["ms"] * (p["n_layers"] if not r["op"].startswith("head") else tokens // chunk) for r in rows)
    # the whole step's GEMMs back to back, repeated for ~4 s, the last repetitions timed (sustained clocks)
    t_end, reps = time.time() + 4.0, []
    while time.time() < t_end or len(reps) < 3:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for fn, _ in step_ops:
            fn()
        b.record()
        torch.cuda.synchronize()
        reps.append(a.elapsed_time(b))
    step_ms = min(reps[-3:])
    return {"fused": fused, "rows": rows, "step_tflop": round(flops / 1e12, 1), "sum_of_ops_ms": round(sum_ms, 1),
            "step_sustained_ms": round(step_ms, 1), "step_tflops": round(flops / step_ms / 1e9, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch per GPU (mbs x seq)")
    ap.add_argument("--chunk", type=int, default=1024, help="loss chunk (output-head rows per GEMM)")
    ap.add_argument("--comm", action="store_true", help="all-gather a block's bf16 parameters in a loop on a side "
                                                        "stream while timing (run under torchrun, >= 2 ranks)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    p = {**PRESETS["tiny"], **PRESETS[a.model]}
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    stop, side = None, None
    if a.comm:
        import threading

        import torch.distributed as dist
        dist.init_process_group("nccl", device_id=dev)
        block = sum(k * n for _, k, n in linears(p, False))   # a block's parameters, all-gathered as bf16
        shard = torch.empty(block // dist.get_world_size(), device=dev, dtype=torch.bfloat16)
        full = torch.empty(block, device=dev, dtype=torch.bfloat16)
        stream, stop = torch.cuda.Stream(), threading.Event()

        def loop():  # lock-step over ranks: each round all-gathers, then agrees (max) on whether to stop
            torch.cuda.set_device(dev)
            flag = torch.zeros(1, device=dev)
            with torch.cuda.stream(stream):
                while True:
                    dist.all_gather_into_tensor(full, shard)
                    flag.fill_(float(stop.is_set()))
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                    if flag.item():
                        break
        side = threading.Thread(target=loop, daemon=True)
        side.start()
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "model": a.model, "tokens": a.tokens,
           "comm": a.comm, "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
           "runs": [measure(p, a.tokens, a.chunk, fused, dev) for fused in (False, True)]}
    if stop is not None:
        stop.set()
        side.join()
    if int(os.environ.get("RANK", 0)) == 0:
        for r in res["runs"]:
            print(f"{'fused' if r['fused'] else 'separate'} q/k/v and gate/up, {a.tokens} tokens"
                  f"{' (NCCL all-gather running)' if a.comm else ''}: step GEMMs {r['step_tflop']} TFLOP, "
                  f"sustained {r['step_sustained_ms']} ms = {r['step_tflops']} TFLOP/s (sum of ops "
                  f"{r['sum_of_ops_ms']} ms)")
            print("  " + ", ".join(f"{x['op']} {x['tflops']:.0f}" for x in r["rows"]))
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
    if a.comm:
        import torch.distributed as dist
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
