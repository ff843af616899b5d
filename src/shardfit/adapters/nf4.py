"""NF4 with double-quantised scales (QLoRA, Dettmers et al. 2023): the format, its quantisation and dequantisation.

Levels: the 16 NF4 values (NF4_LEVELS), quantiles of N(0, 1) scaled to [-1, 1], 8 positive and 7 negative with an
exact zero (the paper's asymmetric construction; tests/adapters/test_nf4.py derives them). A weight w of a block of
BLOCK = 64 consecutive weights (row-major order) is stored as the index c of the level nearest to w / a, where a is
the block's absmax as stored; it reads back as NF4_LEVELS[c] x a.
Double quantisation: the absmaxes of GROUP_BLOCKS = 256 consecutive blocks (one group: GROUP = 16,384 weights) are
stored as int8 q = round((a - m) / s), m the group's mean absmax, s = max |a - m| / 127, with m and s in fp32; a block
reads back its absmax as fp32(q x s + m) (exact in float64, one rounding). Unlike bitsandbytes (one mean per tensor,
an 8-bit dynamic map), the mean and a linear int8 scale are per group: every group is self-contained, so a rank
quantises its own rows with no collective and a shard boundary never splits a group (adapters/qlora.py).
Layout, for g groups (a weight of n elements: g = ceil(n / GROUP), the last group zero-padded): codes [g, 8192] uint8,
two codes a byte, the even element in the high nibble (as bitsandbytes packs); absmax [g, 256] int8; stats [g, 2]
int32 holding the bits of (m, s) in fp32. A module stores the three as bit-for-bit views in a floating "carrier"
dtype (`carried`), the compute dtype FSDP gathers in: FSDP2 before torch 2.13 cannot shard integer parameters (it
makes every sharded parameter require grad), and a carrier equal to FSDP's param_dtype is gathered uncast.
Memory: 0.5 + 1/64 + 8/16384 = 0.516113 bytes a weight (4.13 bits; bf16: 2 bytes), plus < 16,384 padded weights
a tensor. Dequantisation is exact: fp32(level x absmax) (two fp32 values, one rounding), then the compute dtype; its
transient is ~6 bytes a weight eagerly (fp32 levels, then the copy in dtype), one fused kernel under torch.compile.
On CUDA with Triton, dequantize_kernel does the same arithmetic, bit for bit, in one hand-written kernel that reads
the packed tensors once and writes the weight once (kernels/nf4_dequant.py; ~2.5 bytes of traffic a weight).
"""

from __future__ import annotations

import torch

from shardfit.kernels.nf4_dequant import available, nf4_dequant

BLOCK = 64  # weights per absmax
GROUP_BLOCKS = 256  # absmaxes per second-level (mean, scale)
GROUP = BLOCK * GROUP_BLOCKS  # weights per row of the packed layout
ROW_BYTES = GROUP // 2
BYTES_PER_WEIGHT = 0.5 + 1 / BLOCK + 8 / GROUP

# The NF4 levels as the QLoRA paper and bitsandbytes give them (fp32), ascending; index 7 is the exact zero.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """Constants per device: "mids" [15] fp32 (the midpoints between neighbouring levels: a value goes to the nearest
    level), "pairs" [256, 2] fp32 (the two levels a packed byte holds, high nibble first), "levels" [16] fp32 (the
    kernel's table). Made once per device in
    eager code; under torch.compile made in the graph (a cache filled inside a traced autograd.Function would be a
    side effect dynamo refuses), where they fold into constants."""
    if torch.compiler.is_compiling():
        return _make(kind, device)
    if (kind, device) not in _TABLES:
        _TABLES[kind, device] = _make(kind, device)
    return _TABLES[kind, device]


def _make(kind: str, device: torch.device) -> torch.Tensor:
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)
    if kind == "mids":
        return ((levels[1:].double() + levels[:-1].double()) / 2).float()
    if kind == "levels":
        return levels
    byte = torch.arange(256, device=device)
    return torch.stack([levels[byte >> 4], levels[byte & 15]], dim=1)


def n_groups(numel: int) -> int:
    """Rows of the packed layout of a weight of `numel` elements."""
    return -(-numel // GROUP)


STORED = (torch.uint8, torch.int8, torch.int32)  # codes, absmax, stats as quantize makes them
ROW_STORED_BYTES = (ROW_BYTES, GROUP_BLOCKS, 8)  # bytes a group takes in each


def carried(parts: tuple[torch.Tensor, ...], carrier: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(codes, absmax, stats) as views of dtype `carrier` (same bytes; each row's bytes divide by its size)."""
    return tuple(t.view(carrier) for t in parts)


def stored(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The integer views of carried (or already integer) storage: bit for bit, no copy."""
    return tuple(t if t.dtype == d else t.view(d) for t, d in zip((codes, absmax, stats), STORED))


def block_absmax(absmax: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """The blocks' absmaxes as stored, fp32 [g, 256], from the int8 codes [g, 256] and the int32 stats [g, 2]."""
    absmax = absmax if absmax.dtype == torch.int8 else absmax.view(torch.int8)
    mean_scale = stats.view(torch.float32).double()
    return (absmax.double() * mean_scale[:, 1:2] + mean_scale[:, 0:1]).float()


@torch.no_grad()
def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [g, 8192] uint8, absmax [g, 256] int8, stats [g, 2] int32) of w, [g * GROUP] elements (pad first:
    pad_to_groups). Deterministic: the same on any rank, for any split into groups (every reduction is within a
    group, the mean in float64)."""
    g = w.numel() // GROUP
    if w.numel() != g * GROUP:
        raise ValueError(f"quantize takes whole groups of {GROUP} weights, got {w.numel()}")
    x = w.detach().float().reshape(g, GROUP_BLOCKS, BLOCK)
    amax = x.abs().amax(dim=-1).double()  # [g, 256]
    mean = amax.mean(dim=-1, keepdim=True).float()
    dev = amax - mean.double()
    scale = (dev.abs().amax(dim=-1, keepdim=True) / 127).float()
    q = torch.where(scale > 0, dev / scale.double(), 0).round().clamp(-127, 127).to(torch.int8)
    stats = torch.cat([mean, scale], dim=1).view(torch.int32)
    a = block_absmax(q, stats).unsqueeze(-1)  # codes are chosen against the absmax as it reads back
    t = torch.where(a != 0, x / a, 0)
    idx = torch.bucketize(t, _table("mids", w.device), out_int32=True).view(g, ROW_BYTES, 2)
    codes = (idx[..., 0] * 16 + idx[..., 1]).to(torch.uint8)
    return codes, q, stats


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The g * GROUP weights, flat, in dtype: fp32(level x block absmax), then dtype. Takes carried storage too."""
    codes, absmax, stats = stored(codes, absmax, stats)
    g = codes.shape[0]
    pairs = _table("pairs", codes.device)[codes.int()]  # [g, 8192, 2] fp32: one gather for both nibbles
    pairs.view(g, GROUP_BLOCKS, BLOCK).mul_(block_absmax(absmax, stats).unsqueeze(-1))
    return pairs.view(-1).to(dtype)


def kernel_dequantizes(codes: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether dequantize_kernel runs for this storage and dtype here: CUDA tensors with Triton importable."""
    return dtype in (torch.bfloat16, torch.float16, torch.float32) and available(codes)


def dequantize_kernel(codes: torch.Tensor, absmax: torch.Tensor, stats: torch.Tensor, numel: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """dequantize(codes, absmax, stats, dtype)[:numel], bit for bit, by one Triton kernel (kernels/nf4_dequant.py):
    the first `numel` weights, flat, in dtype (the padding is never written). Takes carried storage too (the integer
    views are the same bytes); contiguous, on CUDA (kernel_dequantizes). No host synchronisation."""
    codes, absmax, stats = stored(codes, absmax, stats)
    return nf4_dequant(codes, absmax, stats.view(torch.float32), _table("levels", codes.device), numel, dtype)


def pad_to_groups(flat: torch.Tensor, groups: int) -> torch.Tensor:
    """flat, zero-padded to groups * GROUP elements (zeros quantise to the exact zero level)."""
    missing = groups * GROUP - flat.numel()
    return flat if not missing else torch.cat([flat, flat.new_zeros(missing)])


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """The level index of every weight, [g * GROUP] int64, in weight order (tests, inspection)."""
    codes = codes if codes.dtype == torch.uint8 else codes.view(torch.uint8)
    return torch.stack([codes >> 4, codes & 15], dim=-1).view(-1).long()


__all__ = ["BLOCK", "BYTES_PER_WEIGHT", "GROUP", "GROUP_BLOCKS", "NF4_LEVELS", "ROW_BYTES", "ROW_STORED_BYTES",
           "STORED", "block_absmax", "carried", "dequantize", "dequantize_kernel", "kernel_dequantizes", "n_groups",
           "pad_to_groups", "quantize", "stored", "unpack_codes"]
