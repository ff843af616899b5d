"""out = x * scale, or out += x * scale, in fp32 from a narrower x (bf16): one pass over memory.

Why a kernel: PyTorch's CUDA elementwise ops vectorize only when every operand has the same dtype; a bf16 input with
an fp32 output takes the per-element dynamic-cast path, well below the memory's speed, and accumulating into a kept
gradient adds a second, fp32 pass. For the expert gradients of an EP step (parallel/expert.py, E = W: 302M fp32
elements a layer on 2 ranks of Qwen3-30B-A3B) both are on the step's critical path. This kernel reads x (2 bytes)
and, when accumulating, out (4), and writes out (4) once: 6 or 10 bytes an element at the memory's speed.

On tensors that are not CUDA (the CPU runs, or no Triton) the same arithmetic in PyTorch ops.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_kernel():
    """The Triton kernel, compiled on first use (None without Triton: the CPU wheels do not ship it)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def scaled_accumulate(x_ptr, out_ptr, n, scale, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
        # int64 offsets: one expert weight stack can exceed 2^31 elements (128 experts x 2048 x 768 x 3 is 604M;
        # a larger model's grows past it)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * scale
        if ACCUMULATE:
            y += tl.load(out_ptr + offs, mask=mask)
        tl.store(out_ptr + offs, y, mask=mask)

    return scaled_accumulate


_BLOCK = 4096  # elements a program: 8 warps x 32 threads x 16 (a bf16 load of 32 bytes, two fp32 stores of 32)


def _launch(x: torch.Tensor, out: torch.Tensor, scale: float, accumulate: bool) -> bool:
    if out.shape != x.shape or out.device != x.device:
        raise ValueError(f"out {tuple(out.shape)} on {out.device} must match x {tuple(x.shape)} on {x.device}")
    kernel = _triton_kernel() if x.is_cuda and x.is_contiguous() and out.is_contiguous() else None
    if kernel is None:
        return False
    n = x.numel()
    if n:  # Triton launches on the current device's current stream
        with torch.cuda.device(x.device):
            kernel[(-(-n // _BLOCK),)](x, out, n, scale, ACCUMULATE=accumulate, BLOCK=_BLOCK, num_warps=8)
    return True


def scaled_cast(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new tensor x * scale in `dtype` (fp32), computed in fp32."""
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if dtype != torch.float32 or not _launch(x, out, scale, accumulate=False):
        torch.mul(x.to(dtype), scale, out=out)
    return out


def scaled_accumulate_(out: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """out += x * scale in place (out fp32, the shape of x), computed in fp32."""
    if out.dtype != torch.float32 or not _launch(x, out, scale, accumulate=True):
        out.add_(x.to(out.dtype), alpha=scale)
    return out
