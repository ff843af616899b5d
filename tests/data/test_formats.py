"""data/formats.py and data/chat.py: every record layout becomes the tokens of its hand-converted `messages`,
detected from the first record or chosen by data.format; a record of another layout, or a malformed one, is one line
naming its file:line (record N, row N) and the key; data.format's old file-format values move to data.file_format."""

import json
import re

import pytest

from shardfit.config import load_config, spellings
from shardfit.data.build import build_datasets
from shardfit.data.formats import detect
from shardfit.errors import ShardfitError

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _examples(path, *extra):
    cfg = load_config(None, [f"--data.path={path}", "--data.seq_len=128", "--data.pack=false", *extra])
    train, _, _ = build_datasets(cfg.data, cfg.model.vocab_size)
    return [(ids.tolist(), mask.tolist()) for ids, mask in train.examples], train


@pytest.mark.parametrize("record, layout", [
    ({"messages": []}, "messages"), ({"conversations": [], "id": 3}, "sharegpt"),
    ({"instruction": "a", "input": "", "output": "b"}, "alpaca"), ({"instruction": "a", "output": "b"}, "alpaca"),
    ({"prompt": "a", "completion": "b"}, "prompt_completion"), ({"text": "a"}, "text"),
    ({"instruction": "a"}, "text"), ({"prompt": "a", "response": "b"}, "text"), ([1, 2], "text"),
])
def test_detection_from_the_keys(record, layout):
    assert detect(record) == layout


SHAREGPT_TURNS = [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                  {"from": "gpt", "value": "hello"}, {"from": "user", "value": "2+2?"},
                  {"from": "assistant", "value": "4"}]
# (case, records as written, the hand-converted messages they must tokenize to)
SAME_AS_MESSAGES = [
    ("sharegpt, multi-turn with a system turn", [{"conversations": SHAREGPT_TURNS}], [CHAT]),
    ("sharegpt, top-level system", [{"system": "be brief", "conversations": SHAREGPT_TURNS[1:]}], [CHAT]),
    ("sharegpt, messages-style turns", [{"conversations": CHAT}], [CHAT]),
    ("sharegpt, a turn not trained (weight 0)",
     [{"conversations": [*SHAREGPT_TURNS[:2], {**SHAREGPT_TURNS[2], "weight": 0}, *SHAREGPT_TURNS[3:]]}],
     [[*CHAT[:2], {**CHAT[2], "weight": 0}, *CHAT[3:]]]),
    ("alpaca with and without input", [{"instruction": "add", "input": "2 2", "output": "4"},
                                       {"instruction": "greet", "input": "", "output": "hi", "system": "be brief"}],
     [[{"role": "user", "content": "add\n\n2 2"}, {"role": "assistant", "content": "4"}],
      [{"role": "system", "content": "be brief"}, {"role": "user", "content": "greet"},
       {"role": "assistant", "content": "hi"}]]),
    ("conversational prompt/completion: loss on the completion only",
     [{"prompt": CHAT[:4], "completion": CHAT[4:]}], [[*CHAT[:2], {**CHAT[2], "weight": 0}, *CHAT[3:]]]),
]


@pytest.mark.parametrize("case, records, messages", SAME_AS_MESSAGES, ids=[c[0] for c in SAME_AS_MESSAGES])
def test_every_layout_tokenizes_as_its_messages(tmp_path, case, records, messages):
    got, train = _examples(_write(tmp_path / "d.jsonl", records))
    want, _ = _examples(_write(tmp_path / "m.jsonl", [{"messages": m} for m in messages]))
    assert got == want
    assert train.info == {"format": detect(records[0]), "template": "plain"}


def test_weight_zero_turn_is_masked_but_kept(tmp_path):
    weighted = [*CHAT[:2], {**CHAT[2], "weight": 0}, *CHAT[3:]]
    [(ids, mask)], _ = _examples(_write(tmp_path / "d.jsonl", [{"messages": weighted}]))
    [(ids_all, mask_all)], _ = _examples(_write(tmp_path / "m.jsonl", [{"messages": CHAT}]))
    assert ids == ids_all and sum(mask) == sum(mask_all) - len("hello\n") - 1  # its content, newline and EOS


def test_json_array_and_parquet_read_like_json_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"instruction": "add", "input": "2 2", "output": "4"}, {"instruction": "a", "input": "", "output": "b"}]
    want, _ = _examples(_write(tmp_path / "d.jsonl", rows))
    (tmp_path / "alpaca_data.json").write_text(json.dumps(rows, indent=4))  # Alpaca's own file: one JSON array
    assert _examples(tmp_path / "alpaca_data.json")[0] == want
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert _examples(tmp_path / "d.parquet")[0] == want
    pq.write_table(pa.Table.from_pylist([{"conversations": SHAREGPT_TURNS}]), tmp_path / "s.parquet")
    assert _examples(tmp_path / "s.parquet")[0] == _examples(_write(tmp_path / "m.jsonl", [{"messages": CHAT}]))[0]


def test_prompt_completion_strings_stay_raw(tmp_path):
    """prompt + completion + EOS, no template: the layout of OpenAI's legacy and TRL's standard prompt/completion."""
    [(ids, mask)], _ = _examples(_write(tmp_path / "d.jsonl", [{"prompt": "2+2=", "completion": "4"}]))
    assert ids == [*b"2+2=4", 257] and mask == [False] * 4 + [True, True]


A, S = {"instruction": "a", "output": "b"}, {"conversations": SHAREGPT_TURNS}
# (case, file name, content, extra overrides, what the one line says)
BAD = [
    ("explicit layout, other record", "d.jsonl", [S], ["--data.format=alpaca"],
     r"d.jsonl:1: no 'instruction' key \(found: conversations, a record of sharegpt\) but data.format is alpaca "
     r"\(data.format\); fix: write every record as alpaca \('instruction', 'input' \(optional\), 'output'\)"),
    ("detected layout, a later record", "d.jsonl", [A, A, {"instruction": "a"}], [],
     r"d.jsonl:3: no 'output' key \(found: instruction\) but data.format is alpaca \(detected from line 1\)"),
    ("unknown ShareGPT speaker", "d.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}], [],
     r"d.jsonl:1: conversations\[0\].from: 'bot' is not a known speaker; fix: use one of human, user, gpt"),
    ("ShareGPT turn without a value", "d.jsonl", [{"conversations": [{"from": "human", "text": "x"}]}], [],
     r"d.jsonl:1: conversations\[0\]: needs 'from' and 'value' strings \(found: from, text\)"),
    ("ShareGPT with no gpt turn", "d.jsonl", [{"conversations": SHAREGPT_TURNS[:2]}], [],
     r"d.jsonl:1: conversation has no assistant message to learn from"),
    ("Alpaca output not a string", "d.jsonl", [{"instruction": "a", "output": 5}], [],
     r"d.jsonl:1: 'output' is int, not a string"),
    ("prompt string, completion list", "d.jsonl", [{"prompt": "a", "completion": [CHAT[2]]}], [],
     r"d.jsonl:1: 'prompt' is str and 'completion' list; fix: give two strings, or two lists"),
    ("JSON array record", "d.json", b'[{"instruction": "a", "output": "b"}, {"instruction": "c"}]', [],
     r"d.json:record 2: no 'output' key"),
    ("chat with data.chat_template=none", "d.jsonl", [S], ["--data.chat_template=none"],
     r"d.jsonl:1: a chat example, but data.chat_template=none; fix: set data.chat_template to auto"),
    ("no tokenizer template, chat_template=tokenizer", "d.jsonl", [S], ["--data.chat_template=tokenizer"],
     r"data.chat_template=tokenizer: the tokenizer has no chat template"),
    ("text layout on chat records", "d.jsonl", [S], ["--data.format=text"],
     r"d.jsonl:1: no 'text' field \(found: conversations\); fix: set data.text_field .* or data.format to the "
     r"layout of fine-tuning records"),
    ("an unknown layout names both fixes", "d.jsonl", [{"question": "q", "answer": "a"}], [],
     r"d.jsonl:1: no 'text' field \(found: answer, question\); fix: set data.text_field .* or data.format"),
    ("fine-tuning layout with mode=pretrain", "d.jsonl", [A], ["--data.format=alpaca", "--data.mode=pretrain"],
     r"data.format: alpaca records are fine-tuning examples, but data.mode=pretrain"),
    ("fine-tuning layout, no data", None, None, ["--data.format=sharegpt"],
     r"data.format: sharegpt needs data.path: the embedded corpus is text"),
]


@pytest.mark.parametrize("case, name, content, extra, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_records_are_one_line(tmp_path, case, name, content, extra, needle):
    path = []
    if name:
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else
                                      b"".join(json.dumps(r).encode() + b"\n" for r in content))
        path = [f"--data.path={tmp_path / name}"]
    with pytest.raises(ShardfitError) as e:
        cfg = load_config(None, [*path, "--data.seq_len=128", *extra])
        build_datasets(cfg.data, cfg.model.vocab_size)
    assert re.search(needle, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_truncation_is_counted_on_the_training_set_after_the_split(tmp_path):
    """The issue's numbers: 40 examples, most longer than seq_len; with val_fraction the training set's count is
    of its own examples (it was the whole file's, more than the training set held)."""
    rows = [{"prompt": "q", "completion": "a" * (16 + 3 * i)} for i in range(40)]  # 24 longer than 65 tokens
    path = _write(tmp_path / "d.jsonl", rows)
    _, whole = _examples(path, "--data.seq_len=64")
    _, half = _examples(path, "--data.seq_len=64", "--data.val_fraction=0.5")
    need = [len(ids) - 1 for ids, _ in half.examples]
    assert half.truncated == sum(n > 64 for n in need) < whole.truncated == 24
    assert half.n_tokens == sum(min(n + 1, 65) for n in need)  # tokens after truncation, not before
    assert half.truncation.cut == sum(max(n - 64, 0) for n in need)
    warning = half.header[1]
    assert warning.startswith(f"warning: truncation cuts {half.truncated} of 20 training examples")
    fix = int(re.search(r"--data.seq_len=(\d+)", warning).group(1))
    assert fix % 8 == 0 and sum(n <= fix for n in need) >= 0.95 * len(need)


def test_plain_template_exported_renders_as_training(tmp_path):
    """PLAIN_JINJA (what an export holds) renders the generation prompt shardfit's plain template trains on."""
    from shardfit.data.chat import PLAIN_JINJA, ChatRenderer

    plain, jinja, with_eos = ChatRenderer(None), ChatRenderer(PLAIN_JINJA), ChatRenderer(PLAIN_JINJA,
                                                                                        {"eos_token": "</s>"})
    assert jinja.kind == plain.kind == with_eos.kind == "plain"
    for chat in (CHAT[:2], CHAT[:4]):  # the byte tokenizer's export: no eos_token text (its EOS is an id)
        assert jinja.render(chat, True) == plain.render(chat, True)
    # a tokenizer's eos_token text where training puts the EOS id
    assert with_eos.render(CHAT, False) == "".join("</s>" if t is None else t for t, _ in plain.segments(CHAT))
    assert with_eos.render(CHAT[1:2], True) == "<|user|>\nhi\n<|assistant|>\n"


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(spellings, "_announced", set())
    for var in ("RANK", "SHARDFIT_LAUNCHER_PID"):
        monkeypatch.delenv(var, raising=False)


def test_old_data_format_values_move_to_file_format(tmp_path, capsys, fresh):
    cfg = load_config(None, ["--data.format=jsonl"])
    assert (cfg.data.file_format, cfg.data.format) == ("jsonl", "auto")
    assert capsys.readouterr().err == ("shardfit: data.format=jsonl is now data.file_format=jsonl (data.format names "
                                       "the record layout: messages, sharegpt, alpaca, prompt_completion or text); "
                                       f"the old spelling is accepted until {spellings.UNTIL}\n")
    (tmp_path / "c.toml").write_text('[data]\nformat = "parquet"\n')
    assert load_config(tmp_path / "c.toml").data.file_format == "parquet"
    assert load_config(None, ["--data.format=text"]).data.format == "text"  # a record layout too: no notice
    assert "data.format=parquet is now" in capsys.readouterr().err
    with pytest.raises(ShardfitError, match=r"command line: data.format and data.file_format are both given"):
        load_config(None, ["--data.format=jsonl", "--data.file_format=jsonl"])
    # a checkpoint's config.toml written before the move: generate reads its [data] the same way
    from shardfit.weights.local import checkpoint_config

    (tmp_path / "config.toml").write_text('[data]\nformat = "jsonl"\nseq_len = 64\n')
    assert checkpoint_config(tmp_path).data.file_format == "jsonl"


@pytest.mark.parametrize("arg, key", [("--conversation_style=sharegpt", "data.format"),
                                      ("--data.chat_template_name=chatml", None),
                                      ("--chat_template=chatml", "data.chat_template")])
def test_other_tools_spellings_name_the_key(arg, key):
    with pytest.raises(ShardfitError) as e:
        load_config(None, [arg])
    assert (f"is {key} (" in str(e.value)) if key else "did you mean 'data.chat_template'" in str(e.value)
