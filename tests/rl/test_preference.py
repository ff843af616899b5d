"""Preference losses of the RL API (rl/preference.py, engine/preference.py): loss_fn="dpo" | "ipo" | "simpo" |
"orpo" over datums in pairs, "kto" over labelled datums. The gradient equals a hand-written single-process reference
(each sequence alone, plain log_softmax, the mean over units: TRL's formulas) on 1 and 2 gloo ranks, with pairs of
skewed lengths packed several to a row; TRL's metrics come back; bad input is one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_ranks
from tests.helpers import SMALL

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=40", "--logging.run_dir="]
LENGTHS = [(9, 5), (3, 12), (7, 7), (15, 4), (2, 2), (6, 11), (10, 3)]  # (chosen, rejected) tokens per pair
DESIRABLE = [True, True, False, True, False, False, True, False, True, True, False, True, True, False]
CASES = {"dpo": {"beta": 0.5, "label_smoothing": 0.1}, "ipo": {"beta": 0.3}, "simpo": {"beta": 2.0, "gamma": 0.4},
         "orpo": {"beta": 0.25},
         "kto": {"beta": 0.4, "desirable": DESIRABLE, "kl": 0.3, "desirable_weight": 1.2, "undesirable_weight": 0.8}}


def _pairs(seed=0, prompt_len=2):
    """Datums in pairs with a prompt masked out (mask 0) and reference log-probs."""
    from shardfit.rl import make_datum

    rng = np.random.default_rng(seed)
    out = []
    for lengths in LENGTHS:
        prompt = rng.integers(0, 256, prompt_len)
        for L in lengths:
            seq = np.concatenate([prompt, rng.integers(0, 256, L)])
            mask = np.r_[np.zeros(prompt_len - 1), np.ones(L)]  # label t is token t + 1: the completion's L labels
            out.append(make_datum(seq[:-1], target_tokens=seq[1:], mask=mask,
                                  ref_logprobs=rng.normal(-5.5, 0.5, L + prompt_len - 1)))
    return out


def _hand_written(model, datums, case, cfg):
    """Sequence sums from each datum alone (full logits), then the pair losses from their papers' definitions."""
    s, r, n = [], [], []
    for d in datums:
        ls = torch.log_softmax(model(torch.as_tensor(d.tokens)[None]).float()[0], -1)
        lp = ls.gather(1, torch.as_tensor(d.inputs["target_tokens"])[:, None]).squeeze(1)
        m = torch.as_tensor(d.inputs["mask"]) > 0
        s.append(lp[m].sum())
        r.append(torch.as_tensor(d.inputs["ref_logprobs"])[m].sum())
        n.append(float(m.sum()))
    beta = cfg["beta"]
    if case == "kto":  # TRL's KTOTrainer: per example, the mean over the batch's examples
        losses = [cfg["desirable_weight"] * (1 - torch.sigmoid(beta * ((s[i] - r[i]) - cfg["kl"]))) if good else
                  cfg["undesirable_weight"] * (1 - torch.sigmoid(beta * (cfg["kl"] - (s[i] - r[i]))))
                  for i, good in enumerate(cfg["desirable"])]
        return torch.stack(losses).mean()
    losses = []
    for k in range(len(datums) // 2):
        c, j = 2 * k, 2 * k + 1
        if case == "dpo":
            h = beta * ((s[c] - r[c]) - (s[j] - r[j]))
            eps = cfg["label_smoothing"]
            losses.append(-(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h))
        elif case == "ipo":
            h = (s[c] - r[c]) / n[c] - (s[j] - r[j]) / n[j]
            losses.append((h - 1 / (2 * beta)) ** 2)
        elif case == "orpo":  # TRL's ORPOTrainer: the chosen NLL over the batch's chosen tokens, minus lambda x
            # the mean log-sigmoid of the log odds ratio of per-token means
            mc, mr = s[c] / n[c], s[j] / n[j]
            log_odds = (mc - mr) - (torch.log(1 - torch.exp(mc)) - torch.log(1 - torch.exp(mr)))
            chosen_tokens = sum(n[0::2])
            losses.append(-s[c] * (len(datums) // 2) / chosen_tokens - beta * F.logsigmoid(log_odds))
        else:
            losses.append(-F.logsigmoid(beta * (s[c] / n[c] - s[j] / n[j]) - cfg["gamma"]))
    return torch.stack(losses).mean()


def _grads_vs_reference(rank, world, prompt_len=2, extra=()):
    from shardfit.config import load_config
    from shardfit.models import build_model
    from shardfit.rl import DatumEngine

    engine = DatumEngine.start(load_config(None, [*ARGS, *extra]))
    ref = build_model(engine.cfg.model, loss_chunk=engine.cfg.compute.loss_chunk)
    ref.init_weights(engine.cfg.train.seed)
    datums = _pairs(prompt_len=prompt_len)
    report = {}
    for case, cfg in CASES.items():
        res = engine.forward_backward(datums, case, cfg)
        report.setdefault("logprobs", []).append([o["logprobs"].tolist() for o in res.outputs])
        got = {}
        for name, p in engine.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            got[name] = g.detach().clone() * world  # FSDP averages over ranks; optim_step multiplies by world
        for p in engine.params:
            p.grad = None
        engine.engine._pending.clear()
        ref.zero_grad()
        want_loss = _hand_written(ref, datums, case, cfg)
        want_loss.backward()
        want = dict(ref.named_parameters())
        err = max(float((got[k] - want[k].grad).abs().max() / (want[k].grad.abs().max() + 1e-12)) for k in got)
        report[case] = {"err": err, "loss": res.metrics["loss:sum"], "want": float(want_loss),
                        "acc": res.metrics.get("rewards/accuracies:mean", 0.5)}
    return report


@pytest.mark.parametrize("world", [1, 2])
def test_pair_losses_gradient_equals_hand_written(world):
    reports = run_ranks(_grads_vs_reference, world)
    for report in reports:
        report.pop("logprobs")
        for case, r in report.items():
            assert r["err"] < 1e-4, (case, r)
            assert abs(r["loss"] - r["want"]) < 1e-5 * max(1.0, abs(r["want"])), (case, r)
            assert 0.0 <= r["acc"] <= 1.0


@pytest.mark.parametrize("world", [1, 2])
def test_a_shared_prompt_computed_once_gives_the_gradients_and_logprobs_of_pairs_packed_apart(world):
    """compute.share_prefix: each pair's 11-token prompt as one prefix tree (10 trunk tokens computed once, rows of
    40 tokens holding more pairs) against the same pairs packed apart; both against the hand-written reference."""
    from shardfit.rl.pack import plan_datums
    from shardfit.rl.preference import pair_coefficients
    from shardfit.rl.prefix_trees import pair_trees

    datums = _pairs(prompt_len=11)
    _, masks = pair_coefficients(datums)
    trees = pair_trees(datums, masks)
    assert trees == [(2, 10)] * len(LENGTHS)  # the prompt less its last token, whose label is each answer's first
    shared, apart = (plan_datums(datums, 44, 1, 1, pairs=True, trees=t) for t in (trees, None))
    assert shared.micro_batches < apart.micro_batches  # fewer rows: the test's pass differs from the other
    on, off = (run_ranks(_grads_vs_reference, world, 11, extra)
               for extra in ((), ("--compute.share_prefix=false",)))
    for a, b in zip(on, off):
        for case in CASES:
            assert a[case]["err"] < 1e-4 and b[case]["err"] < 1e-4, (case, a[case], b[case])
            assert abs(a[case]["loss"] - b[case]["loss"]) < 1e-5 * max(1.0, abs(b[case]["loss"]))
        for x, y in zip(a["logprobs"], b["logprobs"]):
            for u, v in zip(x, y):
                np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-5)


def test_pair_metrics_follow_trl_definitions():
    from shardfit.engine.preference import PairObjective
    from shardfit.rl.preference import pair_coefficients, pair_metrics

    datums = _pairs()[:4]
    coefs, masks = pair_coefficients(datums)
    assert abs(sum(float(c.sum()) for c in coefs) - 1.0) < 1e-6  # the mean over pairs
    logprobs = [np.full(len(d), -1.0, dtype=np.float32) for d in datums]
    m = pair_metrics(PairObjective("dpo", beta=0.5), datums, logprobs, masks)
    s = [-float(mk.sum()) for mk in masks]
    r = [float(d.inputs["ref_logprobs"][mk].sum()) for d, mk in zip(datums, masks)]
    chosen = [0.5 * (s[2 * k] - r[2 * k]) for k in range(2)]
    rejected = [0.5 * (s[2 * k + 1] - r[2 * k + 1]) for k in range(2)]
    assert m["rewards/chosen"] == pytest.approx(np.mean(chosen))
    assert m["rewards/margins"] == pytest.approx(np.mean(np.subtract(chosen, rejected)))
    assert m["rewards/accuracies"] == pytest.approx(np.mean(np.greater(chosen, rejected)))
    assert m["logps/chosen"] == pytest.approx(np.mean([s[0], s[2]]))


def test_bad_pair_input_is_one_line():
    from shardfit.errors import ShardfitError
    from shardfit.rl.losses import resolve_loss
    from shardfit.rl.preference import objective_of, pair_coefficients

    with pytest.raises(ShardfitError, match="3 datums: a preference loss takes pairs"):
        pair_coefficients(_pairs()[:3])
    with pytest.raises(ShardfitError, match="takes no option 'normalize'") as e:
        objective_of("dpo", {"normalize": "sum"})
    assert e.value.where == "loss_fn_config"
    with pytest.raises(ShardfitError, match="beta=0.0 must be a number > 0"):
        objective_of("ipo", {"beta": 0})
    assert resolve_loss("dpo", {}).required == ("target_tokens", "ref_logprobs")
    assert resolve_loss("simpo", {}).required == ("target_tokens",)


def test_bad_kto_and_orpo_input_is_one_line():
    from shardfit.errors import ShardfitError
    from shardfit.rl.losses import resolve_loss
    from shardfit.rl.preference import objective_of, pair_coefficients, terms_of

    with pytest.raises(ShardfitError, match="dpo takes no option 'kl'"):
        objective_of("dpo", {"kl": 0.1})
    with pytest.raises(ShardfitError, match="undesirable_weight=0.0 must be a number > 0"):
        objective_of("kto", {"undesirable_weight": 0})
    with pytest.raises(ShardfitError, match="beta='x' is not a number"):
        objective_of("orpo", {"beta": "x"})
    datums = _pairs()[:3]
    obj = objective_of("kto", {})
    _, masks = pair_coefficients(datums, group=obj.group)  # KTO takes any number of datums
    with pytest.raises(ShardfitError, match=r"kto needs one label a datum \(3 datums\)") as e:
        terms_of(obj, datums, masks, {"desirable": [True, False]})
    assert e.value.where == "loss_fn_config.desirable"
    assert terms_of(obj, datums, masks, {"desirable": "1,0,1"}).desirable.tolist() == [True, False, True]
    with pytest.raises(ShardfitError, match="kto needs one label a datum"):
        terms_of(obj, datums, masks, {"desirable": "1,0,x"})
    with pytest.raises(ShardfitError, match="kl=-1 must be a number >= 0"):
        terms_of(obj, datums, masks, {"desirable": [True, False, True], "kl": -1})
    assert resolve_loss("kto", {}).required == ("target_tokens", "ref_logprobs")
    assert resolve_loss("orpo", {}).required == ("target_tokens",)
