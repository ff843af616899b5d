"""Preference training in the trainer (train/preference.py): the reference of a LoRA run is the base with the adapters
off, a resumed full run reads the reference its start wrote (its own model is no longer the reference), and the
settings it cannot run with are one line each."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardfit.errors import ShardfitError
from tests._dist import run_ranks
from tests.helpers import small_config

PAIRS = [{"prompt": f"q{i}?", "chosen": " yes" + "!" * (i % 3), "rejected": " no" + "?" * (i % 5)} for i in range(8)]


def _data(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    return path


def _cfg(tmp_path, *extra, run="run"):
    return small_config("--train.device=cpu", f"--data.path={_data(tmp_path)}", "--preference.objective=dpo",
                        "--train.micro_batch_tokens=64", "--train.global_batch=4", *extra,
                        run_dir=str(tmp_path / run))


def test_lora_reference_is_the_base_with_the_adapters_off(tmp_path):
    from shardfit.train import Trainer

    trainer = Trainer(_cfg(tmp_path, "--lora.rank=4"))
    try:
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
    (["--train.micro_batch_tokens=48"], "train.micro_batch_tokens"),
    (["--train.eval_every=2"], "train.eval_every"),
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
    return {"losses": [h["loss"] for h in history],
            "reference": [float(c.sum() + r.sum()) for c, r in trainer.preference.train_reference]}


def test_two_ranks_train_as_one(tmp_path):
    """The reference pass and the steps on 2 gloo ranks (each its share of the pairs) equal one process."""
    from tests.helpers import SMALL

    path = _data(tmp_path)
    args = [*SMALL, "--train.device=cpu", f"--data.path={path}", "--preference.objective=dpo",
            "--train.micro_batch_tokens=64", "--train.global_batch=4", "--train.steps=3"]
    one = run_ranks(_fit, 1, args, str(tmp_path / "one"))[0]
    two = run_ranks(_fit, 2, args, str(tmp_path / "two"))
    assert two[0] == two[1]
    np.testing.assert_allclose(two[0]["reference"], one["reference"], rtol=1e-5)
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-5, atol=1e-6)
    assert one["losses"][0] == pytest.approx(np.log(2), abs=1e-6)
