"""adapters/lora_stack.py: each token through its own model's adapter (kernels/multi_lora.py's stacked form), exact
zero for a token of no model, and each model's gradients from its own tokens only."""

from __future__ import annotations

import torch

from shardfit.adapters.lora_stack import AdapterStack


def _stack(k=3, r=4, d_in=8, d_out=6):
    torch.manual_seed(0)
    mod = torch.nn.Linear(d_in, d_out, bias=False)
    mod.lora_dropout, mod.lora_scale = 0.0, 0.5
    a = [torch.randn(r, d_in) for _ in range(k)]
    b = [torch.randn(d_out, r) for _ in range(k)]
    a_all = torch.cat(a).requires_grad_()
    b_all = torch.cat([x.t() for x in b]).requires_grad_()
    return mod, a, b, AdapterStack([mod], [a_all], [b_all], k, r, torch.float32)


def test_stacked_adapters_are_each_tokens_own():
    mod, a, b, stack = _stack()
    slots = torch.tensor([0, 1, 2, -1, 2, 2, 0, 1, -1, 1])
    stack.set_rows(slots)
    x = torch.randn(len(slots), 8)
    got = stack.delta(mod, x)
    for i, s in enumerate(slots.tolist()):
        want = torch.zeros(6) if s < 0 else (x[i] @ a[s].t() @ b[s].t()) * 0.5
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
    assert bool((got[slots < 0] == 0).all())  # no model: exactly nothing added


def test_a_models_gradients_come_from_its_own_tokens_only():
    mod, _, _, stack = _stack()
    slots = torch.tensor([0, 0, 2, -1, 2])  # model 1 has no token
    stack.set_rows(slots)
    stack.delta(mod, torch.randn(5, 8)).square().sum().backward()
    ga, gb = stack.a[0].grad, stack.b[0].grad  # [K*r, in], [K*r, out]
    assert bool((ga[4:8] == 0).all()) and bool((gb[4:8] == 0).all())  # model 1: exactly nothing
    assert ga[0:4].abs().sum() > 0 and ga[8:12].abs().sum() > 0


def test_under_compile_one_graph_serves_every_number_of_models():
    """K*r is marked dynamic: passes of 2, 3 and 5 models run one compiled graph (left to automatic dynamic shapes,
    K = 3 recompiled every block's forward and backward in the middle of a served step: session 23's clients
    benchmark)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def layer(stack, mod, x):
        return stack.delta(mod, x)

    compiled = torch.compile(layer, backend=counter)
    mod = _stack()[0]  # one layer, as a served model's: each pass a new stack of its own K
    for k in (2, 3, 5):
        stack = AdapterStack([mod], *[[t.requires_grad_()] for t in (torch.randn(k * 4, 8), torch.randn(k * 4, 6))],
                             k, 4, torch.float32)
        slots = torch.arange(10) % (k + 1) - 1  # every model and padding
        stack.set_rows(slots)
        x = torch.randn(10, 8)
        got = compiled(stack, mod, x)
        got.square().sum().backward()
        torch.testing.assert_close(got, stack.delta(mod, x), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
