"""kernels/multi_lora.py's multi-LoRA delta, added in place to the base layer's output, in two Triton launches: for
decoding (N <= MAX_TOKENS tokens), where sampling/lora_bank.py's banked linears call it.

Why: at decode the torch form is five small kernels per banked linear (the shrink GEMM, which cuBLAS splits over K
into a GEMM and a splitKreduce; the column mask's product; the expand GEMM; the add onto the base output), each a
launch of 1.5-5 us where its bytes need well under one: the bank of a linear is S R (in + out) bf16 = 0.5 MB at the
Qwen3-8B shape (S R = 4 x 16, in = out = 4096). At 7 banked linears and 36 layers that was 1,260 launches a step,
most of what LoRA rows added to it (measured: benchmarks/README.md#sampler-s21). Here it is two launches a linear
(504 a step):

  shrink   grid (N/BN, SR/BSR, SPLITS)   program (row tile, column tile of the bank, split of `in`):
           part[split, rows, cols] = x[rows, split's K] A_all[cols, split's K]^T   fp32, [SPLITS, N, SR]
  expand   grid (N/BN, out/BO)           program (row tile, tile of out's columns):
           h = sum over splits of part[:, rows, :], in split order (fixed: the same bits whatever the batch holds)
           h = h * cols[rows, :]                                               fp32, [BN, SR] in chunks of BJ
           out[rows, tile] = (out[rows, tile] + h B_all[:, tile]) in out's dtype, accumulated in fp32
           written only for rows whose cols row is not all zero: a token of slot -1 (the base alone) or of a freed
           slot keeps its base output bit for bit (not even -0.0 + 0 = +0.0 touches it)

The split-K reduction lives in the expand (not a third launch, and no atomics: a float atomic add sums in arrival
order, which would change tokens with what shares the batch). Its price is that every out tile re-reads its rows'
partials: SPLITS x BN x SR x 4 bytes a program, which `plan_splits` holds to PART_BYTES (8 splits at S R = 64; 32 KiB
beside the tile's B_all [SR, BO] bf16 = 16 KiB). The splits depend on the layer's shape alone, and every tile's rows
are computed apart (zero-padded past N), so a row's bits do not depend on N or on the other rows.

Bytes at the 8B shape, N = 64: the shrink reads x (0.5 MB) and A_all (0.5 MB) from DRAM once and from L2 up to
SR/BSR (x) and N/BN (A) times, ~32 KiB a program over 128 programs; the expand reads B_all (0.5 MB) once from DRAM
and N/BN times from L2, and out [N, out] (0.5 MB) once each way (the torch form wrote and read the delta besides).

Shapes: x [N, in] (last dim contiguous), A_all [S*R, in], B_all [S*R, out], cols [N, S*R] (kernels/multi_lora.py's
stack_bank and slot_columns), out [N, out] (contiguous; any float dtype). The dot products take bf16/fp16 operands
where the bank is bf16/fp16 (on the GPU, as cuBLAS does; h rounded to it before the expand, as multi_lora's h * cols
is), fp32 "ieee" otherwise and under Triton's interpreter (whose numpy has no bf16 arithmetic). No host
synchronisation, shapes fixed by (N, in, out, S*R): capturable in a CUDA graph. Without Triton `available` is False
and the caller keeps multi_lora.
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import combine_fns, interpreting, runs_on, triton_kernels

MAX_TOKENS = 256  # the decode case: above it (prefill chunks) cuBLAS's GEMMs are the better form
TILE_ROWS = 16  # BN: tl.dot's least M; a decode batch of 64 rows is 4 row tiles
SHRINK_COLS = 16  # BSR: the bank's columns a shrink program takes (one slot at rank 16)
SHRINK_K = 64  # BK: the K step of the shrink's loop
EXPAND_COLS = 128  # BO: out's columns an expand program writes
EXPAND_K = 64  # BJ: the bank's columns (the expand's K) per step
MIN_SPLIT = 512  # the least of `in` a shrink split takes (8 splits of 4096)
PART_BYTES = 32 << 10  # the partials an expand program re-reads: SPLITS x BN x SR x 4 at most (module docstring)


@triton_kernels
def _triton_kernels(triton, tl):
    """The shrink and expand kernels (kernels/triton_common.py's triton_kernels: made once per mode, None without
    Triton)."""
    fns = combine_fns()  # kernels/triton_common.py: why not tl.max
    globals().update(_lora_maximum=fns["maximum"])

    @triton.jit
    def shrink_kernel(x_ptr, a_ptr, part_ptr, N, IN, SR, stride_x, stride_a, chunk,
                      BN: tl.constexpr, BSR: tl.constexpr, BK: tl.constexpr, HALF_DOT: tl.constexpr):
        # x [N, IN] (stride_x), A_all [SR, IN] (stride_a), part [SPLITS, N, SR] fp32 (contiguous); split s takes
        # x's columns s*chunk : (s+1)*chunk (chunk a multiple of BK; a split past IN writes zeros). HALF_DOT: the
        # dots' operands in the bank's bf16/fp16, else fp32 (module docstring)
        DOT = a_ptr.dtype.element_ty if HALF_DOT else tl.float32
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        cols = tl.program_id(1) * BSR + tl.arange(0, BSR)
        s = tl.program_id(2)
        r_ok, c_ok = rows < N, cols < SR
        k_lo = s * chunk
        acc = tl.full([BN, BSR], 0.0, tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + chunk, IN), BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < IN
            xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                         mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, BK]
            at = tl.load(a_ptr + cols[:, None].to(tl.int64) * stride_a + k[None, :],
                         mask=c_ok[:, None] & k_ok[None, :], other=0.0)  # [BSR, BK]
            if HALF_DOT:
                acc = tl.dot(xt.to(DOT), tl.trans(at.to(DOT)), acc)
            else:
                acc = tl.dot(xt.to(DOT), tl.trans(at.to(DOT)), acc, input_precision="ieee")
        at_part = (s * N + rows[:, None]).to(tl.int64) * SR + cols[None, :]
        tl.store(part_ptr + at_part, acc, mask=r_ok[:, None] & c_ok[None, :])

    @triton.jit
    def expand_kernel(part_ptr, cols_ptr, b_ptr, out_ptr, N, OUT, SR, stride_c, stride_b, stride_o,
                      SPLITS: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, BO: tl.constexpr,
                      HALF_DOT: tl.constexpr):
        # part [SPLITS, N, SR] fp32, cols [N, SR] (stride_c), B_all [SR, OUT] (stride_b), out [N, OUT] (stride_o)
        DOT = b_ptr.dtype.element_ty if HALF_DOT else tl.float32
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        o = tl.program_id(1) * BO + tl.arange(0, BO)
        r_ok, o_ok = rows < N, o < OUT
        acc = tl.full([BN, BO], 0.0, tl.float32)
        live = tl.full([BN], 0.0, tl.float32)  # max |cols| of each row: 0 for slot -1
        for j0 in range(0, SR, BJ):
            j = j0 + tl.arange(0, BJ)
            m = r_ok[:, None] & (j < SR)[None, :]
            h = tl.full([BN, BJ], 0.0, tl.float32)
            for s in range(SPLITS):  # the splits in order: a fixed sum
                h += tl.load(part_ptr + (s * N + rows[:, None]).to(tl.int64) * SR + j[None, :], mask=m, other=0.0)
            c = tl.load(cols_ptr + rows[:, None].to(tl.int64) * stride_c + j[None, :], mask=m,
                        other=0.0).to(tl.float32)  # [BN, BJ]
            live = tl.maximum(live, tl.reduce(tl.abs(c), 1, _lora_maximum))  # noqa: F821 (made by the factory)
            bt = tl.load(b_ptr + j[:, None].to(tl.int64) * stride_b + o[None, :],
                         mask=(j < SR)[:, None] & o_ok[None, :], other=0.0)  # [BJ, BO]
            if HALF_DOT:  # h * cols rounded to the bank's dtype, as multi_lora's is
                acc = tl.dot((h * c).to(DOT), bt.to(DOT), acc)
            else:
                acc = tl.dot(h * c, bt.to(DOT), acc, input_precision="ieee")
        at_out = out_ptr + rows[:, None].to(tl.int64) * stride_o + o[None, :]
        keep = r_ok[:, None] & o_ok[None, :] & (live > 0)[:, None]  # rows of no slot: not written at all
        base = tl.load(at_out, mask=keep, other=0.0)
        tl.store(at_out, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=keep)

    return shrink_kernel, expand_kernel


def available(t: torch.Tensor) -> bool:
    """Whether multi_lora_decode_ runs on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernels)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_splits(k_in: int, sr: int) -> int:
    """Splits of `in` for the shrink: at least MIN_SPLIT of `in` a split, at most PART_BYTES of partials an expand
    program re-reads. A function of the layer's shape alone, not of N or the GPU: a row's bits then depend on its own
    x, slot and the bank, whatever shares the batch or the size it is padded to (at the 8B shape, 8 splits: 32 to 128
    shrink programs for N = 1 to 64)."""
    budget = max(1, PART_BYTES // (TILE_ROWS * sr * 4))
    return max(1, min(budget, _cdiv(k_in, MIN_SPLIT)))


def multi_lora_decode_(out: torch.Tensor, x: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor,
                       cols: torch.Tensor, *, splits: int | None = None) -> torch.Tensor:
    """out [N, out] += multi_lora(x [N, in], A_all [S*R, in], B_all [S*R, out], cols [N, S*R]) in place, rows with
    an all-zero cols row untouched (module docstring); returns out. Launches on the current stream, no host sync."""
    kernels = _triton_kernels()
    if kernels is None:
        raise RuntimeError("multi_lora_decode_ needs Triton (kernels/multi_lora.py's multi_lora is the same function "
                           "in PyTorch)")
    N, k_in = x.shape
    sr, n_out = b_all.shape
    if (a_all.shape != (sr, k_in) or cols.shape != (N, sr) or out.shape != (N, n_out) or x.stride(-1) != 1
            or a_all.stride(-1) != 1 or b_all.stride(-1) != 1 or cols.stride(-1) != 1 or out.stride(-1) != 1):
        raise ValueError(f"multi_lora_decode_: out {tuple(out.shape)}, x {tuple(x.shape)}, A_all "
                         f"{tuple(a_all.shape)}, B_all {tuple(b_all.shape)}, cols {tuple(cols.shape)} do not fit "
                         "(module docstring: last dims contiguous)")
    if N == 0 or n_out == 0:
        return out
    S = splits or plan_splits(k_in, sr)
    chunk = _cdiv(_cdiv(k_in, S), SHRINK_K) * SHRINK_K
    half = a_all.dtype in (torch.bfloat16, torch.float16) and b_all.dtype == a_all.dtype and not interpreting()
    part = torch.empty(S, N, sr, dtype=torch.float32, device=x.device)  # [SPLITS, N, SR]
    shrink, expand = kernels
    shrink[(_cdiv(N, TILE_ROWS), _cdiv(sr, SHRINK_COLS), S)](
        x, a_all, part, N, k_in, sr, x.stride(0), a_all.stride(0), chunk,
        BN=TILE_ROWS, BSR=SHRINK_COLS, BK=SHRINK_K, HALF_DOT=half)
    expand[(_cdiv(N, TILE_ROWS), _cdiv(n_out, EXPAND_COLS))](
        part, cols, b_all, out, N, n_out, sr, cols.stride(0), b_all.stride(0), out.stride(0),
        SPLITS=S, BN=TILE_ROWS, BJ=EXPAND_K, BO=EXPAND_COLS, HALF_DOT=half)
    return out


__all__ = ["MAX_TOKENS", "available", "multi_lora_decode_", "plan_splits"]
