"""LoRA modules (adapters/lora.py): forward and every adapter's gradient equal PEFT's on tiny Hugging Face Llama and
Qwen3 models; a fresh adapter is the base exactly; names, dtypes and targets as the swap promises."""

from __future__ import annotations

import pytest
import torch

from shardfit.adapters.lora import (
    LoRALinear,
    LoRAOutputHead,
    apply_lora,
    init_adapters,
    is_adapter,
    lora_targets,
)
from shardfit.config.schema import LoraConfig, ModelConfig
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.weights.peft import export_adapter
from shardfit.weights.peft_config import peft_key
from tests.adapters.tiny_hf import hf_model, randomize_adapters, save_tiny, shardfit_model

peft = pytest.importorskip("peft")
ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _peft_grad(named: dict, name: str) -> torch.Tensor:
    """The gradient of PEFT's parameter for shardfit's adapter `name` (PEFT's in-model names carry 'default')."""
    key = peft_key(name)
    key = key + ".default" if key.endswith(("lora_embedding_A", "lora_embedding_B")) else \
        key.replace(".weight", ".default.weight")
    return named[key].grad


@pytest.mark.parametrize("kind, targets", [("llama", ALL + ",embed_tokens,lm_head"), ("qwen3", ALL)])
def test_forward_and_gradients_equal_peft(tmp_path, kind, targets):
    path = save_tiny(kind, tmp_path)
    model = shardfit_model(path)
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    adapted = apply_lora(model, lora, None)
    init_adapters(model, seed=3)
    randomize_adapters(model)
    export_adapter(model, tmp_path / "adapter", lora, adapted, str(path))
    ref = peft.PeftModel.from_pretrained(hf_model(path), tmp_path / "adapter", is_trainable=True)

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ours, theirs = model(ids), ref(input_ids=ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    w = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    named = dict(ref.named_parameters())
    adapters = [(n, p) for n, p in model.named_parameters() if is_adapter(n)]
    assert len(adapters) == 2 * len(adapted) == 2 * (14 + 2 * (kind == "llama"))
    for name, p in adapters:
        g = _peft_grad(named, name)
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert ((p.grad - g).norm() / g.norm()).item() < 1e-5, name
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))  # frozen base


def test_fresh_adapters_are_the_base_and_seeded_by_name():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                      tie_embeddings=False)
    base = build_model(cfg)
    base.init_weights(seed=5)
    ids = torch.randint(0, 64, (2, 9))
    expected = base(ids)
    lora = LoraConfig(rank=4, targets=ALL + ",embed_tokens,lm_head")
    apply_lora(base, lora, None)
    init_adapters(base, seed=5)
    assert torch.equal(base(ids), expected)  # B = 0 (embeddings: A = 0): training starts from the base exactly
    again = build_model(cfg)
    again.init_weights(seed=5)
    apply_lora(again, lora, None)
    init_adapters(again, seed=5)
    a, b = dict(base.named_parameters()), dict(again.named_parameters())
    assert all(torch.equal(a[k], b[k]) for k in a)
    qa, ka = a["model.layers.0.self_attn.q_proj.lora_A"], a["model.layers.0.self_attn.k_proj.lora_A"]
    assert not torch.equal(qa, ka) and 0.5 < qa.std().item() * (3 * 32) ** 0.5 < 1.5  # PEFT's variance, 1/(3 in)


def test_names_dtypes_and_targets():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                      n_experts=4, experts_per_token=2, moe_ffn_dim=16, dense_layers="1")
    with torch.device("meta"):
        model = build_model(cfg)
    names = set(model.state_dict())
    targets = apply_lora(model, LoraConfig(rank=2, targets="all-linear,lm_head"), torch.bfloat16)
    assert not any(t.endswith("mlp.gate") for t in targets)  # MoE routers take no adapter
    assert "model.layers.1.mlp.gate_proj" in targets and "model.layers.0.mlp.gate_proj" not in targets  # experts
    assert isinstance(model.lm_head, LoRAOutputHead) and isinstance(model.model.layers[0].self_attn.q_proj,
                                                                     LoRALinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays one parameter, cast once
    base = {n: p for n, p in model.named_parameters() if not is_adapter(n)}
    assert set(model.state_dict()) - {n for n in model.state_dict() if is_adapter(n)} == names  # HF names kept
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in base.values())
    adapters = [p for n, p in model.named_parameters() if is_adapter(n)]
    assert adapters and all(p.dtype == torch.float32 and p.requires_grad for p in adapters)
    with pytest.raises(ShardfitError, match="lora.targets: 'embed_tokens' matches no module"):
        apply_lora(build_model(cfg).model.layers[0], LoraConfig(rank=2, targets="embed_tokens"), None)
    assert [n for n, _ in lora_targets(model, "q_proj")] == ["model.layers.0.self_attn.q_proj",
                                                           "model.layers.1.self_attn.q_proj"]


def test_an_fp8_layer_takes_an_adapter():
    """FP8 swaps first (parallelize step 0): the adapter sits on the Float8Linear, whose matmul stays FP8."""
    pytest.importorskip("torchao.float8", reason="FP8 needs the optional torchao extra")
    from shardfit.config.schema import ComputeConfig
    from shardfit.parallel.fp8 import apply_fp8

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32)
    model = build_model(cfg)
    model.init_weights(seed=0)
    assert apply_fp8(model, ComputeConfig(fp8="tensorwise"), "cpu", None) > 0
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 32)
    base_out = q(x)
    apply_lora(model, LoraConfig(rank=4, targets="q_proj"), None)
    init_adapters(model, seed=0)
    randomize_adapters(model)
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(q, Float8Linear) and type(q).__name__ == "LoRAFloat8Linear"
    delta = (x @ q.lora_A.t() @ q.lora_B.t()) * q.lora_scale
    torch.testing.assert_close(q(x), base_out + delta)


@pytest.mark.parametrize("args, needle", [
    (["--lora.targets=q_proj,qproj"], "lora.targets: 'qproj' is not a module shardfit puts an adapter on"),
    (["--lora.rank=-1"], "lora.rank: -1 is out of range"),
    (["--lora.alpha=0"], "lora.alpha: 0.0 is out of range"),
    (["--model.lora.rank=8"], "[lora] is a section of its own"),
    (["--lora.rank=4", "--lora.dropout=0.1", "--lora.targets=q_proj,lm_head"], "lora.dropout: 0.1 with an adapter"),
    (["--checkpoint.export_merged=out"], "checkpoint.export_merged: merges LoRA adapters"),
])
def test_bad_lora_keys_are_one_line(args, needle):
    from shardfit.config import load_config

    with pytest.raises(ShardfitError) as e:
        load_config(None, args)
    assert needle in str(e.value) and "\n" not in str(e.value) and "fix:" in str(e.value)


def test_lora_keys_in_toml(tmp_path):
    from shardfit.config import config_to_toml, load_config

    (tmp_path / "nested.toml").write_text("[model.lora]\nrank = 8\n")
    with pytest.raises(ShardfitError, match=r"unknown key 'model.lora'.*fix: \[lora\] is a section of its own"):
        load_config(tmp_path / "nested.toml")
    (tmp_path / "lora.toml").write_text('[lora]\nrank = 8\nalpha = 16\ntargets = "all-linear,embed_tokens"\n')
    cfg = load_config(tmp_path / "lora.toml")
    assert (cfg.lora.rank, cfg.lora.targets) == (8, "all-linear,embed_tokens")
    (tmp_path / "saved.toml").write_text(config_to_toml(cfg))
    assert load_config(tmp_path / "saved.toml").lora == cfg.lora
