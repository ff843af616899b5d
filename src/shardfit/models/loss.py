"""Fused linear cross-entropy: the loss and its gradients without materialising [N, V] fp32 logits.

For Llama-3 (V = 128,256) at 8,192 tokens per rank the full fp32 logits are 4.2 GB, and the ordinary path keeps
them plus their softmax alive until backward. Here the tokens go through in chunks: each chunk's logits exist only
inside the loop, and the gradients with respect to the hidden states and the weight are computed right there and
kept (the same size as the inputs). Backward only scales them by the incoming gradient.
"""

from __future__ import annotations

import functools

import torch

from shardfit.errors import ShardfitError


def _chunk_loss(x: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of one chunk of fp32 logits x [c, V], and its log-sum-exp [c]."""
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None]).squeeze(1)
    return ((lse - picked) * valid).sum(), lse


def _chunk_loss_and_grad(logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor):
    """(summed loss, d(loss)/d(logits) in the logits' dtype) of one chunk of logits [c, V].

    Eager, this makes one fp32 copy of the chunk and updates it in place (about eight passes over it); compiled
    (compute.compile), Inductor fuses it into a reduction and one pointwise kernel that read the bf16 logits twice
    and write the bf16 gradient once, with no fp32 [c, V] buffer at all."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 for bf16/fp16 logits; fp64 stays
    loss, lse = _chunk_loss(x, target, valid)
    probs = x.sub_(lse[:, None]).exp_()  # softmax, in place of the fp32 copy
    probs.scatter_add_(1, target[:, None], torch.full_like(lse, -1.0)[:, None])  # minus the one-hot target
    return loss, probs.mul_(valid[:, None]).to(logits.dtype), lse


@functools.cache
def compiled_once(fn, dynamic: bool = False):
    """fn through torch.compile, made on first use and once per process (and per `dynamic`): importing shardfit
    compiles nothing. The loss's and the log-probs' chunk functions (static shapes: a last short chunk is a second
    specialisation), QLoRA's dequantisation (dynamic: one function for every weight shape)."""
    return torch.compile(fn, dynamic=dynamic)


def _chunk_fn(compiled: bool):
    return compiled_once(_chunk_loss_and_grad) if compiled else _chunk_loss_and_grad


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, ignore_index: int,
                compiled: bool, token_losses: torch.Tensor | None, token_targets: torch.Tensor | None):
        # h [N, D], weight [V, D], labels [N]; token_losses [N] fp32 or None; token_targets [N] int64 or None
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = torch.promote_types(h.dtype, torch.float32)  # fp32 for bf16/fp16 inputs, fp64 stays fp64
        loss = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty_like(h) if want_h else None
        # The weight gradient is accumulated in the weight's dtype (as the unsharded FSDP gradient would be).
        grad_w = torch.zeros_like(weight) if want_w else None
        chunk_fn = _chunk_fn(compiled)
        for s in range(0, h.shape[0], chunk):
            hc, lc = h[s:s + chunk], labels[s:s + chunk]  # [c, D], [c]
            logits = hc @ weight.t()  # [c, V], freed at the end of the iteration
            valid = lc != ignore_index
            target = lc.clamp(min=0)
            # each token's loss, picked before the chunk function turns the logits into their gradient
            tt = token_targets[s:s + chunk] if token_targets is not None else None  # [c]: whose loss to report
            picked = (logits.gather(1, (target if tt is None else tt.clamp(min=0))[:, None]).squeeze(1).to(acc)
                      if token_losses is not None else None)
            if not (want_h or want_w):
                part, lse = _chunk_loss(logits.to(acc), target, valid)
                loss += part
            else:
                part, g, lse = chunk_fn(logits, target, valid)  # g = d(sum loss)/d(logits) [c, V]
                loss += part
            if token_losses is not None:
                token_losses[s:s + chunk] = (lse - picked) * (valid if tt is None else tt >= 0)
            if not (want_h or want_w):
                continue
            if want_h:
                grad_h[s:s + chunk] = g @ weight
            if want_w:
                grad_w.addmm_(g.t(), hc)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None, None


def liger_available() -> bool:
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


def choose_loss_kernel(kind: str, device: torch.device) -> str:
    """compute.kernels resolved for the device: "liger" (Liger-Kernel's fused loss) where asked or, with "auto", where
    CUDA and the package are there; else "torch" (this module's)."""
    if kind == "liger" and (device.type != "cuda" or not liger_available()):
        raise ShardfitError("compute.kernels=liger needs CUDA and the liger-kernel package",
                            where="compute.kernels", fix="pip install 'shardfit[liger]' on a GPU machine, or use auto")
    if kind == "auto":
        return "liger" if device.type == "cuda" and liger_available() else "torch"
    return kind


def fused_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int = 1024,
                               ignore_index: int = -100, impl: str = "torch", compiled: bool = False,
                               token_losses: torch.Tensor | None = None,
                               token_targets: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over tokens with label != ignore_index of cross_entropy(h @ weight.T, label), as an fp32 scalar.

    impl "liger": Liger-Kernel's Triton kernel (CUDA only; optional extra), which also computes the gradients in
    forward but fuses the softmax, its gradient and the loss into one pass over each logits chunk, and accumulates
    the weight gradient in fp32. "torch": the chunked pure-PyTorch version above (any device); `compiled` runs its
    per-chunk softmax and gradient through torch.compile. token_losses ("torch" only): an [N] buffer that receives
    each token's loss (0 where ignored), the values the sum adds up; with token_targets [N], each token's loss for
    that target instead (0 where negative), so that tokens outside the sum (a prompt's) report theirs too."""
    if impl == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        # positional: input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing,
        # reduction, softcap, return_z_loss, accum_dtype
        loss = LigerFusedLinearCrossEntropyFunction.apply(h, weight, labels, None, None, ignore_index, 0.0, 0.0,
                                                          "sum", None, False, torch.float32)[0]
        return loss.float()
    return _FusedLinearCrossEntropy.apply(h, weight, labels, chunk, ignore_index, compiled, token_losses,
                                          token_targets)
