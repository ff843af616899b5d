"""PEFT's format (weights/peft.py, peft_config.py): an exported adapter round-trips and loads in PEFT, the merged
weights load in transformers with the adapter's logits, `shardfit generate --adapter` decodes what PEFT's model
decodes, and what shardfit cannot reproduce (DoRA, rsLoRA, pickled weights) is one error line."""

from __future__ import annotations

import json

import pytest
import torch

from shardfit.adapters.lora import apply_lora, init_adapters, is_adapter
from shardfit.config import load_config
from shardfit.config.schema import LoraConfig
from shardfit.errors import ShardfitError
from shardfit.weights.hf_export import export_hf
from shardfit.weights.peft import attach_adapter, export_adapter, merged_parameters
from shardfit.weights.peft_config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_lora_fields, read_adapter_config
from tests.adapters.tiny_hf import hf_model, randomize_adapters, save_tiny, shardfit_model

peft = pytest.importorskip("peft")
LORA = LoraConfig(rank=4, alpha=12.0, targets="q_proj,v_proj,down_proj,embed_tokens")


@pytest.fixture()
def adapted(tmp_path):
    """(base directory, shardfit LoRA model with random adapters, its exported adapter directory)."""
    path = save_tiny("llama", tmp_path)
    model = shardfit_model(path)
    targets = apply_lora(model, LORA, None)
    init_adapters(model, seed=0)
    randomize_adapters(model)
    export_adapter(model, tmp_path / "adapter", LORA, targets, str(path))
    return path, model, tmp_path / "adapter"


def test_export_round_trips_and_fills_the_config(adapted, tmp_path):
    path, model, out = adapted
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 12, str(path))
    assert config["target_modules"] == ["down_proj", "embed_tokens", "q_proj", "v_proj"]
    assert read_adapter_config(out) == {"rank": 4, "alpha": 12, "dropout": 0.0,
                                        "targets": "down_proj,embed_tokens,q_proj,v_proj"}
    fresh = shardfit_model(path)
    attach_adapter(fresh, out)
    got, want = dict(fresh.named_parameters()), dict(model.named_parameters())
    assert all(torch.equal(got[n], want[n]) for n in want)
    # lora.adapter fills the lora.* keys from the file; an explicit key that disagrees is refused
    cfg = load_config(None, ["--data.seq_len=32", f"--model.path={path}", f"--lora.adapter={out}"], adapter_lora_fields)
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets) == (4, 12.0, "down_proj,embed_tokens,q_proj,v_proj")
    with pytest.raises(ShardfitError, match=r"lora.rank: lora.rank=8 conflicts with rank=4 in .*adapter_config"):
        load_config(None, ["--data.seq_len=32", f"--model.path={path}", f"--lora.adapter={out}", "--lora.rank=8"],
                    adapter_lora_fields)
    # config reads no weight file itself: a caller that hands it no reader is told so, naming the key
    with pytest.raises(ShardfitError, match=r"^lora.adapter: names a PEFT adapter directory.*adapter_lora_fields"):
        load_config(None, ["--data.seq_len=32", f"--model.path={path}", f"--lora.adapter={out}"])


def test_merged_export_loads_in_transformers_with_the_adapters_logits(adapted, tmp_path):
    path, model, out = adapted
    export_hf(model, tmp_path / "merged", dtype="float32", source=path, params=merged_parameters(model))
    names = set(json.loads((tmp_path / "merged" / "config.json").read_text()))
    assert "vocab_size" in names
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(ids)
        merged = hf_model(tmp_path / "merged")(input_ids=ids).logits
        theirs = peft.PeftModel.from_pretrained(hf_model(path), out)(input_ids=ids).logits
    for other in (merged, theirs):
        assert ((ours - other).norm() / other.norm()).item() < 1e-5
    assert ((ours - hf_model(path)(input_ids=ids).logits).norm() / ours.norm()).item() > 1e-3  # adapters matter


def test_generate_with_an_adapter_decodes_what_peft_decodes(adapted, capsys):
    from shardfit.cli.generate import generate as main
    from shardfit.data.tokenizer import build_tokenizer

    path, _, out = adapted
    ref = peft.PeftModel.from_pretrained(hf_model(path), out).eval()
    tok = build_tokenizer("byte")
    ids = tok.encode("hello")
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(ref(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    want = tok.decode([t for t in ids[5:] if t != tok.eos_id])
    # the base comes from the adapter's base_model_name_or_path (a local directory)
    assert main(["--adapter", str(out), "--prompt", "hello", "--max-new-tokens", "8", "--device", "cpu",
                 "--tokenizer", "byte", "--raw"]) == 0
    got = capsys.readouterr().out.rstrip("\n")
    assert got == want and ids[5:8] != [ids[4]] * 3


@pytest.mark.parametrize("change, needle", [
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"use_rslora": True}, "use_rslora=True is not supported"),
    ({"target_modules": ".*proj"}, "target_modules is a regular expression"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3', not LORA"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern="),
])
def test_what_shardfit_cannot_reproduce_is_one_line(adapted, change, needle):
    _, _, out = adapted
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    with pytest.raises(ShardfitError, match=needle) as e:
        read_adapter_config(out)
    assert "\n" not in str(e.value) and ADAPTER_CONFIG in str(e.value)


def test_pickled_weights_and_tied_merges_are_refused(adapted, tmp_path):
    path, model, out = adapted
    (out / ADAPTER_WEIGHTS).rename(out / "adapter_model.bin")
    with pytest.raises(ShardfitError, match="adapter_model.bin is a pickle: refused"):
        read_adapter_config(out)
    tied = shardfit_model(save_tiny("llama", tmp_path / "tied", tied=True))
    apply_lora(tied, LoraConfig(rank=2, targets="embed_tokens"), None)
    with pytest.raises(ShardfitError, match="tied to the output head"):
        next(merged_parameters(tied))
    assert not any(is_adapter(n) for n, _ in merged_parameters(model))


def test_an_adapter_alone_names_its_base_as_generate_takes_it(adapted, tmp_path):
    """--lora.adapter without --model.path: the adapter's base_model_name_or_path when it is a local directory (one
    rule with `shardfit generate --adapter`), not the tiny preset; a base that is not here is one line naming it."""
    path, _, out = adapted
    cfg = load_config(None, [f"--lora.adapter={out}", "--data.seq_len=32"], adapter_lora_fields)
    assert cfg.model.path == str(path) and cfg.model.dim == shardfit_model(path).cfg.dim and cfg.lora.rank == 4
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": "Org/not-here"}))
    with pytest.raises(ShardfitError) as err:
        load_config(None, [f"--lora.adapter={out}", "--data.seq_len=32"], adapter_lora_fields)
    assert "'Org/not-here'" in str(err.value) and "--model.path" in err.value.fix
