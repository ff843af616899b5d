"""Training defaults that follow the model: its size, where its weights come from, and the data."""

import json
import subprocess
import sys

import pytest

from shardfit.config import config_to_toml, load_config
from shardfit.config.loader import config_help
from shardfit.config.schema import Config

# A Llama config.json of ~1.2B parameters (the 100M-2B row): load_config reads only this file, never weights.
ONE_B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
         "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 500000.0}


def _train(cfg) -> tuple:
    t = cfg.train
    return t.lr, t.warmup_steps, t.global_batch, t.micro_batch


def test_the_tiny_model_keeps_its_measured_setting():
    base = Config().train
    assert _train(load_config()) == (base.lr, base.warmup_steps, base.global_batch, base.micro_batch)


def test_presets_bring_rates_of_their_size():
    eight = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096"])
    seventy = load_config(None, ["--model.name=llama3-70b", "--data.seq_len=4096"])
    one = load_config(None, ["--model.name=llama3-1b", "--data.seq_len=4096"])
    assert seventy.train.lr < eight.train.lr < one.train.lr < Config().train.lr  # larger models, smaller rates
    assert eight.train.lr <= 3e-4  # 3e-3 (the tiny model's) made Llama-3-8B diverge
    # the pretraining batch is a number of tokens: longer sequences, fewer of them
    short = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=1024"])
    assert short.train.global_batch * 1024 == eight.train.global_batch * 4096
    assert eight.train.micro_batch == 0  # shardfit plan chooses on CUDA
    assert eight.train.warmup_steps == round(0.1 * eight.train.steps)
    moe = load_config(None, ["--model.name=qwen3-30b-a3b", "--data.seq_len=4096"])
    assert moe.train.lr == seventy.train.lr  # sized by total parameters (30.5B), not the 3.3B active


def test_user_settings_win(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[train]\nlr = 1e-3\n[model]\nname = "llama3-8b"\n')
    cfg = load_config(f, ["--train.warmup_steps=7", "--train.micro_batch=2", "--train.global_batch=8"])
    assert _train(cfg) == (1e-3, 7, 8, 2)
    # the resolved config holds the model's defaults and reads back as the same config
    sized = load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096"])
    (tmp_path / "resolved.toml").write_text(config_to_toml(sized))
    assert load_config(tmp_path / "resolved.toml") == sized
    assert "lr = 0.0003" in config_to_toml(sized)


def _model_dir(tmp_path):
    d = tmp_path / "one_b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ONE_B))
    return d


def test_pretrained_weights_take_fine_tuning_rates_and_the_data_picks_the_batch(tmp_path):
    d = _model_dir(tmp_path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    text = tmp_path / "notes.txt"
    text.write_text("plain text for continued pretraining\n")
    scratch = load_config(None, ["--model.name=llama3-1b", "--data.seq_len=4096", "--train.steps=1000"])
    sft = load_config(None, [f"--model.path={d}", f"--data.path={chats}", "--data.seq_len=4096",
                             "--train.steps=1000"])
    cont = load_config(None, [f"--model.path={d}", f"--data.path={text}", "--data.seq_len=4096",
                              "--train.steps=1000"])
    assert sft.train.lr == cont.train.lr < scratch.train.lr / 10  # fine-tuning: an order of magnitude lower
    assert sft.train.warmup_steps == cont.train.warmup_steps == 30 < scratch.train.warmup_steps == 100
    assert cont.train.global_batch == scratch.train.global_batch  # pretraining data: tokens per step
    assert sft.train.global_batch == 32  # fine-tuning data: examples per step
    # data.mode says so without reading the file (auto reads its first line, as the data loader does)
    forced = load_config(None, [f"--model.path={d}", f"--data.path={text}", "--data.mode=sft", "--data.seq_len=4096"])
    assert forced.train.global_batch == 32


def test_help_shows_the_defaults_of_the_model_given():
    tiny = config_help()
    big = config_help(load_config(None, ["--model.name=llama3-8b", "--data.seq_len=4096"]))
    assert "--train.lr=0.003 " in tiny and "--train.lr=0.0003 " in big
    assert "--train.global_batch=128 " in big and "(by model size: see below)" in big
    assert "Training defaults by model size" in big and "2B-20B" in big


def test_a_process_that_loads_only_the_config_gets_the_model_and_data_answers(tmp_path):
    """config/ imports neither models/ nor data/ (tests/test_import_graph.py): the root package answers for them
    (shardfit/__init__.py). A fresh process importing shardfit.config alone gets the defaults of the model's size and
    of fine-tuning data, and torch only once a model is counted."""
    d = _model_dir(tmp_path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    args = [f"--model.path={d}", f"--data.path={chats}", "--data.seq_len=4096"]
    code = ("import sys; from shardfit.config import load_config; torch = 'torch' in sys.modules; "
            f"c = load_config(None, {args!r}); "
            "print(torch, 'shardfit.models' in sys.modules, c.train.global_batch, c.train.lr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    want = load_config(None, args)
    assert out == ["False", "True", "32", str(want.train.lr)] and want.train.global_batch == 32


# (weights, data, family): from scratch on text, and fine-tuning Hugging Face checkpoints of each family on
# prompt/completion examples and (continued pretraining) on text
KINDS = [("scratch", "text", "llama"), ("scratch", "text", "qwen3_moe"), ("pretrained", "sft", "llama"),
         ("pretrained", "text", "llama"),
         # slow: the fine-tuning defaults on examples of a dense model are pretrained-sft-llama's (the same rate and
         # batch: config/defaults.py takes the size, the weights and the data, not the family); ~3 s
         pytest.param("pretrained", "sft", "qwen3", marks=pytest.mark.slow),
         ("pretrained", "sft", "qwen3_moe")]


def _hf_model(family: str, path) -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    sizes = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    if family == "llama":
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    elif family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**sizes, head_dim=16))
    else:
        hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **sizes, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    hf.save_pretrained(path)


@pytest.mark.parametrize("weights, data, family", KINDS,
                         ids=["-".join(k.values if hasattr(k, "values") else k) for k in KINDS])
def test_defaults_only_the_loss_falls(tmp_path, weights, data, family):
    """A small model of each kind trained with the training defaults (rate, warm-up, batch) learns. Only the length
    of the run and of its sequences are set, for the test's time (and the shape of the model from scratch)."""
    from shardfit.parallel import shutdown_distributed
    from shardfit.train import Trainer

    args = ["--data.seq_len=64", "--train.steps=25", "--train.device=cpu", "--logging.progress=none",
            "--checkpoint.final=false", f"--logging.run_dir={tmp_path / 'run'}"]
    if weights == "scratch":
        args += ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
                 "--model.ffn_dim=128"]
        if family == "qwen3_moe":
            args += ["--model.qk_norm=true", "--model.n_experts=4", "--model.experts_per_token=2",
                     "--model.moe_ffn_dim=32"]
    else:
        _hf_model(family, tmp_path / "hf")
        args.append(f"--model.path={tmp_path / 'hf'}")
    if data == "sft":
        examples = tmp_path / "data.jsonl"
        examples.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": f"{a + b}"}) + "\n"
                                    for a in range(20) for b in range(10)))
        args.append(f"--data.path={examples}")
    elif weights == "pretrained":
        text = tmp_path / "data.txt"
        text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
        args.append(f"--data.path={text}")
    cfg = load_config(None, args)
    assert cfg.train.lr == (3e-3 if weights == "scratch" else 3e-4)  # the < 100M row: defaults, not settings
    assert cfg.model.n_experts == (4 if family == "qwen3_moe" else 0)
    try:
        history = Trainer(cfg).fit()
    finally:
        shutdown_distributed()
    losses = [h["loss"] for h in history]
    # fine-tuning rates move a randomly initialised "pretrained" model slowly: a fall of 10% in 25 steps, no divergence
    assert sum(losses[-5:]) / 5 < 0.9 * losses[0] and max(losses) <= losses[0] + 0.05, losses


@pytest.mark.parametrize("args, seq", [([], 256), (["--model.name=llama3-8b"], 4096),
                                       (["--model.name=llama3-8b", "--data.seq_len=8192"], 8192),
                                       (["--model.name=llama3-1b", "--model.max_seq_len=2048"], 2048),
                                       (["--model.name=qwen3-30b-a3b"], 4096)])
def test_real_models_default_to_a_real_context_length(args, seq):
    """Issue 27: `shardfit plan --model.name=llama3-8b` planned at the tiny model's 256 tokens."""
    cfg = load_config(None, args)
    assert cfg.data.seq_len == seq
    if seq == 4096:  # the pretraining batch follows the context length: 512K tokens a step at 2B-20B parameters
        assert cfg.train.global_batch * seq in (1 << 19, 1 << 20)


def test_lora_fine_tuning_takes_a_lora_rate(tmp_path):
    """The full fine-tune's 2e-5 barely moves adapters that start at zero; LoRA recipes use 1e-4 to 3e-4."""
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(ONE_B))
    assert load_config(None, [f"--model.path={path}"]).train.lr == 2e-5
    assert load_config(None, [f"--model.path={path}", "--lora.rank=16"]).train.lr == 1e-4
    assert load_config(None, [f"--model.path={path}", "--lora.rank=16", "--train.lr=3e-4"]).train.lr == 3e-4
    assert load_config(None, ["--lora.rank=8"]).train.lr == Config().train.lr  # the tiny model keeps its setting
