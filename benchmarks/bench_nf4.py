"""NF4 kernels side by side (issue 23: "choose the kernel path by measurement"): shardfit's own NF4 (adapters/nf4.py,
eager, under torch.compile and through its Triton kernel, kernels/nf4_dequant.py: what QLoRA runs on CUDA) against
bitsandbytes 4-bit (what HF + PEFT QLoRA runs), and torchao's NF4Tensor when it imports, on the Llama-3-70B linear
shapes. The Triton kernel is also timed at a few launch shapes (shardfit_triton_sweep: tile blocks x warps; the
default is tile64_w4), each checked bit for bit against the eager dequantisation.

For each weight [out, in]: the time to dequantise it whole to bf16 (what a QLoRA layer does in forward, in the
recompute and in backward), as effective GB/s of bf16 written; and the frozen layer's forward y = x W^T at
x [T, in] (T = --tokens), against the bf16 matmul alone. Accuracy: each format's mean |w - deq(w)| / mean |w| on the
same random weight (normal, std 0.02), so a faster kernel cannot hide a coarser format. CUDA events, the median of
--reps after --warmup; one JSON line at the end (and --out).

  python benchmarks/bench_nf4.py --out nf4.json            # on the GPU (bitsandbytes from the carried wheel)
  python benchmarks/bench_nf4.py --device cpu --tokens 64 --shapes 256x512 --reps 2   # CPU check (ours only)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shardfit.adapters import nf4  # noqa: E402

SHAPES_70B = ["8192x8192", "1024x8192", "28672x8192", "8192x28672"]  # q/o, k/v, gate/up, down: [out, in]


def timed(fn, device: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of fn()."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def packed(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """shardfit's NF4 storage of w (codes, absmax, stats)."""
    return nf4.quantize(nf4.pad_to_groups(w.reshape(-1), nf4.n_groups(w.numel())))


def ours(w: torch.Tensor, parts: tuple[torch.Tensor, ...], compiled: bool):
    """(dequantise(), reference) for shardfit's NF4 of w: PyTorch ops, eager or compiled."""
    out, inn = w.shape

    def deq():
        return nf4.dequantize(*parts, torch.bfloat16)[:out * inn].view(out, inn)

    fn = torch.compile(deq) if compiled else deq
    return fn, deq()


TRITON_LAUNCHES = [(32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]  # (tile blocks, warps)


def triton_kernel(w: torch.Tensor, parts: tuple[torch.Tensor, ...], tile_blocks: int | None = None,
                  num_warps: int | None = None):
    """dequantise() for shardfit's NF4 of w through the Triton kernel (nf4.dequantize_kernel, as QLoRA calls it; or
    the kernel itself at another launch shape)."""
    from shardfit.kernels.nf4_dequant import nf4_dequant

    out, inn = w.shape
    if not nf4.kernel_dequantizes(parts[0], torch.bfloat16):
        raise RuntimeError("the Triton kernel runs on CUDA with Triton only")
    if tile_blocks is None:
        return lambda: nf4.dequantize_kernel(*parts, out * inn, torch.bfloat16).view(out, inn)
    codes, absmax, stats = nf4.stored(*parts)
    levels = torch.tensor(nf4.NF4_LEVELS, device=w.device)
    return lambda: nf4_dequant(codes, absmax, stats.view(torch.float32), levels, out * inn, torch.bfloat16,
                               tile_blocks=tile_blocks, num_warps=num_warps).view(out, inn)


def bnb_kernels(w: torch.Tensor):
    """(dequantise(), matmul(x), deq(w)) for bitsandbytes NF4 with double quantisation, as BitsAndBytesConfig
    (load_in_4bit, bnb_4bit_quant_type=nf4, bnb_4bit_use_double_quant=True) stores a Linear4bit weight."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    packed, state = F.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4",
                                    quant_storage=torch.uint8)

    def deq():
        return F.dequantize_4bit(packed, state)

    def mm(x):
        return bnb.matmul_4bit(x, packed.t(), quant_state=state)

    return deq, mm, deq()


def torchao_kernels(w: torch.Tensor):
    from torchao.dtypes.nf4tensor import to_nf4

    t = to_nf4(w, block_size=64, scaler_block_size=256)

    def deq():
        return t.get_original_weight()

    def mm(x):
        return torch.nn.functional.linear(x, t)

    return deq, mm, deq()


def skipped(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def measure(shape: str, a, dev: torch.device) -> dict:
    out, inn = map(int, shape.split("x"))
    g = torch.Generator(device=dev).manual_seed(0)
    w = (torch.randn(out, inn, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(a.tokens, inn, device=dev, generator=g, dtype=torch.bfloat16)
    scale = w.float().abs().mean()
    row = {"shape": shape, "bf16_mm_ms": timed(lambda: x @ w.t(), dev, a.reps, a.warmup)}
    kernels = {}
    parts = packed(w)
    for name, compiled in (("shardfit_eager", False), ("shardfit_compiled", True)):
        deq, ref = ours(w, parts, compiled)
        kernels[name] = (deq, (lambda x, deq=deq: x @ deq().t()), ref)
    eager_ref = kernels["shardfit_eager"][2]
    try:
        deq = triton_kernel(w, parts)
        kernels["shardfit_triton"] = (deq, (lambda x, deq=deq: x @ deq().t()), deq())
        row["shardfit_triton_exact"] = bool(torch.equal(kernels["shardfit_triton"][2], eager_ref))
    except Exception as e:  # no CUDA or no Triton here: said, not fatal
        row["shardfit_triton_skipped"] = skipped(e)
    if "shardfit_triton" in kernels:
        sweep, exact = {}, True
        for tile, warps in TRITON_LAUNCHES:
            try:
                fn = triton_kernel(w, parts, tile, warps)
                exact = exact and bool(torch.equal(fn(), eager_ref))
                sweep[f"tile{tile}_w{warps}"] = round(timed(fn, dev, a.reps, a.warmup), 4)
            except Exception as e:  # a launch shape this Triton does not build: said, the others go on
                sweep[f"tile{tile}_w{warps}"] = skipped(e)
        row["shardfit_triton_sweep"], row["shardfit_triton_sweep_exact"] = sweep, exact
        print(f"{shape}: Triton launches (dequantise ms): {sweep}, all exact: {exact}", flush=True)
    for name, make in (("bitsandbytes", bnb_kernels), ("torchao", torchao_kernels)):
        try:
            kernels[name] = make(w)
        except Exception as e:  # not installed here, or no kernel for this device: said, not fatal
            row[f"{name}_skipped"] = skipped(e)
    for name, (deq, mm, ref) in kernels.items():
        ms = timed(deq, dev, a.reps, a.warmup)
        row[name] = {"dequant_ms": round(ms, 4), "dequant_gbps": round(w.numel() * 2 / ms / 1e6, 1),
                     "linear_ms": round(timed(lambda mm=mm: mm(x), dev, a.reps, a.warmup), 4),
                     "rel_error": round(float((w.float() - ref.float()).abs().mean() / scale), 5)}
    if "shardfit_triton" in row and "bitsandbytes" in row:  # > 1: the Triton kernel dequantises faster
        ours_ms, bnb_ms = row["shardfit_triton"]["dequant_ms"], row["bitsandbytes"]["dequant_ms"]
        row["triton_vs_bnb_dequant"] = round(bnb_ms / ours_ms, 3)
    return row


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=SHAPES_70B)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device(a.device)
    rows = []
    for shape in a.shapes:
        rows.append(measure(shape, a, dev))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    names = [k for k in ("shardfit_eager", "shardfit_compiled", "shardfit_triton", "bitsandbytes", "torchao")
             if k in rows[0]]
    print(f"{'shape':>12} {'bf16 mm':>8} " + " ".join(f"{n[:17]:>26}" for n in names))
    print(f"{'':>12} {'ms':>8} " + " ".join(f"{'deq ms / linear ms / err':>26}" for _ in names))
    for r in rows:
        cells = [f"{r[n]['dequant_ms']:7.3f} / {r[n]['linear_ms']:7.3f} / {r[n]['rel_error']:.4f}" for n in names]
        print(f"{r['shape']:>12} {r['bf16_mm_ms']:8.3f} " + " ".join(f"{c:>26}" for c in cells))
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "tokens": a.tokens,
              "torch": torch.__version__, "triton": triton_version(), "rows": rows}
    line = json.dumps(result)
    if a.out:
        Path(a.out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
