"""A QLoRA run end to end (test_lora_runs.py's runs with model.quantize=nf4, and with an FP8 base, fp8): model.path is
quantised shard by shard into the codes of the whole weights quantised at once, on 1 and 2 ranks; its checkpoints
hold neither base nor codes and resume exactly (the base quantised again, identically, from model.path or the seed);
its PEFT adapter exports and continues training as LoRA's does; its merged exports (checkpoint.export_merged and
`shardfit export`: the base dequantised) and `shardfit generate` on its checkpoint give the trained model's logits
(an FP8 base's merge: up to the activations' FP8 rounding, which a merged bf16 model does not do)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardfit.adapters.lora import is_adapter
from shardfit.adapters.quantized import is_storage
from tests._dist import run_ranks
from tests.adapters.test_lora_runs import IDS, _train_and_export, _uninterrupted_then_resumed
from tests.adapters.tiny_hf import hf_model, save_tiny

peft = pytest.importorskip("peft")
NF4 = ("--model.quantize=nf4",)
FORMATS = {"nf4": (NF4, "NF4", "weight_nf4"), "fp8": (("--model.quantize=fp8",), "FP8", "weight_fp8")}


# fp8's resume in the default run: tests/engine/test_fp8_base_engine.py and tests/serve/test_fp8_base_serve.py
@pytest.mark.parametrize("fmt", ["nf4", pytest.param("fp8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("world, base", [(1, True), pytest.param(2, False, marks=pytest.mark.slow)],
                         ids=["1rank-model-path", "2ranks-seeded"])
def test_resume_equals_uninterrupted_and_saves_no_codes(tmp_path, world, base, fmt):
    from shardfit.weights.checkpoint_verify import read_metadata

    path = str(save_tiny("llama", tmp_path)) if base else None
    r = run_ranks(_uninterrupted_then_resumed, world, path, str(tmp_path), FORMATS[fmt][0])[0]
    assert r["b"] == r["a"][2:], "resumed losses must equal the uninterrupted run's, bit for bit"
    assert r["same"]  # adapters and the rebuilt codes alike
    ckpt = Path(tmp_path) / "b" / "checkpoints" / "step_00000002"
    model_keys = [k[len("model."):] for k in read_metadata(ckpt).state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(is_adapter(k) for k in model_keys)


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_exports_and_generate_give_the_trained_logits(tmp_path, capsys, fmt):
    from shardfit.cli.export import export
    from shardfit.weights.local import load_dcp

    flags, label, storage = FORMATS[fmt]
    base = save_tiny("llama", tmp_path)
    r = run_ranks(_train_and_export, 1, str(base), str(tmp_path), flags)[0]
    assert r["continued"] and r["n"] == 2 * (4 * 2 + 1)  # the PEFT adapter, as LoRA's
    trained = torch.tensor(r["logits"])
    ids = torch.tensor(IDS)
    assert export([str(tmp_path / "run"), str(tmp_path / "exported"), "--dtype", "float32"]) == 0  # shardfit export
    assert f"carry {label}'s rounding" in capsys.readouterr().out
    with torch.no_grad():
        merged = hf_model(tmp_path / "merged")(input_ids=ids).logits
        exported = hf_model(tmp_path / "exported")(input_ids=ids).logits
        model, _ = load_dcp(str(tmp_path / "run"), torch.device("cpu"), torch.float32)  # generate --checkpoint
        from_ckpt = model(ids)
        on_the_original_base = peft.PeftModel.from_pretrained(hf_model(base), tmp_path / "adapter")(
            input_ids=ids).logits
    assert any(n.endswith(storage) for n, _ in model.named_parameters())
    merge_gap = 1e-5 if fmt == "nf4" else 0.05  # FP8: the trained model rounds its activations, a merge does not
    for got, bound in ((merged, merge_gap), (exported, merge_gap), (from_ckpt, 1e-5)):
        assert ((got - trained).norm() / trained.norm()).item() < bound
    # the adapter on the unquantised base: close, but not the trained model (that one carries NF4's rounding)
    gap = ((on_the_original_base - trained).norm() / trained.norm()).item()
    assert 1e-4 < gap < 0.2, gap


def _loaded_codes(rank, world, base, root, flags=NF4):
    import shardfit.weights.quantized_io as qlora_io
    from shardfit.engine import Engine
    from tests.adapters.test_lora_runs import _config
    from tests.helpers import full_state

    qlora_io._STAGE_BYTES = 40_000  # a batch of one or two layers' rows: several batches, one oversized layer alone
    engine = Engine.start(_config(base, *flags, "--lora.targets=all-linear", run_dir=f"{root}/{world}"))
    state = full_state(engine.model)  # a collective: every rank
    if rank:
        return None
    return {k: v.reshape(-1).view(torch.uint8).tolist() for k, v in state.items() if is_storage(k)}


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_model_path_is_quantised_shard_by_shard_as_a_whole(tmp_path, fmt):
    """intermediate_size 544: each NF4 MLP weight is 3 groups (2 rows of the codes on rank 0, 1 on rank 1, the last
    padded; the rows a rank reads start and end inside a weight row); FP8's storage rows are weight rows."""
    from shardfit.adapters.fp8_base import quantized_class
    from shardfit.adapters.lora import apply_lora
    from shardfit.adapters.quantized import apply_quantized
    from shardfit.config.schema import LoraConfig
    from tests.adapters.tiny_hf import shardfit_model

    base = save_tiny("llama", tmp_path, intermediate_size=544)
    whole = shardfit_model(base)
    targets = apply_lora(whole, LoraConfig(rank=4, targets="all-linear"), None)
    apply_quantized(whole, targets, quantized_class(fmt))
    expected = {n: p.detach().reshape(-1).view(torch.uint8).tolist() for n, p in whole.named_parameters()
                if is_storage(n)}  # bytes: the carried storage's float view holds NaN patterns
    two = run_ranks(_loaded_codes, 2, str(base), str(tmp_path), FORMATS[fmt][0])[0]
    assert len(expected) == len(quantized_class(fmt).STORAGE) * 7 * 2 and two == expected
