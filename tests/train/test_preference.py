"""Preference training in the trainer (train/preference.py): the reference of a LoRA run is the base with the adapters
off (on an FP8 base too, model.quantize=fp8: the FP8 base itself), a resumed full run reads the reference its start
wrote (its own model is no longer the reference), and the settings it cannot run with are one line each."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardfit.errors import ShardfitError
from tests._dist import run_ranks
from tests.helpers import small_config

PAIRS = [{"prompt": f"q{i}?", "chosen": " yes" + "!" * (i % 3), "rejected": " no" + "?" * (i % 5)} for i in range(8)]
EXAMPLES = [{"prompt": f"q{i}?", "completion": " yes" * (1 + i % 3), "label": i % 3 != 1} for i in range(8)]


def _data(tmp_path, records=PAIRS):
    path = tmp_path / ("examples.jsonl" if records is EXAMPLES else "pairs.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _cfg(tmp_path, *extra, run="run"):
    return small_config("--train.device=cpu", f"--data.path={_data(tmp_path)}", "--preference.objective=dpo",
                        "--train.micro_batch_tokens=64", "--train.global_batch=4", *extra,
                        run_dir=str(tmp_path / run))


@pytest.mark.parametrize("base", [[], ["--model.quantize=fp8"]], ids=["base", "fp8-base"])
def test_lora_reference_is_the_base_with_the_adapters_off(tmp_path, base):
    from shardfit.train import Trainer

    trainer = Trainer(_cfg(tmp_path, "--lora.rank=4", *base))
    try:
        assert any(n.startswith("FP8 base: ") for n in trainer.engine.notices) == bool(base)
        with torch.no_grad():  # adapters that change the model: the reference must not see them
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
        steps = trainer.preference
        with_adapters = steps.compute_reference(trainer.engine)
        said = []
        steps.prepare(trainer.engine, resumed=False, say=said.append)
        assert "the frozen base, adapters off" in said[0]
        assert trainer.engine.models.current == "default"  # the adapters back in the slot
        assert not (trainer.run_dir / "reference_logprobs.npz").exists()  # LoRA: recomputed on resume, not saved
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.zero_()
        base = steps.compute_reference(trainer.engine)
        for (c, r), (bc, br) in zip(steps.train_reference, base):
            np.testing.assert_allclose(c, bc, atol=1e-6)
            np.testing.assert_allclose(r, br, atol=1e-6)
        assert max(float(np.abs(c - ac).max()) for (c, _), (ac, _) in zip(base, with_adapters)) > 1e-3
    finally:
        trainer.claim.release()
        trainer.watchdog.stop()


def test_a_resumed_full_run_reads_the_reference_its_start_wrote(tmp_path, capsys):
    from shardfit.train import Trainer

    first = Trainer(_cfg(tmp_path, "--train.steps=2", "--checkpoint.final=true", "--logging.progress=lines"))
    first.fit()
    start = [(c.copy(), r.copy()) for c, r in first.preference.train_reference]
    second = Trainer(_cfg(tmp_path, "--train.steps=3", "--checkpoint.final=true", "--logging.progress=lines",
                          "--checkpoint.allow_changes=train.steps"))
    assert second.step == 2
    history = second.fit()
    assert "reference log-probs: read from" in capsys.readouterr().out
    for (c, r), (c0, r0) in zip(second.preference.train_reference, start):
        assert np.array_equal(c, c0) and np.array_equal(r, r0)
    assert [h["step"] for h in history] == [3]


@pytest.mark.parametrize("extra, key", [
    (["--train.micro_batch_tokens=0"], "train.micro_batch_tokens"),
    # not first the micro_batch multiple, whose fix ("use a multiple of micro_batch") would lead to this one
    (["--train.micro_batch_tokens=0", "--train.global_batch=2"], "train.micro_batch_tokens"),
    (["--train.micro_batch_tokens=48"], "train.micro_batch_tokens"),
    (["--train.eval_every=2"], "train.eval_every"),  # without a validation set
])
def test_what_preference_training_cannot_run_with_is_one_line(tmp_path, extra, key):
    from shardfit.train.preference import check_preference_config

    with pytest.raises(ShardfitError) as e:
        check_preference_config(_cfg(tmp_path, *extra))
    assert e.value.where == key and e.value.fix


def _fit(rank, world, args, run_dir):
    from shardfit.config import load_config
    from shardfit.train import Trainer

    trainer = Trainer(load_config(None, [*args, f"--logging.run_dir={run_dir}"]))
    history = trainer.fit()
    reference = trainer.preference.train_reference
    records = [json.loads(x) for x in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()] \
        if rank == 0 else []
    return {"losses": [h["loss"] for h in history],
            "reference": [float(c.sum() + r.sum()) for c, r in reference] if reference else None,
            "kl": [r["kl"] for r in records if "kl" in r],
            "eval": [{k: v for k, v in r.items() if k.startswith(("val_loss", "eval_"))} for r in records
                     if r.get("kind") == "eval"]}


FP8_LORA = ["--lora.rank=4", "--lora.targets=all-linear", "--model.quantize=fp8"]


@pytest.mark.parametrize("objective, extra", [("dpo", []), ("orpo", []), ("kto", []), ("dpo", FP8_LORA)],
                         ids=["dpo", "orpo", "kto", "dpo-lora-fp8-base"])
def test_two_ranks_train_as_one(tmp_path, objective, extra):
    """The reference pass, the steps (KTO's reference point too) and the validation metrics on 2 gloo ranks (each
    its share of the units) equal one process; DPO of LoRA on an FP8 base too (its reference: the FP8 base)."""
    from tests.helpers import SMALL

    path = _data(tmp_path, EXAMPLES if objective == "kto" else PAIRS)
    args = [*SMALL, "--train.device=cpu", f"--data.path={path}", f"--preference.objective={objective}",
            "--train.micro_batch_tokens=64", "--train.global_batch=4", "--train.steps=3", "--logging.log_every=1",
            "--data.val_fraction=0.25", "--train.eval_every=3", "--train.lr=3e-3", *extra]
    one = run_ranks(_fit, 1, args, str(tmp_path / "one"))[0]
    two = run_ranks(_fit, 2, args, str(tmp_path / "two"))
    assert two[0]["losses"] == two[1]["losses"]
    if objective != "orpo":  # ORPO has no reference
        np.testing.assert_allclose(two[0]["reference"], one["reference"], rtol=1e-5)
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(two[0]["kl"], one["kl"], rtol=1e-4, atol=1e-6)
    (e1,), (e2,) = one["eval"], two[0]["eval"]
    assert e1.keys() == e2.keys() and "val_loss" in e1 and "eval_rewards/chosen" in e1
    # an FP8 base: after 3 steps an e4m3 rounding of an output gradient flipped by the ranks' other fp32 sums moves
    # the adapters a little (tests/engine/test_fp8_base_engine.py); measured 4e-4
    np.testing.assert_allclose([e2[k] for k in e1], [e1[k] for k in e1], rtol=2e-3 if extra else 1e-4, atol=1e-6)
    if objective == "dpo":
        assert one["losses"][0] == pytest.approx(np.log(2), abs=1e-6)
    if objective == "kto":  # step 1: the policy is the reference, z = 0; then it moves
        assert one["kl"][0] == 0.0 and len(one["kl"]) == 3


def test_kto_reference_point_and_validation_follow_their_definitions(tmp_path):
    """KTO's z is max(0, mean of the KL sequences' (policy - reference) sums); DPO's validation loss, before
    training, is log 2 with zero margins, and after changing the model the mean of -log sigmoid(beta x margin) of
    the held-out pairs, computed here from a separate no-grad pass."""
    from shardfit.train import Trainer

    def perturb(trainer):
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            for p in trainer.model.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p  # one rank: the whole tensor
                local.add_(torch.randn(local.shape, generator=g) * 0.05)

    trainer = Trainer(_cfg(tmp_path, "--preference.objective=kto", f"--data.path={_data(tmp_path, EXAMPLES)}",
                           run="kto"))
    try:
        steps = trainer.preference
        steps.prepare(trainer.engine, resumed=False, say=lambda _: None)
        units = [steps.datums(i) for i in range(4)]
        assert steps.kl_point(trainer.engine, units) == 0.0
        perturb(trainer)
        policy = steps.compute_reference(trainer.engine)  # the perturbed model's log-probs of the same sequences
        diffs = [float(policy[i][1].sum() - steps.train_reference[i][1].sum()) for i in range(4)]
        assert steps.kl_point(trainer.engine, units) == pytest.approx(max(0.0, float(np.mean(diffs))), rel=1e-5)
    finally:
        trainer.claim.release()
        trainer.watchdog.stop()

    trainer = Trainer(_cfg(tmp_path, "--data.val_fraction=0.25", "--train.eval_every=1", run="dpo"))
    try:
        steps = trainer.preference
        steps.prepare(trainer.engine, resumed=False, say=lambda _: None)
        first = steps.evaluate(trainer.engine)
        assert first["val_loss"] == pytest.approx(np.log(2), abs=1e-6)
        # the policy is the reference: margins 0 up to rounding (the pass shares each pair's prompt, the reference
        # pass scores the sequences apart: the same sums in another order)
        assert first["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
        assert first["eval_rewards/accuracies"] == 0.0
        perturb(trainer)
        got = steps.evaluate(trainer.engine)
        policy, ref = steps.compute_reference(trainer.engine, data=steps.val), steps.reference[id(steps.val)]
        margins = np.array([(c.sum() - rc.sum()) - (r.sum() - rr.sum()) for (c, r), (rc, rr) in zip(policy, ref)])
        assert got["val_loss"] == pytest.approx(float(np.mean(np.logaddexp(0, -0.1 * margins))), rel=1e-4)
        assert got["eval_rewards/accuracies"] == pytest.approx(float(np.mean(margins > 0)))
        assert got["val_tokens"] == sum(int(s.counted.sum()) for i in range(2) for s in steps.val.sides_of(i))
    finally:
        trainer.claim.release()
        trainer.watchdog.stop()
