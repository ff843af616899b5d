"""Decode attention over a paged KV cache in one Triton kernel (plus a small combine): each row's one new query per
head against that row's own blocks, read in place through its block table.

Why a kernel: the portable path (sampling/attention.py "gather") first copies each row's blocks into a dense
[B, T, K, Dh] tensor and then runs SDPA over it, so every cached key and value crosses the memory bus three times
(read by the gather, written, read by SDPA). Decoding is bound by those bytes: at 64 rows of ~640 tokens the
Qwen3-8B shape holds ~6 GB of KV against 16 GB of weights, so the gather's two extra passes cost about half again
the step. Here each key and value is read once, straight from the pool.

Shapes: B rows, H = K x G query heads (the G heads of key/value head k are k*G .. k*G+G-1, Hugging Face's layout),
Dh head size, the pool [n_blocks, bs, K, Dh] (keys and values alike), tables [B, M] block ids, lengths [B] the keys
each row sees (its query's position + 1: key t is visible iff t < length).

A program takes (row b, key/value head k, split s): the G query heads of k as one [GP, Dh] tile (GP = G rounded up
to 16, tl.dot's least), the row's blocks of split s in tiles of BLOCKS_PER_TILE blocks (gathered through the table
inside the kernel), an online softmax in fp32 (scores and the running max, sum and output), bf16 operands into the
tensor cores as SDPA's kernels use them. Splitting a row's blocks over S programs (flash-decoding) keeps enough
programs in flight when B x K is small against the SMs: each split writes its partial output [Dh] and log-sum-exp,
and `combine` (a second kernel, one program a row and head) weighs them by exp(lse - max) (a split with no keys has
lse -inf: weight 0) and writes q's dtype. One split skips the combine: the kernel writes q's dtype itself. No host
synchronisation, fixed shapes: capturable in a CUDA graph at fixed (B, M, splits).

Without Triton (the CPU wheels) `available` is False and the caller keeps its gather path; the tests run the kernel
under Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import torch

from shardfit.kernels.triton_common import combine_fns, interpreting, runs_on, triton_kernels

BLOCKS_PER_TILE = 4  # 64 keys a tile at bs 16: [64, 128] bf16 keys + values = 32 KiB in flight a program


@triton_kernels
def _triton_kernels(triton, tl):
    """The decode kernel and the splits' combine (kernels/triton_common.py's triton_kernels: made once per mode,
    None without Triton)."""

    # the reductions' combine functions (kernels/triton_common.py says why not tl.max / tl.sum), as module globals:
    # triton resolves a kernel's callees among them
    fns = combine_fns()
    globals().update(_paged_maximum=fns["maximum"], _paged_add=fns["add"])

    @triton.jit
    def paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, out_ptr, lse_ptr, sm_scale,
                            stride_qb, stride_qh, stride_pb, stride_pt, stride_pk, stride_tb, width,
                            K_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr,
                            BS: tl.constexpr, TILE: tl.constexpr, SPLITS: tl.constexpr,
                            BF16_DOT: tl.constexpr):
        # q [B, H, DH]; pools [n_blocks, BS, K, DH] (stride_pb, stride_pt, stride_pk; DH contiguous); tables [B, M];
        # lengths [B]; width: M, the table's columns (a row never reads past them, whatever its length says: a
        # padded batch entry's position runs on); out [B, H, SPLITS, DH] fp32 (q's dtype with one split), lse
        # [B, H, SPLITS] fp32
        # (contiguous). BF16_DOT: the dot products' operands in bf16 (the GPU); fp32 under the interpreter, whose
        # numpy has no bf16 arithmetic
        DOT = tl.bfloat16 if BF16_DOT else tl.float32
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1)
        s = tl.program_id(2)
        n_keys = tl.load(lengths_ptr + b)
        n_blocks = tl.minimum((n_keys + BS - 1) // BS, width)
        per_split = ((n_blocks + SPLITS - 1) // SPLITS + TILE - 1) // TILE * TILE  # whole tiles a split
        first = s * per_split
        last = tl.minimum(first + per_split, n_blocks)
        g = tl.arange(0, GP)
        d = tl.arange(0, DH)
        head = kh * G + g  # [GP]
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :], mask=g[:, None] < G, other=0.0)
        q = q.to(DOT)  # [GP, DH]
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.full([GP], 0.0, tl.float32)
        acc = tl.full([GP, DH], 0.0, tl.float32)
        t = tl.arange(0, TILE * BS)  # [T]: the tile's keys
        for blk in range(first, last, TILE):
            bi = blk + t // BS  # [T] the key's block within the row
            phys = tl.load(tables_ptr + b * stride_tb + bi, mask=bi < last, other=0).to(tl.int64)
            pos = bi * BS + t % BS
            ok = (bi < last) & (pos < n_keys)  # [T]
            off = phys * stride_pb + (t % BS) * stride_pt + kh * stride_pk  # [T]
            k = tl.load(k_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(DOT)
            v = tl.load(v_ptr + off[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(DOT)
            sc = tl.dot(q, tl.trans(k)) * sm_scale  # [GP, T] fp32
            sc = tl.where(ok[None, :], sc, float("-inf"))
            # finite: a tile in [first, last) holds a visible key
            m_new = tl.maximum(m_i, tl.reduce(sc, 1, _paged_maximum))  # noqa: F821 (made by the factory)
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, _paged_add)  # noqa: F821
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v)
            m_i = m_new
        has = l_i > 0  # a split past the row's blocks saw no key: output 0, lse -inf (weight 0 in the combine)
        out = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (b * (K_HEADS * G) + head) * SPLITS + s  # [GP]
        tl.store(out_ptr + row[:, None] * DH + d[None, :], out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)
        tl.store(lse_ptr + row, lse, mask=g < G)

    @triton.jit
    def combine_kernel(part_ptr, lse_ptr, out_ptr, SPLITS: tl.constexpr, SP: tl.constexpr, DH: tl.constexpr):
        # one program a (row, head) r: part [r, SPLITS, DH] fp32, lse [r, SPLITS] fp32 -> out [r, DH] in its dtype,
        # the splits weighed by exp(lse - max) (an empty split's lse is -inf: weight 0; split 0 holds a key)
        r = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, SP)
        d = tl.arange(0, DH)
        lse = tl.load(lse_ptr + r * SPLITS + s, mask=s < SPLITS, other=float("-inf"))
        w = tl.exp(lse - tl.reduce(lse, 0, _paged_maximum))  # noqa: F821
        part = tl.load(part_ptr + (r * SPLITS + s)[:, None] * DH + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
        out = tl.reduce(w[:, None] * part, 0, _paged_add) / tl.reduce(w, 0, _paged_add)  # noqa: F821
        tl.store(out_ptr + r * DH + d, out.to(out_ptr.dtype.element_ty))

    return paged_decode_kernel, combine_kernel


def available(t: torch.Tensor) -> bool:
    """Whether paged_decode_attention runs on t's device here: CUDA with Triton importable (or the interpreter)."""
    return runs_on(t, _triton_kernels)


def default_splits(rows: int, kv_heads: int, width: int, device: torch.device) -> int:
    """Splits of a row's blocks so that rows x kv_heads x splits programs fill the SMs about four times over, at
    most one tile of blocks a split (a host-side choice per captured shape, never per step)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    return max(1, min(-(-4 * sms // max(rows * kv_heads, 1)), -(-width // BLOCKS_PER_TILE)))


def combine(part: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Splits' partial outputs part [B, H, S, Dh] and log-sum-exps lse [B, H, S] (fp32, contiguous) -> [B, H, Dh] in
    `dtype`: one launch (torch's ops for the same weighing were eight a layer, the cast included)."""
    kernels = _triton_kernels()
    B, H, S, Dh = part.shape
    out = torch.empty(B, H, Dh, dtype=dtype, device=part.device)
    if B:
        kernels[1][(B * H,)](part, lse, out, SPLITS=S, SP=max(2, 1 << (S - 1).bit_length()), DH=Dh)
    return out


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           lengths: torch.Tensor, *, scale: float | None = None, splits: int | None = None,
                           tile: int = BLOCKS_PER_TILE) -> torch.Tensor:
    """q [B, H, Dh] (one query a row), pools [n_blocks, bs, K, Dh], tables [B, M], lengths [B] (keys visible to the
    row, >= 1; at most M x bs are read) -> [B, H, Dh] in q's dtype. Launches on the current stream, no host
    synchronisation."""
    kernels = _triton_kernels()
    if kernels is None:
        raise RuntimeError("paged_decode_attention needs Triton (sampling/attention.py's gather path is the same "
                           "function in PyTorch)")
    B, H, Dh = q.shape
    _, bs, K, _ = k_pool.shape
    if (H % K or k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride() or k_pool.stride(-1) != 1
            or q.stride(-1) != 1 or tables.stride(-1) != 1 or Dh & (Dh - 1) or Dh < 16 or tables.shape[0] != B
            or lengths.shape != (B,)):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)}, pools {tuple(k_pool.shape)}, tables "
                         f"{tuple(tables.shape)}, lengths {tuple(lengths.shape)} do not fit (module docstring)")
    G = H // K
    S = splits or default_splits(B, K, tables.shape[1], q.device)
    # one split: the kernel writes the output in q's dtype; several: fp32 partials, then the combine kernel
    part = torch.empty(B, H, S, Dh, dtype=torch.float32 if S > 1 else q.dtype, device=q.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    if B:
        kernels[0][(B, K, S)](q, k_pool, v_pool, tables, lengths, part, lse, scale or 1.0 / math.sqrt(Dh),
                          q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                          tables.stride(0), tables.shape[1], K_HEADS=K, G=G, GP=max(16, 1 << (G - 1).bit_length()),
                          DH=Dh, BS=bs, TILE=tile, SPLITS=S, BF16_DOT=not interpreting())
    return part[:, :, 0] if S == 1 else combine(part, lse, q.dtype)
