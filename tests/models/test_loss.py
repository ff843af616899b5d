import pytest
import torch
import torch.nn.functional as F

from shardfit.models import fused_linear_cross_entropy
from shardfit.models.init import seeded_normal_


def test_fused_linear_cross_entropy_matches_plain_path():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[3, 10, 11]] = -100
    loss = fused_linear_cross_entropy(h, w, labels, chunk=8)
    (2.5 * loss).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w2.t(), labels, reduction="sum", ignore_index=-100)
    (2.5 * ref).backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h.grad, h2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_fused_loss_without_grad_and_all_masked():
    h, w = torch.randn(5, 4), torch.randn(7, 4)
    with torch.no_grad():
        assert fused_linear_cross_entropy(h, w, torch.full((5,), -100)).item() == 0.0
        ref = F.cross_entropy(h @ w.t(), torch.arange(5), reduction="sum")
        torch.testing.assert_close(fused_linear_cross_entropy(h, w, torch.arange(5), chunk=2), ref)


def test_seeded_init_depends_on_name_and_seed_only():
    a, b = torch.empty(5000, 300), torch.empty(5000, 300)
    seeded_normal_(a, 0.02, 0, "w")
    seeded_normal_(b, 0.02, 0, "w")
    assert torch.equal(a, b) and abs(a.std().item() - 0.02) < 1e-3
    seeded_normal_(b, 0.02, 1, "w")
    assert not torch.equal(a, b)
    seeded_normal_(b, 0.02, 0, "v")
    assert not torch.equal(a, b)


@pytest.mark.slow  # ~22 s of CPU compilation; compiled training runs in the CUDA tests
def test_compiled_chunk_matches_eager():
    """compute.compile runs the per-chunk softmax and gradient through torch.compile: same loss and gradients
    (bf16 inputs, so the fp32 copy is fused away; a short last chunk is a second specialisation)."""
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(45, 32, generator=g).bfloat16()
    w0 = (torch.randn(300, 32, generator=g) * 0.3).bfloat16()
    labels = torch.randint(0, 300, (45,), generator=g)
    labels[[0, 7, 44]] = -100
    out = []
    for compiled in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w, labels, chunk=16, compiled=compiled)
        loss.backward()
        out.append((loss.detach(), h.grad.float(), w.grad.float()))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-5, atol=1e-4)
    for a, b in zip(out[1][1:], out[0][1:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert out[0][1][[0, 7, 44]].abs().sum() == 0  # masked tokens get no gradient
