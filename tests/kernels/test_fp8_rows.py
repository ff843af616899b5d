"""kernels/fp8_rows.py under Triton's interpreter: the per-row quantisation computes adapters/fp8_base's arithmetic
bit for bit up to its cast (the scales and the clamped fp32 quotients: rows held whole and rows looped over, with
and without a column scale, zero, tiny and huge rows, ragged lengths), and the transposed byte copy equals torch's
on ragged shapes. The interpreter's own fp32 -> e4m3 cast is wrong across binades (kernels/fp8_rows.quantize_rows):
the codes themselves are checked on CUDA (tests/cuda/test_cuda_fp8_base.py). CI's CPU venv has no Triton: skipped."""

import pytest
import torch

from shardfit.adapters.fp8_base import row_quotients

LENGTHS = [16, 100, 4096, 14336, 20000]  # one pass (pow2 and ragged blocks), the MLP width, and a looped row


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels are made under it (a cache entry of their own)


def _rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(6, k, generator=gen) * torch.logspace(-20, 3, 6)[:, None]
    x[1] = 0  # a zero row: scale 1, codes 0
    x[2] = torch.randn(k, generator=gen) * 1e-42  # subnormal values: the scale is clamped to fp32's smallest normal
    x[3, ::7] *= 1e4  # outliers
    return x.to(dtype)


@pytest.mark.parametrize("k", LENGTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("col_scale", [False, True], ids=["rows", "dY_s_w"])
def test_quotients_and_scales_equal_the_torch_arithmetic(interpreted, k, dtype, col_scale):
    from shardfit.kernels.fp8_rows import quantize_rows

    x = _rows(k, dtype)
    cs = torch.rand(k, generator=torch.Generator().manual_seed(1)) * 4 + 1e-3 if col_scale else None
    got_q, got_s = quantize_rows(x, cs, quotients=True)
    want_q, want_s = row_quotients(x, cs)
    assert got_s.shape == (6, 1) and torch.equal(got_s, want_s)
    assert torch.equal(got_q, want_q)
    assert got_q.abs().max() <= 448


def test_refuses_what_it_does_not_read(interpreted):
    from shardfit.kernels.fp8_rows import quantize_rows, transpose_bytes

    with pytest.raises(ValueError, match="contiguous 2-D"):
        quantize_rows(torch.randn(8, 32).t())
    with pytest.raises(ValueError, match="col_scale"):
        quantize_rows(torch.randn(8, 32), torch.ones(31))
    with pytest.raises(ValueError, match="1-byte"):
        transpose_bytes(torch.zeros(4, 4))


@pytest.mark.parametrize("shape", [(64, 64), (130, 70), (1, 200), (300, 1), (96, 4096)])
def test_transposed_bytes_equal_torchs(interpreted, shape):
    from shardfit.kernels.fp8_rows import transpose_bytes

    t = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(transpose_bytes(t), t.t().contiguous())
    codes = t.view(torch.float8_e4m3fn)  # the codes' own dtype is kept
    got = transpose_bytes(codes)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), t.t().contiguous())
