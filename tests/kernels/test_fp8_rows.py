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
    # subnormal values: the scale is clamped to fp32's smallest normal. fp32 only: in bf16 (its subnormals stop at
    # 9.2e-41) this row is all zeros, and bf16 subnormals cannot be checked here: the interpreter's bf16 -> fp32
    # conversion gets them wrong (2.76e-40 read as 5.9e-39); tests/cuda/test_cuda_fp8_base.py has a bf16 one
    x[2] = torch.randn(k, generator=gen) * 1e-42
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


@pytest.mark.parametrize("k", [100, 20000])  # held whole and looped over
def test_non_finite_rows_stay_non_finite_as_in_the_torch_arithmetic(interpreted, k):
    """A NaN or inf in a row (a diverging step's activations or gradients) gives torch's quotients and scale: NaN
    quotients (NaN codes, so the matmul's row is NaN and the trainer's non-finite check skips the step), not the
    finite +-448 that NaN-ignoring max/min (PTX max.f32, np.fmax) made of them."""
    from shardfit.kernels.fp8_rows import quantize_rows

    x = _rows(k, torch.bfloat16)
    x[0, 5] = float("nan")
    x[3, k - 1] = float("inf")
    x[4, 7] = -float("inf")
    x[5, :] = float("nan")
    for cs in (None, torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5):
        got_q, got_s = quantize_rows(x, cs, quotients=True)
        want_q, want_s = row_quotients(x, cs)
        assert want_q[[0, 3, 4, 5]].isnan().any(dim=1).all()  # torch's: each such row has NaN codes
        for got, want in ((got_q, want_q), (got_s, want_s)):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
