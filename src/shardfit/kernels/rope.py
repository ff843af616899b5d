"""Rotary position embedding in one Triton kernel, for decoding (no autograd): models/decoder.py's apply_rope is five
torch ops a call (the two halves' concatenation with a negation, two products, the sum), twice a layer (q and k).

Why: as kernels/rms_norm.py says for the norms, a decode step's tensors are tiny and each op is a launch of a few
microseconds: ten launches a layer here, ~360 a step at 36 layers. One program a token: its H heads' rows of Dh read
once, the two halves rotated, written once.

The same numbers as apply_rope's torch ops, rounding included: each op of the eager form rounds to the tensor's
dtype (x * cos, then rotate_half(x) * sin, then their sum), so the kernel rounds its two products to x's dtype before
adding them in fp32 and rounding the sum: bit for bit the eager result (the negation is exact).

Shapes: x [B, S, H, Dh] (Dh contiguous, heads at a fixed stride), cos and sin [B, S, Dh] in x's dtype (the two
halves share frequencies: Hugging Face's layout). Without Triton `available` is False and the caller keeps the
torch ops.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import runs_on, triton_kernels


@triton_kernels
def _triton_kernel(triton, tl):
    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                    HP: tl.constexpr, HALF: tl.constexpr):
        # token t: x [t, H, 2 HALF] (stride_xt, stride_xh; Dh contiguous), cos/sin [t, 2 HALF] (stride_ct),
        # out [t, H, 2 HALF] (stride_ot, stride_oh) in x's dtype
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, HP)
        d = tl.arange(0, HALF)
        ok = (h < H)[:, None]
        at = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(at, mask=ok, other=0.0)  # [HP, HALF] the first half of each head
        x2 = tl.load(at + HALF, mask=ok, other=0.0)
        dt = x1.dtype
        c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * stride_ct + d).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # eager: x * cos (rounded), rotate_half(x) = [-x2, x1] times sin (rounded), the sum (rounded)
        o1 = (f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)
        o2 = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
        out = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(out, o1.to(dt), mask=ok)
        tl.store(out + HALF, o2.to(dt), mask=ok)

    return rope_kernel


def available(t: torch.Tensor) -> bool:
    """Whether rope runs on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernel)


def fits(head_dim: int) -> bool:
    """Whether the kernel takes this head size: each half a power of two (tl.arange's lengths), at least 2."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 2 and not half & (half - 1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(x, cos, sin) (models/decoder.py) in one launch: x [B, S, H, Dh], cos/sin [B, S, Dh] of x's dtype ->
    [B, S, H, Dh] in x's dtype. No autograd: for decoding under no_grad."""
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("rope needs Triton (models/decoder.py's apply_rope is the same function in PyTorch)")
    B, S, H, Dh = x.shape
    if not fits(Dh):
        raise ValueError(f"rope: head size {Dh} is not twice a power of two (the caller keeps apply_rope)")
    xt = x.reshape(B * S, H, Dh)  # a view for the projections' outputs decoding makes
    if xt.stride(-1) != 1:
        xt = xt.contiguous()
    c = cos.expand(B, S, Dh).reshape(B * S, Dh)
    s = sin.expand(B, S, Dh).reshape(B * S, Dh)
    if c.stride(-1) != 1 or s.stride() != c.stride():
        c, s = c.contiguous(), s.contiguous()
    out = torch.empty(B * S, H, Dh, dtype=x.dtype, device=x.device)
    if B * S:
        kernel[(B * S,)](xt, c, s, out, H, xt.stride(0), xt.stride(1), c.stride(0), out.stride(0), out.stride(1),
                         HP=max(2, 1 << (H - 1).bit_length()), HALF=Dh // 2)
    return out.view(B, S, H, Dh)
