"""Expert parallelism (parallel.expert_parallel = E): each rank of a group of E neighbouring ranks holds n_experts/E
of every MoE layer's experts, and the routed rows travel to the rank of their expert and back by all-to-all.
The design, layouts and syncs: docs/expert-parallel.md.

Mesh: (efsdp = W/E, ep = E), rank r at EP position r % E; with HSDP (replicate R) (replicate, efsdp, ep). Expert
weights keep their global shape [n_experts, ...] as DTensors sharded over "ep", then FSDP-sharded over "efsdp"
(whose reduce-scatter divides by W: the all-to-all's backward already brought every token's contribution home).
E = W (a world of one included) keeps the experts out of FSDP: the computation casts them (_ComputeCast) and its
backward writes param.grad in one fp32 pass.
Collectives, per MoE layer and micro-batch, the same on every rank whatever its routing (empty splits included):
all-to-all of the counts [n] int64; ONE host sync (the split sizes); all-to-all of the rows [N, H] to their
experts' ranks and the reverse all-to-all of the results. Recomputation under checkpointing repeats them with the
same splits. The exchange runs outside torch.compile (data-dependent sizes); parallel/expert_overlap.py hides it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardfit.kernels import scaled_accumulate_, scaled_cast
from shardfit.models.moe import Experts, MoE, inverse_permutation, permute_rows
from shardfit.parallel.dtensor import local_tensor
from shardfit.parallel.layout import ParallelLayout


class _ComputeCast(torch.autograd.Function):
    """param (an fp32 expert stack: a DTensor sharded over ep, or a plain tensor) -> this rank's slice [n/E, ...] in
    the compute dtype, as `uses` outputs (one per use of the experts in the layer: the overlapped exchange runs them
    twice) that share one cast. The backward writes param.grad itself, divided by `divide` (the world size: FSDP's
    reduction would have divided by it), in fp32 and in one pass over memory per use (kernels/scaled_accumulate.py):
    a new gradient for the first, added in place to the kept one afterwards. It returns no gradient, so autograd's
    AccumulateGrad does nothing for param: its own accumulation would be a second fp32 pass over the gradient, and
    the bf16 -> fp32 cast through PyTorch's mixed-dtype ops is not vectorized.
    So this is for .backward() only: torch.autograd.grad would not see param's gradient (and create_graph is
    refused), and tensor hooks on param get None (post-accumulate-grad hooks run: .grad is written first)."""

    @staticmethod
    def forward(ctx, param, dtype, divide, uses=1):
        ctx.param, ctx.divide = param, divide
        w = local_tensor(param)
        w = w.to(dtype) if w.dtype != dtype else w.view_as(w)
        return w if uses == 1 else tuple(w.view_as(w) for _ in range(uses))

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("experts outside FSDP write their gradients in place: no create_graph / double backward")
        p, scale = ctx.param, 1.0 / ctx.divide
        for grad in grads:
            if grad is None:
                continue
            if p.grad is not None:
                scaled_accumulate_(local_tensor(p.grad), grad, scale)
                continue
            g = scaled_cast(grad, scale, p.dtype)
            if isinstance(p, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride())
            p.grad = g
        return None, None, None, None


class ShardedExperts(Experts):
    """Experts whose weights are DTensors sharded over the EP group: the computation reads this rank's slice
    [n/E, ...] (to_local is differentiable: the gradient arrives as a DTensor of the same placement). Outside FSDP
    (E = W) compute_dtype is set and the slice is cast here (module docstring: E = W). apply_expert_parallel makes
    the model's Experts one in place (sharded_class): the same module, parameter names (checkpoints unchanged) and
    whatever else its class reads: every parameter of weight_params() is sharded and cast alike (LoRA adapters on
    the experts, adapters/expert_lora.py, included: a frozen parameter's cast simply takes no gradient)."""

    compute_dtype: torch.dtype | None = None  # set by shard_experts when the experts stay out of FSDP
    grad_divide = 1.0
    # parallel/gathered.py's one cast per pass: weight_params() cast (this rank's slices) for the no-grad pass under
    # way, [] until its first forward; None outside such a pass (a cast per forward, as autograd needs)
    pass_cast: list[torch.Tensor | None] | None = None

    def weights(self):
        return self.weight_uses(1)[0]

    def weight_uses(self, uses: int) -> list[tuple[torch.Tensor | None, ...]]:
        """weight_params() as local tensors, for each of `uses` runs of the experts in one layer
        (parallel/expert_overlap.py)."""
        params = self.weight_params()
        if self.compute_dtype is None:
            return [tuple(None if w is None else w.to_local() for w in params)] * uses
        if self.pass_cast is not None and not torch.is_grad_enabled():  # cast once for the whole no-grad pass
            if not self.pass_cast:
                self.pass_cast[:] = [None if w is None else local_tensor(w).to(self.compute_dtype) for w in params]
            return [tuple(self.pass_cast)] * uses
        cast = [(None,) * uses if w is None else _ComputeCast.apply(w, self.compute_dtype, self.grad_divide, uses)
                for w in params]
        return list(zip(*(c if isinstance(c, tuple) else (c,) for c in cast)))  # one use: a tensor each


_SHARDED: dict[type, type] = {Experts: ShardedExperts}


def sharded_class(cls: type) -> type:
    """The sharded class of an experts class: ShardedExperts, or for a subclass of Experts (adapters/expert_lora.py's
    LoRAExperts) a class made once whose weights are ShardedExperts' and whose computation is that subclass's."""
    if cls not in _SHARDED:
        _SHARDED[cls] = type(f"Sharded{cls.__name__}", (ShardedExperts, cls), {})
    return _SHARDED[cls]


def fresh_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters whose gradient the computation writes itself, fresh every step (_ComputeCast: experts outside
    FSDP): the step runners free them after each step whatever memory.keep_grads says (step_overlap.zero_grads).
    Read from the model when a runner is built, so they are the materialized parameters, not the meta ones."""
    return [p for m in outside_fsdp_experts(model) for p in m.parameters()]


def outside_fsdp_experts(model: nn.Module) -> list[ShardedExperts]:
    """The experts modules kept out of FSDP (E = W), which cast their own weights at each forward (_ComputeCast)."""
    return [m for m in model.modules() if isinstance(m, ShardedExperts) and m.compute_dtype is not None]


class _AllToAll(torch.autograd.Function):
    """x [sum(send), H] -> [sum(recv), H]: rows send[p] to peer p, recv[p] from it; backward the reverse exchange.
    A plain c10d collective (the host does not wait for it; torch 2.11 runs it on the current stream), not a
    functional one: those wrap the result in a tensor subclass whose dispatch costs host time at every later op
    on it, and the EP forward is bound by its host."""

    @staticmethod
    def forward(ctx, x, recv, send, group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        return _exchange(x, recv, send, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.send, ctx.recv, ctx.group), None, None, None


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class ExpertExchange:
    """MoE.exchange under EP: (rows [N, H] sorted by global expert, counts [n], experts) -> outputs [N, H] in the
    same order, each row computed by the rank holding its expert. See the module docstring for the steps."""

    def __init__(self, group: dist.ProcessGroup, ep: int, n_experts: int, position: int):
        self.group, self.ep, self.local, self.position = group, ep, n_experts // ep, position
        self.n_experts = n_experts

    @torch.compiler.disable
    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        ep, local = self.ep, self.local
        # 1. received[p, j]: rows peer p sends to this rank's local expert j
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(ep, local)
        # 2. the only host sync: rows to and from each peer
        send, recv = torch.stack([counts.view(ep, local).sum(1), received.sum(1)]).tolist()
        return self.run(xs, received, send, recv, experts)

    def run(self, xs, received, send, recv, experts):
        # 3. rows out, ordered (source peer, local expert) on arrival; regrouped by local expert for the GEMM
        rows = _AllToAll.apply(xs, recv, send, self.group)  # [M, H]
        back = run_arrived(experts, rows, received)  # FSDP's hooks (efsdp gather) run here
        return _AllToAll.apply(back, send, recv, self.group)  # [N, H], the rows' original order


class LocalExperts(ExpertExchange):
    """MoE.exchange of a world of one (E = W = 1): nothing to exchange. The experts are outside FSDP as with E = W
    (over one rank FSDP would cast the fp32 weights and copy them into its "all-gather" output in forward and again
    in backward, and copy the bf16 gradient into an fp32 reduce-scatter input, then out: ~48 B a parameter a step
    against the cast's 6 + the gradient write's 6: docs/moe.md, "One GPU"). They run here, outside the compiled graph as
    under EP (the cast's backward writes param.grad itself, which a graph cannot hold); the block's graph breaks in
    two around them."""

    @torch.compiler.disable
    def __call__(self, xs: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        return experts(xs, counts)


def run_arrived(experts: nn.Module, rows: torch.Tensor, received: torch.Tensor, weights=None) -> torch.Tensor:
    """rows [M, H] as they arrived (ordered peer, then local expert), received [P, n/E] their counts -> the experts'
    results [M, H] in the same order: regrouped by local expert for the GEMMs, then put back."""
    dest = regroup_destinations(received, rows.shape[0])  # arrival row -> its row in local-expert order
    order = inverse_permutation(dest)
    ys = experts(permute_rows(rows, order, dest), received.sum(0), weights=weights)
    return permute_rows(ys, dest, order)  # arrival order again


def regroup_destinations(received: torch.Tensor, rows: int) -> torch.Tensor:
    """received [E, n/E] rows from peer p for local expert j -> dest [rows]: where each arrival row (ordered peer,
    then expert, then as sent) goes when the rows are ordered expert, then peer (the stable sort by local expert).
    Arithmetic, not a sort: a block (p, j) moves by its start in the target order minus its start on arrival
    (two exclusive cumsums over E x n/E counts), so each row's destination is its index plus its block's shift
    (a few small kernels where the radix sort took about twenty launches a layer). rows = received.sum(), known on
    the host after the exchange's sync: repeat_interleave would otherwise read it there again."""
    flat = received.reshape(-1)  # (p, j) order
    arrival = flat.cumsum(0) - flat
    by_expert = received.t().reshape(-1)  # (j, p) order
    target = (by_expert.cumsum(0) - by_expert).view(received.shape[1], received.shape[0]).t().reshape(-1)
    shift = (target - arrival).repeat_interleave(flat, output_size=rows)
    return torch.arange(rows, device=received.device) + shift


def apply_expert_parallel(model: nn.Module, mesh, exchange: type[ExpertExchange] = ExpertExchange) -> list[MoE]:
    """On the meta model (parallelize step 0): each MoE layer's experts become ShardedExperts (in place) whose
    weights are DTensors sharded over mesh["ep"] along the experts (the layout's expert mesh), and each layer
    exchanges its rows through the EP group with `exchange` (or its overlapped form, parallel/expert_overlap.py).
    Returns the MoE layers."""
    from torch.distributed.tensor import Shard

    ep_mesh = mesh["ep"]
    ep, pos = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        experts = moe.experts
        n = experts.gate_proj.shape[0]
        for name, p in list(experts.named_parameters(recurse=False)):  # every one is stacked [n, ...]
            local = p.detach()[pos * n // ep:(pos + 1) * n // ep]  # meta: a view, no memory
            d = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(experts, name, nn.Parameter(d, requires_grad=p.requires_grad))
        experts.__class__ = sharded_class(type(experts))  # in place: the module and its names stay
        moe.exchange = exchange(ep_mesh.get_group(), ep, n, pos)
    return layers


def experts_outside_fsdp(ep: int, world: int, offload: str = "none") -> bool:
    """ParallelLayout.experts_outside_fsdp for these degrees (the planner's name; world 0: not known)."""
    return ParallelLayout(world, expert=ep, offload=offload).experts_outside_fsdp


def experts_run_eagerly(ep: int, world: int, offload: str = "none") -> bool:
    """ParallelLayout.experts_run_eagerly for these degrees (the planner's name; world 0: not known)."""
    return ParallelLayout(world, expert=ep, offload=offload).experts_run_eagerly


def shard_experts(block: nn.Module, layout: ParallelLayout, mesh, mp_policy, **fsdp_kwargs) -> set[nn.Parameter]:
    """parallelize step 3, before the block's own fully_shard: the block's experts form an FSDP group of their own
    over the expert mesh's "efsdp" dim (HSDP: "replicate", "efsdp"), whose gradient reduction divides by the world
    size (module docstring: Gradients); or, with E = W, stay out of FSDP: returns the parameters the block's and the
    root's fully_shard must then ignore."""
    moe = getattr(block, "mlp", None)
    if not isinstance(moe, MoE) or moe.exchange is None:
        return set()
    world, hsdp = layout.world, layout.replicate > 1
    if not hsdp and layout.experts_outside_fsdp:
        moe.experts.compute_dtype = mp_policy.param_dtype or moe.experts.gate_proj.dtype
        moe.experts.grad_divide = float(world)
        return set(moe.experts.parameters())
    fully_shard(moe.experts, mesh=mesh["replicate", "efsdp"] if hsdp else mesh["efsdp"], mp_policy=mp_policy,
                **fsdp_kwargs)
    moe.experts.set_gradient_divide_factor(float(world))
    if mesh["efsdp"].size() > 1 and dist.get_backend(mesh["efsdp"].get_group()) == "gloo":
        # A divide factor other than the group's size is NCCL's PREMUL_SUM, which gloo lacks: FSDP then sums and
        # divides by the factor itself (the CPU runs: one pass more, no numerical difference in fp32). Not for a
        # group of one rank: FSDP skips the collective and divides by the factor as it copies, and forcing the
        # sum there divides twice (tests/parallel/test_expert_parallel.py compares the gradient norms).
        moe.experts.set_force_sum_reduction_for_comms(True)
    return set()
