"""FP8 matmuls (`compute.fp8`, torchao): which layers convert, sharded FP8 training equals single-process FP8
training, FP8 really changes the numerics (a little), and checkpoints and exports hold plain weights."""

import pytest
import torch
from safetensors.torch import load_file

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.parallel import fp8 as fp8_mod
from shardfit.train import Trainer
from tests._dist import run_ranks
from tests.helpers import full_state, reference_train, small_config

pytest.importorskip("torchao.float8", reason="FP8 needs the optional torchao extra")


def _converted(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_on_gpus_only_the_blocks_large_linears_convert(recipe):
    cfg = load_config(None, ["--model.name=llama3-8b", "--model.n_layers=2", f"--compute.fp8={recipe}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    n = fp8_mod.apply_fp8(model, cfg.compute, "cuda", (9, 0))
    names = _converted(model)
    assert n == len(names) == 10  # q, o, gate, up, down of 2 blocks
    assert not any(x.endswith(("k_proj", "v_proj")) for x in names)  # [4096 -> 1024]: too small to gain
    assert type(model.lm_head).__name__ == "OutputHead"  # the loss reads the head's logits in full precision


def test_moe_routers_and_experts_stay_and_cpu_converts_every_eligible_layer():
    cfg = small_config("--model.n_experts=4", "--model.experts_per_token=2", "--model.moe_ffn_dim=32",
                       "--compute.fp8=tensorwise")
    with torch.device("meta"):
        model = build_model(cfg.model)
    names = _converted(model)
    assert names == []
    fp8_mod.apply_fp8(model, cfg.compute, "cpu", None)
    names = _converted(model)
    assert sorted({x.split(".")[-1] for x in names}) == ["k_proj", "o_proj", "q_proj", "v_proj"]  # emulated: all
    assert not any(x.endswith("mlp.gate") for x in names)


def test_start_line_says_what_runs_in_fp8():
    cfg = small_config("--compute.fp8=tensorwise").compute
    assert fp8_mod.fp8_notice(cfg, 0, "cuda").endswith("every matmul runs in bf16")
    assert "set --compute.compile=true" in fp8_mod.fp8_notice(cfg, 10, "cuda")
    compiled = small_config("--compute.fp8=tensorwise", "--compute.compile=true").compute
    assert fp8_mod.fp8_notice(compiled, 10, "cuda") == ("fp8 tensorwise: 10 linear layers run FP8 matmuls (weights "
                                                        "all-gathered in FP8)")
    assert "emulated on the CPU" in fp8_mod.fp8_notice(cfg, 10, "cpu")


def test_clear_errors(monkeypatch):
    cfg = small_config("--compute.fp8=tensorwise")
    with pytest.raises(ShardfitError, match=r"compute.fp8=tensorwise: needs FP8 tensor cores .* has 8.0"):
        fp8_mod.apply_fp8(build_model(cfg.model), cfg.compute, "cuda", (8, 0))
    monkeypatch.setattr(fp8_mod, "fp8_available", lambda: False)
    with pytest.raises(ShardfitError, match=r"needs torchao.*fix: pip install 'shardfit\[fp8\]'"):
        fp8_mod.apply_fp8(build_model(cfg.model), cfg.compute, "cpu", None)


def _train_fp8(rank, world, overrides, run_dir):
    trainer = Trainer(small_config(*overrides, run_dir=run_dir))
    history = trainer.fit()
    # FP8 weights are torchao's wrapper subclass around the high-precision tensor (its FSDP all-gather hooks)
    state = {k: getattr(v, "_tensor", v).tolist() for k, v in full_state(trainer.model).items()}
    return {"losses": [h["loss"] for h in history], "state": state if rank == 0 else None,
            "layers": trainer.engine.parallel.fp8_layers}


@pytest.mark.slow  # ~8 s; FP8 parity stays in the tensorwise dense test
def test_two_rank_fp8_moe_training_matches_one_rank(tmp_path):
    """An MoE model with FP8 attention projections: ranks route differently, the experts stay high precision, and
    2 ranks still equal 1."""
    overrides = ["--compute.fp8=tensorwise", "--model.n_experts=8", "--model.experts_per_token=2",
                 "--model.moe_ffn_dim=32", "--train.micro_batch=2", "--compute.activation_checkpoint=selective"]
    two = run_ranks(_train_fp8, 2, overrides, str(tmp_path))
    one = run_ranks(_train_fp8, 1, overrides, str(tmp_path / "one"))[0]
    assert two[0]["layers"] == one["layers"] == 8  # q, k, v, o of 2 blocks; routers and experts not
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
    for k, v in two[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), torch.tensor(one["state"][k]), rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_two_rank_fp8_training_matches_one_rank(tmp_path, recipe):
    """Tensorwise all-gathers the weights in FP8 with scales from one all-reduce: the same casts as one rank. The
    micro-batches are the same on 1 and 2 ranks (dynamic scales depend on them); only the gradients' reduction order
    differs."""
    overrides = [f"--compute.fp8={recipe}", "--train.micro_batch=2", f"--checkpoint.export_hf={tmp_path}/hf",
                 "--checkpoint.export_dtype=float32"]
    two = run_ranks(_train_fp8, 2, overrides, str(tmp_path))
    one = run_ranks(_train_fp8, 1, overrides[:-2], str(tmp_path / "one"))[0]
    assert two[0]["losses"] == two[1]["losses"] and two[0]["layers"] == one["layers"] == 14
    torch.testing.assert_close(torch.tensor(two[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-5)
    for k, v in two[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), torch.tensor(one["state"][k]), rtol=1e-4, atol=1e-4, msg=k)
    # FP8 is not a no-op: the same run without it lands elsewhere, but close
    _, plain = reference_train(small_config("--train.micro_batch=2"))
    assert two[0]["losses"] != pytest.approx(plain, rel=1e-4)
    assert two[0]["losses"] == pytest.approx(plain, rel=0.05)
    # the export holds plain tensors under the Hugging Face names, equal to the trained weights
    exported = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(f))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert type(exported[name]) is torch.Tensor
    torch.testing.assert_close(exported[name], torch.tensor(two[0]["state"][name]))


def _load_hf_fp8(rank, world, path, recipe):
    from shardfit.config import load_config
    from shardfit.weights.hf_load import load_hf_checkpoint
    from tests.helpers import parallelize_config as parallelize

    cfg = load_config(None, [f"--model.path={path}", "--data.seq_len=32", f"--compute.fp8={recipe}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    report = parallelize(model, cfg, torch.device("cpu"), world, seed=0, init=False)
    load_hf_checkpoint(model, path)
    fp8_mod.refresh_fp8_scales(model, cfg.compute)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids)
    state = {k: getattr(v, "_tensor", v).tolist() for k, v in full_state(model).items()}
    return {"state": state, "layers": report.fp8_layers, "logits": logits.tolist()}


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_hugging_face_weights_load_into_fp8_layers(tmp_path, kind):
    """A Hugging Face checkpoint loads into the FP8 model's sharded weights (torchao's subclass) exactly, q/k/v
    biases and MoE layers included, and its logits stay near the model's own."""
    from shardfit.config import load_config
    from shardfit.weights.hf_load import load_hf_checkpoint
    from tests.weights.test_hf_checkpoints import _save

    path, hf = _save(kind, tmp_path)
    res = run_ranks(_load_hf_fp8, 2, str(path), "tensorwise")[0]
    assert res["layers"] > 0
    plain = build_model(load_config(None, [f"--model.path={path}", "--data.seq_len=32"]).model)
    load_hf_checkpoint(plain, path)  # one process, no FP8: the reference tensors
    ref = plain.state_dict()
    assert set(res["state"]) == {k for k in ref if not k.endswith("inv_freq")}
    for k, v in res["state"].items():
        assert torch.equal(torch.tensor(v), ref[k]), k
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
    got = torch.tensor(res["logits"])
    assert not torch.equal(got, want)  # FP8 rounding is there ...
    assert ((got - want).norm() / want.norm()).item() < 0.1  # ... and small
