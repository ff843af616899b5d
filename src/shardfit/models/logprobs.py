"""Per-token log-probabilities (and entropies) of target tokens without materialising [N, V] logits.

The RL losses (rl/losses.py) are arbitrary functions of the per-token log-probabilities, so, unlike the fused
cross-entropy of loss.py, the gradient with respect to the logits cannot be formed in forward: the upstream gradient
of each token is known only in backward. Forward keeps h [N, D] (as nn.Linear would) and the log-sum-exp [N];
backward recomputes each chunk's logits [c, V] (one more matmul per chunk than loss.py) and turns them into the
chunk's logit gradient right there. At most one chunk of fp32 logits is alive at a time, in either pass.

  d logp_t / d x_t = onehot(target_t) - p_t                     (x_t: the token's logits, p_t = softmax(x_t))
  d H_t / d x_t    = -p_t * (log p_t + H_t)                      (H_t = -sum_i p_ti log p_ti)
"""

from __future__ import annotations

import torch


def _logits(hc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 (or wider) logits [c, V] of one chunk of hidden states hc [c, D]."""
    return (hc @ weight.t()).to(torch.promote_types(hc.dtype, torch.float32))


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, with_entropy: bool):
        # h [N, D], weight [V, D], targets [N] (negative: no target; its log-prob is reported as 0)
        acc = torch.promote_types(h.dtype, torch.float32)
        n = h.shape[0]
        logp = torch.zeros(n, dtype=acc, device=h.device)
        lse = torch.empty(n, dtype=acc, device=h.device)
        ent = torch.zeros(n if with_entropy else 0, dtype=acc, device=h.device)
        valid = targets >= 0
        for s in range(0, n, chunk):
            x = _logits(h[s:s + chunk], weight)  # [c, V], freed at the end of the iteration
            lse_c = torch.logsumexp(x, dim=-1)
            lse[s:s + chunk] = lse_c
            picked = x.gather(1, targets[s:s + chunk].clamp(min=0)[:, None]).squeeze(1)
            logp[s:s + chunk] = (picked - lse_c) * valid[s:s + chunk]
            if with_entropy:
                ent[s:s + chunk] = lse_c - (x.sub(lse_c[:, None]).exp_() * x).sum(-1)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.with_entropy = chunk, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_ent: torch.Tensor):
        h, weight, targets, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None  # accumulated in the weight's dtype, as FSDP's would be
        valid = targets >= 0
        g_logp = g_logp * valid if g_logp is not None else torch.zeros_like(lse)
        use_ent = ctx.with_entropy and g_ent is not None and g_ent.numel() > 0
        for s in range(0, h.shape[0], ctx.chunk):
            hc = h[s:s + ctx.chunk]
            x = _logits(hc, weight)
            logp_all = x.sub_(lse[s:s + ctx.chunk, None])  # log softmax, in place of the logits
            p = logp_all.exp()
            gl = g_logp[s:s + ctx.chunk]
            g = p * -gl[:, None]  # -g * p
            g.scatter_add_(1, targets[s:s + ctx.chunk].clamp(min=0)[:, None], gl[:, None])  # + g * onehot
            if use_ent:
                H = -(p * logp_all).sum(-1)
                g -= g_ent[s:s + ctx.chunk, None] * p * (logp_all + H[:, None])
            g = g.to(h.dtype)
            if want_h:
                grad_h[s:s + ctx.chunk] = g @ weight
            if want_w:
                grad_w.addmm_(g.t(), hc)
        return grad_h, grad_w, None, None, None


def fused_linear_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                          entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h @ weight.T)[t, targets[t]] for every token ([N], fp32; 0 where targets[t] < 0), and with
    `entropy` the entropy of each token's distribution ([N], fp32), both differentiable."""
    logp, ent = _FusedLinearLogprobs.apply(h, weight, targets, chunk, entropy)
    return logp, (ent if entropy else None)
