"""parallel.overlap_optimizer (parallel/step_overlap.py): the step taken group by group in forward order must be the
one optimizer.step() takes, and every optimized parameter must be stepped exactly once, experts kept out of FSDP
included. Off CUDA the groups are stepped at once (no streams): the CPU checks the grouping and the arithmetic; the
stream ordering is checked on the GPU (tests/cuda/test_cuda_step_overlap.py)."""

import pytest
import torch

from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, small_config

MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32"]


def _train(rank, world, extra, run_dir):
    from shardfit.models.moe import MoE
    from shardfit.parallel.step_overlap import forward_order_groups

    t = Trainer(small_config("--train.micro_batch=2", "--train.steps=4", *extra, run_dir=run_dir))
    modules, groups = forward_order_groups(t.model, t.optimizer)
    ids = [id(p) for g in groups for p in g]
    experts = {id(p) for b in t.model.model.layers if isinstance(b.mlp, MoE) for p in b.mlp.experts.parameters()}
    in_block = all(any(id(p) in {id(q) for q in g} for g, m in zip(groups, modules) if any(m is b for b in
                   t.model.model.layers)) for p in t.model.parameters() if id(p) in experts)
    history = t.fit()
    state = {k: v.tolist() for k, v in full_state(t.model).items()}
    return {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "state": state if rank == 0 else None, "once": len(ids) == len(set(ids)) == len(t.optimizer.param_groups[0]
                                                                                    ["params"]) + len(
                t.optimizer.param_groups[1]["params"]), "experts_in_blocks": in_block}


@pytest.mark.parametrize("extra", [
    [],
    ["--memory.keep_grads=false", "--train.global_batch=8"],  # two micro-batches a step, gradients freed
    [*MOE, "--parallel.expert_parallel=2"],  # experts out of FSDP (E = W): stepped with their block
], ids=["dense", "accumulation-freed-grads", "moe-ep2"])
def test_overlapped_step_equals_the_plain_step(tmp_path, extra):
    plain = run_ranks(_train, 2, extra, str(tmp_path / "plain"))
    over = run_ranks(_train, 2, [*extra, "--parallel.overlap_optimizer=true"], str(tmp_path / "over"))
    assert over[0]["once"] and over[0]["experts_in_blocks"]
    assert over[0]["losses"] == plain[0]["losses"] and over[0]["norms"] == plain[0]["norms"]  # bit for bit
    for k, v in plain[0]["state"].items():
        assert torch.equal(torch.tensor(over[0]["state"][k]), torch.tensor(v)), k
