"""Preference data: TRL's preference records as pairs of token sequences (chosen, rejected), each with its prompt
masked out, for `shardfit train` with preference.objective (train/preference.py).

  {"prompt": str, "chosen": str, "rejected": str}          prompt + answer + EOS, trained on answer + EOS (no chat
                                                           template, as prompt/completion strings are)
  {"prompt": [msgs], "chosen": [msgs], "rejected": [msgs]}  a chat of prompt then answer, through the chat template
                                                           (data/chat.py), trained on the answer's assistant turns
  {"chosen": [msgs], "rejected": [msgs]}                   the implicit prompt: the messages both share from the
                                                           start (TRL's extract_prompt); the rest is the answer
  {"chosen": str, "rejected": str}                         the implicit prompt: the longest common prefix of text

A record's "tools" reach the template as fine-tuning's do. Each side is cut to data.seq_len labels (counted); a pair
with a side that keeps no trained label is left out (counted; a data set of only such pairs is refused). Every
refusal is one line naming the record's file:line and its field. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardfit.data.chat import renderer_of
from shardfit.data.dataset import ShuffledDataset
from shardfit.data.formats import detect
from shardfit.data.messages import check_messages, json_type, record_tools
from shardfit.data.sft import Truncation, tokenize_pieces
from shardfit.data.sources import read_records
from shardfit.errors import ShardfitError

Sequence = tuple[np.ndarray, np.ndarray]  # (token ids [L] int64, trained [L] bool)


@dataclass
class Side:
    """One sequence of a pair as the step reads it: inputs [n], target tokens [n], counted [n] (the trained labels),
    n = min(L - 1, data.seq_len)."""

    tokens: np.ndarray
    targets: np.ndarray
    counted: np.ndarray


class PreferencePairs(ShuffledDataset):
    """One pair per item, visited in the seeded order of a run (data/dataset.py)."""

    unit = "pairs"  # what an item is, as the header names it (train/schedule.py)

    def __init__(self, pairs: list[tuple[Sequence, Sequence]], seq_len: int, seed: int, where: str):
        self.pairs, self.seq_len, self.seed, self.where = pairs, seq_len, seed, where
        self.num_windows = len(pairs)
        self.truncation = Truncation.of([s for p in pairs for s in p], seq_len)
        self.n_tokens = self.truncation.kept

    def index(self, k: int) -> int:
        """The pair that is sample k of the run (k counts across epochs)."""
        return self._item(k)

    def sides_of(self, index: int) -> tuple[Side, Side]:
        """Pair `index` of the data set: (chosen, rejected)."""
        return tuple(side(ids, trained, self.seq_len) for ids, trained in self.pairs[index])

    def item_length(self, k: int) -> int:
        return sum(min(len(ids) - 1, self.seq_len) for ids, _ in self.pairs[self._item(k)])


def side(ids: np.ndarray, trained: np.ndarray, limit: int) -> Side:
    n = min(len(ids) - 1, limit)
    return Side(ids[:n], ids[1:n + 1], trained[1:n + 1].copy())


def common_prefix(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def pair_pieces(obj: object, where: str) -> tuple[list, list, bool]:
    """(chosen, rejected, chat): each side as messages (chat, assistant turns of the prompt weighted 0) or as
    (text, trained) pieces."""
    if not isinstance(obj, dict) or detect(obj) != "preference":
        keys = ", ".join(sorted(map(str, obj))) if isinstance(obj, dict) else f"a JSON {json_type(obj)}"
        raise ShardfitError(f"not a preference record (found: {keys or 'none'})", where=where,
                            fix="write every record as {\"prompt\", \"chosen\", \"rejected\"} or {\"chosen\": "
                                "[messages], \"rejected\": [messages]}")
    chosen, rejected, prompt = obj["chosen"], obj["rejected"], obj.get("prompt")
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if value is None:
            raise ShardfitError(f"{key}: a JSON null, not a string or a list of messages", where=where,
                                fix=f"give {key} as a string, or as a list of messages as the other fields are")
    kinds = {k: type(v) for k, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)) if v is not None}
    if set(kinds.values()) <= {str}:
        if prompt is None:  # the implicit prompt: the text both answers share
            cut = len(os.path.commonprefix([chosen, rejected]))
            prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
        for key, text in (("chosen", chosen), ("rejected", rejected)):
            if not text:
                raise ShardfitError(f"{key}: no answer after the prompt", where=where,
                                    fix="give chosen and rejected answers that differ")
        same(chosen, rejected, where)
        return ([(prompt, False), (chosen, True), (None, True)], [(prompt, False), (rejected, True), (None, True)],
                False)
    if set(kinds.values()) != {list}:
        found = ", ".join(f"{k} a JSON {json_type(obj[k])}" for k in kinds)
        raise ShardfitError(f"mixed field types ({found})", where=where,
                            fix="give prompt, chosen and rejected all as strings, or all as lists of messages")
    c = check_messages(chosen, "chosen", where)
    r = check_messages(rejected, "rejected", where)
    if prompt is not None:
        head = check_messages(prompt, "prompt", where)
    else:
        n = common_prefix(c, r)
        head, c, r = c[:n], c[n:], r[n:]
    head = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in head]
    for key, msgs in (("chosen", c), ("rejected", r)):
        if not any(m["role"] == "assistant" for m in msgs):
            raise ShardfitError(f"{key}: no assistant message after the prompt", where=where,
                                fix="end chosen and rejected with the assistant's (different) answers")
    same(c, r, where)
    return head + c, head + r, True


def same(chosen, rejected, where: str) -> None:
    """Refuse a pair whose answers are the same: it holds no preference (its margin is 0 whatever the model)."""
    if chosen == rejected:
        raise ShardfitError("rejected: the same answer as chosen", where=where,
                            fix="give chosen and rejected answers that differ, or drop the record")


def pair_records(obj: object, where: str) -> list[tuple[list, bool, None]]:
    """A preference record as read_units takes it: [(chosen, chat, None), (rejected, chat, None)]."""
    if isinstance(obj, dict) and detect(obj) == "unpaired":
        raise ShardfitError("an unpaired example (prompt, completion, label): DPO, IPO, SimPO and ORPO train on "
                            "pairs", where=where, fix="--preference.objective=kto trains on labelled examples")
    chosen, rejected, chat = pair_pieces(obj, where)
    return [(chosen, chat, None), (rejected, chat, None)]


@dataclass
class Units:
    units: list[tuple]  # pairs: (chosen, rejected) Sequences; KTO: (Sequence, desirable)
    dropped: int
    template: str  # the chat template applied: tokenizer, plain, or none
    template_text: str


def read_units(files: list[Path], data_cfg, tokenizer, spec: str, records_of=pair_records,
               group: int = 2) -> Units:
    """Every unit of the files whose sequences all keep a trained label within data.seq_len. records_of(obj, where)
    -> [(pieces or messages, chat, tag)]: group 2, a pair per record (tags unused); group 1, a labelled example per
    item (data/unpaired.py: tag the label)."""
    renderer, chats, units, dropped = None, 0, [], 0
    layouts = '{"prompt", "chosen", "rejected"}' + (' or {"prompt", "completion", "label"}' if group == 1 else "")
    for path in files:
        for obj, where in read_records(path, data_cfg.file_format, what="preference records",
                                       text_fix=f"convert it to JSON lines of {layouts} (docs/preference.md)"):
            items = records_of(obj, where)
            seqs = []
            for pieces, chat, _tag in items:
                if chat:
                    renderer = renderer_of(renderer, data_cfg, where, "pair" if group == 2 else "example")
                    chats += 1
                    pieces = renderer.segments(pieces, where, tools=record_tools(obj, where))
                seqs.append(tokenize_pieces(pieces, tokenizer))
            kept = [trained[1:data_cfg.seq_len + 1].any() for _, trained in seqs]
            if group == 2:
                if all(kept):
                    units.append(tuple(seqs))
                else:
                    dropped += 1
                continue
            for seq, ok, (_, _, tag) in zip(seqs, kept, items):
                if ok:
                    units.append((seq, tag))
                else:
                    dropped += 1
    what = "preference pair with a trained token within data.seq_len={} on both sides" if group == 2 else \
        "KTO example with a trained token within data.seq_len={}"
    if not units:
        raise ShardfitError(f"no {what.format(data_cfg.seq_len)} ({dropped:,} left out)", where=spec,
                            fix="raise data.seq_len, or give non-empty answers")
    return Units(units, dropped, renderer.kind if chats else "none",
                 renderer.describe() if chats else "none (strings are trained as they are)")
