"""The decode SwiGLU kernel (kernels/swiglu.py) under Triton's interpreter against F.silu(gate) * up: the eager
roundings (silu rounded to the dtype, then the product), here in fp16 (the interpreter's numpy has no bf16) and
fp32, a size that is not a multiple of the block, a strided view; mismatched inputs refused."""

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def interpreted(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_silu_mul_is_the_torch_ops(interpreted, dtype):
    from shardfit.kernels.swiglu import silu_mul

    g = torch.Generator().manual_seed(0)
    both = (torch.randn(3, 2 * 700, generator=g) * 4).to(dtype)
    gate, up = both[:, :700], both[:, 700:]  # views with a row stride: taken (copied contiguous)
    got = silu_mul(gate, up)
    want = F.silu(gate) * up
    assert got.dtype == dtype and got.shape == want.shape
    # the same roundings; exp may differ from torch's by an fp32 ulp, which can move a rounding by one unit
    tol = 1e-3 if dtype == torch.float16 else 1e-6
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="silu_mul"):
        silu_mul(gate, up[:, :5])
