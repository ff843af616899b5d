"""compute.activation_checkpoint=auto on several GPUs: every rank plans for the job's smallest GPU (the Engine's one
all-reduce MIN of the device memory before it builds), so ranks whose own cards differ build the same blocks."""

import pytest
import torch

from tests._dist import run_ranks
from tests.plan.test_auto_checkpointing import H200, RL_8B

pytestmark = pytest.mark.cuda

SMALL_GIB = 60.0  # rank 1's card, as the patched device memory reports it; rank 0 reports an H200


def _resolve(rank, world):
    import shardfit.engine.build as engine_mod
    from shardfit.config import load_config
    from shardfit.parallel.dist import DistInfo

    gib = SMALL_GIB if rank == 1 else H200
    engine_mod.device_memory_bytes = lambda cfg, device: gib * 2**30  # this rank's card
    cfg = load_config(None, RL_8B)
    dist_info = DistInfo(rank, world, rank, torch.device("cuda", rank), "nccl")
    line = engine_mod.resolve_auto_checkpointing(cfg, dist_info)
    return {"ac": cfg.compute.activation_checkpoint, "blocks": cfg.compute.ac_blocks, "line": line}


def test_every_rank_plans_for_the_smallest_gpu():
    from shardfit.config import load_config
    from shardfit.plan.auto_checkpointing import auto_checkpointing

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    got = run_ranks(_resolve, 2, backend="nccl")
    assert got[0] == got[1], got  # the same blocks on both ranks
    small, _ = auto_checkpointing(load_config(None, RL_8B), 2, SMALL_GIB)
    large, _ = auto_checkpointing(load_config(None, RL_8B), 2, H200)
    assert (got[0]["ac"], got[0]["blocks"]) == (small["compute.activation_checkpoint"], small["compute.ac_blocks"])
    assert small != large  # the smaller card's plan differs: rank 0 took it from the all-reduce, not its own card
