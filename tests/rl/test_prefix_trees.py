"""RL datums that share a prompt (a group of rollouts) packed as prefix trees (rl/prefix_trees.py, rl/pack.py): the
same gradients, loss and per-datum log-probs (the prompt's included) as the datums packed apart, for the mean
cross-entropy and the per-token losses, on 1 and 2 gloo ranks; and which runs become trees."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL

PROMPT, ROLLOUTS = 40, 4
ARGS = [*SMALL, "--model.max_seq_len=128", "--train.device=cpu", "--train.micro_batch_tokens=128",
        "--logging.run_dir="]
CASES = {"cross_entropy": {}, "importance_sampling": {"normalize": "token_mean"},
         "ppo": {"normalize": "sequence_mean", "clip_low_threshold": 0.9, "clip_high_threshold": 1.1}}


def _groups(seed=0, prompts=3):
    """prompts x ROLLOUTS datums: each prompt's rollouts one after another (the cookbook's order), the prompt's
    PROMPT tokens with weight 0, a response of 3-20 tokens with weight 1, one advantage a rollout (GRPO's)."""
    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        prompt = rng.integers(0, 256, PROMPT)
        for _ in range(ROLLOUTS):
            seq = np.concatenate([prompt, rng.integers(0, 256, int(rng.integers(3, 21)))])
            L = len(seq) - 1
            w = np.r_[np.zeros(PROMPT - 1), np.ones(L - PROMPT + 1)]  # label t is token t + 1
            out.append(make_datum(seq[:-1], target_tokens=seq[1:], weights=w, mask=w,
                                  logprobs=rng.normal(-5.5, 0.3, L), advantages=np.full(L, rng.normal())))
    return out


def test_a_prompts_rollouts_become_one_tree_that_fits_a_row():
    from shardfit.rl.pack import plan_datums
    from shardfit.rl.prefix_trees import prefix_groups

    datums = _groups()
    lossy = [d.inputs["weights"] != 0 for d in datums]
    trees = prefix_groups(datums, lossy, budget=128)
    assert trees == [(ROLLOUTS, PROMPT - 1)] * 3  # the prompt less its last token, whose target is the response's
    # a budget that holds 2 to 3 rollouts of a prompt: the runs split, each tree within the budget
    budget = PROMPT - 1 + 2 * 21
    small = prefix_groups(datums, lossy, budget=budget)
    assert len(small) > 3 and sum(c for c, _ in small) == len(datums)
    first = np.cumsum([0] + [c for c, _ in small])
    for (c, t), f in zip(small, first):
        assert t == (PROMPT - 1 if c > 1 else 0)
        assert t + sum(len(datums[k]) - t for k in range(f, f + c)) <= budget
    # a shorter common prefix than MIN_TRUNK: apart
    assert prefix_groups(datums, lossy, budget=128, min_trunk=PROMPT) == [(1, 0)] * len(datums)
    # weight on a prompt token: the trunk stops before it
    lossy[1][5] = True
    assert prefix_groups(datums, lossy, budget=128)[0] == (1, 0)
    shared = plan_datums(datums, 128, 1, 1, trees=prefix_groups(datums, [d.inputs["weights"] != 0 for d in datums],
                                                                 128))
    apart = plan_datums(datums, 128, 1, 1)
    assert shared.micro_batches < apart.micro_batches


def _pass(rank, world, extra):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine, make_datum, step

    engine = DatumEngine.start(load_config(None, [*ARGS, *extra]))
    plans, plan = [], step.plan_shared
    step.plan_shared = lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1]  # noqa: E731  (rows planned)
    datums = _groups()  # every rank the same datums
    plain = [make_datum(d.tokens, target_tokens=d.inputs["target_tokens"], weights=d.inputs["weights"])
             for d in datums]  # no mask: the trainer's mean cross-entropy (rl/step.py is_token_mean_cross_entropy)
    # the cookbook's RL datums: no mask, no weights; the prompt's advantages (and sampler log-probs) are 0
    cookbook = [make_datum(d.tokens, target_tokens=d.inputs["target_tokens"],
                           logprobs=d.inputs["logprobs"] * d.inputs["weights"],
                           advantages=d.inputs["advantages"] * d.inputs["weights"]) for d in datums]
    report = {"micro_batches": []}
    for case, cfg in {**CASES, "mean": {}, "cookbook": {}}.items():
        data = {"mean": plain, "cookbook": cookbook}.get(case, datums)
        loss_fn = {"mean": "cross_entropy", "cookbook": "importance_sampling"}.get(case, case)
        res = engine.forward_backward(data, loss_fn, cfg)
        report["micro_batches"].append(plans[-1].micro_batches)
        grads = {}
        for name, p in engine.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().clone().flatten()[:512].tolist()
        for p in engine.params:
            p.grad = None
        engine.engine._pending.clear()
        fwd = engine.forward(data, loss_fn, cfg)
        report[case] = {"loss": res.metrics["loss:sum"], "grads": grads,
                        "logprobs": [o["logprobs"].tolist() for o in res.outputs],
                        "forward": [o["logprobs"].tolist() for o in fwd.outputs]}
    return report


@pytest.mark.parametrize("world", [1, 2])
def test_rollouts_sharing_their_prompt_train_as_rollouts_packed_apart(world):
    on = run_ranks(_pass, world, [])
    off = run_ranks(_pass, world, ["--compute.share_prefix=false"])
    for a, b in zip(on, off):
        shared, apart = a["micro_batches"], b["micro_batches"]
        assert all(m < n for m, n in zip(shared, apart)), (shared, apart)  # the trees were packed
        for case in [*CASES, "mean", "cookbook"]:
            x, y = a[case], b[case]
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6), case
            for name in y["grads"]:
                torch.testing.assert_close(torch.tensor(x["grads"][name]), torch.tensor(y["grads"][name]),
                                           rtol=1e-4, atol=1e-6, msg=f"{case} {name}")
            for key in ("logprobs", "forward"):
                for u, v in zip(x[key], y[key]):
                    np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def _per_datum_mean(logp, x, cfg):
    """A custom loss that reads every token of its datum: -w logp over the datum's token count (its index, "datum")."""
    own = x["datum"] >= 0  # not padding
    d = x["datum"].long().clamp(min=0)
    n = torch.zeros(int(d.max()) + 1).index_add(0, d, own.float())
    return -x["weights"] * logp / n.clamp(min=1)[d]


def _apart_and_shared(rank, world):
    """(shared, apart) per case on one engine: compute.share_prefix toggled between the two passes."""
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    engine = DatumEngine.start(load_config(None, ARGS))
    datums = _groups(prompts=2)
    counted = [copy.deepcopy(d) for d in datums]  # the IS datums with logprobs_at="counted"
    for i, d in enumerate(counted):
        d.inputs["advantages"][:PROMPT - 1] = 0  # the prompt carries no loss in any datum
        if i % ROLLOUTS == 0:  # each prompt's first rollout counts (and scores) its prompt, the others do not
            d.inputs["mask"][:] = 1
    cases = {"custom": (datums, _per_datum_mean, {}),
             "counted": (counted, "importance_sampling", {"logprobs_at": "counted"})}
    report = {}
    for case, (data, loss_fn, cfg) in cases.items():
        for share in (True, False):
            engine.cfg.compute.share_prefix = share
            res = engine.forward_backward(data, loss_fn, cfg)
            grads = torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten()
                               for p in engine.params])
            for p in engine.params:
                p.grad = None
            engine.engine._pending.clear()
            report[f"{case} {share}"] = {"loss": res.metrics["loss:sum"], "grads": grads[:4096].tolist(),
                                         "logprobs": [o["logprobs"].tolist() for o in res.outputs]}
    return report


@pytest.mark.parametrize("case", ["custom", "counted"])
def test_losses_that_read_more_than_a_tokens_loss_see_each_datum_as_apart(case):
    """custom: a callable gets every token's log-prob and datum index and may combine a datum's tokens (here a mean
    over them): a trunk laid once is one datum's tokens alone. counted: logprobs_at="counted" reports 0 for a token
    its datum does not count; a trunk counted (and scored) by one datum and not by another reported one datum's."""
    out = run_ranks(_apart_and_shared, 1)[0]
    x, y = out[f"{case} True"], out[f"{case} False"]
    assert x["loss"] == pytest.approx(y["loss"], rel=1e-5, abs=1e-6)
    torch.testing.assert_close(torch.tensor(x["grads"]), torch.tensor(y["grads"]), rtol=1e-4, atol=1e-6)
    for u, v in zip(x["logprobs"], y["logprobs"]):
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def test_a_trunk_stops_at_the_first_token_the_datums_do_not_share_alike():
    """Identical datums keep one token each; a target that differs, or a token with loss in either datum, ends the
    trunk; a datum that is the other's prefix keeps its last token; the packed row's positions continue the trunk."""
    from shardfit.rl import make_datum
    from shardfit.rl.pack import pack_row, plan_datums
    from shardfit.rl.prefix_trees import shared_prefix

    rng = np.random.default_rng(1)
    seq = rng.integers(0, 256, 61)
    a = make_datum(seq[:-1], target_tokens=seq[1:])
    free = np.zeros(60, dtype=bool)
    assert shared_prefix(a, a, free, free) == 59  # identical: each keeps its last token
    other = seq[1:].copy()
    other[44] += 1
    assert shared_prefix(a, make_datum(seq[:-1], target_tokens=other), free, free) == 44
    lossy = free.copy()
    lossy[50:] = True
    assert shared_prefix(a, a, free, lossy) == shared_prefix(a, a, lossy, free) == 50
    short = make_datum(seq[:40], target_tokens=seq[1:41])
    assert shared_prefix(a, short, free, free[:40]) == 39
    datums = [a, short, a]
    plan = plan_datums(datums, 128, 1, 1, trees=[(3, 39)])
    _, _, pos, branch, _, _, _, real = pack_row(plan, datums, plan.bins[0][0], None, set(), None)
    assert real == 39 + 21 + 1 + 21
    for i, d in enumerate(datums):
        cols = plan.where[i].columns(len(d))
        assert pos[0, cols].tolist() == list(range(len(d)))  # each datum's RoPE positions as alone
        assert set(branch[0, cols[39:]].tolist()) == {i + 1} and not branch[0, cols[:39]].any()


@pytest.mark.parametrize("budget, shared", [(120, False), (160, True)])
def test_trees_are_packed_only_where_the_pass_needs_fewer_rows(budget, shared):
    """4 pairs of a 20-token prompt and two 10-token answers: 60 tokens a pair apart, 40 as a tree. Rows of 120
    hold 2 pairs apart or 3 trees: 2 rows either way, so apart (a tree would add its mask's cost to the same
    work); rows of 160 hold them all as trees in 1 row against 2 apart: trees."""
    from shardfit.rl import make_datum
    from shardfit.rl.pack import plan_shared

    rng = np.random.default_rng(0)
    datums = []
    for _ in range(4):
        prompt = rng.integers(0, 256, 20)
        for _ in range(2):
            seq = np.concatenate([prompt, rng.integers(0, 256, 11)])
            datums.append(make_datum(seq[:-1], target_tokens=seq[1:]))
    trees = [(2, 20)] * 4
    plan = plan_shared(datums, budget, 1, 1, pairs=True, trees=trees)
    assert plan.branched == shared and plan.micro_batches == (1 if shared else 2)
    assert all(w.trunk == (20 if shared else 0) for w in plan.where)
    assert not plan_shared(datums, budget, 1, 1, pairs=True).branched  # no trees asked: apart
