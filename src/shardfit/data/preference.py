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
from shardfit.data.sources import read_records, resolve_files
from shardfit.data.token_shards import check_token_ids
from shardfit.data.tokenizer import build_tokenizer
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
    kinds = {k: type(v) for k, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)) if v is not None}
    if set(kinds.values()) <= {str}:
        if prompt is None:  # the implicit prompt: the text both answers share
            cut = len(os.path.commonprefix([chosen, rejected]))
            prompt, chosen, rejected = chosen[:cut], chosen[cut:], rejected[cut:]
        for key, text in (("chosen", chosen), ("rejected", rejected)):
            if not text:
                raise ShardfitError(f"{key}: no answer after the prompt", where=where,
                                    fix="give chosen and rejected answers that differ")
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
    return head + c, head + r, True


@dataclass
class Pairs:
    pairs: list[tuple[Sequence, Sequence]]
    dropped: int
    template: str  # the chat template applied: tokenizer, plain, or none
    template_text: str


def read_pairs(files: list[Path], data_cfg, tokenizer, spec: str) -> Pairs:
    """Every pair of the files whose sides both keep a trained label within data.seq_len."""
    renderer, chats, pairs, dropped = None, 0, [], 0
    for path in files:
        for obj, where in read_records(path, data_cfg.file_format):
            chosen, rejected, chat = pair_pieces(obj, where)
            if chat:
                renderer = renderer_of(renderer, data_cfg, where, "pair")
                chats += 1
                tools = record_tools(obj, where)
                chosen, rejected = (renderer.segments(s, where, tools=tools) for s in (chosen, rejected))
            pair = tuple(tokenize_pieces(s, tokenizer) for s in (chosen, rejected))
            if not all(trained[1:data_cfg.seq_len + 1].any() for _, trained in pair):
                dropped += 1
                continue
            pairs.append(pair)
    if not pairs:
        raise ShardfitError(f"no preference pair with a trained token within data.seq_len={data_cfg.seq_len} on both "
                            f"sides ({dropped:,} left out)", where=spec,
                            fix="raise data.seq_len, or give pairs with non-empty answers")
    return Pairs(pairs, dropped, renderer.kind if chats else "none",
                 renderer.describe() if chats else "none (strings are trained as they are)")


def build_preference(data_cfg, vocab_size: int) -> tuple[PreferencePairs, object]:
    """(the training pairs, tokenizer); its header the start-up lines, its info the format and template."""
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    if data_cfg.val_path or data_cfg.val_fraction > 0:
        raise ShardfitError("no validation set for preference training yet", where="data.val_path",
                            fix="leave data.val_path empty and data.val_fraction=0 (the log's rewards/accuracies "
                                "and rewards/margins follow training)")
    if not data_cfg.path:
        raise ShardfitError("preference training needs preference records", where="data.path",
                            fix="give JSON lines of {\"prompt\", \"chosen\", \"rejected\"} (docs/preference.md)")
    files = resolve_files(data_cfg.path)
    got = read_pairs(files, data_cfg, tokenizer, data_cfg.path)
    check_token_ids(max(int(ids.max()) for p in got.pairs for ids, _ in p), vocab_size, data_cfg.path)
    pairs = PreferencePairs(got.pairs, data_cfg.seq_len, data_cfg.seed, str(files[0]))
    cut = pairs.truncation
    left = f", {got.dropped:,} left out (a side with no trained token within data.seq_len)" if got.dropped else ""
    pairs.header = tuple(n for n in [
        f"data: preference pairs ({data_cfg.path}), chat template: {got.template_text}; {len(got.pairs):,} pairs"
        f"{left}, {cut.kept:,} tokens after truncation at data.seq_len={data_cfg.seq_len} ({cut.describe()})",
        cut.warning(data_cfg.seq_len)] if n)
    pairs.info = {"format": "preference", "template": got.template}
    return pairs, tokenizer
