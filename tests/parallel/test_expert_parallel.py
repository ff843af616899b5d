"""Expert parallelism (parallel/expert.py) on gloo ranks must train the weights one process trains."""

import pytest
import torch

from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, small_config

MOE = ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--train.micro_batch=2"]


def _train_ep(rank, world, overrides, run_dir):
    cfg = small_config(*overrides, run_dir=run_dir)
    trainer = Trainer(cfg)
    layer = trainer.model.model.layers[0].mlp
    local = layer.experts.gate_proj.to_local().shape[0] if hasattr(layer.experts.gate_proj, "to_local") else None
    seen = []
    layer.gate.register_forward_hook(lambda m, i, o: seen.append(torch.bincount(o.argmax(-1), minlength=8).tolist()))
    history = trainer.fit()
    state = {k: v.tolist() for k, v in full_state(trainer.model).items()}
    return {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history],
            "state": state if rank == 0 else None, "local_rows": local, "routing": seen}


@pytest.mark.parametrize("world,ep,ac", [(2, 2, "none"), (2, 2, "full"), (4, 2, "selective"), (4, 4, "full")])
def test_expert_parallel_matches_single_process(tmp_path, world, ep, ac):
    overrides = [*MOE, f"--parallel.expert_parallel={ep}", f"--parallel.activation_checkpoint={ac}"]
    res = run_ranks(_train_ep, world, overrides, str(tmp_path), timeout=300)
    assert res[0]["routing"] != res[1]["routing"]  # ranks send their tokens to different experts
    assert all(r["local_rows"] == 8 // world for r in res)  # each rank holds its own slice of the experts
    one = run_ranks(_train_ep, 1, overrides[:-2] + [f"--parallel.activation_checkpoint={ac}"], str(tmp_path / "one"))
    # Adam hides a gradient off by a constant factor (it divides by the gradient's own scale): the norms show it.
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(res[0][key]), torch.tensor(one[0][key]), rtol=1e-5, atol=1e-5)
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), torch.tensor(one[0]["state"][k]), rtol=1e-4, atol=1e-4, msg=k)
