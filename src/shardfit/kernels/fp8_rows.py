"""The FP8 base's two memory-bound helpers (adapters/fp8_base.py) as Triton kernels: the per-row e4m3 quantisation of
activations and gradients, and the transposed copy of a weight's e4m3 codes for the input gradient's matmul.

Why kernels: both sit beside every FP8 base matmul and both are pure memory traffic, yet torch.compile's quantiser
and the eager transposed copy together took back most of what the FP8 GEMM saves over bf16's
(benchmarks/README.md#dpo-s25 measures each part).
- quantize_rows: one program a row. Rows up to ONE_PASS_MAX elements are loaded once into registers (16,384 fp32
  over 16 warps: 32 a thread), their amax reduced there and the same registers scaled and stored: one read of the
  input and one write of the codes (the compiled quantiser reads the input twice, a looped reduction then the
  scaling). Longer rows loop over blocks twice (the second read mostly from L2: a row is <= a few hundred KiB).
  The arithmetic is adapters/fp8_base.quantize_rows_fp8's, bit for bit: f = fp32(t) (x col_scale, fp32),
  amax |f|, scale = amax x fp32(1 / 448) (at least fp32's smallest normal; 1 for a zero row), codes =
  round-to-nearest-even e4m3 of clamp(f / scale, +-448) with an IEEE-rounded division (div_rn: Triton's `/` on
  fp32 is the approximate one). Non-finite values come out as torch's do: every max and min here propagates NaN
  (tl.maximum's default, PTX max.f32, drops it: a NaN became a finite -448 code and a diverging step's NaN
  activations or gradients finite, past the trainer's non-finite check), so a NaN row has scale 1 and NaN codes
  where it has NaNs, an inf row scale inf and NaN codes at its infs.
- transpose_bytes: [R, C] bytes -> [C, R], tiles of 64 x 64 through the kernel's shared memory so that both the
  loads and the stores of a warp are contiguous runs (the eager strided copy stores one byte per 4,096 apart).

Shapes: x [m, k] contiguous in bf16, fp16 or fp32; col_scale [k] fp32 or None; codes out [m, k] float8_e4m3fn and
scales [m, 1] fp32 (what torch._scaled_mm takes as a row-major first operand and its scale_a). Without Triton (the
CPU wheels) `available` is False and the caller keeps its PyTorch path; on the CPU the tests run these under
Triton's interpreter.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import launch_device, runs_on, triton_kernels

ONE_PASS_MAX = 16384  # the longest row held in registers whole (16 warps: 32 fp32 values a thread)
LOOP_BLOCK = 4096  # a longer row's block
TILE = 64  # transpose_bytes: a program's [TILE, TILE] bytes
E4M3_MAX = 448.0
_INV_MAX = 1 / E4M3_MAX  # a kernel's float argument is fp32: the same rounding as the torch path's product
_TINY = torch.finfo(torch.float32).tiny
# the kernels' callees, set by the factory (a kernel resolves them among its module's globals when it compiles or,
# interpreted, when it runs; triton_common.py: why they are made there)
_fp8_max = _fp8_scaled = _fp8_codes = None


@triton_kernels
def _triton_kernels(triton, tl):
    # kernels/triton_common.py: why not tl.max; not its combine_fns()["maximum"] either, which drops NaN

    @triton.jit
    def _nan_max(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    globals().update(_fp8_max=_nan_max)

    @triton.jit
    def _scaled(x_ptr, cs_ptr, d, ok, HAS_COL_SCALE: tl.constexpr):
        f = tl.load(x_ptr + d, mask=ok, other=0.0).to(tl.float32)
        if HAS_COL_SCALE:
            f = f * tl.load(cs_ptr + d, mask=ok, other=0.0)
        return f

    @triton.jit
    def _codes(f, scale, QUOTIENTS: tl.constexpr):
        q = tl.math.div_rn(f, scale)
        q = tl.minimum(tl.maximum(q, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)  # a NaN quotient stays NaN (torch.clamp's)
        return q if QUOTIENTS else q.to(tl.float8e4nv)

    # callees are looked up among the module's globals (compiled and interpreted alike)
    globals().update(_fp8_scaled=_scaled, _fp8_codes=_codes)

    @triton.jit
    def quantize_rows_kernel(x_ptr, cs_ptr, codes_ptr, scale_ptr, K, inv_max, tiny,
                             HAS_COL_SCALE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                             QUOTIENTS: tl.constexpr):
        # x [m, K] contiguous; codes [m, K] e4m3 (QUOTIENTS: fp32, the clamped quotients before the cast); scale [m]
        # fp32; cs [K] fp32 when HAS_COL_SCALE
        row = tl.program_id(0).to(tl.int64)  # int64: m x K may pass 2^31
        x_row, c_row = x_ptr + row * K, codes_ptr + row * K
        d = tl.arange(0, BLOCK)
        if ONE_PASS:  # the row in registers: one read
            ok = d < K
            f = _fp8_scaled(x_row, cs_ptr, d, ok, HAS_COL_SCALE)  # [BLOCK] fp32
            amax = tl.reduce(tl.abs(f), 0, _fp8_max)
        else:
            acc = tl.full([BLOCK], 0.0, tl.float32)  # not tl.zeros: jit-wrapped (triton_common.py: why)
            for start in range(0, K, BLOCK):
                ok = start + d < K
                acc = _fp8_max(acc, tl.abs(_fp8_scaled(x_row + start, cs_ptr + start, d, ok, HAS_COL_SCALE)))
            amax = tl.reduce(acc, 0, _fp8_max)
        scale = tl.where(amax > 0, tl.maximum(amax * inv_max, tiny), 1.0)
        tl.store(scale_ptr + row, scale)
        if ONE_PASS:
            tl.store(c_row + d, _fp8_codes(f, scale, QUOTIENTS), mask=ok)
        else:
            for start in range(0, K, BLOCK):
                ok = start + d < K
                f = _fp8_scaled(x_row + start, cs_ptr + start, d, ok, HAS_COL_SCALE)
                tl.store(c_row + start + d, _fp8_codes(f, scale, QUOTIENTS), mask=ok)

    @triton.jit
    def transpose_bytes_kernel(src_ptr, dst_ptr, R, C, TILE: tl.constexpr):
        # src [R, C] uint8 row-major -> dst [C, R] uint8 row-major
        r = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE] source rows
        c = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE] source columns
        tile = tl.load(src_ptr + r[:, None] * C + c[None, :], mask=(r[:, None] < R) & (c[None, :] < C))
        tl.store(dst_ptr + c[:, None] * R + r[None, :], tl.trans(tile), mask=(c[:, None] < C) & (r[None, :] < R))

    return quantize_rows_kernel, transpose_bytes_kernel


def available(t: torch.Tensor) -> bool:
    """Whether these kernels run on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernels)


def quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None = None, *,
                  quotients: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [m, k] e4m3, scales [m, 1] fp32) of x [m, k] (times col_scale [k] first): quantize_rows_fp8's
    arithmetic in one kernel (module docstring). Launches on the current stream, no host synchronisation.
    quotients: the fp32 values clamp(f / scale) in place of their e4m3 codes, for the tests under Triton's
    interpreter, whose fp32 -> e4m3 cast is not the GPU's (it rounds half up and drops the carry into the exponent:
    127.9 becomes 64, not 128); the cast itself is checked on CUDA."""
    if x.dim() != 2 or not x.is_contiguous() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_rows takes a contiguous 2-D bf16/fp16/fp32 tensor, got {x.dtype} "
                         f"{tuple(x.shape)} with strides {x.stride()}")
    m, k = x.shape
    if col_scale is not None and (col_scale.dtype != torch.float32 or col_scale.numel() != k
                                  or not col_scale.is_contiguous()):
        raise ValueError(f"quantize_rows: col_scale must be {k} contiguous fp32 values, got {col_scale.dtype} "
                         f"{tuple(col_scale.shape)}")
    codes = torch.empty(m, k, dtype=torch.float32 if quotients else torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        one_pass = k <= ONE_PASS_MAX
        block = max(16, 1 << (k - 1).bit_length()) if one_pass else LOOP_BLOCK
        kernel = _triton_kernels()[0]
        with launch_device(x):
            kernel[(m,)](x, x if col_scale is None else col_scale, codes, scales, k, _INV_MAX, _TINY,
                         HAS_COL_SCALE=col_scale is not None, BLOCK=block, ONE_PASS=one_pass, QUOTIENTS=quotients,
                         num_warps=max(1, min(16, block // 1024)))
    return codes, scales


def transpose_bytes(t: torch.Tensor) -> torch.Tensor:
    """t [R, C] of a 1-byte dtype (e4m3 codes, uint8), contiguous, as a new contiguous [C, R] of the same dtype."""
    if t.dim() != 2 or t.element_size() != 1 or not t.is_contiguous():
        raise ValueError(f"transpose_bytes takes a contiguous 2-D tensor of 1-byte elements, got {t.dtype} "
                         f"{tuple(t.shape)}")
    r, c = t.shape
    out = torch.empty(c, r, dtype=t.dtype, device=t.device)
    if r and c:
        kernel = _triton_kernels()[1]
        with launch_device(t):
            kernel[(-(-r // TILE), -(-c // TILE))](t.view(torch.uint8), out.view(torch.uint8), r, c, TILE=TILE,
                                                   num_warps=4)
    return out


__all__ = ["ONE_PASS_MAX", "available", "quantize_rows", "transpose_bytes"]
