"""RMSNorm's forward in one Triton kernel, for decoding (no autograd): models/decoder.py's RMSNorm is seven torch ops
(the fp32 cast, the square, the mean, + eps, rsqrt, the product, the cast back and the weight's product).

Why: a decode step's tensors are tiny (B rows x 4,096 at most), so each op is a launch of a few microseconds whatever
its bytes, and a Qwen3 block holds four norms (input, post-attention, the q and k heads'): ~28 kernels a layer, about
a thousand a step at 36 layers, a sizeable share of a step whose weights take ~5 ms to read (the profile in
benchmarks/README.md). One program a row: the row read once, the mean of squares in fp32, the row written once in
the input's dtype, times the weight, as the torch ops round it: the normalised row cast to the input's dtype, then
its product with the weight rounded to their common dtype (`rms_norm`).

Shapes: x [..., D] (rows are everything but the last dim; D contiguous), weight [D]. Without Triton `available` is
False and the caller keeps the torch ops.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import combine_fns, runs_on, triton_kernels


@triton_kernels
def _triton_kernel(triton, tl):
    fns = combine_fns()  # kernels/triton_common.py: why not tl.sum
    globals().update(_rms_add=fns["add"])

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_x, stride_o, eps, BLOCK: tl.constexpr):
        # x [rows, D] (stride_x), out [rows, D] (stride_o) in x's dtype; w [D] in its own dtype
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK)
        ok = d < D
        x = tl.load(x_ptr + r * stride_x + d, mask=ok, other=0.0).to(tl.float32)
        ms = tl.reduce(x * x, 0, _rms_add) / D  # noqa: F821 (made by the factory)
        y = (x * tl.rsqrt(ms + eps)).to(x_ptr.dtype.element_ty)  # torch: x * rsqrt(...), cast back to x's dtype
        w = tl.load(w_ptr + d, mask=ok, other=0.0)
        out = (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty)  # weight x (the cast row)
        tl.store(out_ptr + r * stride_o + d, out, mask=ok)

    return rms_norm_kernel


def available(t: torch.Tensor) -> bool:
    """Whether rms_norm runs on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), in fp32 and cast to x's dtype before the weight's product (as
    models/decoder.py's RMSNorm with a weight of x's dtype). No autograd: for decoding under no_grad."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("rms_norm needs Triton (models/decoder.py's RMSNorm is the same function in PyTorch)")
    D = x.shape[-1]
    rows = x.reshape(-1, D)  # a view for the layouts decoding makes (contiguous last dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        kernel[(rows.shape[0],)](rows, weight, out, D, rows.stride(0), out.stride(0), eps,
                                 BLOCK=max(16, 1 << (D - 1).bit_length()))
    return out.view(x.shape)
