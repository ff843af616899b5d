"""The expert exchange with its all-to-alls hidden behind this rank's own rows (parallel.expert_overlap, E = W).
The design and the backward's order: docs/expert-parallel.md.

The rows for this rank's own experts (sorted first by sort_keys: the head of xs) need no exchange. The remote rows
leave by an all-to-all that is launched, not waited for (_LaunchDispatch); the experts run on the own rows meanwhile
(`both`: their first half); the wait (_WaitDispatch); the received rows run and start back by the reverse
all-to-all (_LaunchCombine); `both`: the own rows' second half runs under it; the wait (_WaitCombine) writes the
own rows' results into the head of the output [N, H]. Backward needs no ordering code: autograd runs the ready node
with the highest sequence number first (tests/parallel/test_expert_overlap.py logs the order).
Collectives: those of ExpertExchange, in the same order on every rank (a rank's split to itself is zero);
recomputation launches and waits them again. Streams: a launched all-to-all runs on the process group's stream and
wait() makes the compute stream wait for it; its input and output are allocated and freed on the compute stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfit.parallel.expert import ExpertExchange, run_arrived


class _Pending:
    """A launched exchange between its launch and its wait (one for the dispatch, one for the combine): forward's,
    then backward's reverse, and the gradient buffer that reverse writes into."""

    __slots__ = ("work", "grad")

    def __init__(self):
        self.work = self.grad = None

    def wait(self) -> torch.Tensor | None:
        """Wait for the launched exchange (the compute stream waits on CUDA); returns the buffer it wrote into when
        it is a backward's reverse exchange, and forgets both."""
        work, grad = self.work, self.grad
        self.work = self.grad = None
        work.wait()
        return grad


class _LaunchDispatch(torch.autograd.Function):
    """xs [N, H] (own rows first) -> (the own rows cut in parts of `cuts` rows [c, H] (views), received rows
    [sum(recv), H], still arriving): the all-to-all of xs[own:] is launched, not waited for (_WaitDispatch waits).
    Backward: waits for the reverse exchange _WaitDispatch.backward launched into the gradient buffer [N, H] and
    writes the own parts' gradients into its head."""

    @staticmethod
    def forward(ctx, xs, cuts, recv, send, group, pending):
        ctx.cuts, ctx.pending = cuts, pending
        own = sum(cuts)
        remote = xs.new_empty((sum(recv), xs.shape[1]))
        pending.work = dist.all_to_all_single(remote, xs[own:], recv, send, group=group, async_op=True)
        return (*xs[:own].split(cuts), remote)

    @staticmethod
    def backward(ctx, *grads):
        full = ctx.pending.wait()  # rows own: written by the reverse exchange
        for part, grad in zip(full[:sum(ctx.cuts)].split(ctx.cuts), grads[:-1]):
            if grad is None:
                part.zero_()
            else:
                part.copy_(grad)
        return full, None, None, None, None, None


class _WaitDispatch(torch.autograd.Function):
    """Waits for the dispatch; backward launches the reverse exchange into a new gradient buffer [N, H] (rows own:)
    and hands its input on as a placeholder: _LaunchDispatch.backward waits for it and returns the buffer."""

    @staticmethod
    def forward(ctx, remote, pending, recv, send, group, rows, own):
        ctx.pending, ctx.recv, ctx.send, ctx.group, ctx.rows, ctx.own = pending, recv, send, group, rows, own
        pending.wait()
        return remote.view_as(remote)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        full = grad.new_empty((ctx.rows, grad.shape[1]))
        ctx.pending.grad = full
        ctx.pending.work = dist.all_to_all_single(full[ctx.own:], grad, ctx.send, ctx.recv, group=ctx.group,
                                                  async_op=True)
        return grad, None, None, None, None, None, None


class _LaunchCombine(torch.autograd.Function):
    """The received rows' results in arrival order [sum(recv), H] -> the layer's output [N, H], whose rows own: the
    reverse all-to-all is filling (launched, not waited for: _WaitCombine waits and writes the own rows' results
    into the head). Backward: waits for _WaitCombine.backward's exchange and returns its buffer."""

    @staticmethod
    def forward(ctx, back, rows, own, recv, send, group, pending):
        ctx.pending = pending
        out = back.new_empty((rows, back.shape[1]))
        pending.work = dist.all_to_all_single(out[own:], back.contiguous(), send, recv, group=group, async_op=True)
        return out

    @staticmethod
    def backward(ctx, _placeholder):
        return ctx.pending.wait(), None, None, None, None, None, None


class _WaitCombine(torch.autograd.Function):
    """(out [N, H] from _LaunchCombine, the own rows' results in parts) -> out, complete: waits for the exchange and
    writes the parts into its head. Backward launches the reverse exchange of out's rows own: (their gradient going
    to the experts' ranks) and returns the parts' gradients while it is in flight."""

    @staticmethod
    def forward(ctx, out, pending, recv, send, group, *parts):
        ctx.pending, ctx.recv, ctx.send, ctx.group = pending, recv, send, group
        ctx.cuts = [p.shape[0] for p in parts]
        pending.wait()
        for head, part in zip(out[:sum(ctx.cuts)].split(ctx.cuts), parts):
            head.copy_(part)
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        own = sum(ctx.cuts)
        grad_back = grad.new_empty((sum(ctx.recv), grad.shape[1]))
        ctx.pending.grad = grad_back
        ctx.pending.work = dist.all_to_all_single(grad_back, grad[own:].contiguous(), ctx.recv, ctx.send,
                                                  group=ctx.group, async_op=True)
        return (grad, None, None, None, None, *grad[:own].split(ctx.cuts))


def split_counts(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [n] rows per expert (sorted rows) -> (per-expert counts of the first `rows` rows, of the rest), on the
    device: an expert whose rows straddle the cut is in both parts."""
    first = counts.cumsum(0).clamp(max=rows)
    first = torch.diff(first, prepend=first.new_zeros(1))
    return first, counts - first


class OverlappedExpertExchange(ExpertExchange):
    """ExpertExchange whose dispatch (and with hide_combine, its combine) overlaps this rank's own rows' expert
    computation (module docstring)."""

    hide_combine = False

    def sort_keys(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T*k] -> sort keys: this rank's experts before every other (ids - n), the rest in expert order."""
        lo = self.position * self.local
        own = (ids >= lo) & (ids < lo + self.local)
        return torch.where(own, ids - self.n_experts, ids)

    def run(self, xs, received, send, recv, experts):
        pos, both = self.position, self.hide_combine
        own = send[pos]  # == recv[pos]: the rows this rank routes to itself
        send, recv = list(send), list(recv)
        send[pos] = recv[pos] = 0
        # the own rows' parts: all under the dispatch, or the first half under it and the second under the combine
        cuts = [own // 2, own - own // 2] if both else [own]
        counts = split_counts(received[pos], cuts[0]) if both else (received[pos],)
        weights = experts.weight_uses(len(cuts) + 1)
        dispatch, combine = _Pending(), _Pending()
        *parts, remote = _LaunchDispatch.apply(xs, cuts, recv, send, self.group, dispatch)
        ys = [experts(parts[0], counts[0], weights=weights[0])]  # while the dispatch is in flight
        remote = _WaitDispatch.apply(remote, dispatch, recv, send, self.group, xs.shape[0], own)
        others = torch.cat([received[:pos], received[pos + 1:]])  # [E-1, n/E] rows from each other peer
        back = run_arrived(experts, remote, others, weights[-1])
        out = _LaunchCombine.apply(back, xs.shape[0], own, recv, send, self.group, combine)
        if both:
            ys.append(experts(parts[1], counts[1], weights=weights[1]))  # while the combine is in flight
        return _WaitCombine.apply(out, combine, recv, send, self.group, *ys)


class FullyOverlappedExpertExchange(OverlappedExpertExchange):
    """parallel.expert_overlap=both: the own rows in two halves, the first under the dispatch, the second under the
    combine (a third grouped GEMM triple a layer: more host time in a forward bound by it; measure)."""

    hide_combine = True
