"""Many LoRA models on one frozen base and frozen versions (engine/registry.py), through the RL API:

- a new model starts at the base exactly; B's steps leave A untouched; interleaved models equal each trained alone,
  bit for bit (CPU); a frozen version keeps its log-probs however the model trains afterwards; the base is the zero
  adapter; 2 gloo ranks return what 1 returns; all of it on an FP8 base too (model.quantize=fp8), where sampling
  in-process is refused in one line and scoring (Engine.forward) is not;
- refusals are one line: an unknown model, training a version, a second model on an engine without LoRA;
- without LoRA a version is a copy of every weight: it keeps its weights through training, the model's come back.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests._dist import run_ranks
from tests.helpers import SMALL, random_datums

ARGS = [*SMALL, "--train.device=cpu", "--train.micro_batch_tokens=32", "--logging.run_dir=", "--lora.rank=4",
        "--lora.targets=all-linear"]
BASES = {"base": [], "fp8-base": ["--model.quantize=fp8"]}  # the frozen base as the compute dtype, or in FP8


def _data(seed, n=3):
    return random_datums(seed, n)


def _lp(res):
    return [o["logprobs"].tolist() for o in res.outputs]


def _steps(engine, model, seeds):
    from shardfit.rl import AdamParams

    losses = []
    for s in seeds:
        losses.append(engine.forward_backward(_data(s), "cross_entropy", model=model).metrics["loss:sum"])
        engine.optim_step(AdamParams(learning_rate=2e-2), model=model)
    return losses


def _models(rank, world, *extra):
    from shardfit.config import load_config
    from shardfit.engine.registry import BASE
    from shardfit.rl import DatumEngine

    probe = _data(99, 2)
    e = DatumEngine.start(load_config(None, [*ARGS, *extra]))
    out = {"base": _lp(e.forward(probe, model=BASE)), "default0": _lp(e.forward(probe, model="default"))}
    e.add_model("A", seed=1)
    e.add_model("B", seed=2)
    out["B0"] = _lp(e.forward(probe, model="B"))
    ref = e.freeze("A")  # A at the base: the DPO reference taken before training
    out["A_losses"] = _steps(e, "A", [1, 2, 3])
    out["A3"] = _lp(e.forward(probe, model="A"))
    out["ref_after"] = _lp(e.forward(probe, model=ref))
    out["B_losses"] = _steps(e, "B", [4, 5])
    out["A_after_B"] = _lp(e.forward(probe, model="A"))
    out["B2"] = _lp(e.forward(probe, model="B"))
    mid = e.freeze("A")
    out["A_more"] = _steps(e, "A", [6])
    out["mid"] = _lp(e.forward(probe, model=mid))
    # interleaved: C and D, call by call, each step's calls of the two models alternating
    from shardfit.rl import AdamParams

    e.add_model("C", seed=1)
    e.add_model("D", seed=2)
    inter = {"C": [], "D": []}
    for sc, sd in ([1, 4], [2, 5]):
        inter["C"].append(e.forward_backward(_data(sc), "cross_entropy", model="C").metrics["loss:sum"])
        inter["D"].append(e.forward_backward(_data(sd), "cross_entropy", model="D").metrics["loss:sum"])
        e.optim_step(AdamParams(learning_rate=2e-2), model="D")
        e.optim_step(AdamParams(learning_rate=2e-2), model="C")
    out["inter"] = inter
    out["C2"], out["D2"] = _lp(e.forward(probe, model="C")), _lp(e.forward(probe, model="D"))
    out["summary"] = e.models.summary()
    errors = {}
    from shardfit.sampling.params import SamplingParams

    for what, call in {"unknown": lambda: e.forward(probe, model="nope"),
                       "version_train": lambda: e.forward_backward(probe, model=ref),
                       "exists": lambda: e.add_model("A"),
                       "sample": lambda: e.sample([[1, 2, 3]], SamplingParams(2), version=ref)}.items():
        try:
            call()
        except Exception as err:  # noqa: BLE001  the message is the assertion
            errors[what] = f"{type(err).__name__}: {err}"
    out["errors"] = errors
    out["extra"] = list(extra)
    return out


def _alone(rank, world, *extra):
    """A trained on seeds 1, 2 alone, in a fresh engine: what C above must equal."""
    from shardfit.config import load_config
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, [*ARGS, *extra]))
    e.add_model("C", seed=1)
    return {"losses": _steps(e, "C", [1, 2]), "C2": _lp(e.forward(_data(99, 2), model="C"))}


@pytest.fixture(scope="module", params=list(BASES.values()), ids=list(BASES))
def one(request):
    return run_ranks(_models, 1, *request.param)[0]


def test_new_models_start_at_the_base_and_train_apart(one):
    r = one
    assert r["default0"] == r["base"] == r["B0"]  # B = 0: every new model is the base exactly
    assert r["A_losses"][0] > r["A_losses"][-1]
    assert r["A3"] != r["base"]
    assert r["A_after_B"] == r["A3"]  # B's steps left A untouched
    assert r["B2"] != r["A3"] and r["B2"] != r["base"]


def test_a_version_keeps_the_weights_it_was_made_from(one):
    r = one
    assert r["ref_after"] == r["base"]  # frozen at the base, after 3 of A's steps
    assert r["mid"] == r["A3"]  # frozen after A's third step, it reads those weights after A's fourth


def test_interleaved_models_equal_each_trained_alone(one):
    alone = run_ranks(_alone, 1, *one["extra"])[0]
    assert one["inter"]["C"] == alone["losses"]  # bit for bit
    assert one["C2"] == alone["C2"]
    assert one["summary"]["models"] == 5 and one["summary"]["versions"] == 2


def test_refusals_are_one_line(one):
    e = one["errors"]
    assert "no model or version 'nope'" in e["unknown"] and "\n" not in e["unknown"]
    assert "frozen version" in e["version_train"]
    assert "model 'A' exists" in e["exists"]
    assert "sample" not in e  # a version samples, on an FP8 base too (sampling/source.py: its layers in FP8)


def test_two_ranks_equal_one(one):
    two = run_ranks(_models, 2, *one["extra"])
    assert two[0]["A3"] == two[1]["A3"]
    np.testing.assert_allclose(np.concatenate(two[0]["A3"]), np.concatenate(one["A3"]), rtol=0, atol=2e-5)
    np.testing.assert_allclose(np.concatenate(two[0]["mid"]), np.concatenate(one["mid"]), rtol=0, atol=2e-5)
    assert two[0]["ref_after"] == two[0]["base"]


def _full_param(rank, world):
    """Without LoRA: a second model and the base alone refused; a version (a copy of every weight) keeps the weights
    it was made from through training, and the model's own come back exactly after it is sampled; a version loaded
    from a saved checkpoint (load_version) scores the saved weights and leaves the model's own as they were."""
    import tempfile
    from pathlib import Path

    from shardfit.config import load_config
    from shardfit.engine.registry import BASE
    from shardfit.rl import DatumEngine

    e = DatumEngine.start(load_config(None, [a for a in ARGS if not a.startswith("--lora")]))
    probe = _data(99, 2)
    out = {"errors": {}, "start": _lp(e.forward(probe))}
    for what, call in {"add": lambda: e.add_model("B"), "base": lambda: e.forward(probe, model=BASE)}.items():
        try:
            call()
        except Exception as err:  # noqa: BLE001  the message is the assertion
            out["errors"][what] = str(err)
    ref = e.freeze()
    out["losses"] = _steps(e, None, [1, 2])
    out["trained"] = _lp(e.forward(probe))
    out["ref"] = _lp(e.forward(probe, model=ref))
    out["back"] = _lp(e.forward(probe, model="default"))  # the model's own weights, copied back from the host
    with tempfile.TemporaryDirectory() as tmp:
        saved = e.save_state(Path(tmp) / "two", optimizer=False)  # the weights after 2 steps, on disk
        out["more"] = _steps(e, None, [3])
        out["ref_again"] = _lp(e.forward(probe, model=ref))
        out["three"] = _lp(e.forward(probe, model="default"))
        loaded = e.load_version(saved)  # a sampler of a saved path: every weight, into a version
        out["loaded"] = _lp(e.forward(probe, model=loaded))
        out["three_again"] = _lp(e.forward(probe, model="default"))  # the model's own, back after the load
        out["after_load"] = _steps(e, None, [4])
    out["summary"] = e.models.summary()
    return out


def test_without_lora_one_model_and_its_versions():
    r = run_ranks(_full_param, 1)[0]
    assert "needs LoRA" in r["errors"]["add"] and "--lora.rank" in r["errors"]["add"]
    assert "the base alone is LoRA's" in r["errors"]["base"]
    assert r["ref"] == r["ref_again"] == r["start"] != r["trained"]
    assert r["back"] == r["trained"]
    assert r["loaded"] == r["trained"] != r["three"] == r["three_again"]  # the saved weights; the model's untouched
    assert len(r["after_load"]) == 1  # the model trains on after the load
    assert r["summary"]["models"] == 1 and r["summary"]["versions"] == 2


def _step_without_gradients(rank, world):
    """optim_step with no forward_backward since the last one (a new model's first call, or a client's): no error,
    nothing to apply, the weights as they were; with and without LoRA."""
    from shardfit.config import load_config
    from shardfit.rl import AdamParams, DatumEngine
    from tests.helpers import full_state

    out = {}
    for name, args in (("lora", ARGS), ("full", [a for a in ARGS if not a.startswith("--lora")])):
        e = DatumEngine.start(load_config(None, args))
        before = {k: v.clone() for k, v in full_state(e.model).items()}
        m = e.optim_step(AdamParams(learning_rate=1e-2))
        e.finish()
        after = full_state(e.model)
        out[name] = [m["grad_norm:mean"], m["skipped:max"], all(bool((before[k] == after[k]).all()) for k in before)]
    return out


def test_an_optimizer_step_with_no_gradients_changes_nothing():
    r = run_ranks(_step_without_gradients, 1)[0]
    assert r["lora"] == [0.0, 0.0, True] and r["full"] == [0.0, 0.0, True]
