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


def test_eager_path_is_bit_equal_to_the_formulas_it_replaced():
    """The per-chunk functions the compiled path shares run, eagerly, exactly the operations the loop ran inline
    before (fp32 values and gradients bit for bit, entropy included)."""
    g = torch.Generator().manual_seed(3)
    N, D, V, chunk = 37, 24, 90, 8
    h = torch.randn(N, D, generator=g, requires_grad=True)
    w = (torch.randn(V, D, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[0, 20]] = -100
    up_lp, up_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    logp, ent = fused_linear_logprobs(h, w, targets, chunk, True)
    gh, gw = torch.autograd.grad((logp * up_lp).sum() + (ent * up_ent).sum(), (h, w))
    # the inline loop as it stood (models/logprobs.py before the chunk functions)
    with torch.no_grad():
        valid = targets >= 0
        ref_lp, ref_ent, lse = torch.zeros(N), torch.zeros(N), torch.empty(N)
        ref_gh, ref_gw = torch.empty_like(h), torch.zeros_like(w)
        for s in range(0, N, chunk):
            x = (h[s:s + chunk] @ w.t()).float()
            lse_c = torch.logsumexp(x, dim=-1)
            lse[s:s + chunk] = lse_c
            picked = x.gather(1, targets[s:s + chunk].clamp(min=0)[:, None]).squeeze(1)
            ref_lp[s:s + chunk] = (picked - lse_c) * valid[s:s + chunk]
            ref_ent[s:s + chunk] = lse_c - (x.sub(lse_c[:, None]).exp_() * x).sum(-1)
        gl_all = up_lp * valid
        for s in range(0, N, chunk):
            x = (h[s:s + chunk] @ w.t()).float()
            logp_all = x.sub_(lse[s:s + chunk, None])
            p = logp_all.exp()
            gl = gl_all[s:s + chunk]
            gr = p * -gl[:, None]
            gr.scatter_add_(1, targets[s:s + chunk].clamp(min=0)[:, None], gl[:, None])
            H = -(p * logp_all).sum(-1)
            gr -= up_ent[s:s + chunk, None] * p * (logp_all + H[:, None])
            ref_gh[s:s + chunk] = gr @ w
            ref_gw.addmm_(gr.t(), h[s:s + chunk])
    for a, b in ((logp, ref_lp), (ent, ref_ent), (gh, ref_gh), (gw, ref_gw)):
        assert torch.equal(a, b)


@pytest.mark.slow  # CPU compilation of the two chunk functions (~30 s on two cores)
@pytest.mark.parametrize("entropy", [False, True])
def test_compiled_chunks_equal_eager(entropy):
    """compute.compile runs each chunk's statistics and gradient through torch.compile: on bf16 inputs (the logits
    stay bf16 into the fused kernels) the same log-probs, entropies and gradients as eager, to bf16 rounding; a
    short last chunk is a second specialisation."""
    g = torch.Generator().manual_seed(1)
    h0 = torch.randn(45, 32, generator=g).bfloat16()
    w0 = (torch.randn(300, 32, generator=g) * 0.3).bfloat16()
    targets = torch.randint(0, 300, (45,), generator=g)
    targets[[0, 7, 44]] = -100
    up_lp, up_ent = torch.randn(45, generator=g), torch.randn(45, generator=g)
    out = []
    for compiled in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        logp, ent = fused_linear_logprobs(h, w, targets, 16, entropy, compiled=compiled)
        total = (logp * up_lp).sum() + ((ent * up_ent).sum() if entropy else 0)
        gh, gw = torch.autograd.grad(total, (h, w))
        out.append((logp.detach(), ent.detach() if entropy else None, gh.float(), gw.float()))
    (lp0, e0, gh0, gw0), (lp1, e1, gh1, gw1) = out
    # eager rounds the logits to bf16 and converts them; compiled reads the same bf16 logits: same fp32 math
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    assert (lp1[[0, 7, 44]] == 0).all()
    if entropy:
        torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh1, gh0, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(gw1, gw0, rtol=2e-2, atol=2e-3)
