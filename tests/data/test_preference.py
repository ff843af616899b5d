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
