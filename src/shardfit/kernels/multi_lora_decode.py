"""kernels/multi_lora.py's multi-LoRA delta, added in place to the base layer's output, in two Triton launches: for
decoding (N <= MAX_TOKENS tokens), where sampling/lora_bank.py's banked linears call it.

Why: at decode the torch form is five small kernels per banked linear (the shrink GEMM, which cuBLAS splits over K
into a GEMM and a splitKreduce; the column mask's product; the expand GEMM; the add onto the base output), each a
launch of 1.5-5 us where its bytes need well under one: the bank of a linear is S R (in + out) bf16 = 0.5 MB at the
Qwen3-8B shape (S R = 4 x 16, in = out = 4096). At 7 banked linears and 36 layers that was 1,260 launches a step,
most of what LoRA rows added to it (measured: benchmarks/README.md#sampler-s21). Here it is two launches a linear
(504 a step; 360 with sibling groups, below):

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

Layers that read one input (q|k|v, gate|up: sampling/lora_bank.py's sibling groups) share one shrink: `lora_shrink`
over their A banks stacked [members*SR, in] writes part [SPLITS, N, members*SR], and each member's `lora_expand_`
reads its SR columns of it (offset m*SR). The shrink's column tiles never span two members and its splits are
plan_splits of one member's SR, so each member's partials are the bits its own shrink writes: grouped or not, the
same outputs. At the 8B shape with the 7 linears of a block banked: 14 launches a layer alone, 10 grouped (q|k|v 1 +
3, o 2, gate|up 1 + 2, down 2): 360 a step of 36 layers instead of 504.

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
    def shrink_kernel(x_ptr, a_ptr, part_ptr, N, IN, SR, SRM, stride_x, stride_a, chunk,
                      BN: tl.constexpr, BSR: tl.constexpr, BK: tl.constexpr, HALF_DOT: tl.constexpr):
        # x [N, IN] (stride_x), A_all [SR, IN] (stride_a): the stacked banks of SR / SRM members (one: SRM = SR),
        # part [SPLITS, N, SR] fp32 (contiguous); program_id(1) = member x its column tiles (a tile never spans two
        # members: each member's columns are computed as its own launch would); split s takes x's columns
        # s*chunk : (s+1)*chunk (chunk a multiple of BK; a split past IN writes zeros). HALF_DOT: the dots' operands
        # in the bank's bf16/fp16, else fp32 (module docstring)
        DOT = a_ptr.dtype.element_ty if HALF_DOT else tl.float32
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        tiles = (SRM + BSR - 1) // BSR  # column tiles of one member (not tl.cdiv: triton_common.py says why)
        local = (tl.program_id(1) % tiles) * BSR + tl.arange(0, BSR)  # the member's own columns
        cols = (tl.program_id(1) // tiles) * SRM + local
        s = tl.program_id(2)
        r_ok, c_ok = rows < N, local < SRM
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
    def expand_kernel(part_ptr, cols_ptr, b_ptr, out_ptr, N, OUT, SR, PW, C0, stride_c, stride_b, stride_o,
                      SPLITS: tl.constexpr, BN: tl.constexpr, BJ: tl.constexpr, BO: tl.constexpr,
                      HALF_DOT: tl.constexpr):
        # part [SPLITS, N, PW] fp32 whose columns C0 : C0 + SR are this layer's (a group's shared partials; alone:
        # C0 = 0, PW = SR), cols [N, SR] (stride_c), B_all [SR, OUT] (stride_b), out [N, OUT] (stride_o)
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
                h += tl.load(part_ptr + (s * N + rows[:, None]).to(tl.int64) * PW + C0 + j[None, :], mask=m,
                             other=0.0)
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


def _half(bank: torch.Tensor) -> bool:
    """Whether a launch's dots take the bank's own bf16/fp16 operands (module docstring)."""
    return bank.dtype in (torch.bfloat16, torch.float16) and not interpreting()


def _kernels():
    kernels = _triton_kernels()
    if kernels is None:
        raise RuntimeError("multi_lora_decode_ needs Triton (kernels/multi_lora.py's multi_lora is the same function "
                           "in PyTorch)")
    return kernels


def _refuse(what: str, **shapes: torch.Tensor):
    raise ValueError(f"{what}: " + ", ".join(f"{k} {tuple(t.shape)}" for k, t in shapes.items())
                     + " do not fit (module docstring: last dims contiguous)")


def lora_shrink(x: torch.Tensor, a_all: torch.Tensor, *, members: int = 1, splits: int | None = None
                ) -> torch.Tensor:
    """The shrink launch: x [N, in], A_all [members*SR, in] (the stacked banks of `members` layers that read x; one
    layer: its own A_all) -> part [SPLITS, N, members*SR] fp32, member m's columns m*SR : (m+1)*SR, each computed
    as that layer's own launch would (the same tiles and splits: plan_splits of its SR). No host sync."""
    N, k_in = x.shape
    if a_all.shape[0] % members or a_all.shape[1] != k_in or x.stride(-1) != 1 or a_all.stride(-1) != 1:
        _refuse(f"lora_shrink of {members} members", x=x, A_all=a_all)
    sr = a_all.shape[0] // members  # one member's S*R
    S = splits or plan_splits(k_in, sr)
    part = torch.empty(S, N, a_all.shape[0], dtype=torch.float32, device=x.device)  # [SPLITS, N, members*SR]
    if N == 0 or sr == 0:
        return part
    chunk = _cdiv(_cdiv(k_in, S), SHRINK_K) * SHRINK_K
    _kernels()[0][(_cdiv(N, TILE_ROWS), members * _cdiv(sr, SHRINK_COLS), S)](
        x, a_all, part, N, k_in, a_all.shape[0], sr, x.stride(0), a_all.stride(0), chunk,
        BN=TILE_ROWS, BSR=SHRINK_COLS, BK=SHRINK_K, HALF_DOT=_half(a_all))
    return part


def lora_expand_(out: torch.Tensor, part: torch.Tensor, b_all: torch.Tensor, cols: torch.Tensor, *,
                 offset: int = 0) -> torch.Tensor:
    """The expand launch: out [N, out] += (sum of part [SPLITS, N, width]'s columns offset : offset + SR over the
    splits, in order) * cols [N, SR], times B_all [SR, out], in place; rows of an all-zero cols row untouched.
    Returns out. No host sync."""
    n_split, N, width = part.shape
    sr, n_out = b_all.shape
    if (not 0 <= offset <= width - sr or cols.shape != (N, sr) or out.shape != (N, n_out) or not part.is_contiguous()
            or b_all.stride(-1) != 1 or cols.stride(-1) != 1 or out.stride(-1) != 1):
        _refuse(f"lora_expand_ at column {offset}", out=out, part=part, B_all=b_all, cols=cols)
    if N == 0 or n_out == 0:
        return out
    _kernels()[1][(_cdiv(N, TILE_ROWS), _cdiv(n_out, EXPAND_COLS))](
        part, cols, b_all, out, N, n_out, sr, width, offset, cols.stride(0), b_all.stride(0), out.stride(0),
        SPLITS=n_split, BN=TILE_ROWS, BJ=EXPAND_K, BO=EXPAND_COLS, HALF_DOT=_half(b_all))
    return out


def multi_lora_decode_(out: torch.Tensor, x: torch.Tensor, a_all: torch.Tensor, b_all: torch.Tensor,
                       cols: torch.Tensor, *, splits: int | None = None) -> torch.Tensor:
    """out [N, out] += multi_lora(x [N, in], A_all [S*R, in], B_all [S*R, out], cols [N, S*R]) in place, rows with
    an all-zero cols row untouched (module docstring); returns out. One layer's two launches, on the current stream,
    no host sync."""
    if a_all.shape[0] != b_all.shape[0] or out.shape[0] != x.shape[0]:
        _refuse("multi_lora_decode_", out=out, x=x, A_all=a_all, B_all=b_all, cols=cols)
    return lora_expand_(out, lora_shrink(x, a_all, splits=splits), b_all, cols)


__all__ = ["MAX_TOKENS", "available", "lora_expand_", "lora_shrink", "multi_lora_decode_", "plan_splits"]
