"""QLoRA training (model.quantize=nf4) through the Trainer: the loss falls, 2 gloo ranks equal 1 (losses, adapters
and the codes themselves), FSDP2 shards the codes along dim 0 (uneven shards, a rank with none) and gathers them
uncast beside fp32 adapters and a bf16 base, the codes do not change, every checkpointing mode gives the same run,
and compiled blocks train the same adapters."""

from __future__ import annotations

import pytest
import torch

from shardfit.adapters.lora import is_adapter
from shardfit.adapters.quantized import is_storage
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.adapters.test_lora_training import LORA, MOE, _local, _modes, plain_and_compiled
from tests.helpers import full_state, same_bits, small_config

# ffn_dim 544: each MLP weight is 64 x 544 = 34,816 weights = 3 groups (the last padded): 2 rows on rank 0, 1 on
# rank 1; the 64 x 64 attention weights are 1 group: rank 1 holds none of it.
QLORA = [*LORA, "--model.quantize=nf4", "--model.ffn_dim=544"]


def _train(rank, world, overrides, run_dir, flags=QLORA, storage_key="weight_nf4"):
    """One run of a quantised base (flags: QLoRA's, or test_fp8_base_training.py's; storage_key: the format's first
    storage tensor)."""
    from shardfit.parallel.step_overlap import param_group

    t = Trainer(small_config(*flags, *overrides, run_dir=run_dir))
    frozen = {n: _local(p).detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    stepped = {id(p) for g in t.engine.optimizer.param_groups for p in g["params"]}
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
            "n_storage": sum(is_storage(n) for n in frozen),
            "in_optimizer": sorted(n for n, p in after.items() if id(p) in stepped),
            "group": sorted({f"{str(p.sharded_param.dtype)[6:]}:{p.sharded_param.requires_grad}"
                             for p in group.fsdp_params}),
            "storage_cast": [str(fp.param_dtype) for fp in storage],
            "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
            "rows": {k: _local(after[f"model.layers.0.{k}.{storage_key}"]).shape[0]
                     for k in ("mlp.up_proj", "self_attn.q_proj") if f"model.layers.0.{k}.{storage_key}" in after},
            "notices": [n for n in t.engine.notices if "base weights of" in n]}


def test_loss_falls_and_two_ranks_equal_one(tmp_path):
    two = run_ranks(_train, 2, [], str(tmp_path / "two"))
    one = _train(0, 1, [], str(tmp_path / "one"))  # in this process: a group of one
    assert one["losses"][-1] < one["losses"][0] - 0.1, one["losses"]
    assert two[0]["losses"] == two[1]["losses"]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
    for k, v in one["adapters"].items():
        torch.testing.assert_close(torch.tensor(two[0]["adapters"][k]), torch.tensor(v), rtol=1e-4, atol=1e-5,
                                   msg=k)
    assert two[0]["codes"] == one["codes"] and len(one["codes"]) == 3 * 7 * 2  # quantised alike on 1 and 2 ranks
    assert [r["rows"] for r in two] == [{"mlp.up_proj": 2, "self_attn.q_proj": 1},
                                        {"mlp.up_proj": 1, "self_attn.q_proj": 0}]
    for r in [one, *two]:
        assert r["frozen_same"] and r["n_storage"] == 3 * 7 * 2  # the codes, bit for bit after training
        assert r["in_optimizer"] and all(is_adapter(n) for n in r["in_optimizer"])
        assert r["group"] == ["float32:False", "float32:True"]  # the storage carried in fp32, the compute dtype
        assert len(r["storage_cast"]) == 21 and set(r["storage_cast"]) <= {"None", "torch.float32"}  # uncast


def test_bf16_mixed_precision_gathers_the_codes_uncast(tmp_path):
    """compute.param_dtype=bfloat16 on gloo: the norms stored in bf16, the adapters in fp32, the NF4 storage in
    bf16 carriers (the compute dtype: FSDP casts nothing), one fully_shard group per block; the storage is
    gathered as it is (a cast would ruin the fp32 bits in weight_stats, and the loss would not fall) and the base is
    dequantised to bf16."""
    r = run_ranks(_train, 2, ["--compute.param_dtype=bfloat16"], str(tmp_path))
    assert r[0]["losses"] == r[1]["losses"] and r[0]["losses"][-1] < r[0]["losses"][0] - 0.1
    assert r[0]["group"] == ["bfloat16:False", "float32:True"]
    assert len(r[0]["storage_cast"]) == 21 and set(r[0]["storage_cast"]) <= {"None", "torch.bfloat16"}
    assert r[0]["frozen_same"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["--parallel.sequence_parallel=2"],
    [*MOE, "--train.micro_batch=2", "--parallel.expert_parallel=2"],
    ["--train.micro_batch=2", "--compute.activation_checkpoint=full"],
], ids=["ulysses", "moe-ep", "accum2-fullac"])
def test_two_ranks_equal_one_with_other_parallelisms(tmp_path, overrides):
    two = run_ranks(_train, 2, overrides, str(tmp_path / "two"))
    one = _train(0, 1, [o for o in overrides if "_parallel" not in o], str(tmp_path / "one"))
    assert two[0]["losses"] == two[1]["losses"] and one["losses"][-1] < one["losses"][0]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
    assert two[0]["codes"] == one["codes"] and all(r["frozen_same"] for r in [one, *two])


def test_every_checkpointing_mode_gives_the_same_run(tmp_path):
    """The recompute dequantises again, as the forward did: the same losses, bit for bit."""
    r = run_ranks(_modes, 1, str(tmp_path), QLORA)[0]
    assert r["full"] == r["none"] and r["selective"] == r["none"]


@pytest.mark.slow  # CPU compile of the blocks: ~30 s
def test_compiled_blocks_train_the_same_adapters(tmp_path):
    plain, compiled = plain_and_compiled(_train, tmp_path)
    assert compiled["frozen_same"] and compiled["codes"] == plain["codes"]
    assert compiled["graph_breaks"] == 0  # the NF4 matmul's autograd.Function traces whole
