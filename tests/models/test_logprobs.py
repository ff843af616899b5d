"""The chunked log-prob kernel equals log_softmax + gather (values and gradients, entropy included)."""

import pytest
import torch

from shardfit.models.logprobs import fused_linear_logprobs


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("entropy", [False, True])
def test_values_and_gradients_equal_the_reference(chunk, entropy):
    g = torch.Generator().manual_seed(chunk)
    N, D, V = 23, 16, 50
    h = torch.randn(N, D, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[3, 11]] = -100  # no target: log-prob 0, no gradient
    up_lp, up_ent = torch.randn(N, dtype=torch.float64, generator=g), torch.randn(N, dtype=torch.float64, generator=g)

    logp, ent = fused_linear_logprobs(h, w, targets, chunk, entropy)
    out = (logp * up_lp).sum() + ((ent * up_ent).sum() if entropy else 0)
    gh, gw = torch.autograd.grad(out, (h, w))

    ls = torch.log_softmax(h @ w.t(), -1)
    valid = targets >= 0
    ref_lp = ls.gather(1, targets.clamp(min=0)[:, None]).squeeze(1) * valid
    ref = (ref_lp * up_lp).sum()
    if entropy:
        ref_ent = -(ls.exp() * ls).sum(-1)
        ref = ref + (ref_ent * up_ent).sum()
        torch.testing.assert_close(ent, ref_ent)
    else:
        assert ent is None
    rh, rw = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(logp, ref_lp)
    assert (logp[~valid] == 0).all()
    torch.testing.assert_close(gh, rh)
    torch.testing.assert_close(gw, rw)
