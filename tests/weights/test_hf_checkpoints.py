"""Hugging Face model directories: config mapping, sharded loading, export, and the errors for bad checkpoints."""

import json
from pathlib import Path

import pytest
import torch

from shardfit.config import load_config
from shardfit.errors import ShardfitError
from shardfit.models import build_model
from shardfit.weights.hf_export import export_hf
from shardfit.weights.hf_load import load_hf_checkpoint
from tests._dist import run_ranks
from tests.helpers import full_state
from tests.helpers import parallelize_config as parallelize

transformers = pytest.importorskip("transformers")
SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "llama-tied": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**SIZES, sliding_window=None)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SIZES)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**SIZES, "head_dim": 32})),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SIZES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1])),
}
ARGS = ["--data.seq_len=32", "--train.device=cpu"]


def _save(kind: str, root: Path) -> tuple[Path, object]:
    torch.manual_seed(0)
    hf = FAMILIES[kind]().eval()
    with torch.no_grad():  # random biases so that qkv bias matters
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    out = root / kind
    hf.save_pretrained(out, max_shard_size="60KB")
    return out, hf


def _logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_load_matches_transformers(tmp_path, kind):
    path, hf = _save(kind, tmp_path)
    assert (path / "model.safetensors.index.json").is_file()  # several shards
    cfg = load_config(None, [f"--model.path={path}", *ARGS])
    assert cfg.model.name == kind.split("-")[0]
    model = build_model(cfg.model)
    load_hf_checkpoint(model, path)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits.detach()
    got = _logits(model, ids)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    if cfg.model.tie_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if cfg.model.n_experts:  # the router picks the same experts as transformers'
        h = torch.randn(50, 64)
        _, ref_ids = hf.model.layers[0].mlp.gate(h)[1:]
        _, ids = model.model.layers[0].mlp.route(h)
        assert torch.equal(ids, ref_ids)
        assert type(model.model.layers[1].mlp).__name__ == "MLP"  # mlp_only_layers stays dense


def _sharded_load_and_export(rank, world, path, out):
    cfg = load_config(None, [f"--model.path={path}", *ARGS])
    with torch.device("meta"):
        model = build_model(cfg.model)
    parallelize(model, cfg, torch.device("cpu"), world, seed=0, init=False)
    load_hf_checkpoint(model, path)
    state = {k: v.tolist() for k, v in full_state(model).items()}
    export_hf(model, out, dtype="float32", source=path, max_shard_bytes=40_000)
    return state if rank == 0 else None


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_two_rank_load_equals_single_and_export_round_trips(tmp_path, kind):
    path, hf = _save(kind, tmp_path)
    out = tmp_path / "export"
    state = run_ranks(_sharded_load_and_export, 2, str(path), str(out))[0]
    single = build_model(load_config(None, [f"--model.path={path}", *ARGS]).model)
    load_hf_checkpoint(single, path)
    for k, v in single.state_dict().items():
        if k in state:
            assert torch.equal(torch.tensor(v.tolist()), torch.tensor(state[k])), k
    assert not (tmp_path / "export.tmp").exists()
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    back = type(hf).from_pretrained(out).eval()  # transformers loads the export ...
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(back(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)  # ... with the same logits
    again = build_model(load_config(None, [f"--model.path={out}", *ARGS]).model)
    load_hf_checkpoint(again, out)  # and shardfit reads it back to identical tensors
    for k, v in single.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_adjacent_tensors_are_read_together_and_large_ones_in_chunks(tmp_path, monkeypatch):
    """A MoE checkpoint's expert matrices follow each other in the file: fewer reads than tensors. With a staging
    buffer smaller than most tensors, each is read in chunks: the same values either way."""
    from shardfit.weights import hf_load

    path, _ = _save("qwen3_moe", tmp_path)
    cfg = load_config(None, [f"--model.path={path}", *ARGS])
    merged = build_model(cfg.model)
    res = load_hf_checkpoint(merged, path)
    assert res.reads < res.tensors and res.bytes == sum(p.numel() * 4 for p in merged.parameters())
    monkeypatch.setattr(hf_load, "_PINNED_BYTES", 1000)  # 250 fp32 values: most tensors take several reads
    chunked = build_model(cfg.model)
    small = load_hf_checkpoint(chunked, path)
    assert small.reads > res.reads and small.bytes == res.bytes
    for (k, a), b in zip(merged.state_dict().items(), chunked.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def _corrupt(kind: str, path: Path) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    first = path / sorted(set(index.values()))[0]
    if kind == "missing-shard":
        first.unlink()
    elif kind == "truncated":
        first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    elif kind == "shape":
        cfg = json.loads((path / "config.json").read_text())
        cfg["intermediate_size"] = 128
        (path / "config.json").write_text(json.dumps(cfg))
    elif kind == "fewer-layers":
        cfg = json.loads((path / "config.json").read_text())
        cfg["num_hidden_layers"] = 1
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind, needle", [
    ("missing-shard", "checkpoint shard is missing"),
    ("truncated", "corrupt or truncated safetensors file"),
    ("shape", "has shape [96, 64], the model expects [128, 64]"),
    ("fewer-layers", "has no place in the model"),
])
def test_bad_checkpoints_name_file_and_tensor(tmp_path, kind, needle):
    path, _ = _save("llama", tmp_path)
    _corrupt(kind, path)
    cfg = load_config(None, [f"--model.path={path}", *ARGS])
    with pytest.raises(ShardfitError) as e:
        load_hf_checkpoint(build_model(cfg.model), path)
    msg = str(e.value)
    assert needle in msg and str(path) in msg and "\n" not in msg


@pytest.mark.parametrize("edit, needle", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
])
def test_unsupported_configs(tmp_path, edit, needle):
    path, _ = _save("llama", tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(edit)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShardfitError, match=needle):
        load_config(None, [f"--model.path={path}", *ARGS])


def test_config_conflicts_and_missing_dirs(tmp_path):
    path, _ = _save("llama", tmp_path)
    with pytest.raises(ShardfitError, match="conflicts with dim=64"):
        load_config(None, [f"--model.path={path}", "--model.dim=128", *ARGS])
    with pytest.raises(ShardfitError, match="model directory not found"):
        load_config(None, [f"--model.path={tmp_path}/nope", *ARGS])
    with pytest.raises(ShardfitError, match="no config.json"):
        load_config(None, [f"--model.path={tmp_path}", *ARGS])


def test_train_from_hf_dir_and_export(tmp_path):
    import subprocess
    import sys

    path, hf = _save("qwen2", tmp_path)
    out = tmp_path / "trained"
    p = subprocess.run([sys.executable, "-m", "shardfit", "train", f"--model.path={path}", *ARGS, "--train.steps=2",
                        "--train.global_batch=2", "--train.micro_batch=2", f"--logging.run_dir={tmp_path}/run",
                        f"--checkpoint.export_hf={out}", "--checkpoint.export_dtype=float32"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr
    assert "qwen2 model" in p.stdout and f"exported Hugging Face model to {out}" in p.stdout
    assert all(f.stat().st_mode & 0o044 for f in out.glob("*.safetensors"))  # readable by group and others
    report = next(line for line in p.stdout.splitlines() if line.startswith(f"loaded {path} in "))
    assert "(0.0% apart)" in report and "peak host RSS per rank" in report  # one rank, CPU: no device memory
    assert "rank 0: planning" in report and " reads over " in report
    trained = type(hf).from_pretrained(out).eval()
    ids = torch.randint(0, 300, (1, 16))
    assert not torch.allclose(trained(ids).logits, hf(ids).logits)  # two optimizer steps moved the weights
    assert torch.isfinite(trained(ids).logits).all()


def test_moe_auxiliary_loss_matches_transformers(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SIZES, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=0.02)).eval()
    hf.save_pretrained(tmp_path / "moe")
    cfg = load_config(None, [f"--model.path={tmp_path / 'moe'}", *ARGS])
    assert cfg.model.router_aux_coef == 0.02
    model = build_model(cfg.model)
    load_hf_checkpoint(model, tmp_path / "moe")
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(2))
    out = hf(ids, labels=ids)
    assert out.aux_loss is not None and out.aux_loss > 0
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # transformers shifts inside
    got = model(ids, labels) / (labels != -100).sum()
    torch.testing.assert_close(got, out.loss.detach(), rtol=1e-5, atol=1e-6)
    dense = build_model(load_config(None, [f"--model.path={tmp_path / 'moe'}", *ARGS,
                                           "--model.router_aux_coef=0"]).model)
    dense.load_state_dict(model.state_dict())
    assert (model(ids, labels) - dense(ids, labels)).item() > 0  # the auxiliary term is really there
