"""The MoE combine alone (models/moe.py MoE.combine: the experts' rows [T*k, H] back to token order, weighted by
the router and summed per token, plus the block's residual add), compiled as the block compiles it: today's
weighted_slot_sum (k terms) against the reduction over the k slots it replaced, forward without gradients (a log-prob
recompute) and forward + backward. One micro-batch of the RL benchmark's MoE rows: T = 17,408 tokens, k = 8, H = 2,048,
bf16. Effective GB/s counts the bytes each must move at least: forward reads ys and x and writes out; backward
reads the gradient and ys (for the weights' gradient) and writes ys' gradient and the weights'.

  python benchmarks/bench_moe_combine.py --out combine.json      # GPU
  python benchmarks/bench_moe_combine.py --device cpu --tokens 256 --hidden 64 --reps 2   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shardfit.models.moe import inverse_permutation, permute_rows, weighted_slot_sum  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nf4 import timed  # noqa: E402  (CUDA events, the median of reps after warmup)


def reduction_over_slots(x, ys, order, inverse, weights):
    """The combine before: a sum over dim 1 (Inductor: a persistent reduction of k = 8 per output element)."""
    T, k = weights.shape
    out = permute_rows(ys, inverse, order)
    return x + (out.view(T, k, -1) * weights[..., None]).sum(dim=1)


def slot_terms(x, ys, order, inverse, weights):
    T, k = weights.shape
    return x + weighted_slot_sum(permute_rows(ys, inverse, order).view(T, k, -1), weights)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=17408)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    dev = torch.device(a.device)
    dt = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    T, k, H = a.tokens, a.k, a.hidden
    ids = torch.randint(0, a.experts, (T * k,), generator=g).to(dev)
    order = torch.argsort(ids, stable=True)
    inverse = inverse_permutation(order)
    ys = torch.randn(T * k, H, generator=g).to(dev, dt)
    x = torch.randn(T, H, generator=g).to(dev, dt)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(dev, dt)
    gout = torch.randn(T, H, generator=g).to(dev, dt)
    el = ys.element_size()
    fwd_bytes = (T * k * H + 2 * T * H) * el
    bwd_bytes = (2 * T * k * H + T * H) * el + T * k * el
    res = {"shape": {"T": T, "k": k, "H": H}, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    ref = None
    for name, fn in (("reduction_over_slots", reduction_over_slots), ("slot_terms", slot_terms)):
        f = torch.compile(fn)
        with torch.no_grad():
            out = f(x, ys, order, inverse, weights)
            ms = timed(lambda f=f: f(x, ys, order, inverse, weights), dev, a.reps, a.warmup)
        yg, wg = ys.detach().requires_grad_(), weights.detach().requires_grad_()

        def step(f=f, yg=yg, wg=wg):
            f(x, yg, order, inverse, wg).backward(gout)

        ms_b = timed(step, dev, a.reps, a.warmup)
        exact = out.float()
        if ref is None:
            ref = exact
        res[name] = {"fwd_ms": round(ms, 3), "fwd_GBps": round(fwd_bytes / ms / 1e6, 1), "fwd_bwd_ms": round(ms_b, 3),
                     "fwd_bwd_GBps": round((fwd_bytes + bwd_bytes) / ms_b / 1e6, 1),
                     "max_abs_vs_first": float((exact - ref).abs().max())}
    res["fwd_speedup"] = round(res["reduction_over_slots"]["fwd_ms"] / res["slot_terms"]["fwd_ms"], 3)
    res["fwd_bwd_speedup"] = round(res["reduction_over_slots"]["fwd_bwd_ms"] / res["slot_terms"]["fwd_bwd_ms"], 3)
    print(json.dumps(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
