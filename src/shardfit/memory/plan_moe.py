"""`shardfit plan` for mixture-of-experts blocks (models/moe.py), with and without expert parallelism.

Shapes: T tokens of a rank's micro-batch, H hidden, k experts per token, I expert inner size, n experts, E the
expert-parallel degree (parallel.expert_parallel), W ranks; bf16 activations (2 bytes an element).

What an MoE layer saves for backward is counted by running the model's own MoE.forward on the meta device (see
meta_moe): the router, the sort of (token, slot) pairs by expert, the gather h[order // k] -> xs [T*k, H], the
scatter back to token order and the routing-weighted combine are the model's code; only the expert computation
comes from here, as the model's MoE.exchange hook (the one expert parallelism uses), and it is the CUDA path of
Experts.forward (one grouped GEMM per projection: the meta device cannot take that branch, whose test is
`xs.is_cuda`, and the CPU's per-expert loop saves per-expert pieces and is what selective checkpointing would see
as matmuls, which the grouped GEMM is not). Routing counts as spread evenly: the bytes depend on T*k, not the split.

Per MoE layer, eager (Qwen3-30B-A3B, T = 8,192: T*k = 65,536, H = 2,048, I = 768):
  xs [T*k, H] (256 MiB: the grouped GEMMs' input), g and u [T*k, I], SiLU(g) and SiLU(g)*u [T*k, I] (4 x 96 MiB),
  the combine's input [T*k, H] (256 MiB), the router's input [T, H], its fp32 probabilities [T, n], indices.
Compiled (parallel.compile): the decoder block calls the MoE phases itself, so without EP a compiled block is one
graph, split by Inductor's min-cut partitioner; compiled_saved_bytes traces it so (dynamo on the meta device) and
counts what the forward graph hands to its backward: in the MoE part xs, g, u, SiLU(g)*u and the combine's input;
SiLU(g) is recomputed (-96 MiB a layer). Expert parallelism: the exchange (parallel/expert.py) is left out of
torch.compile, so the block is two graphs around it and the experts run eagerly (SiLU(g) saved again, and the
routing weights, an input of the combine graph); the rows a rank's experts receive, regrouped by local expert, are
what its grouped GEMMs save: about T*k rows with balanced routing, as many as it sends. With E = W the experts are
out of FSDP and an unrecomputed block holds its bf16 copy of them until its backward (held_expert_bytes); their
fp32 gradients are freed after every step and written again by the backward as it frees the activations
(outside_fsdp_params; plan.estimate counts the larger of the two at the peak, both under accumulation).

Measured on 2 x H200 (benchmarks/results/2026-11-23_s8_h200x2_moe2.json, 12 layers, micro-batch 2): full AC 68.6
GiB (plan 68.6), no AC 83.6 (86.1, +3.0%), compiled 79.0 (80.9, +2.4%), compiled EP 2 86.1 (86.5, +0.5%; session
9, the experts' gradients freed: 72.5, plan 73.0, +0.7%). What is
left over without EP (~2.5 GiB) is not the activations (eager - compiled: measured 4.6 GiB, counted 4.3): the plan
adds two gathered blocks and one fp32 reduce-scatter input (3.5 GiB for a 623M-parameter block; 1.2 with EP 2) to
every block's activations, a sum the dense blocks' peaks match but whose moments may not coincide here.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch


def eager_experts(par, world: int) -> bool:
    """Whether a GPU run keeps the experts out of its compiled graphs: under expert parallelism (the exchange), and
    on one rank with the experts outside FSDP (LocalExperts: parallel/expert.py); world 0: not known, not one."""
    from shardfit.parallel.expert import experts_run_eagerly

    return experts_run_eagerly(par.expert_parallel, world, par.offload)


def _grouped_experts(xs: torch.Tensor, counts: torch.Tensor, experts) -> torch.Tensor:
    """Experts.forward's CUDA path (the meta device cannot take its is_cuda branch): xs [N, H] sorted by expert,
    counts [n] -> [N, H]."""
    return experts.run_grouped(xs, counts)


def meta_moe(moe, eager_experts: bool) -> None:
    """Make a meta MoE layer run its own forward with the CUDA expert path; with eager_experts (expert parallelism,
    or experts outside FSDP on one rank) left out of torch.compile as ExpertExchange and LocalExperts are (the
    all-to-alls themselves save nothing for backward: their backward is the reverse exchange). The exchange's
    buffers are exchange_bytes."""
    moe.exchange = torch.compiler.disable(_grouped_experts) if eager_experts else _grouped_experts
    # private copies of the code: dynamo keeps compiled graphs (and counts recompiles) per code object, so the
    # plan's traces on meta tensors must not fill the caches the training run's frames will use (MoE.run becomes a
    # frame of its own when the exchange breaks the block's graph)
    for name in ("forward", "run"):
        setattr(moe, name, types.MethodType(_fresh(getattr(type(moe), name)), moe))


def _fresh(fn):
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled_saved_bytes(block: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes a compiled MoE block saves for backward: torch.compile of the block's forward (dynamo, with the graph
    breaks the GPU run has), each graph split by the partitioner Inductor uses, run on meta tensors; the tensors
    the compiled forwards save are counted by storage, parameters (and views of them) excluded."""
    compiled = torch.compile(types.MethodType(_fresh(type(block).forward), block), backend=_backend(), dynamic=False)
    with saved_storages(block) as saved:
        compiled(*inputs)
    return sum(saved.values())


@contextlib.contextmanager
def saved_storages(module: torch.nn.Module):
    """Within: every tensor autograd saves for backward, counted once per storage ({storage: bytes}, yielded), the
    module's parameters and views of them excluded (they are counted as weights, not activations)."""
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in params:
            seen[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


@functools.cache
def _backend():
    """AOTAutograd with Inductor's partitioner, its graphs run as they are (on meta tensors): what Inductor would
    compile is split the same way, and only the split matters here."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                        bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))


def expert_params(model: torch.nn.Module) -> tuple[int, ...]:
    """Parameters of each block's experts (0 for dense blocks) of a (meta) model."""
    from shardfit.models.moe import MoE

    return tuple(sum(p.numel() for p in b.mlp.experts.parameters()) if isinstance(b.mlp, MoE) else 0
                 for b in model.model.layers)


def gathered_params(block_params: tuple[int, ...], experts: tuple[int, ...], ep: int,
                    outside: bool = False) -> tuple[int, ...]:
    """Parameters each block all-gathers in bf16 (and reduce-scatters in fp32) on one rank. Under expert
    parallelism a rank computes only its n/E experts: their FSDP group spans the W/E ranks holding the same experts
    (parallel/expert.py), so it gathers those whole, not all n (Qwen3-30B-A3B, E = 2: 321M of a block's 623M
    parameters); experts outside FSDP (E = W) none of them (outside_transient_bytes). The states stay
    16 B/param/W: each rank holds a unique 1/W of every weight either way."""
    return tuple(b - e + (0 if outside else e // ep) for b, e in zip(block_params, experts))


def outside_transient_bytes(experts: tuple[int, ...], par, element: int) -> int:
    """Experts outside FSDP, in one block's backward: the grouped GEMMs' weight gradients [n/E, ...] in the compute
    dtype until _ComputeCast's backward has written them into the fp32 .grad, and under checkpointing the
    recomputed cast of the weights (not held from the forward then: held_expert_bytes). Qwen3-30B-A3B on one
    rank: 1.1 GiB (2.3 GiB checkpointed) where FSDP's terms counted 4.6 GiB of gathered and reduce-scatter buffers
    (measured on one H200: the plan +5.2% with those, see tests/memory/test_plan.py)."""
    recomputed = par.activation_checkpoint != "none"
    return max(experts, default=0) // par.expert_parallel * element * (2 if recomputed else 1)


def held_expert_bytes(experts: int, ep: int, world: int, element: int, offload: str = "none") -> int:
    """Expert weights an unrecomputed MoE block keeps from its forward to its backward. With E = W the experts are
    out of FSDP and cast by the computation (parallel/expert.py): the grouped GEMMs save that [n/E, ...] copy, one
    per block (Qwen3-30B-A3B, E = 2: 604 MiB a layer). Under FSDP the gathered copy is freed after the forward and
    gathered again for the backward: nothing held."""
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
