"""adapters/lora_stack.py: each token through its own model's adapter (kernels/multi_lora.py's stacked form), exact
zero for a token of no model, and each model's gradients from its own tokens only; under compile one graph for every
K, and, through the Engine, one compiled variant of the block forward for every block (below)."""

from __future__ import annotations

import torch

from shardfit.adapters.lora_stack import AdapterStack
from tests._dist import run_ranks
from tests.engine.test_multi_model import ARGS
from tests.helpers import random_datums


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
    got = stack.layers[0].delta(mod, x)
    for i, s in enumerate(slots.tolist()):
        want = torch.zeros(6) if s < 0 else (x[i] @ a[s].t() @ b[s].t()) * 0.5
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
    assert bool((got[slots < 0] == 0).all())  # no model: exactly nothing added


def test_a_models_gradients_come_from_its_own_tokens_only():
    mod, _, _, stack = _stack()
    slots = torch.tensor([0, 0, 2, -1, 2])  # model 1 has no token
    stack.set_rows(slots)
    stack.layers[0].delta(mod, torch.randn(5, 8)).square().sum().backward()
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
        return stack.layers[0].delta(mod, x)

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
        torch.testing.assert_close(got, stack.layers[0].delta(mod, x), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


# --- the blocks under compute.compile, through the Engine (engine/multi_model.py) ---------------------------------
# Each block's forward is one code object (parallel/parallelize.py's checkpoint wrapper), and dynamo keeps at most
# recompile_limit (8) compiled variants of it; past that, a call that matches none runs eager, silently. Session 23's
# stack found each layer's tensors by `id(mod)`, which made dynamo guard on every layer object's identity: each block
# of a pass of several models compiled a variant of its own, and on the 8B shape's 36 blocks those past the 8th ran
# eager in every such pass (~1.6x slower per token than a pass of one model: session 24's clients benchmark). The
# engine's multi-model tests use 2 blocks, which hid it: block 0's input takes no gradient and block 1's does, so each
# got a variant anyway. Here 4 blocks, in a rank of their own (tests/_dist.py: dynamo's caches are per process):
#   - the first pass of several models adds at most 2 variants (block 0's input without gradient, the others' with);
#   - passes after it, of other models and other numbers of them (1 to 5), add no variant and no compiled graph.
COMPILED = [*ARGS, "--compute.compile=true", "--compute.activation_checkpoint=full", "--model.n_layers=4"]
MEAN_TOKENS = {"normalize": "token_mean"}


def _variants(e) -> int:
    """Compiled variants of the blocks' forward (one code object for every block)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    codes = {b.forward._torchdynamo_orig_callable.__code__ for b in e.model.model.layers}
    assert len(codes) == 1, codes
    return len(_debug_get_cache_entry_list(codes.pop()))


def _passes(rank, world):
    from torch._dynamo.utils import counters

    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, COMPILED))
    names = [f"m{i}" for i in range(5)]
    for i, n in enumerate(names):
        e.add_model(n, seed=i + 1)

    def run(models: list[str], seed: int) -> None:
        groups = {m: random_datums(seed + i, 2, (6, 16)) for i, m in enumerate(models)}
        if len(models) == 1:
            e.forward_backward(groups[models[0]], "cross_entropy", MEAN_TOKENS, model=models[0])
        else:
            e.forward_backward_many(groups, "cross_entropy", MEAN_TOKENS)
        for m in models:
            e.models.drop_gradients(m)

    run(["m0"], 10)
    alone = _variants(e)
    run(["m0", "m1"], 20)  # the first pass of several models: compiles
    first = _variants(e) - alone
    graphs = counters["stats"]["unique_graphs"]
    for i, models in enumerate((["m2", "m3", "m4"], ["m4", "m1"], names, ["m3", "m0", "m2"], ["m1"])):
        run(models, 30 + 10 * i)
    return {"alone": alone, "first": first, "later": _variants(e) - alone - first,
            "later_graphs": counters["stats"]["unique_graphs"] - graphs}


def test_passes_of_several_models_compile_one_variant_for_every_block():
    out = run_ranks(_passes, 1)[0]
    assert 1 <= out["first"] <= 2, out  # per input signature, not per block (4 blocks: 4 before the fix)
    assert out["later"] == 0 and out["later_graphs"] == 0, out  # new model sets and K: nothing recompiled
