"""The [preference] section's part of the loader: the token-budget rows preference training needs (a pair in one
row), and the data.* and preference.* keys that preference training (preference.objective, docs/preference.md) would
ignore, each refused in one line naming the key and the fix rather than run as a silent approximation of what was
asked (config/loader.py runs them with its own rules, before its micro_batch check).

What preference training reads of [data]: data.path / val_path / val_fraction, data.file_format, data.seq_len,
data.seed, data.tokenizer and data.chat_template. Its records' layout is detected per record ({prompt?, chosen,
rejected}, KTO's {prompt, completion, label}: data/preference.py), so data.format names nothing it reads; its
units are pairs (KTO: examples) with a loss on the answers, never pretraining windows (data.mode=pretrain); and they
are always packed into token-budget rows (train.micro_batch_tokens), so data.pack=false would not pad one a row.
data.mode=sft is what it does already and is left alone. preference.label_smoothing is read by dpo and simpo
alone (engine/preference.py pair_loss): IPO's squared loss, ORPO and KTO have no smoothed form.
"""

from __future__ import annotations

from typing import Any

SMOOTHED = ("dpo", "simpo")  # the objectives whose loss reads preference.label_smoothing


def _on(c) -> bool:
    return c.preference.objective != "none"


PREFERENCE_RULES: tuple[tuple[str, Any, Any, Any], ...] = (
    ("data.mode", lambda c: _on(c) and c.data.mode == "pretrain",
     lambda c: f"pretrain packs documents, but preference.objective={c.preference.objective} trains on preference "
               "records (a loss on the answers)",
     lambda c: "drop data.mode (or set it to auto), or preference.objective=none to pretrain"),
    ("data.format", lambda c: _on(c) and c.data.format != "auto",
     lambda c: f"{c.data.format} is a fine-tuning layout, but preference.objective={c.preference.objective} detects "
               "each preference record's own layout ({prompt?, chosen, rejected}; chats inside them included)",
     lambda c: "drop data.format (docs/preference.md lists the layouts read)"),
    ("data.pack", lambda c: _on(c) and not c.data.pack,
     lambda c: f"false pads one example a row, but preference.objective={c.preference.objective} always packs its "
               "pairs into token-budget rows (train.micro_batch_tokens)",
     lambda c: "drop data.pack (rows of preference training are never padded per pair)"),
    ("preference.label_smoothing", lambda c: c.preference.label_smoothing and c.preference.objective not in SMOOTHED,
     lambda c: f"{c.preference.label_smoothing} smooths the dpo and simpo losses only, not "
               f"preference.objective={c.preference.objective}",
     lambda c: "drop preference.label_smoothing, or use preference.objective=dpo (conservative DPO) or simpo"),
    # in the loader's rules, which run before its micro_batch check (and the launcher's), so that a micro_batch
    # multiple is never asked for: its fix would lead here
    ("train.micro_batch_tokens", lambda c: _on(c) and not c.train.micro_batch_tokens,
     lambda c: "preference training packs each pair (chosen and rejected) into one token-budget row",
     lambda c: f"set --train.micro_batch_tokens={2 * c.data.seq_len} (at least 2 x data.seq_len)"),
    ("train.micro_batch_tokens", lambda c: _on(c) and 0 < c.train.micro_batch_tokens < 2 * c.data.seq_len,
     lambda c: f"{c.train.micro_batch_tokens} cannot hold a pair of two sequences of data.seq_len={c.data.seq_len}",
     lambda c: f"set it to at least {2 * c.data.seq_len}, or lower data.seq_len"),
)
