"""The expert exchange with its dispatch all-to-all hidden behind this rank's own rows (parallel.expert_overlap).

Of the rows a rank routes, those for its own experts (about 1/E of them) need no exchange. Sorted first
(sort_keys), they are a block at the head of xs, and the layer runs (E = W: the experts are outside FSDP, so
running them twice costs no second gather):
  1. the remote rows xs[own:] leave by an all-to-all that is launched, not waited for (_LaunchDispatch);
  2. meanwhile the experts run on the own rows xs[:own] (one grouped GEMM triple);
  3. the wait (_WaitDispatch); the received rows, regrouped by local expert, go through the experts (a second
     triple); the results return by the reverse all-to-all and join the own rows' results (_Combine).
Backward mirrors it without ordering code of ours: the autograd engine runs the ready node with the highest
sequence number first, and the forward created _LaunchDispatch, then the own rows' GEMMs, then _WaitDispatch. So
_WaitDispatch.backward launches the reverse exchange (the received rows' gradient going home), the own rows' expert
backward runs while it is in flight, and _LaunchDispatch.backward waits for it and writes the own rows' gradient
into the head of the same buffer [N, H] (no zero-filled gradient, no sum of two [N, H] gradients).
Same collectives in the same order on every rank (the exchange's splits are those of ExpertExchange, with a rank's
split to itself zero); recomputation under checkpointing launches and waits the same exchange again.
Streams: on CUDA the launched all-to-all runs on the process group's stream; wait() makes the compute stream wait
for it. c10d keeps its input and output alive until that wait (no record_stream), and both are allocated and
freed on the compute stream, which has waited for the exchange by then.
Each use of the experts gets its own output of the weights' cast (_ComputeCast with uses=2): autograd would
otherwise sum the two bf16 gradients before the fp32 accumulation (one more rounding and one more pass).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfit.models.moe import inverse_permutation, permute_rows
from shardfit.parallel.expert import ExpertExchange, regroup_destinations


class _Pending:
    """The launched exchange between its launch and its wait: forward's dispatch, then backward's reverse, and the
    gradient buffer [N, H] that reverse writes into."""

    __slots__ = ("work", "grad")

    def __init__(self):
        self.work = self.grad = None


class _LaunchDispatch(torch.autograd.Function):
    """xs [N, H] (own rows first) -> (own rows [own, H], a view; received rows [sum(recv), H], still arriving)."""

    @staticmethod
    def forward(ctx, xs, own, recv, send, group, pending):
        ctx.own, ctx.pending = own, pending
        remote = xs.new_empty((sum(recv), xs.shape[1]))
        pending.work = dist.all_to_all_single(remote, xs[own:], recv, send, group=group, async_op=True)
        return xs[:own], remote

    @staticmethod
    def backward(ctx, grad_own, _placeholder):
        pending = ctx.pending
        full, work = pending.grad, pending.work  # rows own: of full are being written by the reverse exchange
        pending.grad = pending.work = None
        work.wait()
        if grad_own is None:
            full[:ctx.own].zero_()
        else:
            full[:ctx.own].copy_(grad_own)
        return full, None, None, None, None, None


class _WaitDispatch(torch.autograd.Function):
    """Waits for the dispatch; backward launches the reverse exchange into a new gradient buffer [N, H] (rows own:)
    and hands its input on as a placeholder: _LaunchDispatch.backward waits for it and returns the buffer."""

    @staticmethod
    def forward(ctx, remote, pending, recv, send, group, rows, own):
        ctx.pending, ctx.recv, ctx.send, ctx.group, ctx.rows, ctx.own = pending, recv, send, group, rows, own
        pending.work.wait()
        pending.work = None
        return remote.view_as(remote)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        full = grad.new_empty((ctx.rows, grad.shape[1]))
        ctx.pending.grad = full
        ctx.pending.work = dist.all_to_all_single(full[ctx.own:], grad, ctx.send, ctx.recv, group=ctx.group,
                                                  async_op=True)
        return grad, None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """(own rows' results [own, H], received rows' results in arrival order [sum(recv), H]) -> [N, H] in xs's order:
    the own results at the head, the others back from their experts' ranks (a synchronous reverse all-to-all)."""

    @staticmethod
    def forward(ctx, ys_own, back, recv, send, group):
        ctx.recv, ctx.send, ctx.group, ctx.own = recv, send, group, ys_own.shape[0]
        out = back.new_empty((ys_own.shape[0] + sum(send), back.shape[1]))
        out[:ctx.own].copy_(ys_own)
        dist.all_to_all_single(out[ctx.own:], back.contiguous(), send, recv, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_back = grad.new_empty((sum(ctx.recv), grad.shape[1]))
        dist.all_to_all_single(grad_back, grad[ctx.own:].contiguous(), ctx.recv, ctx.send, group=ctx.group)
        return grad[:ctx.own], grad_back, None, None, None


class OverlappedExpertExchange(ExpertExchange):
    """ExpertExchange whose dispatch overlaps this rank's own rows' expert computation (module docstring)."""

    def sort_keys(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T*k] -> sort keys: this rank's experts before every other (ids - n), the rest in expert order."""
        lo = self.position * self.local
        own = (ids >= lo) & (ids < lo + self.local)
        return torch.where(own, ids - self.n_experts, ids)

    def run(self, xs, received, send, recv, experts):
        pos = self.position
        own = send[pos]  # == recv[pos]: the rows this rank routes to itself
        send, recv = list(send), list(recv)
        send[pos] = recv[pos] = 0
        pending = _Pending()
        xs_own, remote = _LaunchDispatch.apply(xs, own, recv, send, self.group, pending)
        w_own, w_remote = experts.weight_uses(2)
        ys_own = experts(xs_own, received[pos], weights=w_own)  # while the dispatch is in flight
        remote = _WaitDispatch.apply(remote, pending, recv, send, self.group, xs.shape[0], own)
        others = torch.cat([received[:pos], received[pos + 1:]])  # [E-1, n/E] rows from each other peer
        dest = regroup_destinations(others, sum(recv))
        order = inverse_permutation(dest)
        ys = experts(permute_rows(remote, order, dest), others.sum(0), weights=w_remote)
        return _Combine.apply(ys_own, permute_rows(ys, dest, order), recv, send, self.group)
