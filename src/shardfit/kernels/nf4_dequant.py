"""NF4 dequantisation in one Triton kernel: the packed codes, the int8 absmaxes and each group's (mean, scale) in,
the weight in bf16 (fp16, fp32) out, with the arithmetic of adapters/nf4.py's dequantize, bit for bit.

The format (adapters/nf4.py; this file takes its tensors, not its module): a weight's blocks of BLOCK = 64
consecutive weights, GROUP_BLOCKS = 256 blocks a group, g groups, the last zero-padded. codes [g, 8192] uint8, two
codes a byte, the even weight in the high nibble; absmax [g, 256] int8; stats [g, 2] fp32 (the group's mean and
scale); levels [16] fp32, the NF4 values. Weight i of block b reads back as fp32(levels[code_i] x a_b), then the
output dtype, where a_b = fp32(q_b x scale + mean) computed in fp64 (q_b x scale is exact there: one rounding).

Why a kernel: the same function under torch.compile (a gather from a [256, 2] table, fp32 products, a cast) ran at
about half the memory bandwidth bitsandbytes' CUDA kernel reaches (benchmarks/README.md#nf4-kernel). It is
memory-bound: 0.5 byte a weight read (+ 1/64 of absmax), 2 written (bf16). A program here takes TILE_BLOCKS
consecutive blocks of one group (TILE_BLOCKS divides GROUP_BLOCKS: one (mean, scale), two scalar loads) as rows of
8 weights: a thread loads a row's 4 code bytes as one 32-bit word and writes its 8 weights as one 16-byte vector,
so a warp reads 128 contiguous bytes and writes 512, and the layout of the loaded codes is the layout of the stored
weights (no exchange through shared memory). The 16 levels are a 64-byte table, one L1 line: a warp's 32 lookups
hit one line (the [256, 2] pair table would halve the lookups but spread a warp's over ~14 lines of its 2 KB). The
absmax is rebuilt per row in fp64 (4 fp64 multiply-adds a thread). Built for sm_90 by Triton 3.9 without a GPU
(its ptxas): 40 registers, no shared memory, 16-byte predicated stores, ~10 instructions a weight.

On the CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1: the tests; it rounds fp32 -> bf16 toward
zero where the GPU rounds to nearest even); without Triton there is no kernel (`available` says False) and the
caller keeps its PyTorch path (adapters/nf4.py's dequantize, chosen in adapters/qlora.py).
"""

from __future__ import annotations

import torch

from shardfit.kernels.triton_common import launch_device, triton_kernels

TILE_BLOCKS = 64  # blocks a program: 4,096 weights, 2 KiB of codes in, 8 KiB of bf16 out
NUM_WARPS = 4  # 128 threads: 4 rows of 8 weights each


@triton_kernels
def _triton_kernel(triton, tl):
    """The kernel (kernels/triton_common.py's triton_kernels: made once per mode, None without Triton)."""

    @triton.jit
    def nf4_dequant_kernel(codes_ptr, absmax_ptr, stats_ptr, levels_ptr, out_ptr, numel,
                           BLOCK: tl.constexpr, GROUP_BLOCKS: tl.constexpr, TILE_BLOCKS: tl.constexpr):
        # codes [g, GROUP_BLOCKS * BLOCK / 2] uint8, absmax [g, GROUP_BLOCKS] int8, stats [g, 2] fp32 (mean,
        # scale), levels [16] fp32, out [numel]; the program's blocks [tile, tile + TILE_BLOCKS), rows of 8 weights
        tile = tl.program_id(0).to(tl.int64) * TILE_BLOCKS  # int64: a weight past 2^31 elements stays in reach
        group = tile // GROUP_BLOCKS
        mean = tl.load(stats_ptr + 2 * group).to(tl.float64)
        scale = tl.load(stats_ptr + 2 * group + 1).to(tl.float64)
        ROWS: tl.constexpr = TILE_BLOCKS * BLOCK // 8
        row = tl.arange(0, ROWS)  # [ROWS], 8 a block
        q = tl.load(absmax_ptr + tile + row // (BLOCK // 8))  # [ROWS] int8: the row's block's absmax code
        a = (q.to(tl.float64) * scale + mean).to(tl.float32)  # [ROWS] fp32, as nf4.block_absmax
        byte = row[:, None] * 4 + tl.arange(0, 4)[None, :]  # [ROWS, 4]
        c = tl.load(codes_ptr + tile * (BLOCK // 2) + byte).to(tl.int32)  # [ROWS, 4]; unmasked: groups are padded
        even = tl.load(levels_ptr + (c >> 4)) * a[:, None]  # [ROWS, 4] fp32: weights 0, 2, 4, 6 of the row
        odd = tl.load(levels_ptr + (c & 15)) * a[:, None]  # weights 1, 3, 5, 7
        # [ROWS, 4, 2] -> [ROWS, 8]: tl.interleave spelled in builtins (the interpreter cannot call a library
        # function that was jit-wrapped before TRITON_INTERPRET was set)
        w = tl.reshape(tl.join(even, odd), (ROWS, 8))
        off = row[:, None] * 8 + tl.arange(0, 8)[None, :]  # [ROWS, 8] within the tile
        left = tl.minimum(numel - tile * BLOCK, TILE_BLOCKS * BLOCK).to(tl.int32)  # the last tile's are fewer
        tl.store(out_ptr + tile * BLOCK + off, w.to(out_ptr.dtype.element_ty), mask=off < left)

    return nf4_dequant_kernel


def available(t: torch.Tensor) -> bool:
    """Whether nf4_dequant runs on t's device here: CUDA with Triton importable."""
    return t.is_cuda and _triton_kernel() is not None


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nf4_dequant(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, levels: torch.Tensor, numel: int,
                dtype: torch.dtype = torch.bfloat16, *, tile_blocks: int = TILE_BLOCKS,
                num_warps: int = NUM_WARPS) -> torch.Tensor:
    """The first `numel` weights of the packed NF4 tensor, flat [numel], in dtype (module docstring).

    codes [g, GROUP_BLOCKS * BLOCK / 2] uint8, absmax [g, GROUP_BLOCKS] int8, stats [g, 2] fp32, levels [16] fp32,
    all contiguous on one device (CUDA, or any under TRITON_INTERPRET=1); BLOCK and GROUP_BLOCKS are read from the
    shapes; numel <= g * GROUP_BLOCKS * BLOCK. A slice of groups (a shard's rows) is a packed tensor of its own.
    Launches on the current stream, no host synchronisation. tile_blocks, num_warps: the launch (benchmarks).
    """
    kernel = _triton_kernel()
    if kernel is None:
        raise RuntimeError("nf4_dequant needs Triton (adapters/nf4.py's dequantize is the same function in PyTorch)")
    if (codes.dtype, absmax.dtype, stats.dtype, levels.dtype) != (torch.uint8, torch.int8, torch.float32,
                                                                   torch.float32):
        raise TypeError(f"nf4_dequant takes uint8 codes, int8 absmax, fp32 stats and levels, got {codes.dtype}, "
                        f"{absmax.dtype}, {stats.dtype}, {levels.dtype}")
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"nf4_dequant writes one of {_OUT_DTYPES}, not {dtype}")
    parts = (codes, absmax, stats, levels)
    g, group_blocks = absmax.shape[0], absmax.shape[-1]
    block = 2 * codes.shape[-1] // max(group_blocks, 1)
    if (codes.dim() != 2 or absmax.dim() != 2 or codes.shape[0] != g or tuple(stats.shape) != (g, 2)
            or tuple(levels.shape) != (16,) or block % 8 or 2 * codes.shape[-1] != block * group_blocks
            or group_blocks % tile_blocks or not 0 <= numel <= g * group_blocks * block):
        raise ValueError(f"nf4_dequant: codes {tuple(codes.shape)}, absmax {tuple(absmax.shape)}, stats "
                         f"{tuple(stats.shape)}, levels {tuple(levels.shape)} are not a packed NF4 tensor of "
                         f"{numel} weights in tiles of {tile_blocks} blocks")
    if any(not t.is_contiguous() or t.device != codes.device for t in parts):
        raise ValueError("nf4_dequant takes contiguous tensors on one device")
    out = torch.empty(numel, dtype=dtype, device=codes.device)  # [numel]
    if numel:
        grid = (-(-numel // (tile_blocks * block)),)
        with launch_device(codes):
            kernel[grid](codes, absmax, stats, levels, out, numel, BLOCK=block, GROUP_BLOCKS=group_blocks,
                         TILE_BLOCKS=tile_blocks, num_warps=num_warps)
    return out


__all__ = ["NUM_WARPS", "TILE_BLOCKS", "available", "nf4_dequant"]
