"""logprobs_at="counted" (rl/losses.py): the head scores the counted tokens alone. Their log-probs, entropies, the
loss and every gradient equal the full pass's (where the loss reads only counted tokens); the others report 0;
one and two gloo ranks agree, a micro-batch with nothing to score included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.engine.test_engine_rl import ARGS, _grads

PPO = {"normalize": "token_mean", "clip_low_threshold": 0.9, "clip_high_threshold": 1.1, "kl_coef": 0.1,
       "entropy_coef": 0.01}


def _datums(lengths, seed, with_mask=True):
    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for i, L in enumerate(lengths):
        seq = rng.integers(0, 256, L + 1)
        mask = (np.arange(L) >= L // 3).astype(np.float64)  # a prompt of L/3 tokens, then the response
        if i == 1:
            mask[:] = 0  # nothing to score: alone in its micro-batch at these lengths
        inputs = dict(target_tokens=seq[1:], weights=mask * rng.integers(1, 3, L), logprobs=rng.normal(-3, 1, L) * mask,
                      advantages=rng.normal(0, 1, L) * mask, ref_logprobs=rng.normal(-3, 1, L))
        if with_mask:
            inputs["mask"] = mask
        out.append(make_datum(seq[:-1], **inputs))
    return out


def _compare(rank, world):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine as Engine  # the Engine through datums (rl/step.py)
    from shardfit.rl.losses import counted

    # loss_chunk 8: the scored rows make whole chunks of 8 and a padded rest
    engine = Engine.start(load_config(None, [*ARGS, "--compute.loss_chunk=8"]))
    datums = _datums([29, 30, 7, 18, 11], seed=3)
    report = {}
    full = engine.forward(datums)
    part = engine.forward(datums, "cross_entropy", {"logprobs_at": "counted"})
    report["fwd_counted"] = max(float(np.abs(a["logprobs"] - b["logprobs"])[counted(d)].max(initial=0))
                                for a, b, d in zip(full.outputs, part.outputs, datums))
    report["fwd_others"] = max(float(np.abs(b["logprobs"][~counted(d)]).max(initial=0))
                               for b, d in zip(part.outputs, datums))
    report["fwd_loss"] = abs(full.metrics["loss:sum"] - part.metrics["loss:sum"])
    # (the full pass's datums carry a mask, the counted pass's): without a mask, counted = weights != 0, and the
    # tokens it does not score take no part in the loss (the KL term included)
    for name, loss, cfg, mask_a, mask_b in (("ppo", "ppo", PPO, True, True), ("ppo_weights", "ppo", PPO, True, False),
                                             ("ce_weights", "cross_entropy", {}, False, False)):
        data = _datums([29, 30, 7, 18, 11], seed=4, with_mask=mask_a)
        a = engine.forward_backward(data, loss, cfg)
        ga = _grads(engine)
        b = engine.forward_backward(_datums([29, 30, 7, 18, 11], seed=4, with_mask=mask_b), loss,
                                    {**cfg, "logprobs_at": "counted"})
        gb = _grads(engine)
        if "entropy" in a.outputs[0]:
            report[name + "_entropy"] = max(
                float(np.abs(x["entropy"] - y["entropy"])[counted(d)].max(initial=0)
                      + np.abs(y["entropy"][~counted(d)]).max(initial=0))
                for x, y, d in zip(a.outputs, b.outputs, data))
        report[name + "_grad"] = max(float((ga[k] - gb[k]).abs().max() / (ga[k].abs().max() + 1e-12))
                                     for k in ga)
        report[name + "_loss"] = abs(a.metrics["loss:sum"] - b.metrics["loss:sum"])
        report[name + "_logprobs"] = max(float(np.abs(x["logprobs"] - y["logprobs"])[counted(d)].max(initial=0))
                                         for x, y, d in zip(a.outputs, b.outputs, data))
        report[name + "_metrics"] = sorted(a.metrics) == sorted(b.metrics) and all(
            abs(a.metrics[k] - b.metrics[k]) < 1e-5 for k in a.metrics if k != "loss:sum")
    report["grad_nonzero"] = any(float(g.abs().max()) > 0 for g in gb.values())
    return report


@pytest.mark.parametrize("world", [1, 2])
def test_counted_rows_equal_the_full_pass(world):
    reports = run_ranks(_compare, world)
    assert all(r == reports[0] for r in reports)  # every rank returns every datum's outputs
    r = reports[0]
    assert r["fwd_counted"] < 1e-5 and r["fwd_others"] == 0 and r["fwd_loss"] < 1e-4, r
    assert r["ppo_entropy"] < 1e-5 and r["ppo_weights_entropy"] < 1e-5, r
    for name in ("ppo", "ppo_weights", "ce_weights"):
        assert r[name + "_grad"] < 1e-5, (name, r)
        assert r[name + "_loss"] < 1e-5 and r[name + "_logprobs"] < 1e-5 and r[name + "_metrics"], (name, r)
    assert r["grad_nonzero"]


def test_scored_rows_pad_to_static_chunk_shapes():
    from shardfit.models.logprobs import scored_rows

    for n, chunk, want in ((0, 1024, 0), (1, 1024, 128), (130, 1024, 256), (1030, 1024, 1152), (2048, 1024, 2048),
                           (5, 8, 8), (13, 8, 16)):
        scored = torch.zeros(4096, dtype=torch.bool)
        scored[torch.randperm(4096)[:n]] = True
        rows = scored_rows(scored, chunk)
        assert rows.numel() == want, (n, chunk, rows.numel())
        assert torch.equal(rows[:n], scored.nonzero().flatten()) and bool((rows[n:] == -1).all())


def test_unknown_logprobs_at_is_one_clear_error():
    from shardfit.errors import ShardfitError
    from shardfit.rl.losses import resolve_loss

    with pytest.raises(ShardfitError, match="logprobs_at"):
        resolve_loss("ppo", {"logprobs_at": "response"})
