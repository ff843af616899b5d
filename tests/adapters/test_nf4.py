"""The NF4 format (adapters/nf4.py): its levels are the normal quantiles of the QLoRA paper; dequantisation equals a
float64 reference of the plain formula, bit for bit; every weight reads back within half a level gap of its block's
absmax plus the double quantisation's error; packing order, padding of odd sizes, zeros, the bytes a weight, and
group independence (what sharding relies on)."""

from __future__ import annotations

import pytest
import torch

from shardfit.adapters.nf4 import (
    BLOCK,
    BYTES_PER_WEIGHT,
    GROUP,
    GROUP_BLOCKS,
    NF4_LEVELS,
    block_absmax,
    dequantize,
    n_groups,
    pad_to_groups,
    quantize,
    unpack_codes,
)

LEVELS = torch.tensor(NF4_LEVELS, dtype=torch.float64)


def _weights(n: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with block scales that vary (as real layers' do) and a few outliers."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=gen) * 0.02
    w *= torch.rand(-(-n // BLOCK), generator=gen).repeat_interleave(BLOCK)[:n] * 3 + 0.2
    w[torch.randint(0, n, (max(1, n // 5000),), generator=gen)] *= 8
    return w


def _reference(codes, absmax, stats) -> torch.Tensor:
    """The plain formula in float64: w = level[code] x (q x scale + mean), the block absmax rounded to fp32 (the
    format stores it so), the product rounded once to fp32."""
    idx = torch.stack([codes.long() // 16, codes.long() % 16], dim=-1).reshape(codes.shape[0], GROUP_BLOCKS, BLOCK)
    mean_scale = stats.view(torch.float32).double()
    a = (absmax.double() * mean_scale[:, 1:2] + mean_scale[:, 0:1]).float().double()
    return (LEVELS[idx] * a.unsqueeze(-1)).float().reshape(-1)


def test_levels_are_the_normal_quantiles_of_the_paper():
    """8 positive and 7 negative quantiles of N(0, 1) at evenly spaced probabilities from 0.9677 to 1/2, an exact
    zero, scaled to [-1, 1] (Dettmers et al. 2023, appendix)."""
    p = 0.9677083
    pos = torch.special.ndtri(torch.linspace(p, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(p, 0.5, 8, dtype=torch.float64)[:-1])
    derived = torch.sort(torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)])).values
    torch.testing.assert_close(derived / derived.max(), LEVELS, rtol=0, atol=1e-6)
    assert LEVELS[7] == 0 and LEVELS[0] == -1 and LEVELS[15] == 1 and bool((LEVELS.diff() > 0).all())


@pytest.mark.parametrize("numel", [3 * GROUP, 111, 64 * 37 + 5], ids=["3-groups", "odd-111", "odd-2373"])
def test_dequantisation_equals_the_float64_reference_and_keeps_the_error_bound(numel):
    w = _weights(numel)
    g = n_groups(numel)
    codes, absmax, stats = quantize(pad_to_groups(w, g))
    assert codes.shape == (g, GROUP // 2) and codes.dtype == torch.uint8
    assert absmax.shape == (g, GROUP_BLOCKS) and absmax.dtype == torch.int8
    assert stats.shape == (g, 2) and stats.dtype == torch.int32
    ref = _reference(codes, absmax, stats)
    got = dequantize(codes, absmax, stats, torch.float32)
    assert torch.equal(got, ref)  # bit for bit
    assert torch.equal(dequantize(codes, absmax, stats, torch.bfloat16), ref.to(torch.bfloat16))
    assert not got[numel:].any()  # the padding reads back as zeros
    # the bound: |w' - w| <= half the gap around w's level x its block's absmax + the absmax's double-quant error
    blocks = pad_to_groups(w, g).double().view(-1, BLOCK)
    true_a = blocks.abs().amax(-1)
    stored_a = block_absmax(absmax, stats).double().view(-1)
    scale = stats.view(torch.float32).double()[:, 1].repeat_interleave(GROUP_BLOCKS)
    assert bool(((stored_a - true_a).abs() <= scale / 2 * (1 + 1e-6) + 1e-12).all())
    gaps = LEVELS.diff()
    half_gap = torch.maximum(torch.cat([gaps[:1], gaps]), torch.cat([gaps, gaps[-1:]])) / 2  # around each level
    code = unpack_codes(codes).view(-1, BLOCK)
    bound = half_gap[code] * true_a[:, None] + 2 * (stored_a - true_a).abs()[:, None] + 1e-6 * true_a[:, None]
    err = (got.double().view(-1, BLOCK) - blocks).abs()
    assert bool((err <= bound).all()), (err - bound).max()
    # and NF4's usual figure on these weights: ~10% relative error
    assert (got[:numel] - w).norm() / w.norm() < 0.12


def test_packing_order_two_codes_a_byte_even_element_high():
    idx = torch.randint(0, 16, (GROUP,), generator=torch.Generator().manual_seed(3))
    idx[::BLOCK] = 15  # every block's absmax is exactly 1: the double quantisation is exact, the codes are idx
    w = LEVELS.float()[idx]
    codes, absmax, stats = quantize(w)
    assert torch.equal(codes.view(-1), (idx[0::2] * 16 + idx[1::2]).to(torch.uint8))
    assert torch.equal(unpack_codes(codes), idx)
    assert torch.equal(dequantize(codes, absmax, stats, torch.float32), w)


def test_zeros_and_groups_are_independent():
    """An all-zero block reads back as zeros (the exact zero level); quantising groups one by one equals quantising
    them together, which is what lets each rank quantise its own groups."""
    w = _weights(4 * GROUP, seed=5)
    w[GROUP:GROUP + 3 * BLOCK] = 0
    w[3 * GROUP:] = 0  # a whole group of zeros
    whole = quantize(w)
    assert not dequantize(*whole, torch.float32)[GROUP:GROUP + 3 * BLOCK].any()
    assert not dequantize(*whole, torch.float32)[3 * GROUP:].any()
    parts = [quantize(w[i * GROUP:(i + 1) * GROUP]) for i in range(4)]
    for k in range(3):
        assert torch.equal(whole[k], torch.cat([p[k] for p in parts]))


def test_bytes_per_weight():
    codes, absmax, stats = quantize(torch.zeros(64 * GROUP))
    stored = sum(t.numel() * t.element_size() for t in (codes, absmax, stats))
    assert stored / (64 * GROUP) == BYTES_PER_WEIGHT == 0.5 + 1 / 64 + 8 / 16384  # 0.516113...
    with pytest.raises(ValueError, match="whole groups"):
        quantize(torch.zeros(GROUP + 1))
