"""Mixture-of-experts feed-forward (Qwen3-MoE): top-k softmax router, experts stacked in 3-D parameters.
The design and the load metrics: docs/moe.md; expert parallelism: docs/expert-parallel.md.

The expert computation is one fixed graph whatever the routing: tokens are sorted by expert and every expert runs
on its slice, empty or not (or one grouped matmul on CUDA in bf16). So a rank whose tokens go to different experts
issues the same operations, and activation checkpointing's recomputation saves exactly the tensors the forward
saved (a loop over only the experts that received tokens breaks both).
The results return to token order by a permutation, not atomics: forward and backward are deterministic.
Host syncs: none on the CUDA path (counts per expert by scatter-add, not torch.bincount); the CPU loop reads the
counts. No distributed code: MoE.exchange (set by parallel/) is the seam for expert parallelism.

Shapes: T tokens, H hidden, E experts, k experts per token, I expert inner size.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Routing(NamedTuple):
    """One micro-batch's routing: xs [T*k, H] the tokens' rows sorted by expert (in the exchange's order of experts,
    MoE.exchange), counts [E] rows per expert (expert order), weights
    [T, k] the routing weights, order [T*k] the sort of (token, slot) pairs and inverse [T*k] its inverse."""

    xs: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor


class _PermuteRows(torch.autograd.Function):
    """x [N, H] -> x[index], index a permutation of range(N) and inverse its inverse. The backward is the inverse
    gather: no scatter with atomics and no zero-filled gradient buffer, which autograd's backward of x[index] (an
    accumulating index_put) costs."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _DispatchRows(torch.autograd.Function):
    """h [T, H] -> h[order // k] [T*k, H]: each token's row once per routing slot, in expert order. The backward puts
    the rows' gradients back in (token, slot) order with the inverse permutation and sums each token's k slots:
    a gather and a sum instead of an accumulating scatter."""

    @staticmethod
    def forward(ctx, h, order, inverse, k):
        ctx.save_for_backward(inverse)
        ctx.k = k
        return h.index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse).view(-1, ctx.k, grad.shape[-1]).sum(1), None, None, None


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert [E] of the routed ids [T*k]: a scatter-add of ones on the device. torch.bincount would read the
    ids' maximum on the host to size its output (a host sync in every MoE layer's forward, recomputation included,
    and a graph break under torch.compile)."""
    return torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[j]] = j, on the device (a scatter of N int64: no sort, no sync)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def permute_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _PermuteRows.apply(x, index, inverse)


def weighted_slot_sum(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """rows [T, k, H], weights [T, k] -> sum_s weights[:, s] x rows[:, s] [T, H], the products in rows' dtype summed
    in fp32 (as the sum over dim 1 it replaced). The k slots as k terms, not a reduction over dim 1: compiled, the
    permutation's gather before it then fuses into one pointwise kernel whose loads run along H (Inductor's reduction
    over k = 8 ran far under the memory bandwidth: benchmarks/README.md#rl-2x, bench_moe_combine.py). Autograd saves
    each product's operands: views of rows and weights, no fp32 copy (the .float() of a product saves nothing). Eager
    (compute.compile off), the reduction itself, the same bits: there each slot's rows[:, s] would take a
    SelectBackward writing a zeroed [T, k, H] gradient, k of them summed (~4.5x the bytes the reduction's backward
    writes)."""
    if not torch.compiler.is_compiling():
        return (rows * weights[..., None]).sum(dim=1)
    acc = (rows[:, 0] * weights[:, 0, None]).float()
    for s in range(1, rows.shape[1]):
        acc = acc + (rows[:, s] * weights[:, s, None]).float()
    return acc.to(rows.dtype)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [N, in] sorted by expert, w [E, out, in], offs [E] int32 (cumulative rows) -> [N, out]: each expert's rows
    times its w[e]^T, one grouped GEMM. grouped_mm wants rows of 16 bytes' multiples (a LoRA adapter's rank of 4 in
    bf16 is 8 bytes): a narrower in or out is zero-padded to one, the padded outputs dropped (nothing else changes)."""
    align = 16 // x.element_size()
    out_f, in_f = w.shape[-2:]
    pad_in, pad_out = -in_f % align, -out_f % align
    if pad_in or pad_out:
        x, w = F.pad(x, (0, pad_in)), F.pad(w, (0, pad_in, 0, pad_out))
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    return y[:, :out_f] if pad_out else y


def split_linear(x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """grouped_linear as a loop: expert e's sizes[e] rows of x [N, in] times w[e]^T, every expert, every call."""
    return torch.cat([F.linear(part, w[e]) for e, part in enumerate(x.split(sizes))])


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights; the checkpoint stores them per expert (see shardfit.weights.hf_load)."""

    def __init__(self, n_experts: int, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # [E, I, H]
        self.up_proj = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))  # [E, I, H]
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))  # [E, H, I]

    def weight_params(self) -> tuple[nn.Parameter | None, ...]:
        """The parameters the computation reads, in the order `swiglu` takes them: (gate, up, down); a subclass may
        read more (adapters/expert_lora.py: LoRA adapters on the experts), each stacked [E, ...] along the experts."""
        return self.gate_proj, self.up_proj, self.down_proj

    def weights(self) -> tuple[torch.Tensor | None, ...]:
        """weight_params() as the computation reads them (expert parallelism, parallel/expert.py, swaps in a
        subclass whose weights are this rank's experts, in the compute dtype)."""
        return self.weight_params()

    def forward(self, xs: torch.Tensor, counts: torch.Tensor, weights=None) -> torch.Tensor:
        """xs [N, H] sorted by expert, counts [E] rows per expert -> [N, H] in the same order. weights: what
        self.weights() gives, to use instead (an exchange that runs the experts twice a layer)."""
        if xs.is_cuda and xs.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            return self.run_grouped(xs, counts, weights)
        return self.run_split(xs, counts.tolist(), weights)

    def run_grouped(self, xs: torch.Tensor, counts: torch.Tensor, weights=None) -> torch.Tensor:
        """One grouped GEMM per projection over every expert (the CUDA bf16 path, and shardfit plan's model of it):
        grouped_mm saves its input for backward, SiLU(g) * u saves g and u."""
        offs = counts.cumsum(0).to(torch.int32)  # stays on the device: no host sync
        return self.swiglu(xs, functools.partial(grouped_linear, offs=offs), weights or self.weights())

    def run_split(self, xs: torch.Tensor, sizes: list[int], weights=None) -> torch.Tensor:
        """Every expert, every call, on its `sizes[e]` rows of xs (the path off CUDA/bf16)."""
        return self.swiglu(xs, functools.partial(split_linear, sizes=sizes), weights or self.weights())

    def swiglu(self, xs: torch.Tensor, linear, weights) -> torch.Tensor:
        """xs [N, H] -> down(SiLU(gate xs) * up xs) [N, H], each projection `linear(x, w [E, out, in])` over the
        experts' row groups (grouped_linear or split_linear)."""
        gate, up, down = weights
        return linear(F.silu(linear(xs, gate)) * linear(xs, up), down)


class MoE(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, ffn_dim: int, norm_topk_prob: bool,
                 track_router: bool = False, balance_bias: bool = False):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(dim, n_experts, bias=False)  # the router
        self.experts = Experts(n_experts, dim, ffn_dim)
        # With an auxiliary loss: (fraction of routing slots per expert [k, E], no grad; mean router probability
        # per expert [E]) of the last forward. Recomputation under checkpointing overwrites them with equal values;
        # the loss already holds the forward's tensors, whose backward runs inside this block's backward.
        self.track_router = track_router
        self.router_stats: tuple[torch.Tensor, torch.Tensor] | None = None
        # How the sorted rows reach their experts: None runs them here; expert parallelism (parallel/expert.py)
        # sets a callable (rows [N, H], counts [E], experts) -> [N, H] that exchanges them with the ranks holding
        # the other experts; its sort_keys(ids [T*k]), if it has one, gives the keys the rows are sorted by (ids that
        # put this rank's own experts first).
        self.exchange = None
        # Rows routed to each expert [E] by the last forward (a recomputation writes the same values): the Engine
        # sums them over the step's micro-batches and ranks for the load metrics and the balancing bias.
        self.load: torch.Tensor | None = None
        # Auxiliary-loss-free balancing (DeepSeek-V3, model.router_bias_rate): a bias [E] added to the routing
        # probabilities for the choice of experts only (the weights stay the probabilities), raised for underloaded
        # experts and lowered for overloaded ones after each step (update_balance_bias). A persistent buffer: saved
        # and resumed with the model, equal on every rank because every rank applies the same global update.
        if balance_bias:
            self.register_buffer("balance_bias", torch.zeros(n_experts, dtype=torch.float32))
        else:
            self.balance_bias = None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (weights [T, k] in h's dtype, expert ids [T, k])."""
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float32)  # [T, E]
        if self.balance_bias is None:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            ids = torch.topk(probs + self.balance_bias, self.top_k, dim=-1).indices
            weights = probs.gather(-1, ids)
        if self.track_router:
            slots = F.one_hot(ids, probs.shape[-1]).float().mean(0)  # [k, E]
            self.router_stats = (slots.detach(), probs.mean(0))
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(h.dtype), ids

    def dispatch(self, x: torch.Tensor) -> Routing:
        """x [..., H] -> its tokens' rows sorted by expert, with what run and combine need."""
        h = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, ids = self.route(h)
        flat = ids.reshape(-1)  # [T*k]
        # (token, slot) pairs grouped by expert, in the order the exchange asks for (expert order without one)
        sort_keys = getattr(self.exchange, "sort_keys", None)
        keys = flat if sort_keys is None else sort_keys(flat)
        order = torch.argsort(keys, stable=True)
        counts = expert_counts(flat, self.experts.gate_proj.shape[0])  # [E]
        self.load = counts.detach()
        inverse = inverse_permutation(order)
        xs = _DispatchRows.apply(h, order, inverse, self.top_k)  # [T*k, H]
        return Routing(xs, counts, weights, order, inverse)

    def run(self, r: Routing) -> torch.Tensor:
        """The experts on the sorted rows: [T*k, H] -> [T*k, H] in the same order (here, or through the exchange)."""
        return self.experts(r.xs, r.counts) if self.exchange is None else self.exchange(r.xs, r.counts, self.experts)

    def combine(self, ys: torch.Tensor, r: Routing, shape: torch.Size) -> torch.Tensor:
        """ys [T*k, H] sorted by expert -> the routing-weighted sum per token, in `shape`."""
        out = permute_rows(ys, r.inverse, r.order)  # back to (token, slot) order: out[order[j]] = ys[j]
        return weighted_slot_sum(out.view(-1, self.top_k, shape[-1]), r.weights).view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The decoder block calls the three phases itself (models/decoder.py says why)
        r = self.dispatch(x)
        return self.combine(self.run(r), r, x.shape)


@torch.no_grad()
def update_balance_bias(moe_layers: list[MoE], load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's update after a step: bias_e += rate x sign(mean load - load_e), per layer; load [L, E] is the
    step's rows per expert summed over every micro-batch and rank (the same on every rank)."""
    for moe, row in zip(moe_layers, load):
        moe.balance_bias += rate * torch.sign(row.mean() - row).to(moe.balance_bias)


def router_aux_loss(moe_layers: list[MoE]) -> torch.Tensor:
    """The load-balancing loss of Switch Transformer as transformers computes it for Qwen3-MoE: over the routing
    of every MoE layer taken together, E x sum_e (share of routing slots to e) x (mean probability of e)."""
    slots = torch.stack([m.router_stats[0] for m in moe_layers]).mean(0)  # [k, E]
    probs = torch.stack([m.router_stats[1] for m in moe_layers]).mean(0)  # [E]
    return (slots * probs[None]).sum() * probs.shape[0]
