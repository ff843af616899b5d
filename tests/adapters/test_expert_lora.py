"""LoRA on MoE experts (adapters/expert_lora.py): forward and every adapter's gradient equal PEFT's target_parameters
adapters on a tiny Hugging Face Qwen3-MoE; the grouped GEMM path equals the loop; PEFT's layout and keys round-trip;
the merged export is the adapted model; what PEFT cannot load is one line."""

from __future__ import annotations

import json

import pytest
import torch

from shardfit.adapters.expert_lora import EXPERT_LEAVES, LoRAExperts, add_expert_adapters, is_expert_adapter
from shardfit.adapters.lora import apply_lora, init_adapters, is_adapter, lora_summary
from shardfit.config.schema import LoraConfig, ModelConfig
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.models.moe import Experts
from shardfit.weights.hf_export import export_hf
from shardfit.weights.peft import (
    attach_adapter,
    export_adapter,
    from_peft,
    merged_parameters,
    peft_expert_key,
    to_peft,
)
from shardfit.weights.peft_config import ADAPTER_CONFIG, peft_key, read_adapter_config
from tests.adapters.tiny_hf import hf_model, randomize_adapters, save_tiny, shardfit_model

peft = pytest.importorskip("peft")
IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


def _adapted(tmp_path, targets: str, rank: int = 4):
    """(base directory, shardfit model with random adapters on `targets`, its exported adapter directory)."""
    path = save_tiny("qwen3_moe", tmp_path)
    model = shardfit_model(path)
    lora = LoraConfig(rank=rank, alpha=8.0, targets=targets)
    adapted = apply_lora(model, lora, None)
    init_adapters(model, seed=3)
    randomize_adapters(model)
    export_adapter(model, tmp_path / "adapter", lora, adapted, str(path))
    return path, model, tmp_path / "adapter"


def _peft_grad(named: dict, name: str, experts: tuple[str, ...]) -> torch.Tensor:
    """PEFT's gradient of shardfit's adapter `name`, in shardfit's layout (PEFT's in-model names carry 'default')."""
    if not is_expert_adapter(name):
        return named[peft_key(name).replace(".weight", ".default.weight")].grad
    grad = named[peft_expert_key(name, experts).replace(".weight", ".default.weight")].grad
    return from_peft(name, grad, 4)


@pytest.mark.parametrize("targets, experts", [
    ("q_proj,o_proj,experts", ("gate_up_proj", "down_proj")),
    ("experts.gate_up_proj", ("gate_up_proj",)),
    ("v_proj,experts.down_proj", ("down_proj",)),
])
def test_forward_and_gradients_equal_peft(tmp_path, targets, experts):
    path, model, out = _adapted(tmp_path, targets)
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == [f"mlp.experts.{w}" for w in experts]
    ref = peft.PeftModel.from_pretrained(hf_model(path), out, is_trainable=True)
    ours, theirs = model(IDS), ref(input_ids=IDS).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    with torch.no_grad():
        assert ((ours - hf_model(path)(input_ids=IDS).logits).norm() / ours.norm()).item() > 1e-3  # adapters count
    w = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    (ours * w).sum().backward()
    (theirs * w).sum().backward()
    named = dict(ref.named_parameters())
    adapters = [(n, p) for n, p in model.named_parameters() if is_adapter(n)]
    assert sum(is_expert_adapter(n) for n, _ in adapters) == 2 * len(experts)  # one MoE block (the other is dense)
    for name, p in adapters:
        g = _peft_grad(named, name, experts)
        assert p.grad is not None and p.grad.abs().max() > 0, name
        assert ((p.grad - g).norm() / g.norm()).item() < 1e-5, name
    assert all(p.grad is None for n, p in model.named_parameters() if not is_adapter(n))  # frozen, router included


def test_grouped_gemm_path_equals_the_loop():
    """run_grouped (CUDA bf16's path: one grouped GEMM per projection and adapter factor) against run_split, in fp32
    on the CPU, with a rank whose rows grouped_mm must pad (3 fp32 = 12 bytes) and an expert that gets no rows."""
    torch.manual_seed(0)
    experts = Experts(4, 16, 24)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    add_expert_adapters(experts, ("gate_up_proj", "down_proj"), rank=3, alpha=6.0)
    for name in EXPERT_LEAVES:
        torch.nn.init.normal_(getattr(experts, name), std=0.3)
    counts = torch.tensor([5, 0, 7, 4])
    xs = torch.randn(16, 16)
    runs = {}
    for path in ("grouped", "split"):
        for p in experts.parameters():
            p.grad = None
        x = xs.clone().requires_grad_()
        y = experts.run_grouped(x, counts) if path == "grouped" else experts.run_split(x, counts.tolist())
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        runs[path] = [y, x.grad, *(getattr(experts, n).grad for n in EXPERT_LEAVES)]
    for got, want in zip(runs["grouped"], runs["split"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert isinstance(experts, LoRAExperts) and runs["split"][2][1].abs().sum() == 0  # expert 1: no rows, no grad


def test_fresh_adapters_are_the_base_and_layouts_round_trip():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                      n_experts=4, experts_per_token=2, moe_ffn_dim=16, tie_embeddings=False)
    model = build_model(cfg)
    model.init_weights(seed=5)
    ids = torch.randint(0, 64, (2, 9))
    expected = model(ids)
    targets = apply_lora(model, LoraConfig(rank=2, targets="experts"), None)
    init_adapters(model, seed=5)
    assert torch.equal(model(ids), expected)  # B = 0: training starts from the base exactly
    assert targets == [f"model.layers.{i}.mlp.experts.{w}" for i in (0, 1) for w in ("gate_up_proj", "down_proj")]
    a = model.model.layers[0].mlp.experts.gate_up_proj_lora_A  # [E, r, H], PEFT's variance 1/(3 H)
    assert a.shape == (4, 2, 32) and 0.5 < a.std().item() * (3 * 32) ** 0.5 < 1.5
    assert "experts of 2 MoE layers (gate_up_proj, down_proj)" in lora_summary(model, targets)
    for name in ("x.experts.gate_up_proj_lora_A", "x.experts.down_proj_lora_B"):
        t = torch.randn(4, 6, 3)
        assert torch.equal(from_peft(name, to_peft(name, t), 4), t)
    b = torch.arange(4 * 6 * 3.0).view(4, 6, 3)  # [E, out, r]: PEFT's column j*E + e is expert e's j-th
    assert torch.equal(to_peft("e.down_proj_lora_B", b)[:, 1 * 4 + 2], b[2, :, 1])
    plain = build_model(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                    max_seq_len=32))
    with pytest.raises(ShardfitError, match="names the experts of MoE layers, and this model has none"):
        apply_lora(plain, LoraConfig(rank=2, targets="q_proj,experts"), None)


def test_export_round_trips_and_the_merged_model_is_the_adapted_one(tmp_path, monkeypatch):
    import shardfit.weights.peft as peft_io

    path, model, out = _adapted(tmp_path, "q_proj,experts")
    assert read_adapter_config(out) == {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": "q_proj,experts"}
    fresh = shardfit_model(path)
    monkeypatch.setattr(peft_io, "_STAGE_BYTES", 1)  # each expert B staged in a batch of its own
    attach_adapter(fresh, out)  # shardfit generate --adapter, and lora.adapter's reading
    got, want = dict(fresh.named_parameters()), dict(model.named_parameters())
    assert all(torch.equal(got[n], want[n]) for n in want)
    export_hf(model, tmp_path / "merged", dtype="float32", source=path, params=merged_parameters(model))
    assert not any(is_adapter(n) for n, _ in merged_parameters(model))
    with torch.no_grad():
        ours = model(IDS)
        merged = hf_model(tmp_path / "merged")(input_ids=IDS).logits
    assert ((ours - merged).norm() / merged.norm()).item() < 1e-5


@pytest.mark.parametrize("change, needle", [
    ({"target_parameters": ["model.layers.0.mlp.experts.down_proj"]}, "entry 'model.layers.0.mlp.experts.down"),
    ({"target_parameters": ["mlp.down_proj.weight"]}, "is not an MoE expert weight shardfit adapts"),
])
def test_what_shardfit_cannot_reproduce_is_one_line(tmp_path, change, needle):
    _, _, out = _adapted(tmp_path, "experts")
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == [] and read_adapter_config(out)["targets"] == "experts"
    (out / ADAPTER_CONFIG).write_text(json.dumps({**config, **change}))
    with pytest.raises(ShardfitError, match=needle) as e:
        read_adapter_config(out)
    assert "\n" not in str(e.value) and ADAPTER_CONFIG in str(e.value)


@pytest.mark.parametrize("args, needle", [
    (["--lora.rank=4", "--lora.dropout=0.1", "--lora.targets=q_proj,experts"],
     "lora.dropout: 0.1 with adapters on the MoE experts"),
    (["--lora.targets=experts.up_proj"], "lora.targets: 'experts.up_proj' is not a module shardfit puts an adapter"),
])
def test_bad_expert_targets_are_one_line(args, needle):
    from shardfit.config import load_config

    with pytest.raises(ShardfitError) as e:
        load_config(None, args)
    assert needle in str(e.value) and "\n" not in str(e.value) and "fix:" in str(e.value)


def test_dense_mlp_adapters_of_an_moe_model_carry_peft_s_caveat(tmp_path):
    """PEFT on transformers 5 reads down_proj in a Qwen3-MoE adapter's target_modules as the experts' weight
    (transformers_weight_conversion.py): the dense layer's adapter is left out there, and the notice says so."""
    path, model, out = _adapted(tmp_path, "down_proj")
    targets = ["model.layers.1.mlp.down_proj"]
    assert "PEFT on transformers 5 takes those names for the experts' weights" in lora_summary(model, targets)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_model(path), out)(input_ids=IDS).logits
        assert ((model(IDS) - theirs).norm() / theirs.norm()).item() > 1e-3  # PEFT's reading differs: the caveat
