"""Ulysses sequence parallelism: each rank of a group of P holds S/P tokens of every sequence; attention swaps that
for all S tokens of H/P heads with one all-to-all, runs the ordinary causal kernel, and swaps back.

Why this shape (the fourth seed's crash): everything a rank needs besides its own activations comes through the
all-to-alls inside attention, which are the same on every rank of the group in every call. Position ids are never
exchanged inside the model: the batch source (train/batches.py) and the Engine's datum pass cut the full [B, S]
position ids and labels once per micro-batch (local_slice), before the model and outside any checkpointed region,
so RoPE runs on local rows and recomputation under activation checkpointing repeats exactly the forward's
collectives (the same all-to-alls, in the same order, on every rank).

Memory arithmetic per rank and layer: q/k/v/out stay at [B, S/P, H, Dh]-sized buffers; only the attention kernel
sees S tokens, for H/P heads, so attention activations shrink by P as well.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardfit.parallel.layout import check_sequence_parallel as check_sequence_parallel  # planner tests' name


def _exchange(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split x along scatter_dim into P pieces, send piece j to rank j, concatenate what arrives along gather_dim.

    x [B, S_local, N, Dh] with scatter_dim=2, gather_dim=1 gives [B, S, N/P, Dh] (and the reverse undoes it)."""
    P = dist.get_world_size(group)
    pieces = x.chunk(P, dim=scatter_dim)
    send = torch.stack(pieces, dim=0).contiguous()  # [P, ...piece]: row j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv row j came from rank j
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Differentiable exchange: the gradient of a (scatter a, gather b) exchange is the (scatter b, gather a) one."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), ctx.group, gather_dim, scatter_dim), None, None, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, N, Dh] (all heads, local tokens) -> [B, S, N/P, Dh] (local heads, all tokens)."""
    return _AllToAll.apply(x, group, 2, 1)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S, N/P, Dh] -> [B, S/P, N, Dh]."""
    return _AllToAll.apply(x, group, 1, 2)


class UlyssesAttention:
    """Wraps an attention kernel `core(q, k, v)` on [B, S, heads, Dh] tensors for sequence parallelism over group.

    Key/value heads that do not split over P ranks (P > K, or K % P != 0) are repeated up to the query heads first:
    every rank then holds the K/V heads its own query heads read (grouped-query order is kept by repeat_interleave).
    """

    def __init__(self, core, group, n_heads: int, n_kv_heads: int):
        self.core, self.group = core, group
        P = dist.get_world_size(group)
        self.kv_repeat = 1 if n_kv_heads % P == 0 else n_heads // n_kv_heads

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        # mask (a DocumentMask) describes the full S tokens of the micro-batch: every rank of the group built the same
        # one from the full position ids, and the kernel below runs on all S tokens of this rank's heads.
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=2)
            v = v.repeat_interleave(self.kv_repeat, dim=2)
        q, k, v = (seq_to_heads(t, self.group) for t in (q, k, v))  # [B, S, heads/P, Dh]
        return heads_to_seq(self.core(q, k, v, mask), self.group)  # [B, S/P, H, Dh]


def apply_sequence_parallel(model: torch.nn.Module, group) -> None:
    """Put the Ulysses wrapper around every attention kernel of the model (call before checkpointing/compile)."""
    for block in model.model.layers:
        attn = block.self_attn
        attn.core = UlyssesAttention(attn.core, group, attn.n_heads, attn.n_kv)


def local_slice(x: torch.Tensor, rank: int, P: int) -> torch.Tensor:
    """This rank's contiguous S/P columns of a [B, S] tensor."""
    n = x.shape[1] // P
    return x[:, rank * n:(rank + 1) * n]
