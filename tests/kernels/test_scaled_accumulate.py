"""kernels/scaled_accumulate.py: x * scale into fp32 (new or accumulated), and the expert cast that uses it."""

import pytest
import torch

from shardfit.kernels import scaled_accumulate_, scaled_cast
from shardfit.parallel.expert import _ComputeCast


def _cases(device):
    g = torch.Generator(device=device).manual_seed(0)
    # sizes around the kernel's block (4096): empty, partial block, several blocks with a ragged tail
    for n in (0, 1, 4095, 4097, 3 * 4096 + 5):
        x = torch.randn(n, generator=g, device=device).to(torch.bfloat16)
        acc = torch.randn(n, generator=g, device=device)
        yield x, acc


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_scaled_cast_and_accumulate_compute_in_fp32(device):
    for x, acc in _cases(device):
        ref = x.double() / 3
        out = scaled_cast(x, 1 / 3)
        assert out.dtype == torch.float32 and out.shape == x.shape
        torch.testing.assert_close(out.double(), ref, rtol=1e-7, atol=0)  # fp32 rounding only, not bf16's
        want = acc.double() + ref
        got = scaled_accumulate_(acc, x, 1 / 3)
        assert got is acc  # in place
        torch.testing.assert_close(acc.double(), want, rtol=2e-7, atol=1e-7)


def test_compute_cast_writes_the_divided_gradient_and_accumulates_over_micro_batches():
    """Two micro-batches through _ComputeCast (bf16 compute, divide 2) leave in param.grad what two plain bf16
    casts leave after AccumulateGrad, divided by 2; autograd's own accumulation is not used (it would double)."""
    torch.manual_seed(0)
    w = torch.randn(4, 8, 16)
    p, ref = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    xs = [torch.randn(4, 3, 8).to(torch.bfloat16) for _ in range(2)]
    for x in xs:
        torch.bmm(x, _ComputeCast.apply(p, torch.bfloat16, 2.0)).float().square().sum().backward()
        torch.bmm(x, ref.to(torch.bfloat16)).float().square().sum().backward()
    assert p.grad.dtype == torch.float32
    torch.testing.assert_close(p.grad, ref.grad / 2, rtol=1e-6, atol=1e-6)
