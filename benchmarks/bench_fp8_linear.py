"""The FP8 base's matmul (adapters/fp8_base.py) against its parts and the bf16 matmul, one GPU, the Llama-3-8B MLP
shape (M tokens x K=4096 -> N=14336, and the input gradient back): where its time goes.

  python benchmarks/bench_fp8_linear.py --tokens 16384 --out OUT.json

Rows (ms, median of --reps after warm-up, CUDA events): bf16 forward (x W^T) and input gradient (dY W); the FP8
base's forward (shardfit::fp8_linear: the per-token quantiser, then _scaled_mm rowwise) and its input gradient (the
quantiser of dY s_w, the codes transposed, _scaled_mm); the parts alone: the quantisers (the Triton kernel of
kernels/fp8_rows.py the operator uses, and the compiled torch function it replaced), rowwise and tensorwise
_scaled_mm on ready operands, the transposed copy of the codes (the kernel, and the eager copy it replaced).
Prints one JSON line a row and a table. Attention's shape: --n 4096.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import torch
    from bench_nf4 import timed  # median CUDA-event milliseconds after a warm-up

    from shardfit.adapters.fp8_base import (
        E4M3,
        FP8Linear,
        fp8_linear,
        fp8_linear_input_grad,
        quantize_rows_fp8,
    )
    from shardfit.adapters.quantized import to_dtype, to_quantized
    from shardfit.kernels.fp8_rows import quantize_rows, transpose_bytes
    from shardfit.models.loss import compiled_once

    quantiser = compiled_once(quantize_rows_fp8, dynamic=True)  # the path before the kernel (and without Triton)

    def compiled(t, col_scale):
        with torch.no_grad():
            return quantiser(t, col_scale)

    dev = torch.device("cuda")
    m, k, n = a.tokens, a.k, a.n
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    w = lin.weight.detach().clone()
    layer = to_dtype(to_quantized(lin, FP8Linear), torch.bfloat16)
    codes, scale = layer.weight_fp8, layer.weight_scale
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    wq = codes.view(E4M3).view(n, k)
    sw = scale.view(torch.float32).view(n)
    xq, xs = quantize_rows_fp8(x)
    ones = torch.ones(1, n, device=dev)
    one = torch.ones((), device=dev)
    flops = 2 * m * k * n
    rows = {
        "bf16 forward": lambda: x @ w.t(),
        "bf16 input grad": lambda: dy @ w,
        "fp8 base forward": lambda: fp8_linear(x, codes, scale, n, k),
        "fp8 base input grad": lambda: fp8_linear_input_grad(dy, codes, scale, n, k),
        "quantiser of x (compiled)": lambda: compiled(x, None),
        "quantiser of dY s_w (compiled)": lambda: compiled(dy, sw),
        "quantiser of x (kernel)": lambda: quantize_rows(x),
        "quantiser of dY s_w (kernel)": lambda: quantize_rows(dy, sw),
        "scaled_mm rowwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=sw.view(1, -1),
                                                      out_dtype=torch.bfloat16),
        "scaled_mm tensorwise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                         out_dtype=torch.bfloat16),
        "scaled_mm rowwise, fast accum": lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ones,
                                                                  out_dtype=torch.bfloat16, use_fast_accum=True),
        "codes transposed (eager copy)": lambda: wq.t().contiguous(),
        "codes transposed (kernel)": lambda: transpose_bytes(wq),
    }
    out = []
    for name, fn in rows.items():
        try:
            ms = timed(fn, dev, a.reps, warmup=3)
            row = {"what": name, "ms": round(ms, 4)}
            if "quantiser" not in name and "copy" not in name:
                row["TFLOPs"] = round(flops / ms / 1e9, 1)
        except Exception as e:  # noqa: BLE001 - a part that does not run here is said, the rest measured
            row = {"what": name, "error": f"{type(e).__name__}: {e}"[:200]}
        out.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'what':34} {'ms':>8} {'TFLOP/s':>8}")
    for r in out:
        print(f"{r['what']:34} {r.get('ms', float('nan')):8.3f} {r.get('TFLOPs', ''):>8}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "tokens": m, "k": k, "n": n, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
