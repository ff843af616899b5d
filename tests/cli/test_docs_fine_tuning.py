"""docs/fine-tuning.md's commands, run in page order as a user types them, in one temporary directory on the CPU.

What the page marks (tests/cli/doc_commands.py): every `<!-- test -->` bash block is run, each command with the exit
code the page states; `<!-- test-file: chat.jsonl -->` is the data, its records repeated 20 times (a user's file
has more lines than a page shows). The page's model directory, Qwen2.5-0.5B-Instruct, is a stand-in written here: a
Qwen2 model of the same family (tied embeddings, q/k/v biases) one block deep and 32 wide, with random weights,
shardfit's byte tokenizer and a ChatML chat template in its tokenizer_config.json, as the real one has. Each
`shardfit train` gets --logging.plot=false (the page's own `shardfit plot` draws one). The README's "three commands"
are the page's first block, word for word.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardfit.data.formats import detect, to_example
from shardfit.weights.tokenizer_files import write_byte_tokenizer
from tests.cli.doc_commands import commands, marked_blocks, marked_files
from tests.cli.session import run_commands

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "fine-tuning.md"
MODEL = "Qwen2.5-0.5B-Instruct"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _stand_in(out: Path) -> None:
    """A Qwen2 directory as save_pretrained writes one (config.json, model.safetensors), tokenizer files beside."""
    dim, ffn, heads, kv, vocab = 32, 64, 2, 1, 264
    hd = dim // heads
    gen = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, dim), "model.norm.weight": (dim,)}
    block = {"self_attn.q_proj.weight": (dim, dim), "self_attn.q_proj.bias": (dim,),
             "self_attn.k_proj.weight": (kv * hd, dim), "self_attn.k_proj.bias": (kv * hd,),
             "self_attn.v_proj.weight": (kv * hd, dim), "self_attn.v_proj.bias": (kv * hd,),
             "self_attn.o_proj.weight": (dim, dim), "mlp.gate_proj.weight": (ffn, dim),
             "mlp.up_proj.weight": (ffn, dim), "mlp.down_proj.weight": (dim, ffn),
             "input_layernorm.weight": (dim,), "post_attention_layernorm.weight": (dim,)}
    shapes |= {f"model.layers.0.{k}": s for k, s in block.items()}
    out.mkdir()
    save_file({k: torch.ones(s) if k.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.02
               for k, s in shapes.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab, "hidden_size": dim,
        "intermediate_size": ffn, "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
        "max_position_embeddings": 4096, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 256, "eos_token_id": 257}))
    write_byte_tokenizer(out, 4096)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))


def test_every_sample_record_is_read_as_the_layout_the_page_names():
    rows = re.findall(r"^\| `(\w+)` \| `(\{.*\})` \|$", DOC.read_text(), re.M)
    assert [name for name, _ in rows] == ["messages", "sharegpt", "alpaca", "prompt_completion"]
    for name, record in rows:
        assert detect(json.loads(record)) == name
        assert to_example(json.loads(record), name, "the page", "docs/fine-tuning.md")
    for line in marked_files(DOC)["chat.jsonl"].splitlines():
        assert detect(json.loads(line)) == "messages"


def test_the_readme_shows_the_pages_three_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"^## Fine-tune your own data in three commands\n.*?```bash\n(.*?)```", readme, re.S | re.M)
    assert commands(block.group(1)) == commands(marked_blocks(DOC)[0])


def test_the_pages_commands_do_what_it_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the page's paths are relative to where the user types them
    _stand_in(tmp_path / MODEL)
    for name, text in marked_files(DOC).items():
        (tmp_path / name).write_text(text * 20)
    page = [c for block in marked_blocks(DOC) for c in commands(block)]
    assert all(argv[0] == "shardfit" for argv, _ in page)
    argvs = [[*argv[1:], *(["--logging.plot=false"] if argv[1] == "train" else [])] for argv, _ in page]
    out = run_commands(argvs, tmp_path)
    assert [p.returncode for p in out] == [code for _, code in page], [p.stderr[-2000:] for p in out]
    assert "shardfit plan: qwen2, 1 GPU of 24 GiB" in out[0].stdout
    train = out[1].stdout
    assert "data: messages (detected from chat.jsonl:1), chat template: the tokenizer's template" in train
    assert "40 training examples" in train and "(none cut)" in train
    assert (tmp_path / "chat-model" / "model.safetensors").is_file()
    assert "chat template the model was fine-tuned with" in out[2].stderr
    records = (tmp_path / "runs/chat-val/metrics.jsonl").read_text().splitlines()
    assert "eval" in {json.loads(r)["kind"] for r in records}  # the validation loss was taken
    adapter = {f.name for f in (tmp_path / "chat-adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= adapter
    assert (tmp_path / "chat-merged" / "config.json").is_file()
    assert (tmp_path / "chat-model-2" / "config.json").is_file()
    assert (tmp_path / "runs/chat-val/metrics.png").is_file()
