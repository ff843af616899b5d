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

`qk_rope` is the attention's whole positional step for q and k in ONE launch (models/decoder.py's norm_rope): with
Qwen3's per-head RMSNorm before it (q_norm, k_norm: two norms and two RoPEs, four launches with `rms_norm` and
`rope`, ~20 torch ops) or without (Llama: two RoPEs). One program a token: its q heads [H, Dh] and k heads [K, Dh]
read once, each head's mean square in fp32, the normed head cast to the dtype and weighted as kernels/rms_norm.py
does (the norm's numbers, its reduction order aside), then rotated as above, written once.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import combine_fns, runs_on, triton_kernels


@triton_kernels
def _qk_kernel(triton, tl):
    """{"qk": qk_rope's kernel, "rope": rope's}, both around one per-head helper (norm, then rotation), made a module
    global (triton resolves a kernel's callees there; kernels/triton_common.py says why the reduction is a made
    combine function)."""
    fns = combine_fns()
    globals().update(_rope_add=fns["add"])

    @triton.jit
    def _heads(x_ptr, w_ptr, out_ptr, t, n, stride_xt, stride_xh, stride_ot, stride_oh, c1, c2, s1, s2, eps,
               NP: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        # token t's n heads [n, 2 HALF] of x (stride_xt, stride_xh) -> out (stride_ot, stride_oh), x's dtype
        h = tl.arange(0, NP)
        d = tl.arange(0, HALF)
        ok = (h < n)[:, None]
        at = x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :]
        x1 = tl.load(at, mask=ok, other=0.0)  # [NP, HALF]
        x2 = tl.load(at + HALF, mask=ok, other=0.0)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        if NORM:  # RMSNorm of each head: fp32, cast to the dtype, times the weight (kernels/rms_norm.py's roundings)
            ms = (tl.reduce(f1 * f1, 1, _rope_add) + tl.reduce(f2 * f2, 1, _rope_add)) / (2 * HALF)  # noqa: F821
            r = tl.rsqrt(ms + eps)[:, None]
            w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
            f1 = (w1 * (f1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            f2 = (w2 * (f2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        o1 = (f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)
        o2 = (f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)
        out = out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :]
        tl.store(out, o1.to(dt), mask=ok)
        tl.store(out + HALF, o2.to(dt), mask=ok)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF: tl.constexpr):
        # token t's cos and sin [2 HALF] (stride_ct) as fp32 halves [1, HALF]: (c1, c2, s1, s2)
        d = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + t * stride_ct + d).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + t * stride_ct + HALF + d).to(tl.float32)[None, :]
        return c1, c2, s1, s2

    globals().update(_rope_heads=_heads, _rope_cos_sin=_cos_sin)

    @triton.jit
    def qk_rope_kernel(q_ptr, k_ptr, wq_ptr, wk_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, H, K, stride_qt, stride_qh,
                       stride_kt, stride_kh, stride_ct, stride_qot, stride_qoh, stride_kot, stride_koh, eps,
                       HP: tl.constexpr, KP: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c1, c2, s1, s2 = _rope_cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF)  # noqa: F821
        _rope_heads(q_ptr, wq_ptr, qo_ptr, t, H, stride_qt, stride_qh, stride_qot, stride_qoh,  # noqa: F821
                    c1, c2, s1, s2, eps, HP, HALF, NORM)
        _rope_heads(k_ptr, wk_ptr, ko_ptr, t, K, stride_kt, stride_kh, stride_kot, stride_koh,  # noqa: F821
                    c1, c2, s1, s2, eps, KP, HALF, NORM)

    @triton.jit
    def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                    HP: tl.constexpr, HALF: tl.constexpr):
        # rope: token t's H heads of x rotated, no norm (the helper's NORM=False; x_ptr stands for the unread weight)
        t = tl.program_id(0).to(tl.int64)
        c1, c2, s1, s2 = _rope_cos_sin(cos_ptr, sin_ptr, t, stride_ct, HALF)  # noqa: F821
        _rope_heads(x_ptr, x_ptr, out_ptr, t, H, stride_xt, stride_xh, stride_ot, stride_oh,  # noqa: F821
                    c1, c2, s1, s2, 0.0, HP, HALF, False)

    return {"qk": qk_rope_kernel, "rope": rope_kernel}


def _kernel(name: str):
    """One of rope.py's kernels (None without Triton)."""
    kernels = _qk_kernel()
    return None if kernels is None else kernels[name]


def available(t: torch.Tensor) -> bool:
    """Whether rope and qk_rope run on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _qk_kernel)


def fits(head_dim: int) -> bool:
    """Whether the kernel takes this head size: each half a power of two (tl.arange's lengths), at least 2."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 2 and not half & (half - 1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope(x, cos, sin) (models/decoder.py) in one launch: x [B, S, H, Dh], cos/sin [B, S, Dh] of x's dtype ->
    [B, S, H, Dh] in x's dtype. No autograd: for decoding under no_grad."""
    kernel = _kernel("rope")
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
                         HP=_pow2(H), HALF=Dh // 2)
    return out.view(B, S, H, Dh)


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, S, n, Dh] -> [B*S, n, Dh] (a view for the projections' outputs decoding makes), Dh contiguous."""
    B, S, n, Dh = x.shape
    xt = x.reshape(B * S, n, Dh)
    return xt if xt.stride(-1) == 1 else xt.contiguous()


def qk_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
            eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """models/decoder.py's norm_rope in one launch: q [B, S, H, Dh] and k [B, S, K, Dh] each normed per head
    (RMSNorm with q_weight / k_weight [Dh] and eps; both None: no norm) then rotated by cos/sin [B, S, Dh] ->
    (q, k) in their dtype. The weights must be of q's dtype (the decode model's: its norms' products then round to
    it, as the module's do). No autograd: for decoding under no_grad."""
    kernel = _kernel("qk")
    if kernel is None:
        raise RuntimeError("qk_rope needs Triton (models/decoder.py's norm_rope is the same function in PyTorch)")
    B, S, H, Dh = q.shape
    K = k.shape[2]
    norm = q_weight is not None
    if not fits(Dh) or k.dtype != q.dtype or (norm and (q_weight.dtype != q.dtype or k_weight.dtype != q.dtype)):
        raise ValueError(f"qk_rope: head size {Dh}, q {q.dtype}, k {k.dtype}, weights "
                         f"{None if not norm else (q_weight.dtype, k_weight.dtype)}: not taken (the caller keeps "
                         "norm_rope)")
    qt, kt = _tokens(q), _tokens(k)
    c = cos.expand(B, S, Dh).reshape(B * S, Dh)
    s = sin.expand(B, S, Dh).reshape(B * S, Dh)
    if c.stride(-1) != 1 or s.stride() != c.stride():
        c, s = c.contiguous(), s.contiguous()
    qo = torch.empty(B * S, H, Dh, dtype=q.dtype, device=q.device)
    ko = torch.empty(B * S, K, Dh, dtype=k.dtype, device=k.device)
    wq = q_weight if norm else qo  # unread without the norm (NORM is a constant of the kernel)
    wk = k_weight if norm else ko
    if B * S:
        kernel[(B * S,)](qt, kt, wq, wk, c, s, qo, ko, H, K, qt.stride(0), qt.stride(1), kt.stride(0), kt.stride(1),
                         c.stride(0), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), eps,
                         HP=_pow2(H), KP=_pow2(K), HALF=Dh // 2, NORM=norm)
    return qo.view(B, S, H, Dh), ko.view(B, S, K, Dh)
