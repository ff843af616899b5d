"""The decode RMSNorm kernel (kernels/rms_norm.py) under Triton's interpreter against models/decoder.py's RMSNorm:
the same roundings (the row cast to x's dtype, then the weight's product), rows of any leading shape, a width that
is not a power of two, a weight of another dtype."""

import pytest
import torch

from shardfit.models.decoder import RMSNorm


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("shape,x_dtype,w_dtype", [((3, 1, 64), torch.float32, torch.float32),
                                                   ((2, 1, 4, 24), torch.float32, torch.float32),
                                                   ((5, 48), torch.float16, torch.float32)],
                         ids=["rows", "heads-ragged", "half-rows-fp32-weight"])
def test_kernel_equals_the_modules_forward(interpreted, shape, x_dtype, w_dtype):
    from shardfit.kernels.rms_norm import rms_norm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = (torch.randn(shape, generator=g) * 3).to(x_dtype)
    got = rms_norm(x, norm.weight, norm.eps)
    want = norm(x)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
