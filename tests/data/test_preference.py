"""Preference records (data/preference.py): TRL's layouts become pairs whose trained tokens are the answers alone,
the implicit prompt is the shared prefix, fine-tuning refuses them with the fix, and a bad record is one line naming
file:line and the field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from shardfit.data.build import build_preference
from shardfit.data.preference import pair_pieces, read_units
from shardfit.data.tokenizer import build_tokenizer
from shardfit.errors import ShardfitError

TOK = build_tokenizer("byte")


def _cfg(path, **kw):
    base = dict(path=str(path), file_format="auto", chat_template="plain", tokenizer="byte", seq_len=64, seed=0,
                val_path="", val_fraction=0.0)
    return SimpleNamespace(**{**base, **kw})


def _write(tmp_path, records):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _trained_text(ids, trained):
    return bytes(int(i) for i, t in zip(ids, trained) if t and i < 256).decode()


def test_string_pairs_train_on_the_answers_and_eos():
    chosen, rejected, chat = pair_pieces({"prompt": "Q?", "chosen": " yes", "rejected": " no"}, "f:1")
    assert not chat
    assert chosen == [("Q?", False), (" yes", True), (None, True)]
    assert rejected == [("Q?", False), (" no", True), (None, True)]
    # the implicit prompt of two strings: their common prefix
    chosen, rejected, _ = pair_pieces({"chosen": "Q? yes", "rejected": "Q? no"}, "f:1")
    assert chosen[:2] == [("Q? ", False), ("yes", True)] and rejected[1] == ("no", True)


def test_conversational_layouts_explicit_and_implicit_prompt(tmp_path):
    user = {"role": "user", "content": "colour?"}
    explicit = {"prompt": [user], "chosen": [{"role": "assistant", "content": "blue"}],
                "rejected": [{"role": "assistant", "content": "loud"}]}
    implicit = {"chosen": [user, {"role": "assistant", "content": "blue"}],
                "rejected": [user, {"role": "assistant", "content": "loud"}]}
    got = read_units([_write(tmp_path, [explicit, implicit])], _cfg(tmp_path), TOK, "pairs")
    assert got.template == "plain" and got.dropped == 0
    first, second = got.units
    for (c_ids, c_mask), (r_ids, r_mask) in (first, second):
        assert "blue" in _trained_text(c_ids, c_mask) and "colour" not in _trained_text(c_ids, c_mask)
        assert "loud" in _trained_text(r_ids, r_mask)
    assert all(np.array_equal(a[0], b[0]) for a, b in zip(first, second))  # the two layouts: the same tokens


def test_the_dataset_gives_shifted_sides_with_their_counted_labels(tmp_path):
    path = _write(tmp_path, [{"prompt": "ab", "chosen": "cd", "rejected": "e"}] * 3)
    pairs, _, _ = build_preference(_cfg(path), 264, "dpo")
    chosen, rejected = pairs.sides_of(0)
    assert bytes(chosen.tokens.tolist()).decode() == "abcd"  # ids[:-1]; the targets the next tokens, EOS last
    assert chosen.targets.tolist()[:3] == list(b"bcd") and chosen.counted.tolist() == [False, True, True, True]
    assert rejected.counted.sum() == 2  # "e" and EOS
    assert pairs.item_length(0) == len(chosen.tokens) + len(rejected.tokens)
    assert pairs.header[0].startswith("data: preference pairs") and pairs.info["format"] == "preference"


def test_fine_tuning_refuses_preference_records_with_the_fix(tmp_path):
    from shardfit.config import load_config
    from shardfit.data.build import build_datasets

    path = _write(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}])
    cfg = load_config(None, [f"--data.path={path}"])
    with pytest.raises(ShardfitError, match="records are preference pairs") as e:
        build_datasets(cfg.data, cfg.model.vocab_size)
    assert "--preference.objective=dpo" in e.value.fix


@pytest.mark.parametrize("record, message", [
    ({"prompt": "Q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}, "mixed field types"),
    ({"chosen": "same", "rejected": "same"}, "chosen: no answer after the prompt"),
    ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]},
     "chosen: no assistant message after the prompt"),
    ({"prompt": "Q", "chosen": "a", "rejected": [{"role": "assistant"}]}, "mixed field types"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": 3}],
      "rejected": [{"role": "assistant", "content": "b"}]}, r"chosen\[0\]\.content"),
    # null answers: one line, not os.path.commonprefix's TypeError (implicit prompt) or "no answer" (explicit)
    ({"chosen": None, "rejected": "b"}, "chosen: a JSON null"),
    ({"chosen": "a", "rejected": None}, "rejected: a JSON null"),
    ({"prompt": "Q", "chosen": None, "rejected": "b"}, "chosen: a JSON null"),
    # the same answer twice holds no preference, with an explicit prompt as with the implicit one
    ({"prompt": "Q", "chosen": " a", "rejected": " a"}, "rejected: the same answer as chosen"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "a"}]}, "rejected: the same answer as chosen"),
])
def test_a_bad_record_is_one_line_naming_line_and_field(tmp_path, record, message):
    path = _write(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(ShardfitError, match=message) as e:
        read_units([path], _cfg(path), TOK, "pairs")
    assert e.value.where == f"{path}:2"


def test_an_sft_record_among_pairs_is_refused_by_its_line(tmp_path):
    path = _write(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}, {"prompt": "Q", "completion": "a"}])
    with pytest.raises(ShardfitError, match="not a preference record .found: completion, prompt") as e:
        read_units([path], _cfg(path), TOK, "pairs")
    assert e.value.where == f"{path}:2"


def test_kto_examples_carry_labels_and_their_mismatched_kl_sequences(tmp_path):
    records = [{"prompt": "P0", "completion": "aa", "label": True}, {"prompt": "P1", "completion": "b", "label": False},
               {"prompt": "P2", "chosen": "cc", "rejected": "d"}]  # a pair: two examples, chosen desirable
    path = _write(tmp_path, records)
    data, val, _ = build_preference(_cfg(path), 264, "kto")
    assert val is None and data.unit == "examples" and data.labels.tolist() == [True, False, True, False]
    text = lambda side: bytes(int(i) for i in side.tokens if i < 256).decode()  # noqa: E731
    example, kl = data.sides_of(1)
    assert text(example) == "P1b" and _trained_text(example.targets, example.counted) == "b"
    assert text(kl) == "P1aa"  # prompt 1, then example 0's completion (TRL's rotation by one)
    assert _trained_text(kl.targets, kl.counted) == "aa"
    assert text(data.sides_of(0)[1]) == "P0d"  # the first takes the last one's
    assert data.header[0].startswith("data: KTO examples, 2 desirable and 2 not") and "4 examples" in data.header[0]


@pytest.mark.parametrize("record, objective, message, fix", [
    ({"prompt": "Q", "completion": "a", "label": "yes"}, "kto", "label: a JSON string, not true or false",
     "label: true"),
    ({"prompt": "Q", "completion": "a", "label": True}, "dpo", "an unpaired example", "--preference.objective=kto"),
    ({"text": "x"}, "kto", "not a KTO record", "completion"),
])
def test_a_bad_kto_record_is_one_line(tmp_path, record, objective, message, fix):
    path = _write(tmp_path, [{"prompt": "Q", "chosen": "a", "rejected": "b"}, record])
    with pytest.raises(ShardfitError, match=message) as e:
        build_preference(_cfg(path), 264, objective)
    assert e.value.where == f"{path}:2" and fix in e.value.fix


def test_fine_tuning_refuses_kto_records_and_validation_holds_out_units(tmp_path):
    from shardfit.config import load_config
    from shardfit.data.build import build_datasets

    path = _write(tmp_path, [{"prompt": f"Q{i}", "completion": "a", "label": True} for i in range(8)])
    cfg = load_config(None, [f"--data.path={path}"])
    with pytest.raises(ShardfitError, match="records are KTO's labelled examples") as e:
        build_datasets(cfg.data, cfg.model.vocab_size)
    assert "--preference.objective=kto" in e.value.fix
    pairs = _write(tmp_path, [{"prompt": f"Q{i}", "chosen": "a", "rejected": "b"} for i in range(8)])
    train, val, _ = build_preference(_cfg(pairs, val_fraction=0.25), 264, "dpo")
    assert (train.num_windows, val.num_windows, val.ordered) == (6, 2, True)
    assert "6 pairs (+2 for validation)" in train.header[0]
    with pytest.raises(ShardfitError, match="names the same files as data.path"):
        build_preference(_cfg(pairs, val_path=str(pairs)), 264, "dpo")


@pytest.mark.parametrize("fraction, split", [(0.1, "7 to train on and 1 held out"), (0.9, "1 to train on and 7 held")])
def test_a_kto_holdout_of_one_example_names_data_val_fraction(tmp_path, fraction, split):
    """KTO's KL sequence of an example takes another's completion, so each set needs 2 examples; a val_fraction that
    leaves one was refused naming the data file with the fix "give at least 2 examples"."""
    path = _write(tmp_path, [{"prompt": f"Q{i}", "completion": " a", "label": i % 2 == 0} for i in range(8)])
    with pytest.raises(ShardfitError, match=split) as e:
        build_preference(_cfg(path, val_fraction=fraction), 264, "kto")
    assert e.value.where == "data.val_fraction" and "data.val_path" in e.value.fix
    train, val, _ = build_preference(_cfg(path, val_fraction=0.25), 264, "kto")
    assert (train.num_windows, val.num_windows) == (6, 2)


@pytest.mark.parametrize("name, fmt", [("pairs.txt", "auto"), ("pairs.jsonl", "text")])
def test_a_text_file_of_pairs_names_the_preference_layout(tmp_path, name, fmt):
    """A text file was refused with fine-tuning's fix "set data.format=text to pretrain on it", which no preference
    run can take."""
    path = tmp_path / name
    path.write_text("some text\n")
    with pytest.raises(ShardfitError, match="preference records are read from JSON lines") as e:
        read_units([path], _cfg(path, file_format=fmt), TOK, "pairs")
    assert '"chosen"' in e.value.fix and "pretrain" not in e.value.fix
