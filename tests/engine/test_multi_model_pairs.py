"""Pair losses in a pass of several LoRA models (rl/preference.py pair_pass_many, engine/preference.py join_terms):
3 models, each with its own DPO pairs (2, 1 and 3 pairs: each normalised over its own), trained in one
forward_backward_many equal each trained alone: the loss, TRL's metrics, the gradient norm and the weights after each
model's optim_step (fp32 on the CPU: 1e-5), over two steps (the second with B != 0); so do ORPO, whose batch
constant (the chosen answers' tokens) is each model's own, and KTO (its labels each model's datums'); 2 gloo ranks
equal 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._dist import run_ranks
from tests.engine.test_multi_model import ARGS, MODELS, every_models_adapters
from tests.helpers import random_pairs

N_PAIRS = {"A": 2, "B": 1, "Z": 3}
KTO = {"beta": 0.5, "desirable": [True, False, False, True], "kl": 0.2}  # 4 datums a model (2 "pairs")


def _train(rank, world, together, loss="dpo"):
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    for name, seed in MODELS:
        e.add_model(name, seed=seed)
    cfg = KTO if loss == "kto" else {"beta": 0.5}
    out = {"metrics": {n: [] for n, _ in MODELS}, "norms": []}
    for step in range(2):
        groups = {n: random_pairs(10 * step + i, 2 if loss == "kto" else N_PAIRS[n]) for i, (n, _) in enumerate(MODELS)}
        if together:
            res = e.forward_backward_many(groups, loss, cfg)
        else:
            res = {n: e.forward_backward(d, loss, cfg, model=n) for n, d in groups.items()}
        for n, r in res.items():
            out["metrics"][n].append(r.metrics)
        out["norms"].append([e.optim_step(AdamParams(learning_rate=5e-2), model=n)["grad_norm:mean"]
                             for n, _ in MODELS])
    out["weights"] = every_models_adapters(e)
    return out


def _same(got: dict, want: dict) -> None:
    for n, _ in MODELS:
        for g, w in zip(got["metrics"][n], want["metrics"][n]):
            assert g.keys() == w.keys()
            for k in w:
                np.testing.assert_allclose(g[k], w[k], rtol=1e-5, atol=1e-6, err_msg=f"{n} {k}")
        np.testing.assert_allclose(got["weights"][n], want["weights"][n], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=1e-5)


def test_dpo_pairs_of_three_models_in_one_pass_equal_each_alone():
    got, want = run_ranks(_train, 1, True)[0], run_ranks(_train, 1, False)[0]
    _same(got, want)
    assert len({round(m[1]["loss:sum"], 6) for m in got["metrics"].values()}) == 3  # three models apart
    assert got["weights"]["A"] != got["weights"]["B"] and min(min(n) for n in got["norms"]) > 0


@pytest.mark.parametrize("loss", ["orpo", "kto"])
def test_each_models_batch_constants_are_its_own(loss):
    _same(run_ranks(_train, 1, True, loss)[0], run_ranks(_train, 1, False, loss)[0])


def test_two_ranks_equal_one():
    one, two = run_ranks(_train, 1, True)[0], run_ranks(_train, 2, True)
    for n, _ in MODELS:
        assert two[0]["weights"][n] == two[1]["weights"][n]
        np.testing.assert_allclose(two[0]["weights"][n], one["weights"][n], rtol=0, atol=2e-5)
        for g, w in zip(two[0]["metrics"][n], one["metrics"][n]):
            np.testing.assert_allclose(g["loss:sum"], w["loss:sum"], rtol=1e-5, atol=1e-6)
