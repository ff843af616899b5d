"""The RL API's micro-batches are made as the Engine's loop reaches them (engine/batch.py LazyBatches), not all before
the pass: a FlexAttention mask costs milliseconds of host time per micro-batch, and made up front they all ran while
the GPU sat idle (Engine.forward on an MoE shape, session 24: ~0.1 s of a 0.6 s call). The same results as the
listed batches, bit for bit, in forward and forward_backward (the mean cross-entropy's divisor included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import SMALL

MOE = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32"]
ARGS = [*SMALL, *MOE, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir="]
LENGTHS = (30, 12, 25, 9, 17, 28, 5, 21)  # several datums per row, 5 rows of 32 tokens


def _engine():
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    return DatumEngine.start(load_config(None, ARGS))


def _datums():
    from shardfit.rl import make_datum

    rng = np.random.default_rng(3)
    out = []
    for L in LENGTHS:
        s = rng.integers(0, 256, L + 1)
        mask = np.ones(L, np.float32)
        mask[:2] = 0  # a prompt
        out.append(make_datum(s[:-1], target_tokens=s[1:], mask=mask, weights=np.ones(L),
                              logprobs=rng.normal(-2, 0.5, L).astype(np.float32),
                              advantages=rng.normal(0, 1, L).astype(np.float32)))
    return out


@pytest.mark.parametrize("backward", [False, True])
def test_each_mask_is_made_after_the_micro_batch_before_it_ran(monkeypatch, backward):
    """The order of host events in one pass: mask 0, model 0, mask 1, model 1, ..., then the datums' hash (before
    the change every mask, and the hash first, came before the first micro-batch)."""
    import shardfit.engine.batch as batch
    import shardfit.rl.step as step
    from shardfit.models.attention import DocumentMask

    engine = _engine()
    events = []
    build, fingerprint = DocumentMask.build, step.fingerprint
    monkeypatch.setattr(batch.DocumentMask, "build",
                        staticmethod(lambda *a, **k: events.append("mask") or build(*a, **k)))
    monkeypatch.setattr(step, "fingerprint", lambda d: events.append("hash") or fingerprint(d))
    engine.model.register_forward_pre_hook(lambda *_: events.append("model"))
    datums = _datums()
    if backward:
        engine.forward_backward(datums, "ppo", {"normalize": "token_mean", "logprobs_at": "counted"})
    else:
        engine.forward(datums, "cross_entropy", {"logprobs_at": "counted"})
    n = len(events) // 2
    assert n >= 3 and events == ["mask", "model"] * n + ["hash"]


def test_lazy_batches_are_the_listed_ones():
    from shardfit.rl.pack import datum_batches, plan_datums

    engine, datums = _engine(), _datums()
    plan = plan_datums(datums, engine.datum_budget(), 1, 1)
    lazy = datum_batches(plan, datums, None, None, 0, 0, "sdpa", engine.device)
    listed = list(lazy)
    assert len(lazy) == len(listed) == plan.micro_batches >= 3
    assert lazy.capacity == sum(b.capacity for b in listed)
    for i in (0, -1):
        a, b = lazy[i], listed[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        assert torch.equal(a.mask.dense, b.mask.dense)
    assert len(lazy[1:3]) == 2
    with pytest.raises(IndexError):
        lazy[len(lazy)]


@pytest.mark.parametrize("backward", [False, True])
def test_lazy_and_listed_batches_give_the_same_bits(backward):
    """The Engine's pass over LazyBatches and over the same batches listed: outputs, loss and gradients equal, for
    the mean cross-entropy (its divisor from LazyBatches.capacity) and a per-token loss."""
    from shardfit.engine import CrossEntropy
    from shardfit.rl.losses import coefficients, resolve_loss
    from shardfit.rl.pack import datum_batches, plan_datums
    from shardfit.rl.step import _token_loss

    datums = _datums()
    results = {}
    for how in ("lazy", "list"):
        for name in ("mean", "ppo"):
            engine = _engine().engine
            plan = plan_datums(datums, engine.datum_budget(), 1, 1)
            spec = resolve_loss("ppo", {"normalize": "token_mean"})
            coefs = None if name == "mean" else coefficients(datums, spec)
            loss = CrossEntropy(logprobs=True) if name == "mean" else _token_loss(spec)
            batches = datum_batches(plan, datums, coefs, None, 0, 0, engine.doc_kernel(plan.budget, backward),
                                    engine.device)
            if how == "list":
                batches = list(batches)
            stats = (engine.forward_backward if backward else engine.forward)(batches, loss)
            grads = [p.grad.clone() for p in engine.model.parameters() if p.grad is not None] if backward else []
            results[how, name] = (stats.outputs, stats.loss_sum, grads)
    for name in ("mean", "ppo"):
        (oa, la, ga), (ob, lb, gb) = results["lazy", name], results["list", name]
        assert torch.equal(oa, ob) and la == lb and len(ga) == len(gb)
        assert all(torch.equal(a, b) for a, b in zip(ga, gb))
        assert not backward or ga


def test_an_index_error_while_making_a_micro_batch_is_raised_not_the_end_of_the_pass():
    """LazyBatches iterates over its count: an IndexError raised while micro-batch 1 is made (a bug in packing:
    numpy's and torch's out-of-range index) reaches the caller. Iterated by Sequence's own __iter__ (self[i] until
    an IndexError) it ended the pass after micro-batch 0: a forward_backward over a part of the data reported as
    done, its gradients never reduce-scattered (sync is set for micro-batch count - 1, never reached), and on
    several ranks this rank's collectives fewer than its peers'."""
    from shardfit.engine import CrossEntropy
    from shardfit.engine.batch import LazyBatches
    from shardfit.rl.pack import datum_batches, plan_datums

    engine, datums = _engine().engine, _datums()
    plan = plan_datums(datums, engine.datum_budget(), 1, 1)
    lazy = datum_batches(plan, datums, None, None, 0, 0, "sdpa", engine.device)

    def make(i):
        if i == 1:
            raise IndexError("index 40 is out of bounds (packing micro-batch 1)")
        return lazy.make(i)

    with pytest.raises(IndexError, match="packing micro-batch 1"):
        engine.forward_backward(LazyBatches(len(lazy), make, lazy.capacity), CrossEntropy())
