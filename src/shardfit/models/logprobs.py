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

from shardfit.models.loss import compiled_once


def _logits(hc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 (or wider) logits [c, V] of one chunk of hidden states hc [c, D]."""
    return (hc @ weight.t()).to(torch.promote_types(hc.dtype, torch.float32))


def _chunk_stats(x: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, with_entropy: bool):
    """(log-sum-exp, log-prob of the target (0 where not valid), entropy or an empty tensor) of one chunk of logits
    x [c, V], in fp32 (or wider): x is converted here (a no-op for the eager path's fp32 logits)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    logp = (picked - lse) * valid
    ent = lse - (x.sub(lse[:, None]).exp_() * x).sum(-1) if with_entropy else lse.new_zeros(0)
    return lse, logp, ent


def _chunk_grad(x: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, gl: torch.Tensor, ge: torch.Tensor,
                use_ent: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """d(sum gl * logp + ge * entropy) / d(logits) of one chunk of logits x [c, V], in out_dtype. The eager path
    passes fp32 logits (a temporary: turned into the log-softmax in place)."""
    logp_all = x.to(torch.promote_types(x.dtype, torch.float32)).sub_(lse[:, None])  # log softmax
    p = logp_all.exp()
    g = p * -gl[:, None]  # -g * p
    g.scatter_add_(1, targets.clamp(min=0)[:, None], gl[:, None])  # + g * onehot
    if use_ent:
        H = -(p * logp_all).sum(-1)
        g -= ge[:, None] * p * (logp_all + H[:, None])
    return g.to(out_dtype)


def _chunk_fns(compiled: bool):
    """(stats, grad) per chunk: eager, or through torch.compile (compute.compile with compute.compile_loss, as the
    cross-entropy's chunks in loss.py): Inductor then reads each chunk's bf16 logits in two or three fused passes
    (max, sum of exp, the target's entry; backward one pass writing the bf16 gradient) instead of ~8 passes over an
    fp32 copy. One compiled function each per process; chunk shapes are static (a last short chunk, or entropy on or
    off, is another specialisation)."""
    if not compiled:
        return _chunk_stats, _chunk_grad
    return compiled_once(_chunk_stats), compiled_once(_chunk_grad)


# The label of the head's work in a profile (torch.profiler; benchmarks/bench_rl_profiling.py's forward profile):
# a host annotation the kernels launched under it are attributed to (doctor/profile_trace.py time_by_region).
PROFILE_LABEL = "shardfit::logprob_head"


class _FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, with_entropy: bool,
                compiled: bool):
        # h [N, D], weight [V, D], targets [N] (negative: no target; its log-prob is reported as 0)
        acc = torch.promote_types(h.dtype, torch.float32)
        n = h.shape[0]
        logp = torch.zeros(n, dtype=acc, device=h.device)
        lse = torch.empty(n, dtype=acc, device=h.device)
        ent = torch.zeros(n if with_entropy else 0, dtype=acc, device=h.device)
        valid = targets >= 0
        stats, _ = _chunk_fns(compiled)
        with torch.profiler.record_function(PROFILE_LABEL):
            for s in range(0, n, chunk):
                # compiled: the matmul's own logits (bf16 on GPU) go in, converted inside the fused kernels
                x = h[s:s + chunk] @ weight.t() if compiled else _logits(h[s:s + chunk], weight)  # freed each time
                lse_c, logp_c, ent_c = stats(x, targets[s:s + chunk], valid[s:s + chunk], with_entropy)
                lse[s:s + chunk] = lse_c
                logp[s:s + chunk] = logp_c
                if with_entropy:
                    ent[s:s + chunk] = ent_c
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk, ctx.with_entropy, ctx.compiled = chunk, with_entropy, compiled
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
        if not use_ent:
            g_ent = g_logp.new_zeros(0)
        _, grad_fn = _chunk_fns(ctx.compiled)
        with torch.profiler.record_function(PROFILE_LABEL):
            for s in range(0, h.shape[0], ctx.chunk):
                hc = h[s:s + ctx.chunk]
                x = hc @ weight.t() if ctx.compiled else _logits(hc, weight)
                ge = g_ent[s:s + ctx.chunk] if use_ent else g_ent
                g = grad_fn(x, lse[s:s + ctx.chunk], targets[s:s + ctx.chunk], g_logp[s:s + ctx.chunk], ge,
                            use_ent, h.dtype)
                if want_h:
                    grad_h[s:s + ctx.chunk] = g @ weight
                if want_w:
                    grad_w.addmm_(g.t(), hc)
        return grad_h, grad_w, None, None, None, None


def scored_rows(scored: torch.Tensor, chunk: int) -> torch.Tensor:
    """[n'] int64 on scored's device (the host's: no sync): the flat indices of scored's True entries, then -1s up to
    whole chunks and a rest rounded up to a power of two (at least 128). The head's compiled chunk functions are
    specialised to static shapes (compiled_once): a rest of any size would recompile at every new count."""
    idx = scored.flatten().nonzero().flatten()
    full, rest = divmod(idx.numel(), chunk)
    if rest:
        rest = min(chunk, max(128, 1 << (rest - 1).bit_length()))
    return torch.cat([idx, idx.new_full((full * chunk + rest - idx.numel(),), -1)])


def select_rows(h: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h [n', D], labels [n']) of the scored rows (scored_rows' indices; -1: a pad row, given label -1 so that the
    head reports 0 for it and passes it no gradient) out of h [N, D], labels [N]."""
    keep = rows.clamp(min=0)
    return h.index_select(0, keep), torch.where(rows >= 0, labels.index_select(0, keep), -1)


def spread_rows(values: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """[n]: values [n'] of the scored rows back at their positions, 0 elsewhere. The pad rows (-1) add an exact 0 to
    row 0 (and take no gradient); an index_add, not a view: the output crosses FSDP's root hooks."""
    return values.new_zeros(n).index_add(0, rows.clamp(min=0), values * (rows >= 0))


def fused_linear_logprobs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024,
                          entropy: bool = False, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(h @ weight.T)[t, targets[t]] for every token ([N], fp32; 0 where targets[t] < 0), and with
    `entropy` the entropy of each token's distribution ([N], fp32), both differentiable. `compiled`: each chunk's
    softmax statistics and gradient through torch.compile (the matmuls stay cuBLAS calls)."""
    logp, ent = _FusedLinearLogprobs.apply(h, weight, targets, chunk, entropy, compiled)
    return logp, (ent if entropy else None)
