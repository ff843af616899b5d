"""Forward-only passes of several LoRA models (engine/multi_model.py forward_models), through the RL API's
forward_many:

- 3 trained models (B != 0, so that each model's adapter changes its log-probs) scored in one pass equal each scored
  alone: per-token log-probs and the loss, for a coefficient loss with per-datum normalisation and for a pair loss
  (DPO: its reference log-probs in the loss); a pass of one model through the many-path is forward(model=name) bit
  for bit;
- the pass is a forward: no model gets a gradient or a pending pass, and a model's gradients accumulated before it
  stay as they were;
- 2 gloo ranks equal 1;
- a mean-over-tokens loss is refused in one line, as in forward_backward.
"""

from __future__ import annotations

import numpy as np

from tests._dist import run_ranks
from tests.engine.test_multi_model import ARGS, MODELS, _grads
from tests.helpers import random_datums, random_pairs

SEQUENCE_MEAN = {"normalize": "sequence_mean"}


def _trained():
    """An engine with MODELS, each trained one step on its own datums (B != 0)."""
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    for name, seed in MODELS:
        e.add_model(name, seed=seed)
    for i, (name, _) in enumerate(MODELS):
        e.forward_backward(random_datums(40 + i, 3, (6, 16)), "cross_entropy", model=name)
        e.optim_step(AdamParams(learning_rate=5e-2), model=name)
    return e


def _flat(res) -> list[float]:
    return np.concatenate([o["logprobs"] for o in res.outputs]).tolist()


def _score(rank, world):
    e = _trained()
    data = {n: random_datums(50 + i, 2 + i, (6, 16)) for i, (n, _) in enumerate(MODELS)}
    prefs = {n: random_pairs(60 + i, 1 + i) for i, (n, _) in enumerate(MODELS)}
    out = {"many": {}, "alone": {}}
    for what, loss, cfg, groups in (("ce", "cross_entropy", SEQUENCE_MEAN, data), ("dpo", "dpo", {"beta": 0.2}, prefs)):
        many = e.forward_many(groups, loss, cfg)
        alone = {n: e.forward(d, loss, cfg, model=n) for n, d in groups.items()}
        for key, res in (("many", many), ("alone", alone)):
            out[key][what] = {n: {"lp": _flat(r), "metrics": r.metrics} for n, r in res.items()}
    # a pass of one model through the many-path: forward(model=name), bit for bit
    one = e.forward_many({"B": data["B"]}, "cross_entropy", SEQUENCE_MEAN)["B"]
    out["one"] = _flat(one) == out["alone"]["ce"]["B"]["lp"]
    # a forward between a model's forward_backward and its optim_step leaves its gradients as they were
    e.forward_backward(data["A"], "cross_entropy", model="A")
    before = _grads(e, "A")
    e.forward_many(data, "cross_entropy", SEQUENCE_MEAN)
    out["grads_kept"] = _grads(e, "A") == before
    out["no_grads"] = [not any(_grads(e, n)) for n in ("B", "Z")]
    out["pending"] = [bool(e.models.pending(n)) for n, _ in MODELS]
    try:
        from shardfit.engine import CrossEntropy

        e.engine.forward([], CrossEntropy(), model=["A", "B"])
    except Exception as err:  # noqa: BLE001  the message is the assertion
        out["mean"] = f"{type(err).__name__}: {err}"
    return out


def test_models_scored_in_one_pass_equal_each_scored_alone():
    r = run_ranks(_score, 1)[0]
    for what in ("ce", "dpo"):
        lps = set()
        for n, _ in MODELS:
            many, alone = r["many"][what][n], r["alone"][what][n]
            np.testing.assert_allclose(many["lp"], alone["lp"], rtol=0, atol=2e-5)
            assert many["metrics"].keys() == alone["metrics"].keys()
            for k, v in alone["metrics"].items():
                np.testing.assert_allclose(many["metrics"][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{what} {n} {k}")
            lps.add(round(float(np.sum(many["lp"])), 4))
        assert len(lps) == 3  # three models (and data) apart
    assert r["one"] is True
    assert r["grads_kept"] is True and r["no_grads"] == [True, True]
    assert r["pending"] == [True, False, False]  # A's forward_backward only
    assert "coefficient loss" in r["mean"] and "ShardfitError" in r["mean"] and "\n" not in r["mean"]


def _two(rank, world):
    e = _trained()
    data = {n: random_datums(50 + i, 2 + i, (6, 16)) for i, (n, _) in enumerate(MODELS)}
    res = e.forward_many(data, "cross_entropy", SEQUENCE_MEAN)
    return {n: {"lp": _flat(r), "loss": r.metrics["loss:sum"]} for n, r in res.items()}


def test_two_ranks_equal_one():
    one, two = run_ranks(_two, 1)[0], run_ranks(_two, 2)
    assert two[0] == two[1]
    for n, _ in MODELS:
        np.testing.assert_allclose(two[0][n]["lp"], one[n]["lp"], rtol=0, atol=2e-5)
        np.testing.assert_allclose(two[0][n]["loss"], one[n]["loss"], rtol=1e-5)
