"""The grouped-matmul expert path on CUDA against the every-expert loop, for the same routing."""

import pytest
import torch

from shardfit.models.moe import Experts

pytestmark = pytest.mark.cuda


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_grouped_mm_experts_match_loop_forward_and_backward():
    torch.manual_seed(0)
    E, H, I = 16, 256, 128
    counts = torch.tensor([40, 0, 7, 100, 0, 0, 33, 1, 60, 12, 0, 90, 5, 5, 47, 0], device="cuda")  # empty experts too
    fast = Experts(E, H, I).cuda()
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, 0.05)
    ref = Experts(E, H, I).cuda().double()
    ref.load_state_dict(fast.state_dict())
    fast = fast.bfloat16()
    with torch.no_grad():  # same (bf16-rounded) weights on both sides
        for p, q in zip(fast.parameters(), ref.parameters()):
            q.copy_(p.double())
    xs = torch.randn(int(counts.sum()), H, device="cuda")
    xb = xs.bfloat16().requires_grad_()
    xr = xb.detach().double().requires_grad_()
    out = fast(xb, counts)  # bf16 on CUDA: torch._grouped_mm
    want = ref(xr, counts)  # fp64: the loop over every expert
    assert _rel(out, want) < 1e-2
    out.float().square().sum().backward()
    want.square().sum().backward()
    assert _rel(xb.grad, xr.grad) < 2e-2
    for (name, p), q in zip(fast.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 2e-2, name
        assert p.grad[1].abs().sum() == 0 and p.grad[4].abs().sum() == 0  # empty experts get zero gradient
