"""A resumed run continues exactly where the interrupted one stopped."""

from pathlib import Path

import pytest
import torch

from shardfit.errors import ShardfitError
from shardfit.train import Trainer
from shardfit.weights.checkpoint import complete_checkpoints, resolve_resume
from tests._dist import run_ranks
from tests.helpers import EXTEND, full_state, small_config

ARGS = ["--train.steps=6", "--train.micro_batch=2", "--compute.activation_checkpoint=full", "--checkpoint.final=true"]


def _uninterrupted_then_resumed(rank, world, root, extra=()):
    full = Trainer(small_config(*ARGS, *extra, "--checkpoint.every=3", run_dir=f"{root}/a"))
    losses_a = [h["loss"] for h in full.fit()]
    state_a = full_state(full.model)
    first = Trainer(small_config(*ARGS, *extra, "--train.steps=3", run_dir=f"{root}/b"))
    first.fit()  # saves step 3 at the end
    resumed = Trainer(small_config(*ARGS, *extra, EXTEND, run_dir=f"{root}/b"))
    assert resumed.step == 3
    losses_b = [h["loss"] for h in resumed.fit()]
    state_b = full_state(resumed.model)
    same = all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    return {"a": losses_a, "b": losses_b, "same_params": same}


def _resume_on_one_rank(rank, world, root):
    # continue from the 2-rank checkpoint of step 3 (not the final one), in a new run directory
    t = Trainer(small_config(*ARGS, f"--checkpoint.resume={root}/b/checkpoints/step_00000003", EXTEND,
                             run_dir=f"{root}/c"))
    assert t.step == 3
    return {"losses": [h["loss"] for h in t.fit()]}


@pytest.mark.slow  # ~7 s; plain resume parity stays in the default run
def test_fp8_resume_equals_uninterrupted(tmp_path):
    """FP8 weights (torchao's subclass, all-gathered in FP8) save and load through DCP; the scales are refreshed from
    the loaded weights, so the resumed run repeats the uninterrupted one bit for bit."""
    pytest.importorskip("torchao.float8", reason="FP8 needs the optional torchao extra")
    r = run_ranks(_uninterrupted_then_resumed, 2, str(tmp_path), ["--compute.fp8=tensorwise"])[0]
    assert r["b"] == r["a"][3:] and r["same_params"]


def test_resume_equals_uninterrupted_and_reshards(tmp_path):
    res = run_ranks(_uninterrupted_then_resumed, 2, str(tmp_path))
    r = res[0]
    assert r["b"] == r["a"][3:], "resumed losses must equal the uninterrupted run's, bit for bit"
    assert r["same_params"]
    ckpts = complete_checkpoints(Path(tmp_path) / "a" / "checkpoints")
    assert [p.name for p in ckpts] == ["step_00000003", "step_00000006"]
    for p in ckpts:
        assert (p / "config.toml").is_file() and (p / "rng" / "rank1.safetensors").is_file()
    # a checkpoint saved by 2 ranks loads on 1 rank (DCP reshards) and continues within float tolerance
    one = run_ranks(_resume_on_one_rank, 1, str(tmp_path))[0]
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(r["a"][3:]), rtol=1e-5, atol=1e-5)


def test_incomplete_checkpoints_are_never_resumed(tmp_path):
    root = tmp_path / "checkpoints"
    for name, complete in (("step_00000003", True), ("step_00000006.tmp", True), ("step_00000009", False)):
        (root / name).mkdir(parents=True)
        if complete:
            (root / name / "complete.json").write_text("{}")
    assert complete_checkpoints(root) == [root / "step_00000003"]  # .tmp and unmarked directories never count
    skipped = []
    assert resolve_resume("auto", root, skipped) is None  # and a marker alone does not make a checkpoint whole
    assert skipped == [f"skipped corrupt checkpoint {root / 'step_00000003'}: complete.json: 'step' is None, not a "
                       "count"]
    assert resolve_resume("none", root) is None
    assert resolve_resume("auto", tmp_path / "nothing") is None


def _two_checkpoints_then_resume_after_damage(rank, world, root, damage):
    import os
    import pickle

    Trainer(small_config(*ARGS, "--train.steps=4", "--checkpoint.every=2", run_dir=root)).fit()
    newest = Path(root) / "checkpoints" / "step_00000004"
    if rank == 0:
        if damage == "truncated":
            shard = sorted(newest.glob("*.distcp"))[0]
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        else:  # a .metadata that would run a command under plain pickle.load
            class Evil:
                def __reduce__(self):
                    return (os.system, (f"touch {root}/pwned",))

            (newest / ".metadata").write_bytes(pickle.dumps(Evil()))
    torch.distributed.barrier()
    resumed = Trainer(small_config(*ARGS, "--train.steps=4", run_dir=root))
    return {"step": resumed.step, "notices": resumed.notices}


@pytest.mark.parametrize("damage, needle", [("truncated", "is truncated"),
                                            ("tampered", "refused to load global")])
def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, damage, needle):
    res = run_ranks(_two_checkpoints_then_resume_after_damage, 2, str(tmp_path), damage)
    for r in res:
        assert r["step"] == 2
        assert len(r["notices"]) == 1 and "step_00000004" in r["notices"][0] and needle in r["notices"][0]
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(ShardfitError, match="corrupt checkpoint"):
        resolve_resume(str(tmp_path / "checkpoints" / "step_00000004"), tmp_path)


def _ranks_see_different_checkpoints(rank, world, root, rank1_keeps):
    import shutil

    first = Trainer(small_config(*ARGS, "--train.steps=4", "--checkpoint.every=2", run_dir=f"{root}/a"))
    first.fit()  # checkpoints of steps 2 and 4 in a/checkpoints
    torch.distributed.barrier()
    if rank == 0:  # rank 1 reads its own copy, in which only some checkpoints survived
        shutil.copytree(f"{root}/a/checkpoints", f"{root}/b")
        for p in Path(f"{root}/b").iterdir():
            if p.name not in rank1_keeps:
                shutil.rmtree(p)
    torch.distributed.barrier()
    ckpt = f"{root}/a/checkpoints" if rank == 0 else f"{root}/b"
    try:
        t = Trainer(small_config(*ARGS, "--train.steps=4", f"--checkpoint.dir={ckpt}", run_dir=f"{root}/run{rank}"))
    except ShardfitError as e:
        return {"error": str(e)}
    return {"step": t.step, "notices": t.notices}


def test_ranks_that_see_different_checkpoints_agree_on_one():
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        res = run_ranks(_ranks_see_different_checkpoints, 2, root, ["step_00000002"])
    assert [r["step"] for r in res] == [2, 2]  # not rank 0 at step 4 and rank 1 at step 2
    assert all("rank 0: step 4, rank 1: step 2" in r["notices"][-2 if rank == 0 else -1] for rank, r in enumerate(res))
    # rank 0's step 4 is of the same run: replaced as the run passes it, and said so (run_dir.check_no_overwrite)
    assert "later checkpoints (step_00000004) are replaced" in res[0]["notices"][-1]


def test_a_rank_without_the_checkpoint_stops_every_rank():
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        res = run_ranks(_ranks_see_different_checkpoints, 2, root, [])
    assert all("rank 0: step 4, rank 1: none" in r["error"] for r in res)


def _train_then_return(rank, world, root, extra, run):
    t = Trainer(small_config(*ARGS, *extra, run_dir=f"{root}/{run}"))
    losses = [h["loss"] for h in t.fit()]
    state = {k: v.tolist() for k, v in full_state(t.model).items()}
    return {"start": t.step - len(losses), "losses": losses, "state": state if rank == 0 else None}


@pytest.mark.slow
def test_hsdp_checkpoint_resumes_on_another_layout(tmp_path):
    """Saved by 4 ranks under HSDP (2 replicas of 2-rank shard groups), resumed by 2 ranks under plain FSDP: DCP
    stores each replicated shard once and reshards on load; the run ends where one uninterrupted process does.
    No clipping: the trainer's gradient norm under HSDP is tests/parallel/test_hsdp.py's open xfail."""
    from tests.helpers import reference_train

    no_clip = ["--train.grad_clip=0"]
    run_ranks(_train_then_return, 4, str(tmp_path), [*no_clip, "--parallel.replicate=2", "--train.steps=3"], "a",
              timeout=240)
    step3 = f"--checkpoint.resume={tmp_path}/a/checkpoints/step_00000003"
    res = run_ranks(_train_then_return, 2, str(tmp_path), [*no_clip, step3, EXTEND], "b", timeout=240)[0]
    ref_model, ref_losses = reference_train(small_config(*ARGS, *no_clip))
    assert res["start"] == 3
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-5)
    ref = ref_model.state_dict()
    for k, v in res["state"].items():
        torch.testing.assert_close(torch.tensor(v), ref[k], rtol=1e-4, atol=1e-4, msg=k)
