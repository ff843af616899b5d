"""The losses of the Engine's one step path: the only thing that differs between `shardfit train`, the RL API and the
Tinker server. A loss turns one micro-batch (engine/batch.py DeviceBatch) into (summed loss, per-token outputs).

Two normalisations, which decide how the Engine scales the gradients (engine/engine.py):
  mean_over_tokens  the summed loss is divided by the global batch's loss tokens, a count known only after the
                    step's one stats collective: each micro-batch backpropagates loss / C (C: this rank's token
                    capacity of the pass, the same on every rank) and optim_step multiplies by world x C / N, the
                    gradient of the mean token loss over the global batch. The trainer's cross-entropy.
  coefficients      each token's coefficient c_t, made on the host from the whole global batch (rl/losses.py),
                    already normalises: sum_t c_t l_t is backpropagated as it is and optim_step multiplies by world
                    (FSDP averages over ranks).
MoE models add the router's load-balancing term per micro-batch, weighted as the micro-batch's tokens are: by its
loss tokens (then / N) for the mean, by the sum of its coefficients for a coefficient loss. For `token_mean` the two
are the same weight, n_mb / N: the objective `shardfit train` optimises.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shardfit.engine.batch import DeviceBatch


class Loss:
    mean_over_tokens: bool = False
    outputs: tuple[str, ...] = ()  # per-token outputs, gathered in the pass's collective (flat [n] fp32 each)

    def __call__(self, model: torch.nn.Module, b: DeviceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError


class CrossEntropy(Loss):
    """The fused linear cross-entropy summed over the labels != -100 (no [N, V] logits), mean over the global
    batch's loss tokens. logprobs=True also returns each token's log-probability, -(its cross-entropy): the
    values the sum is made of. router_aux=False leaves the MoE term out (validation's figure)."""

    mean_over_tokens = True

    def __init__(self, logprobs: bool = False, router_aux: bool = True):
        self.outputs = ("logprobs",) if logprobs else ()
        self.router_aux = router_aux

    def __call__(self, model, b):
        per_token = torch.zeros(b.labels.numel(), dtype=torch.float32, device=b.labels.device) if self.outputs else None
        # the RL API's datums report every target's log-prob, in the sum or not (rl/pack.py: "target_tokens")
        loss = model(b.input_ids, b.labels, b.position_ids, b.mask, router_aux=self.router_aux,
                     token_losses=per_token, token_targets=b.inputs.get("target_tokens"))
        return loss, ({"logprobs": -per_token} if per_token is not None else {})


TokenFn = Callable[[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]], torch.Tensor]


class TokenLoss(Loss):
    """sum_t c_t x l_t, l = fn(logp, entropy, inputs) [n] from the per-token log-probabilities of the labels (and
    entropies) through the chunked head of models/logprobs.py; c_t the batch's coefficients (0 in padding). The
    outputs are the log-probs (and entropies), 0 where the head scored nothing."""

    def __init__(self, fn: TokenFn, entropy: bool = False):
        self.fn, self.entropy = fn, entropy
        self.outputs = ("logprobs", "entropy") if self.entropy else ("logprobs",)

    def __call__(self, model, b):
        logp, ent = scored_logprobs(model, b, self.entropy)
        terms = b.coef * self.fn(logp, ent, b.inputs)  # c_t l_t [n]
        total = with_router_aux(model, b, terms.sum())
        out = {"logprobs": logp, "entropy": ent} if ent is not None else {"logprobs": logp}
        out["terms"] = terms  # not gathered: a pass of several models sums them per model (engine/multi_model.py)
        return total, out


def scored_logprobs(model: torch.nn.Module, b: DeviceBatch,
                    entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-prob of each label [n], entropy [n] or None) through the chunked head (0 where nothing is scored)."""
    logp, ent = model(b.input_ids, b.labels, b.position_ids, b.mask, logprobs=True, entropy=entropy, rows=b.rows)
    return logp.flatten(), (ent.flatten() if ent is not None else None)


def with_router_aux(model: torch.nn.Module, b: DeviceBatch, total: torch.Tensor) -> torch.Tensor:
    """A coefficient loss plus the MoE load-balancing term, weighted by the micro-batch's sum of coefficients."""
    aux = model.router_aux_term(b.coef.sum()) if torch.is_grad_enabled() else None
    return total + aux if aux is not None else total
