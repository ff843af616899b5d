"""Training on an FP8 base (model.quantize=fp8) through the Trainer: the loss falls, 2 gloo ranks equal 1 (losses,
adapters and the codes themselves: every row quantised alone), FSDP2 shards the storage by weight rows and gathers
it uncast in bf16 carriers beside fp32 adapters, the codes never change, every checkpointing mode gives the same run
(the recompute repeats the FP8 matmul), and a resume continues the run exactly with no codes saved."""

from __future__ import annotations

import torch

from shardfit.adapters.lora import is_adapter
from shardfit.adapters.quantized import is_storage
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.adapters.test_lora_training import LORA, _local, _modes
from tests.helpers import full_state, same_bits, small_config

FP8 = [*LORA, "--model.quantize=fp8"]


def _train(rank, world, overrides, run_dir):
    from shardfit.parallel.step_overlap import param_group

    t = Trainer(small_config(*FP8, *overrides, run_dir=run_dir))
    frozen = {n: _local(p).detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    group = param_group(t.model.model.layers[0])
    history = t.fit()
    after = dict(t.model.named_parameters())
    state = full_state(t.model)
    storage = [fp for fp in group.fsdp_params if is_storage(fp._param_fqn or "")]
    return {"losses": [h["loss"] for h in history],
            "adapters": {k: v.tolist() for k, v in state.items() if is_adapter(k)} if rank == 0 else None,
            "codes": ({k: v.reshape(-1).view(torch.uint8).tolist() for k, v in state.items() if is_storage(k)}
                      if rank == 0 else None),
            "frozen_same": all(same_bits(_local(after[n]), v) for n, v in frozen.items()),
            "group": sorted({f"{str(p.sharded_param.dtype)[6:]}:{p.sharded_param.requires_grad}"
                             for p in group.fsdp_params}),
            "storage_cast": sorted({str(fp.param_dtype) for fp in storage}),
            "rows": _local(after["model.layers.0.self_attn.q_proj.weight_fp8"]).shape[0],
            "notices": [n for n in t.engine.notices if "FP8 base" in n]}


def test_loss_falls_and_two_ranks_equal_one(tmp_path):
    two = run_ranks(_train, 2, ["--compute.param_dtype=bfloat16"], str(tmp_path / "two"))
    one = _train(0, 1, ["--compute.param_dtype=bfloat16"], str(tmp_path / "one"))
    assert one["losses"][-1] < one["losses"][0] - 0.1, one["losses"]
    assert two[0]["losses"] == two[1]["losses"]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-4, atol=1e-4)
    for k, v in one["adapters"].items():
        torch.testing.assert_close(torch.tensor(two[0]["adapters"][k]), torch.tensor(v), rtol=2e-3, atol=2e-4,
                                   msg=k)
    assert two[0]["codes"] == one["codes"] and len(one["codes"]) == 2 * 7 * 2  # quantised alike on 1 and 2 ranks
    assert [r["rows"] for r in two] == [one["rows"] // 2] * 2  # storage rows are weight rows, split by FSDP
    for r in [one, *two]:
        assert r["frozen_same"]  # the codes and scales, bit for bit after training
        assert r["group"] == ["bfloat16:False", "float32:True"]  # storage carried in bf16, adapters fp32
        assert r["storage_cast"] in (["None"], ["torch.bfloat16"])  # gathered as it is: no cast of its bytes
        assert len(r["notices"]) == 1 and "14 adapted linear layers" in r["notices"][0]


def test_every_checkpointing_mode_gives_the_same_run(tmp_path):
    """The recompute quantises the activations again, as the forward did: the same losses, bit for bit."""
    r = run_ranks(_modes, 1, str(tmp_path), FP8)[0]
    assert r["full"] == r["none"] and r["selective"] == r["none"]
