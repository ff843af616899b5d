"""SwiGLU's elementwise part, silu(gate) * up, in one Triton kernel, for decoding (no autograd): models/decoder.py's
MLP runs it as two torch ops (F.silu, then the product), a launch each on [B, ffn] tensors of a few hundred KB.

Why: with a decode step captured as CUDA graphs, what is left between the GEMMs is launches of tiny kernels, each a
few microseconds of launch and gap whatever its bytes (benchmarks/README.md, the decode profile); one a layer here
instead of two. One program a block of elements: gate and up read once, the product written once.

The same roundings as the eager form: F.silu rounds its fp32 result to the dtype, the product of two tensors of the
dtype rounds again; the kernel rounds its silu to the dtype before the product in fp32 and rounds that (its exp may
differ from CUDA's by an fp32 ulp: the tests hold it to the dtype's rounding). Shapes: gate and up of one shape and
dtype, any layout with a contiguous last dim (a linear's fresh output). Without Triton `available` is False and the
caller keeps the torch ops.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import runs_on, triton_kernels

BLOCK = 1024  # elements a program: [64 rows, 12,288] at the 8B shape is 768 programs


@triton_kernels
def _triton_kernel(triton, tl):
    @triton.jit
    def silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        g = tl.load(g_ptr + i, mask=ok, other=0.0)
        u = tl.load(u_ptr + i, mask=ok, other=0.0)
        dt = g.dtype
        gf = g.to(tl.float32)
        s = (gf / (1.0 + tl.exp(-gf))).to(dt)  # F.silu, rounded to the dtype
        tl.store(out_ptr + i, (s.to(tl.float32) * u.to(tl.float32)).to(dt), mask=ok)

    return silu_mul_kernel


def available(t: torch.Tensor) -> bool:
    """Whether silu_mul runs on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernel)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up in one launch, in their dtype. No autograd: for decoding under no_grad."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("silu_mul needs Triton (F.silu(gate) * up is the same function in PyTorch)")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    g, u = gate.contiguous(), up.contiguous()  # a linear's fresh outputs already are: no copy
    out = torch.empty_like(g)
    n = g.numel()
    if n:
        kernel[(-(-n // BLOCK),)](g, u, out, n, BLOCK=BLOCK)
    return out


__all__ = ["available", "silu_mul"]
