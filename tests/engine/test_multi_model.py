"""Many LoRA models in ONE forward/backward over the shared base (engine/multi_model.py), through the RL API's
forward_backward_many:

- 3 models with different datums in one pass, each loss a mean over its own datums' tokens, get the loss, the
  adapter gradients and (after each one's optim_step) the weights each gets trained alone (fp32 on the CPU: tight
  tolerance), over two steps (the second with B != 0, so that A's gradients are not zero either); a model's pending
  mean-over-tokens pass is folded before the pass of several;
- a model whose datums carry zero loss keeps exactly zero gradients beside the others: nothing leaks;
- 2 gloo ranks equal 1;
- all of the above on an FP8 base too (model.quantize=fp8, adapters/fp8_base.py: the stacked adapters beside the
  FP8 matmul of the base);
- a bad mix is one line each: a model twice, an unknown model, a frozen version; and so are a mean-over-tokens
  loss and an adapter on lm_head.
The per-layer math: tests/adapters/test_lora_stack.py; the collectives: tests/parallel/test_adapter_exchange.py; pair
losses: test_multi_model_pairs.py; forward-only passes: test_multi_model_forward.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._dist import run_ranks
from tests.helpers import SMALL, random_datums

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=48", "--logging.run_dir=", "--lora.rank=4",
        "--lora.targets=all-linear"]
MODELS = (("A", 1), ("B", 2), ("Z", 3))
MEAN = {"normalize": "token_mean"}  # each model's loss a mean over its own datums' tokens
BASES = {"base": [], "fp8-base": ["--model.quantize=fp8"]}  # the frozen base as the compute dtype, or in FP8


def _data(seed, n=3, weight=1.0):
    return random_datums(seed, n, (6, 16), weight)


def _groups(step):
    """A and B learn; Z's datums have weight 0 (zero loss, zero gradient)."""
    return {"A": _data(10 + step), "B": _data(20 + step, 2), "Z": _data(30 + step, 2, weight=0.0)}


def _grads(e, name):
    return torch.cat([g.detach().flatten() for g in e.models.grads(name)]).tolist()


def _adapters(e) -> list[float]:
    """The adapters of the model in the slot, whole on every rank, flat."""
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p for _, p in sorted(e.model.named_parameters())
             if p.requires_grad]
    return torch.cat([w.detach().flatten() for w in whole]).tolist()


def every_models_adapters(e) -> dict[str, list[float]]:
    """{model: _adapters} for each of MODELS (each swapped into the slot in turn)."""
    out = {}
    for n, _ in MODELS:
        e.using(n)
        out[n] = _adapters(e)
    return out


def _train(rank, world, together, *extra):
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine

    e = DatumEngine.start(load_config(None, [*ARGS, *extra]))
    for name, seed in MODELS:
        e.add_model(name, seed=seed)
    out = {"loss": {n: [] for n, _ in MODELS}, "logprobs": {n: [] for n, _ in MODELS}}
    for step in range(2):
        groups = _groups(step)
        if together:
            res = e.forward_backward_many(groups, "cross_entropy", MEAN)
        else:
            res = {n: e.forward_backward(d, "cross_entropy", MEAN, model=n) for n, d in groups.items()}
        for n, r in res.items():
            out["loss"][n].append(r.metrics["loss:sum"])
            out["logprobs"][n].append(np.concatenate([o["logprobs"] for o in r.outputs]).tolist())
        if step == 1 and world == 1:
            out["grads"] = {n: _grads(e, n) for n, _ in MODELS}
        out.setdefault("norms", []).append([e.optim_step(AdamParams(learning_rate=2e-2), model=n)["grad_norm:mean"]
                                            for n, _ in MODELS])
    out["weights"] = every_models_adapters(e)
    out["extra"] = list(extra)
    out["fp8_base"] = any(n.startswith("FP8 base: ") for n in e.engine.notices)  # the base is what was asked
    return out


@pytest.fixture(scope="module", params=list(BASES.values()), ids=list(BASES))
def together(request):
    return run_ranks(_train, 1, True, *request.param)[0]


def test_models_in_one_pass_equal_each_trained_alone(together):
    alone = run_ranks(_train, 1, False, *together["extra"])[0]
    assert together["fp8_base"] == alone["fp8_base"] == bool(together["extra"])
    for n, _ in MODELS:
        np.testing.assert_allclose(together["loss"][n], alone["loss"][n], rtol=1e-5, atol=1e-6)
        for a, b in zip(together["logprobs"][n], alone["logprobs"][n]):
            np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
        # the pending gradients' direction (alone, a mean's pending gradient is scaled by C / N until optim_step),
        # and the norm optim_step applies
        if n != "Z":  # Z's are zeros (below)
            direction = [np.asarray(r["grads"][n]) / np.linalg.norm(r["grads"][n]) for r in (together, alone)]
            np.testing.assert_allclose(*direction, rtol=0, atol=1e-5)
        np.testing.assert_allclose(together["weights"][n], alone["weights"][n], rtol=0, atol=1e-5)
    # A's and B's; Z's is 0 (alone its mean over no tokens skips the step: nan)
    np.testing.assert_allclose(np.asarray(together["norms"])[:, :2], np.asarray(alone["norms"])[:, :2], rtol=1e-5)
    assert [n[2] for n in together["norms"]] == [0.0, 0.0]
    assert np.abs(together["grads"]["A"]).max() > 0 and together["weights"]["A"] != together["weights"]["B"]


def test_a_model_with_zero_loss_gets_exactly_zero_gradients(together):
    assert together["loss"]["Z"] == [0.0, 0.0]
    assert not any(together["grads"]["Z"])  # exact zeros beside A's and B's tokens


def test_two_ranks_equal_one(together):
    two = run_ranks(_train, 2, True, *together["extra"])
    for n, _ in MODELS:
        assert two[0]["weights"][n] == two[1]["weights"][n]
        np.testing.assert_allclose(two[0]["loss"][n], together["loss"][n], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(two[0]["weights"][n], together["weights"][n], rtol=0, atol=2e-5)


def _after_a_mean_pass(rank, world, together):
    """A's first pass alone (the mean cross-entropy: its factor known only after it), then A and B in one pass, then
    each one's optim_step; or the same passes one model at a time. The weights after."""
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    e.add_model("A", seed=1)
    e.add_model("B", seed=2)
    e.forward_backward(_data(1), "cross_entropy", MEAN, model="A")  # the Engine's mean over tokens
    if together:
        e.forward_backward_many({"B": _data(3), "A": _data(2)}, "cross_entropy", MEAN)
    else:
        e.forward_backward(_data(2), "cross_entropy", MEAN, model="A")
        e.forward_backward(_data(3), "cross_entropy", MEAN, model="B")
    norms = [e.optim_step(AdamParams(learning_rate=2e-2), model=m)["grad_norm:mean"] for m in "AB"]
    out = {"norms": norms}
    for m in "AB":
        e.using(m)
        out[m] = _adapters(e)
    return out


def test_a_pending_mean_pass_is_folded_before_the_pass_of_several():
    got, want = run_ranks(_after_a_mean_pass, 1, True)[0], run_ranks(_after_a_mean_pass, 1, False)[0]
    np.testing.assert_allclose(got["norms"], want["norms"], rtol=1e-5)
    for m in "AB":
        np.testing.assert_allclose(got[m], want[m], rtol=0, atol=1e-5)


def _refusals(rank, world):
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, ARGS))
    e.add_model("A", seed=1)
    e.add_model("B", seed=2)
    ref = e.freeze("A")
    d = _data(1)
    errors = {}
    for what, groups in {"twice": [("A", d), ("B", d), ("A", d)], "unknown": {"A": d, "nope": d},
                         "version": {"A": d, ref: d}}.items():
        try:
            e.forward_backward_many(groups, "cross_entropy")
        except Exception as err:  # noqa: BLE001  the message is the assertion
            errors[what] = f"{type(err).__name__}: {err}"
    errors["pending"] = [e.pending for _ in (0,)]
    from shardfit.engine import CrossEntropy

    try:
        e.engine.forward_backward([], CrossEntropy(), model=["A", "B"])
    except Exception as err:  # noqa: BLE001  the message is the assertion
        errors["mean"] = f"{type(err).__name__}: {err}"
    head = DatumEngine.start(load_config(None, [*ARGS[:-1], "--lora.targets=all-linear,lm_head"]))
    head.add_model("A", seed=1)
    head.add_model("B", seed=2)
    try:
        head.forward_backward_many({"A": d, "B": d}, "cross_entropy")
    except Exception as err:  # noqa: BLE001  the message is the assertion
        errors["head"] = f"{type(err).__name__}: {err}"
    return errors


def test_a_bad_mix_is_one_line_each():
    r = run_ranks(_refusals, 1)[0]
    assert "model 'A' appears twice in one pass" in r["twice"]
    assert "no model or version 'nope'" in r["unknown"]
    assert "frozen version" in r["version"] and "A@1" in r["version"]
    assert all("ShardfitError" in r[k] and "\n" not in r[k] for k in ("twice", "unknown", "version"))
    assert r["pending"] == [False]  # refused before any pass: nothing accumulated
    assert "coefficient loss" in r["mean"]
    assert "linear layers only" in r["head"] and "LoRAOutputHead" in r["head"] and "lora.targets" in r["head"]
    assert all("ShardfitError" in r[k] and "\n" not in r[k] for k in ("mean", "head"))
