"""models/moe.py weighted_slot_sum, the MoE combine: eager it is the reduction over the k slots (bit for bit, values
and gradients) and moves no more bytes than it; the k terms are for the compiled block only."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardfit.models.moe import weighted_slot_sum


def _reduction(rows, weights):
    return (rows * weights[..., None]).sum(dim=1)


def _inputs(T=64, k=8, H=32, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(T, k, H, generator=g).to(dtype).requires_grad_()
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(dtype).requires_grad_()
    return rows, weights, torch.randn(T, H, generator=g).to(dtype)


class _Written(TorchDispatchMode):
    """Bytes of every new tensor the ops in its scope write (views excluded)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor) and t._base is None)
        return out


def test_eager_equals_the_reduction_bit_for_bit():
    outs = []
    for fn in (_reduction, weighted_slot_sum):
        rows, weights, g = _inputs()
        out = fn(rows, weights)
        out.backward(g)
        outs.append((out.detach(), rows.grad, weights.grad))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_eager_backward_writes_no_more_than_the_reduction():
    # rows[:, s] per slot, eager, makes autograd's SelectBackward write a zeroed [T, k, H] gradient per slot (k of
    # them, then summed): 26x rows' bytes against the reduction's 5.75x at k = 8
    written = []
    for fn in (_reduction, weighted_slot_sum):
        rows, weights, g = _inputs()
        with _Written() as w:
            fn(rows, weights).backward(g)
        written.append(w.bytes)
    assert written[1] <= written[0], written
