"""parallel.overlap_optimizer on CUDA: the step on a side stream, group by group, each group's next forward waiting
for its own (parallel/step_overlap.py). A missing wait would let a forward read weights mid-update or a backward
zero gradients the step still reads: the runs would drift from the plain ones."""

import pytest
import torch

from tests._dist import run_ranks

pytestmark = pytest.mark.cuda


def _train(rank, world, extra, run_dir):
    from shardfit.train import Trainer
    from tests.helpers import small_config

    t = Trainer(small_config("--train.device=cuda", "--train.micro_batch=2", "--train.steps=6",
                             "--train.watchdog_s=90", *extra, run_dir=run_dir))
    history = t.fit()
    return {"losses": [h["loss"] for h in history], "norms": [h["grad_norm"] for h in history]}


@pytest.mark.parametrize("extra,tol", [
    (["--compute.param_dtype=float32", "--data.document_mask=false"], 1e-6),
    (["--compute.param_dtype=float32", "--data.document_mask=false", "--memory.keep_grads=false",
      "--train.global_batch=8"], 1e-6),
    # the MoE step the overlap is for: compiled, experts out of FSDP (E = W), bf16
    (["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=64", "--compute.compile=true",
      "--parallel.expert_parallel=2", "--model.max_seq_len=256", "--data.seq_len=256"], 3e-2),
], ids=["fp32", "fp32-freed-grads-accumulation", "moe-ep2-compile"])
def test_overlapped_step_on_a_side_stream_trains_as_the_plain_step(tmp_path, extra, tol):
    world = min(2, torch.cuda.device_count())
    if "--parallel.expert_parallel=2" in extra and world < 2:
        pytest.skip("needs 2 GPUs")
    plain = run_ranks(_train, world, extra, str(tmp_path / "plain"), backend="nccl")
    over = run_ranks(_train, world, [*extra, "--parallel.overlap_optimizer=true"], str(tmp_path / "over"),
                     backend="nccl")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(over[0][key]), torch.tensor(plain[0][key]), rtol=tol, atol=tol)
