"""shardfit's decoder against Hugging Face transformers on tiny random configs (fp32)."""

import pytest
import torch

from shardfit.config import load_config
from shardfit.models import build_model

transformers = pytest.importorskip("transformers")

BASE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=96",
        "--model.vocab_size=300", "--model.max_seq_len=128", "--model.norm_eps=1e-6",
        "--data.seq_len=64"]


def _hf_llama(m):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings,
        rope_scaling=None if m.rope_scaling == "none" else dict(
            rope_type="llama3", factor=m.rope_factor, low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor, original_max_position_embeddings=m.rope_original_max_seq_len)))


def _hf_qwen2(m):
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings))


def _hf_qwen3(m):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim,
        max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps, rope_theta=m.rope_theta,
        tie_word_embeddings=m.tie_embeddings, attention_bias=False))


@pytest.mark.parametrize("extra, make_hf", [
    (["--model.tie_embeddings=false", "--model.rope_theta=500000"], _hf_llama),
    (["--model.rope_scaling=llama3", "--model.rope_original_max_seq_len=32", "--model.rope_factor=8"], _hf_llama),
    (["--model.qkv_bias=true", "--model.rope_theta=1000000"], _hf_qwen2),
    (["--model.qk_norm=true", "--model.head_dim=32", "--model.tie_embeddings=false"], _hf_qwen3),
], ids=["llama3", "llama3.2-rope-scaling-tied", "qwen2-qkv-bias", "qwen3-qk-norm"])
def test_logits_and_loss_match_transformers(extra, make_hf):
    cfg = load_config(None, BASE + extra).model
    ours = build_model(cfg)
    ours.init_weights(seed=1)
    with torch.no_grad():  # biases start at zero in both; make them matter
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    hf = make_hf(cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.endswith("inv_freq") or k == "lm_head.weight" for k in missing)
    ids = torch.randint(0, cfg.vocab_size, (2, 77), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids)
        rel = (got - ref).norm() / ref.norm()
        assert rel < 1e-5, rel
        ref_loss = torch.nn.functional.cross_entropy(ref[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        loss = ours(ids[:, :-1], labels=ids[:, 1:])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)


def test_builds_on_meta_without_memory():
    cfg = load_config(None, ["--model.name=llama3-8b"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9


def test_moe_block_runs_its_phases_and_a_hooked_moe_layer_keeps_its_hooks():
    """The block calls the MoE layer's dispatch/run/combine itself (for torch.compile's sake); a forward hook a user
    puts on the layer still runs (the block then calls the layer as a module), and the output is the same."""
    cfg = load_config(None, ["--model.n_experts=8", "--model.experts_per_token=2", "--model.moe_ffn_dim=32"])
    model = build_model(cfg.model)
    model.init_weights(0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    plain = model(ids)
    seen = []
    moe = model.model.layers[0].mlp
    handle = moe.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    hooked = model(ids)
    handle.remove()
    assert seen == [torch.Size([2, 16, cfg.model.dim])]
    assert torch.equal(hooked, plain)
