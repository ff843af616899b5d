"""Training on an FP8 base (model.quantize=fp8) through the Trainer: the loss falls, 2 gloo ranks equal 1 (losses,
adapters and the codes themselves: every row quantised alone), FSDP2 shards the storage by weight rows and gathers
it uncast in bf16 carriers beside fp32 adapters, the codes never change, every checkpointing mode gives the same run
(the recompute repeats the FP8 matmul), and a resume continues the run exactly with no codes saved."""

from __future__ import annotations

import torch

from tests._dist import run_ranks
from tests.adapters.test_lora_training import LORA, _modes
from tests.adapters.test_qlora_training import _train

FP8 = [*LORA, "--model.quantize=fp8"]


def test_loss_falls_and_two_ranks_equal_one(tmp_path):
    bf16 = ["--compute.param_dtype=bfloat16"]
    two = run_ranks(_train, 2, bf16, str(tmp_path / "two"), FP8, "weight_fp8")
    one = _train(0, 1, bf16, str(tmp_path / "one"), FP8, "weight_fp8")
    assert one["losses"][-1] < one["losses"][0] - 0.1, one["losses"]
    assert two[0]["losses"] == two[1]["losses"]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-4)
    for k, v in one["adapters"].items():
        torch.testing.assert_close(torch.tensor(two[0]["adapters"][k]), torch.tensor(v), rtol=2e-3, atol=2e-4,
                                   msg=k)
    assert two[0]["codes"] == one["codes"] and len(one["codes"]) == 2 * 7 * 2  # quantised alike on 1 and 2 ranks
    assert [r["rows"] for r in two] == [{k: n // 2 for k, n in one["rows"].items()}] * 2  # weight rows, split
    for r in [one, *two]:
        assert r["frozen_same"]  # the codes and scales, bit for bit after training
        assert r["group"] == ["bfloat16:False", "float32:True"]  # storage carried in bf16, adapters fp32
        assert set(r["storage_cast"]) in ({"None"}, {"torch.bfloat16"})  # gathered as it is: no cast of its bytes
        assert len(r["notices"]) == 1 and "FP8 base: the base weights of 14 adapted linear layers" in r["notices"][0]


def test_every_checkpointing_mode_gives_the_same_run(tmp_path):
    """The recompute quantises the activations again, as the forward did: the same losses, bit for bit."""
    r = run_ranks(_modes, 1, str(tmp_path), FP8)[0]
    assert r["full"] == r["none"] and r["selective"] == r["none"]
