"""The mixture-of-experts terms of the plan (models/moe.py), with and without expert parallelism: arithmetic only.

Shapes: T tokens of a rank's micro-batch, H hidden, k experts per token, n experts, E the expert-parallel degree
(parallel.expert_parallel), W ranks; routing counts as spread evenly (the bytes depend on T*k, not the split).
  gathered    what a block all-gathers: under EP a rank's n/E experts (their FSDP group spans the W/E ranks that
              hold the same experts), none when the experts are outside FSDP (E = W, parallel/expert.py)
  held        an unrecomputed block keeps its bf16 cast of the experts outside FSDP until its backward
  outside     the fp32 gradients of experts outside FSDP: freed every step, written again by the backward as it
              frees the activations (estimate.py counts the larger of the two at the peak)
  transient   experts outside FSDP, in one block's backward: their weight gradients in the compute dtype (and the
              recomputed cast under checkpointing) instead of FSDP's gathered and reduce-scatter buffers
  exchange    EP's all-to-all buffers while one layer's backward runs: sent, received and regrouped rows [T*k, H]
What an MoE block saves for backward is traced (activation_trace.py), not computed here. This module calls no other
planner module: the estimate and the trace call it. Design and measurements: docs/memory-plan.md.
"""

from __future__ import annotations

import torch


def eager_experts(par, world: int) -> bool:
    """Whether a GPU run keeps the experts out of its compiled graphs: under expert parallelism (the exchange), and
    on one rank with the experts outside FSDP (LocalExperts: parallel/expert.py); world 0: not known, not one."""
    from shardfit.parallel.expert import experts_run_eagerly

    return experts_run_eagerly(par.expert_parallel, world, par.offload)


def expert_params(model: torch.nn.Module) -> tuple[int, ...]:
    """Parameters of each block's experts (0 for dense blocks) of a (meta) model."""
    from shardfit.models.moe import MoE

    return tuple(sum(p.numel() for p in b.mlp.experts.parameters()) if isinstance(b.mlp, MoE) else 0
                 for b in model.model.layers)


def gathered_params(block_params: tuple[int, ...], experts: tuple[int, ...], ep: int,
                    outside: bool = False) -> tuple[int, ...]:
    """Parameters each block all-gathers in bf16 (and reduce-scatters in fp32) on one rank. Under expert
    parallelism a rank computes only its n/E experts: their FSDP group spans the W/E ranks holding the same experts
    (parallel/expert.py), so it gathers those whole, not all n; experts outside FSDP (E = W) none of them
    (outside_transient_bytes). The states stay 16 B/param/W: each rank holds a unique 1/W of every weight either
    way."""
    return tuple(b - e + (0 if outside else e // ep) for b, e in zip(block_params, experts))


def outside_transient_bytes(experts: tuple[int, ...], cfg, element: int) -> int:
    """Experts outside FSDP, in one block's backward: the grouped GEMMs' weight gradients [n/E, ...] in the compute
    dtype until _ComputeCast's backward has written them into the fp32 .grad, and under checkpointing the
    recomputed cast of the weights (not held from the forward then: held_expert_bytes)."""
    recomputed = cfg.compute.activation_checkpoint != "none"
    return max(experts, default=0) // cfg.parallel.expert_parallel * element * (2 if recomputed else 1)


def held_expert_bytes(experts: int, ep: int, world: int, element: int, offload: str = "none") -> int:
    """Expert weights an unrecomputed MoE block keeps from its forward to its backward. With E = W the experts are
    out of FSDP and cast by the computation (parallel/expert.py): the grouped GEMMs save that [n/E, ...] copy, one
    per block. Under FSDP the gathered copy is freed after the forward and gathered again for the backward: nothing
    held."""
    from shardfit.parallel.expert import experts_outside_fsdp

    return experts // ep * element if experts and experts_outside_fsdp(ep, world, offload) else 0


def outside_fsdp_params(experts: list[int], ep: int, world: int, offload: str = "none") -> int:
    """Expert parameters a rank holds outside FSDP (E = W: its n/E of every layer's; parallel/expert.py), else 0."""
    from shardfit.parallel.expert import experts_outside_fsdp

    return sum(experts) // ep if experts_outside_fsdp(ep, world, offload) else 0


def exchange_bytes(m, tokens: int, ep: int, element: int) -> int:
    """Expert parallelism's buffers while one MoE layer's backward runs (the forward's are the same size, and
    freed before the next layer): the gradient rows sent and received by the all-to-all, [T*k, H] each with
    balanced routing, and the copy regrouping the received rows by local expert (or back to arrival order)."""
    return 3 * tokens * m.experts_per_token * m.dim * element if ep > 1 and m.n_experts else 0
