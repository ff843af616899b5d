"""check_layout: the world-size rules the launcher checks before starting processes, the trainer on each rank and
the planner before proposing a layout."""

import pytest

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from shardfit.parallel.layout import check_layout


def _cfg(*args):
    return load_config(None, ["--train.device=cpu", *args])


def test_token_budgets_count_examples_so_any_global_batch_splits():
    check_layout(_cfg("--train.micro_batch_tokens=512", "--train.global_batch=10", "--data.seq_len=256"), 8)
    with pytest.raises(ShardfitError, match="not a multiple of micro_batch x world size"):
        check_layout(_cfg("--train.global_batch=10", "--train.micro_batch=1"), 8)


@pytest.mark.parametrize("args, world, needle", [
    (["--parallel.replicate=3"], 2, "parallel.replicate=3 does not divide the world size 2"),
    (["--parallel.sequence_parallel=3"], 4, "parallel.sequence_parallel=3 does not divide the world size 4"),
    (["--parallel.offload=optimizer"], 2, "parallel.offload=optimizer is not supported"),
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
])
def test_bad_layouts_are_one_line_before_launch(args, world, needle):
    with pytest.raises(ShardfitError, match=needle) as e:
        check_layout(_cfg(*args), world)
    assert "\n" not in str(e.value)
