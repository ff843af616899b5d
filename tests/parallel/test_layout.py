"""check_layout: the world-size rules the launcher checks before starting processes, the trainer on each rank and
the planner before proposing a layout."""

import pytest

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from shardfit.parallel.layout import ParallelLayout, check_layout
from tests._dist import run_ranks


def _cfg(*args):
    return load_config(None, ["--train.device=cpu", *args])


def test_token_budgets_count_examples_so_any_global_batch_splits():
    check_layout(_cfg("--train.micro_batch_tokens=512", "--train.global_batch=10", "--data.seq_len=256"), 8)
    with pytest.raises(ShardfitError, match="not a multiple of micro_batch x world size"):
        check_layout(_cfg("--train.global_batch=10", "--train.micro_batch=1"), 8)


@pytest.mark.parametrize("args, world, needle", [
    (["--parallel.replicate=3"], 2, "parallel.replicate=3 does not divide the world size 2"),
    (["--parallel.sequence_parallel=3"], 4, "parallel.sequence_parallel=3 does not divide the world size 4"),
    (["--parallel.offload=all", "--compute.fp8=tensorwise"], 2,
     "parallel.offload=all does not combine with compute.fp8"),
    (["--train.micro_batch_tokens=128", "--data.seq_len=256"], 2, "micro_batch_tokens=128 is below data.seq_len"),
    (["--train.micro_batch_tokens=514", "--data.seq_len=256", "--parallel.sequence_parallel=4",
      "--model.n_heads=8"], 4, "micro_batch_tokens=514 is not a multiple of parallel.sequence_parallel=4"),
    (["--train.eval_every=10"], 1, "train.eval_every is set but there is no validation data"),
    (["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--parallel.replicate=2",
      "--parallel.expert_parallel=8", "--train.global_batch=16"], 8,
     "expert_parallel=8 does not divide the HSDP shard group of 4 ranks"),
    (["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--parallel.expert_parallel=2",
      "--parallel.expert_overlap=dispatch", "--train.global_batch=32"], 4,
     r"expert_overlap=dispatch needs the experts outside FSDP: parallel.expert_parallel equal to the world size "
     r"\(4; it is 2\)"),
    (["--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--parallel.expert_parallel=2",
      "--parallel.offload=all", "--lora.rank=4", "--lora.targets=q_proj,experts"], 2,
     r"^parallel.expert_parallel: parallel.expert_parallel=2 does not combine with parallel.offload=all yet; fix: set "
     r"parallel.expert_parallel=1 \(the experts then shard and offload with their blocks\), or parallel.offload=none$"),
])
def test_bad_layouts_are_one_line_before_launch(args, world, needle):
    with pytest.raises(ShardfitError, match=needle) as e:
        check_layout(_cfg(*args), world)
    assert "\n" not in str(e.value)


def test_positions_partition_the_ranks_into_neighbouring_groups():
    """8 ranks as 2 replicas x (2 EP groups of 2), Ulysses pairs: every kind of group covers each rank once, is made
    of neighbours, and holds the rank it is asked for; data positions count the Ulysses groups."""
    layouts = [ParallelLayout(8, rank=r, replicate=2, expert=2, sequence=2, moe=True) for r in range(8)]
    for groups in ([x.replica_ranks() for x in layouts], [x.sequence_ranks() for x in layouts],
                   [x.expert_ranks() for x in layouts]):
        assert all(r in g and list(g) == list(range(g.start, g.stop)) for r, g in enumerate(groups))
        assert sorted({r for g in set(groups) for r in g}) == list(range(8))
        assert sum(len(g) for g in set(groups)) == 8  # disjoint
    assert [x.replica_ranks() for x in layouts[:4]] == [range(0, 4)] * 4 and layouts[5].replica_ranks(0) == range(4)
    assert [(x.data_rank, x.sequence_rank) for x in layouts[:4]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layouts[7].data_size == 4 and layouts[7].shard == 4 and layouts[7].replica == 1
    assert layouts[0].experts_run_eagerly and not layouts[0].experts_outside_fsdp  # E = 2 of 8


def test_checked_layout_is_the_configs_and_refuses_what_check_layout_refuses():
    cfg = _cfg("--parallel.replicate=2", "--parallel.sequence_parallel=2", "--train.global_batch=8",
               "--train.micro_batch=1")
    got = ParallelLayout.from_config(cfg, 4, rank=3)
    assert got == ParallelLayout(4, rank=3, replicate=2, sequence=2)
    assert (got.data_rank, got.sequence_rank, got.replica) == (1, 1, 1)
    with pytest.raises(ShardfitError, match="parallel.replicate=3 does not divide the world size 4"):
        ParallelLayout.from_config(_cfg("--parallel.replicate=3"), 4)


def _meshes(rank, world):
    import torch.distributed as dist

    layout = ParallelLayout(world, rank=rank, replicate=2, expert=2, sequence=2, moe=True)
    meshes = layout.meshes("cpu")
    assert layout.meshes("cpu") is meshes  # built once
    return {"fsdp": list(meshes.fsdp.shape), "shard": dist.get_process_group_ranks(meshes.fsdp["shard"].get_group()),
            "sequence": dist.get_process_group_ranks(meshes.sequence),
            "ep": dist.get_process_group_ranks(meshes.expert["ep"].get_group()),
            "expert": list(meshes.expert.shape), "replica": list(layout.replica_ranks()),
            "sequence_ranks": list(layout.sequence_ranks()), "expert_ranks": list(layout.expert_ranks())}


def test_meshes_group_the_ranks_the_positions_name():
    for r in run_ranks(_meshes, 4, timeout=120):
        assert r["fsdp"] == [2, 2] and r["expert"] == [2, 1, 2]
        assert (r["shard"], r["sequence"], r["ep"]) == (r["replica"], r["sequence_ranks"], r["expert_ranks"])
