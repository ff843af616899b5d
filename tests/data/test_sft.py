import json
import re

import numpy as np
import pytest
import torch

from shardfit.config import load_config
from shardfit.data import build_dataset
from shardfit.data.tokenizer import ByteTokenizer
from shardfit.errors import ShardfitError
from tests._dist import run_ranks
from tests.helpers import SMALL, full_state, reference_train


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _ds(path, *extra):
    """One padded example per row (data.pack=false): the layout these tests read; packing is tested below."""
    cfg = load_config(None, [f"--data.path={path}", "--data.seq_len=24", "--data.pack=false", *extra])
    return build_dataset(cfg.data, cfg.model.vocab_size)[0]


def _trained_text(ds, k, tok):
    inputs, labels = ds.pair(k)
    return tok.decode([int(t) for t in labels if t != -100 and t < 256]), inputs, labels


def test_prompt_completion_trains_on_completion_only(tmp_path):
    ds = _ds(_write(tmp_path / "d.jsonl", [{"prompt": "2+2=", "completion": "4"}] * 3))
    tok = ByteTokenizer()
    text, inputs, labels = _trained_text(ds, 0, tok)
    assert text == "4"
    valid = labels != -100
    assert valid.sum() == 2 and labels[valid][-1] == tok.eos_id  # "4" then EOS
    assert tok.decode(inputs[:4]) == "2+2="
    assert (labels[6:] == -100).all() and (inputs[6:] == tok.pad_id).all()  # padding is ignored


def test_plain_chat_template_trains_on_assistant_turns(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ok"}]
    ds = _ds(_write(tmp_path / "c.jsonl", [{"messages": msgs}]), "--data.seq_len=128")
    text, inputs, _ = _trained_text(ds, 0, ByteTokenizer())
    assert text == "hello\nok\n"
    assert ByteTokenizer().decode(inputs).startswith("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello\n")


def test_tokenizer_chat_template(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["hello there"], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(tmp_path / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    data = _write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": "hello there"}]}])
    cfg = load_config(None, [f"--data.path={data}", f"--data.tokenizer={tmp_path / 'tokenizer.json'}",
                             "--data.seq_len=64", "--model.vocab_size=300", "--data.pack=false"])
    ds, tok = build_dataset(cfg.data, cfg.model.vocab_size)
    inputs, labels = ds.pair(0)
    trained = [int(t) for t in labels if t != -100]
    assert tok.tok.decode(trained, skip_special_tokens=False) == "hello there<|im_end|>\n"
    assert trained.count(tok.eos_id) == 1  # the template's own end token, no extra EOS


PC, CHAT = {"prompt": "a", "completion": "b"}, {"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": "b"}]}


@pytest.mark.parametrize("first, row, needle", [
    (PC, {"prompt": "x"}, "no 'completion' key (found: prompt) but data.format is prompt_completion (detected from "
                          "line 1); fix: write every record as prompt_completion ('prompt', 'completion')"),
    (PC, CHAT, "no 'prompt' key (found: messages, a record of messages) but data.format is prompt_completion"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content: missing or null, and the message has no "
                                             "tool_calls; fix: give the message's text as content"),
])
def test_bad_examples_name_the_line(tmp_path, first, row, needle):
    path = _write(tmp_path / "d.jsonl", [first, row])
    with pytest.raises(ShardfitError, match=re.escape(needle)) as e:
        _ds(path, "--data.mode=sft")
    assert "d.jsonl:2" in str(e.value)


def test_truncation_is_counted(tmp_path):
    # the first is cut inside its completion (kept); the second's prompt fills seq_len (left out: nothing to learn)
    rows = [{"prompt": "p" * 10, "completion": "c" * 30}, {"prompt": "p" * 40, "completion": "c"},
            {"prompt": "a", "completion": "b"}]
    ds = _ds(_write(tmp_path / "d.jsonl", rows))
    assert ds.truncated == 1 and len(ds.examples) == 2
    assert ds.notices == (f"{tmp_path / 'd.jsonl'}: 1 of 3 examples left out: no loss-bearing token within "
                          "data.seq_len=24 (raise data.seq_len to keep them)",)
    assert ds.header[1] == ("warning: truncation cuts 1 of 2 training examples (50%) at data.seq_len=24, losing 16 "
                            "tokens; fix: --data.seq_len=40 keeps 95% of them whole")
    assert ds.header[0].endswith("28 tokens after truncation at data.seq_len=24 (cut: 1 of 2 examples, 16 of 44 "
                                  "tokens)")
    assert all(len(x) == 24 for x in ds.pair(0))


def _sft_sharded(rank, world, data, run_dir):
    from shardfit.train import Trainer

    t = Trainer(_cfg(data, run_dir))
    losses = [h["loss"] for h in t.fit()]
    state = full_state(t.model)  # a collective: every rank calls it
    return {"losses": losses, "state": {k: v.tolist() for k, v in state.items()} if rank == 0 else None}


def _cfg(data, run_dir=""):
    args = [*SMALL, f"--data.path={data}", "--train.micro_batch=2"]
    return load_config(None, args + ([f"--logging.run_dir={run_dir}"] if run_dir else []))


def test_two_rank_sft_matches_single_process_with_uneven_token_counts(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"prompt": "q" * int(rng.integers(1, 20)), "completion": "a" * int(rng.integers(1, 12))}
            for _ in range(40)]
    data = _write(tmp_path / "sft.jsonl", rows)
    res = run_ranks(_sft_sharded, 2, str(data), str(tmp_path / "run"))
    ref_model, ref_losses = reference_train(_cfg(data))
    torch.testing.assert_close(torch.tensor(res[0]["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    ref = ref_model.state_dict()
    for k, v in res[0]["state"].items():
        torch.testing.assert_close(torch.tensor(v), ref[k], rtol=1e-4, atol=1e-4, msg=k)


def test_fine_tuning_renders_the_templates_special_tokens_as_generate_does(tmp_path):
    """A template that writes {{ bos_token }} (Llama-3's does) gets it in training as at inference."""
    from shardfit.data.chat import chat_renderer

    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": "<s>",
                                                                "eos_token": {"content": "</s>"}}))
    renderer = chat_renderer(str(tmp_path / "tokenizer.json"))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pieces = renderer.segments(chat)
    assert "".join(t for t, _ in pieces) == "<s><user>hi</s><assistant>yo</s>"
    assert [t for t, trained in pieces if trained] == ["yo</s>"]
    assert renderer.render(chat[:1], add_generation_prompt=True) == "<s><user>hi</s><assistant>"
