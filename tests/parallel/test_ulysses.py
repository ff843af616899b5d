"""Ulysses sequence parallelism on 2 gloo ranks equals single-process training, with activation checkpointing."""

import pytest
import torch
import torch.distributed as dist

from shardfit.errors import ShardfitError
from shardfit.parallel.ulysses import check_sequence_parallel
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, reference_train, small_config


def _train_sp(rank, world, overrides, run_dir):
    exchanges = []
    inner = dist.all_to_all_single

    def counted(out, inp, *args, **kwargs):
        exchanges.append(tuple(inp.shape))
        return inner(out, inp, *args, **kwargs)

    dist.all_to_all_single = counted
    trainer = Trainer(small_config(*overrides, run_dir=run_dir))
    history = trainer.fit()
    state = {k: v.tolist() for k, v in full_state(trainer.model).items()}
    return {"losses": [h["loss"] for h in history], "state": state if rank == 0 else None,
            "exchanges": exchanges, "accum": trainer.accum}


@pytest.mark.parametrize("overrides", [
    ["--compute.activation_checkpoint=full"],  # K=2 key/value heads split over 2 ranks
    ["--compute.activation_checkpoint=selective", "--model.n_kv_heads=1", "--model.qk_norm=true"],  # K repeated
    ["--compute.activation_checkpoint=full", "--model.n_experts=8", "--model.experts_per_token=2",
     "--model.moe_ffn_dim=32"],  # MoE: each rank routes its own half of every sequence's tokens
], ids=["fullac-gqa", "selac-kvrepeat-qknorm", "fullac-moe"])
def test_sequence_parallel_matches_single_process(tmp_path, overrides):
    overrides = ["--parallel.sequence_parallel=2", *overrides]
    res = run_ranks(_train_sp, 2, overrides, str(tmp_path), timeout=240)
    cfg = small_config(*overrides)
    ref_model, ref_losses = reference_train(cfg)
    assert res[0]["losses"] == res[1]["losses"]
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    ref = ref_model.state_dict()
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), ref[k], rtol=1e-4, atol=1e-4, msg=k)
    # Both ranks issued the same exchanges in the same order: per layer and micro-batch, 4 in forward (q, k, v, out),
    # 4 again when checkpointing recomputes the forward, 4 in backward; and nothing else used all-to-all.
    assert res[0]["exchanges"] == res[1]["exchanges"]
    per_mb = 12 * cfg.model.n_layers
    assert len(res[0]["exchanges"]) == cfg.train.steps * res[0]["accum"] * per_mb


@pytest.mark.parametrize("P,world,seq,heads,needle", [
    (3, 4, 32, 4, "world size"), (2, 2, 33, 4, "seq_len"), (2, 2, 32, 3, "n_heads")])
def test_sizes_that_do_not_split_are_refused(P, world, seq, heads, needle):
    with pytest.raises(ShardfitError, match=needle):
        check_sequence_parallel(P, world, seq, heads)
