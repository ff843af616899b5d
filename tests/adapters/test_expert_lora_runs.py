"""Expert LoRA runs from a Hugging Face Qwen3-MoE base, end to end: 2 gloo ranks with expert parallelism (and
recomputation), or with CPU offload, train the adapters one process trains, only adapters reach the optimizer and the
base (router included) stays bit for bit; the PEFT export loads in peft.PeftModel with the trained model's logits,
the merged export in transformers likewise, and the adapter continues training (lora.adapter, each rank reading its
experts); a resumed run equals an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from shardfit.adapters.lora import is_adapter
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.adapters.test_lora_runs import IDS, _config, _logits, _uninterrupted_then_resumed
from tests.adapters.tiny_hf import hf_model, save_tiny
from tests.helpers import full_state

peft = pytest.importorskip("peft")
EXPERTS = "--lora.targets=q_proj,o_proj,experts"


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _train_export_continue(rank, world, base, root, extra):
    from shardfit.parallel.offload import offloaded

    t = Trainer(_config(base, EXPERTS, "--train.steps=3", f"--checkpoint.export_hf={root}/adapter",
                        f"--checkpoint.export_merged={root}/merged", "--checkpoint.export_dtype=float32", *extra,
                        run_dir=f"{root}/run"))
    frozen = {n: _local(p).detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    stepped = {id(p) for g in t.engine.optimizer.param_groups for p in g["params"]}
    in_optimizer = sorted(n for n, p in t.model.named_parameters() if id(p) in stepped)
    host = offloaded(t.model)  # read while sharded: a no-grad forward (_logits) leaves the last block gathered
    losses = [h["loss"] for h in t.fit()]
    after = dict(t.model.named_parameters())
    trained = {k: v for k, v in full_state(t.model).items() if is_adapter(k)}
    logits = _logits(t.model)
    # continue from the exported adapter: the run starts from exactly the trained adapters, and trains on
    more = Trainer(_config(base, EXPERTS, f"--lora.adapter={root}/adapter", "--train.steps=1", *extra,
                           run_dir=f"{root}/more"))
    loaded = {k: v for k, v in full_state(more.model).items() if is_adapter(k)}  # on the CPU: the live tensors
    continued = all(torch.equal(loaded[k], v) for k, v in trained.items())
    host = [host, offloaded(more.model)]
    more_losses = [h["loss"] for h in more.fit()]
    return {"losses": losses, "logits": logits, "in_optimizer": in_optimizer,
            "adapters": {k: v.tolist() for k, v in trained.items()} if rank == 0 else None,
            "base_same": all(torch.equal(_local(after[n]), v) for n, v in frozen.items()),
            "experts_frozen": sum(".mlp.experts." in n or n.endswith("mlp.gate.weight") for n in frozen),
            "continued": continued, "more": more_losses, "offloaded": host}


@pytest.mark.parametrize("world, extra", [
    # E = W: the experts and their adapters outside FSDP, cast by the computation, gradients written by its backward
    (2, ["--parallel.expert_parallel=2", "--compute.activation_checkpoint=full"]),
    pytest.param(2, [], marks=pytest.mark.slow),  # no EP: the experts and their adapters in the blocks' FSDP groups
    # the exchanges overlapped with the own rows: the experts (and their adapters' casts) run three times a layer
    pytest.param(2, ["--parallel.expert_parallel=2", "--parallel.expert_overlap=both",
                     "--compute.activation_checkpoint=selective"], marks=pytest.mark.slow),
    # E < W: the experts' own FSDP group over the 2 ranks holding the same experts (gradients divided by W)
    pytest.param(4, ["--parallel.expert_parallel=2", "--train.micro_batch=2"], marks=pytest.mark.slow),
    # CPU offload (no EP: layout.py refuses it with one): the experts stay in their blocks' FSDP groups (not outside
    # FSDP as with E = W), so FSDP's policy keeps their frozen base and their adapters in host shards with the
    # block's, the CPU step trains the adapters, and lora.adapter reads the export back into host shards
    (2, ["--parallel.offload=all"]),
], ids=["ep2-fullac", "fsdp", "ep2-overlap-both", "4ranks-ep2", "offload"])
def test_ranks_equal_one_and_exports_load_in_peft_and_transformers(tmp_path, world, extra):
    base = save_tiny("qwen3_moe", tmp_path)
    two = run_ranks(_train_export_continue, world, str(base), str(tmp_path / "two"), extra)
    one = _train_export_continue(0, 1, str(base), str(tmp_path / "one"), [])  # in this process: a group of one
    assert all(r["losses"] == two[0]["losses"] for r in two) and one["losses"][-1] < one["losses"][0]
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
    for k, v in one["adapters"].items():
        torch.testing.assert_close(torch.tensor(two[0]["adapters"][k]), torch.tensor(v), rtol=1e-4, atol=1e-5, msg=k)
    # q_proj and o_proj of 2 blocks, the experts' gate_up and down of the MoE block (the second is dense): A and B
    assert sum(".experts." in k for k in one["adapters"]) == 4 and len(one["adapters"]) == 2 * (2 * 2 + 2)
    for r in (one, *two):
        assert r["base_same"] and r["experts_frozen"] == 4  # gate, up, down and the router: frozen, unchanged
        assert r["in_optimizer"] == sorted(one["adapters"]) and r["continued"] and len(r["more"]) == 1
        assert r["offloaded"] == [r is not one and "--parallel.offload=all" in extra] * 2  # every parameter: host
    trained = torch.tensor(two[0]["logits"])
    ids = torch.tensor(IDS)
    with torch.no_grad():
        via_peft = peft.PeftModel.from_pretrained(hf_model(base), tmp_path / "two" / "adapter")(input_ids=ids).logits
        merged = hf_model(tmp_path / "two" / "merged")(input_ids=ids).logits
        untrained = hf_model(base)(input_ids=ids).logits
    for got in (via_peft, merged):
        assert ((got - trained).norm() / trained.norm()).item() < 1e-5
    assert ((untrained - trained).norm() / trained.norm()).item() > 1e-4  # training moved the adapters


def test_resume_equals_uninterrupted(tmp_path):
    """A checkpoint holds the expert adapters (DCP, frozen experts left out); resumed, the run is the same bits."""
    base = save_tiny("qwen3_moe", tmp_path)
    r = run_ranks(_uninterrupted_then_resumed, 1, str(base), str(tmp_path), [EXPERTS])[0]
    assert r["b"] == r["a"][2:] and r["same"]


def _train_experts(rank, world, overrides, run_dir):
    from tests.adapters.test_lora_training import MOE, _train

    return _train(rank, world, [*MOE, "--lora.targets=q_proj,experts", *overrides], run_dir)


@pytest.mark.slow  # CPU compile of the blocks: ~40 s
def test_compiled_blocks_train_the_same_expert_adapters(tmp_path):
    from tests.adapters.test_lora_training import plain_and_compiled

    plain, compiled = plain_and_compiled(_train_experts, tmp_path)
    assert compiled["base_same"] and compiled["in_optimizer"] == plain["in_optimizer"]
    assert sum(".experts." in n for n in plain["in_optimizer"]) == 2 * 2 * 2  # gate_up and down, A and B, 2 blocks


QLORA_MOE = ["--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32", "--lora.rank=4",
             "--lora.targets=all-linear,experts", "--model.quantize=nf4", "--train.steps=4", "--train.micro_batch=1"]


def _qlora_experts(rank, world, run_dir, extra):
    from tests.helpers import same_bits, small_config

    t = Trainer(small_config(*QLORA_MOE, *extra, run_dir=run_dir))
    frozen = {n: _local(p).detach().clone() for n, p in t.model.named_parameters() if not p.requires_grad}
    losses = [h["loss"] for h in t.fit()]
    after = dict(t.model.named_parameters())
    return {"losses": losses, "nf4": sum(n.endswith("weight_nf4") for n in frozen),
            "base_same": all(same_bits(_local(after[n]), v) for n, v in frozen.items())}


def test_qlora_with_expert_adapters_two_ranks_ep2_equal_one(tmp_path):
    """The attention's NF4 base and the experts' bf16-kept base with grouped adapters together: 2 ranks with EP 2 train
    what one process trains, and no frozen byte moves (NF4 storage compared bit for bit)."""
    two = run_ranks(_qlora_experts, 2, str(tmp_path / "two"), ["--parallel.expert_parallel=2"])
    one = run_ranks(_qlora_experts, 1, str(tmp_path / "one"), [])[0]
    assert one["nf4"] > 0 and one["losses"][-1] < one["losses"][0]
    for r in (one, *two):
        assert r["base_same"], r
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
