"""One collective per step outside FSDP, none inside forward/backward; a NaN on one rank skips the step on all."""

import math
import traceback

import torch
import torch.distributed as dist

from shardfit.train import Trainer, TrainingHalted
from tests._dist import run_ranks
from tests.helpers import full_state, small_config

_COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                "broadcast", "barrier", "all_to_all", "all_to_all_single", "reduce_scatter", "gather", "scatter"]


def _count_collectives(rank, world):
    calls = []

    def wrap(name, fn):
        def inner(*args, **kwargs):
            stack = traceback.extract_stack()
            origin = "fsdp" if any("/fsdp/" in f.filename for f in stack) else (
                "shardfit" if any("/shardfit/" in f.filename for f in stack) else "other")
            calls.append((name, origin))
            return fn(*args, **kwargs)
        return inner

    trainer = Trainer(small_config("--train.micro_batch=1", "--train.steps=3", run_dir=f"/tmp/sf-coll-{world}"))
    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    # the micro-batches' forward/backward: from the first micro-batch's callback to the one the Engine makes
    # after the last (i == count), just before its stats collective
    phases, inner = {}, trainer.engine.on_micro_batch
    started = []

    def on_micro_batch(step, i, n):
        if i == 0:
            started.append(len(calls))
        if i == n:
            phases.setdefault("fb", []).append(calls[started[-1]:])
        inner(step, i, n)

    trainer.engine.on_micro_batch = on_micro_batch
    per_step = []
    for _ in range(2):
        before = len(calls)
        trainer.train_step()
        per_step.append(calls[before:])
    return {"fb_shardfit": [sum(o == "shardfit" for _, o in c) for c in phases["fb"]],
            "fb_fsdp": [sum(o == "fsdp" for _, o in c) for c in phases["fb"]],
            "step_shardfit": [[n for n, o in c if o != "fsdp"] for c in per_step]}


def test_one_collective_per_step_none_inside_backward():
    for r in run_ranks(_count_collectives, 2):
        assert r["fb_shardfit"] == [0, 0]  # nothing of ours during the 4 micro-batches' forward/backward
        assert all(n > 0 for n in r["fb_fsdp"])  # FSDP's own all-gathers and reduce-scatters were seen
        assert all(len(c) == 1 for c in r["step_shardfit"]), r["step_shardfit"]


def _adam_steps(optimizer) -> list[float]:
    return [s["step"].item() for s in optimizer.state.values()]


def _nan_on_rank1(rank, world, run_dir, max_skipped):
    cfg = small_config("--train.steps=5", f"--train.max_skipped_steps={max_skipped}", run_dir=run_dir)
    trainer = Trainer(cfg)
    poison = {"on": False}

    def hook(module, inputs, output):
        return output * math.nan if poison["on"] and rank == 1 else output

    trainer.model.model.embed_tokens.register_forward_hook(hook)
    records, same_after_skip, opt_untouched = [], None, None
    try:
        for step in range(5):
            poison["on"] = step == 2
            if step == 2:
                before = full_state(trainer.model)
                opt_before = _adam_steps(trainer.optimizer)
            rec = trainer.train_step()
            if trainer.skipped > max_skipped:
                trainer.save()
                raise TrainingHalted("too many", where="test")
            records.append({"skipped": rec.skipped, "bad": rec.bad_ranks, "loss": rec.loss})
            if step == 2:
                after = full_state(trainer.model)
                same_after_skip = all(torch.equal(before[k], after[k]) for k in before)
                opt_untouched = opt_before == _adam_steps(trainer.optimizer)
        halted = False
    except TrainingHalted:
        halted = True
    return {"records": records, "same": same_after_skip, "opt_untouched": opt_untouched, "halted": halted,
            "step": trainer.step}


def test_nan_on_one_rank_skips_the_step_everywhere(tmp_path):
    res = run_ranks(_nan_on_rank1, 2, str(tmp_path), 3, timeout=120)
    for r in res:
        assert [x["skipped"] for x in r["records"]] == [False, False, True, False, False]
        assert r["records"][2]["bad"] == [1]
        assert r["same"] and r["opt_untouched"]
        assert all(math.isfinite(x["loss"]) for i, x in enumerate(r["records"]) if i != 2)
        assert not r["halted"]
    assert res[0]["records"] == res[1]["records"]


def test_too_many_nonfinite_steps_save_and_stop(tmp_path):
    res = run_ranks(_nan_on_rank1, 2, str(tmp_path), 0, timeout=120)
    assert all(r["halted"] and r["step"] == 3 for r in res)
    assert (tmp_path / "checkpoints" / "step_00000003" / "complete.json").is_file()
