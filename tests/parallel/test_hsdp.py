"""HSDP (parallel.replicate = R): parameters sharded within groups of world/R ranks, replicated across the R groups;
4 gloo ranks (2 x 2) train the same weights as one process, alone and under Ulysses."""

import pytest
import torch

from shardfit.errors import ShardfitError
from shardfit.parallel.parallelize import check_replicate
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, reference_train, small_config

# grad_clip=0: the parity tests compare weights with the reference trainer's; the norm that clipping would use is
# checked on its own (test_gradient_norm_counts_each_shard_once).
NO_CLIP = ["--train.grad_clip=0"]


def _train_hsdp(rank, world, overrides, run_dir):
    trainer = Trainer(small_config(*overrides, run_dir=run_dir))
    w = trainer.model.model.layers[0].self_attn.q_proj.weight  # [dim, dim] = [64, 64]
    layout = {"mesh": list(w.device_mesh.shape), "placements": [type(p).__name__ for p in w.placements],
              "local_rows": w.to_local().shape[0], "dp_rank": trainer.dp_rank, "sp_rank": trainer.sp_rank}
    history = trainer.fit()
    local = {k: v.to_local().flatten().tolist() for k, v in trainer.model.state_dict().items()
             if hasattr(v, "to_local")}
    state = {k: v.tolist() for k, v in full_state(trainer.model).items()}
    return {"losses": [h["loss"] for h in history], "grad_norms": [h["grad_norm"] for h in history],
            "state": state if rank == 0 else None, "local": local, **layout}


def _check_against_reference(res, overrides):
    ref_model, ref_losses = reference_train(small_config(*overrides))
    assert all(r["losses"] == res[0]["losses"] for r in res)  # every rank derives the same metrics
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    ref = ref_model.state_dict()
    assert set(res[0]["state"]) == {k for k in ref if not k.endswith("inv_freq")}
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), ref[k], rtol=1e-4, atol=1e-4, msg=k)


def _check_layout(res, R, world):
    shard = world // R
    for r, x in enumerate(res):
        assert x["mesh"] == [R, shard] and x["placements"] == ["Replicate", "Shard"]
        assert x["local_rows"] == 64 // shard  # sharded over world/R ranks, not world
        # replicas hold the same shard: rank r and rank r + world/R (same shard position, next replica), bit for bit
        if r + shard < world:
            assert x["local"] == res[r + shard]["local"]
        # neighbours r, r + 1 within a shard group hold different rows
        if (r + 1) % shard:
            assert x["local"] != res[r + 1]["local"]


def test_hsdp_2x2_matches_single_process(tmp_path):
    overrides = [*NO_CLIP, "--parallel.replicate=2", "--train.micro_batch=2"]
    res = run_ranks(_train_hsdp, 4, overrides, str(tmp_path), timeout=240)
    _check_layout(res, 2, 4)
    assert [r["dp_rank"] for r in res] == [0, 1, 2, 3]  # HSDP does not change which data a rank reads
    _check_against_reference(res, overrides)


@pytest.mark.slow
def test_hsdp_with_ulysses_matches_single_process(tmp_path):
    """sp=2 groups stay neighbours (r // 2) and read the same samples; HSDP shards over pairs, replicates twice."""
    overrides = [*NO_CLIP, "--parallel.replicate=2", "--parallel.sequence_parallel=2",
                 "--compute.activation_checkpoint=full"]
    res = run_ranks(_train_hsdp, 4, overrides, str(tmp_path), timeout=300)
    _check_layout(res, 2, 4)
    assert [(r["dp_rank"], r["sp_rank"]) for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check_against_reference(res, overrides)


def test_gradient_norm_counts_each_shard_once(tmp_path):
    """4 ranks as 2 replicas of 2-rank shard groups: the norm sums one group's shards (ranks 0-1), once each; summing
    every rank would read sqrt(2) x the 1-process norm, and the wrong ranks (0 and 2) half of the rows."""
    hsdp = run_ranks(_train_hsdp, 4, ["--parallel.replicate=2", "--train.micro_batch=2"], str(tmp_path / "hsdp"),
                     timeout=240)
    one = run_ranks(_train_hsdp, 1, [], str(tmp_path / "one"), timeout=240)
    torch.testing.assert_close(torch.tensor(hsdp[0]["grad_norms"]), torch.tensor(one[0]["grad_norms"]), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("R, world", [(3, 4), (4, 2)])
def test_replicate_that_does_not_divide_the_world_is_refused(R, world):
    with pytest.raises(ShardfitError, match=rf"parallel.replicate={R} does not divide the world size {world}") as e:
        check_replicate(R, world)
    assert "\n" not in str(e.value) and f"use a divisor of {world}" in str(e.value)
    check_replicate(2, 4)
