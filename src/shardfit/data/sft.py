"""Fine-tuning data: records of any layout in data/formats.py (messages, ShareGPT, Alpaca, prompt/completion) as
token ids with a trained mask.

Loss is taken only on what the model should produce: the completion, or every assistant message (its tool calls
included). A chat is rendered, with the record's tools, in the template data.chat_template picks (data/chat.py: the
tokenizer's, or shardfit's plain one); prompt/completion strings are   prompt + completion + EOS   with loss on
completion + EOS. Each example is one sequence: truncated to data.seq_len (examples and tokens cut are counted per data
set, after any held-out split, and reported with the seq_len that keeps 95% of examples whole) or padded, with labels
-100 on prompts and padding. An example with no loss-bearing token within data.seq_len is left out (counted; a data set
of only such examples is refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardfit.data.chat import renderer_of
from shardfit.data.dataset import ShuffledDataset
from shardfit.data.formats import file_format, to_example
from shardfit.data.messages import record_tools
from shardfit.data.sources import read_records
from shardfit.errors import ShardfitError

IGNORE = -100
WARN_TRUNCATED = 0.1  # a warning, with the fix, when truncation cuts more than this fraction of the examples


@dataclass
class Truncation:
    """What cutting examples to data.seq_len costs one data set: examples cut, their tokens lost, tokens kept, and
    the data.seq_len that would keep 95% of the examples whole."""

    examples: int
    total: int  # examples in the data set
    cut: int  # tokens beyond the first seq_len + 1 of each example
    kept: int
    p95: int  # 95th percentile of the tokens an example's row needs (its length - 1)

    @staticmethod
    def of(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int) -> Truncation:
        need = np.fromiter((len(ids) - 1 for ids, _ in examples), dtype=np.int64, count=len(examples))
        over = np.maximum(need - seq_len, 0)
        p95 = int(math.ceil(float(np.percentile(need, 95)))) if len(need) else 0
        return Truncation(int((over > 0).sum()), len(need), int(over.sum()), int((need + 1).sum() - over.sum()), p95)

    def describe(self) -> str:
        if not self.examples:
            return "none cut"
        return (f"cut: {self.examples:,} of {self.total:,} examples, {self.cut:,} of {self.cut + self.kept:,} "
                "tokens")

    def warning(self, seq_len: int) -> str | None:
        """The warning and its fix when truncation cuts more than WARN_TRUNCATED of the examples, else None."""
        if self.examples <= WARN_TRUNCATED * self.total:
            return None
        fix = -(-self.p95 // 8) * 8
        return (f"warning: truncation cuts {self.examples:,} of {self.total:,} training examples "
                f"({self.examples / self.total:.0%}) at data.seq_len={seq_len}, losing {self.cut:,} tokens; fix: "
                f"--data.seq_len={fix} keeps 95% of them whole")


class ExampleDataset(ShuffledDataset):
    """One example per item: a padded row of seq_len (data.pack=false), or unpadded for token-budget micro-batches.
    An example longer than seq_len + 1 tokens is truncated (counted in `truncation`)."""

    def __init__(self, examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, seed: int, pad_id: int,
                 where: str, ordered: bool = False):
        if not examples:
            raise ShardfitError("no fine-tuning examples", where=where, fix="check data.path")
        self.examples, self.seq_len, self.seed, self.pad_id = examples, seq_len, seed, pad_id
        self.num_windows = len(examples)
        self.where, self.ordered = where, ordered
        self.truncation = Truncation.of(examples, seq_len)
        self.truncated = self.truncation.examples
        self.n_tokens = self.truncation.kept  # the start-up line's size: tokens after truncation

    def item(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return example_tokens(*self.examples[self._item(k)], self.seq_len)

    def item_length(self, k: int) -> int:
        return min(len(self.examples[self._item(k)][0]) - 1, self.seq_len)

    def row(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        inputs, labels, _ = self.item(k)
        n = len(inputs)
        return (pad_to(inputs, self.seq_len, self.pad_id), pad_to(labels, self.seq_len, IGNORE), None, n)


def example_tokens(ids: np.ndarray, trained: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An example as (inputs [L], labels [L], positions [L]), L = min(len - 1, limit): label t is token t + 1 where
    that token is trained, else -100."""
    n = min(len(ids) - 1, limit)
    labels = np.where(trained[1:n + 1], ids[1:n + 1], IGNORE)
    return ids[:n], labels, np.arange(n)


def pad_to(x: np.ndarray, length: int, value: int) -> np.ndarray:
    out = np.full(length, value, dtype=np.int64)
    out[:len(x)] = x
    return out


@dataclass
class Examples:
    """What read_examples found: the examples that train, how many were left out, and how they were read."""

    examples: list[tuple[np.ndarray, np.ndarray]]  # (token ids, trained mask) each
    dropped: int  # no loss-bearing token within the first seq_len + 1: left out (they would train nothing)
    pad: int  # the input id of padding
    format: str  # the record layout (data/formats.py)
    origin: str  # where it came from: "data.format" or "detected from file:line"
    template: str  # the chat template applied: tokenizer, plain, or none (no chat in the data)
    template_text: str  # the header's words for it


def data_format(files: list[Path], data_cfg) -> tuple[str, str]:
    """(record layout, where it came from): data.format, or the layout of the first record of the files."""
    if data_cfg.format != "auto":
        return data_cfg.format, "data.format"
    for path in files:
        found = file_format(path, data_cfg.file_format)
        if found is not None:
            return found[0], f"detected from {found[1]}"
    return "text", "no record found"


def read_examples(files: list[Path], data_cfg, tokenizer, spec: str | None = None) -> Examples:
    """Every example of the files with at least one loss-bearing token within data.seq_len. An example without one
    (a prompt longer than seq_len, or a template that masks every token) is left out and counted; a data set that
    keeps none is refused here, not trained for zero steps. spec: the data set as error lines name it."""
    fmt, origin = data_format(files, data_cfg)
    if fmt == "preference":
        raise ShardfitError(f"records are preference pairs (prompt, chosen, rejected; {origin}): fine-tuning "
                            "trains on one answer", where=spec or str(files[0]),
                            fix="--preference.objective=dpo (or ipo, simpo, orpo, kto) to train on the pairs "
                                "(docs/preference.md)")
    if fmt == "unpaired":
        raise ShardfitError(f"records are KTO's labelled examples (prompt, completion, label; {origin}): "
                            "fine-tuning would train on the undesirable ones too", where=spec or str(files[0]),
                            fix="--preference.objective=kto to train on them (docs/preference.md)")
    if fmt == "text":
        raise ShardfitError(f"holds no fine-tuning records ({origin})", where=spec or str(files[0]),
                            fix="give records of one layout: messages, sharegpt, alpaca or prompt_completion")
    renderer, chats = None, 0
    examples, dropped, seq_len = [], 0, data_cfg.seq_len
    for path in files:
        for obj, where in read_records(path, data_cfg.file_format):
            ex = to_example(obj, fmt, origin, where)
            if isinstance(ex[0], dict):  # a chat: through the template
                renderer = renderer_of(renderer, data_cfg, where, "example")
                chats += 1
                pieces = renderer.segments(ex, where, tools=record_tools(obj, where))
            else:
                pieces = ex
            ids, mask = tokenize_pieces(pieces, tokenizer)
            if not mask[1:seq_len + 1].any():  # label t is token t + 1: these are the labels a row keeps
                dropped += 1
                continue
            examples.append((ids, mask))
    if not examples and dropped:
        raise ShardfitError(f"none of the {dropped:,} examples has a loss-bearing token within data.seq_len="
                            f"{seq_len} (prompts longer than that, or every completion token masked)",
                            where=spec or str(files[0]),
                            fix="raise data.seq_len, shorten the prompts, or check the chat template's masks")
    eos_id = tokenizer.eos_id
    pad = tokenizer.pad_id if getattr(tokenizer, "pad_id", None) is not None else (eos_id or 0)
    template = renderer.kind if chats else "none"
    return Examples(examples, dropped, pad, fmt, origin, template,
                    renderer.describe() if chats else "none (no chat: records are trained as they are)")


def tokenize_pieces(pieces: list[tuple[str | None, bool]], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(text, trained) pieces -> (token ids [L] int64, trained [L] bool); text None is EOS (after a completion or an
    assistant turn of the plain template)."""
    ids: list[int] = []
    mask: list[bool] = []
    eos_id = tokenizer.eos_id
    for text, trained in pieces:
        toks = (tokenizer.encode(text) if text else []) if text is not None else (
            [eos_id] if eos_id is not None else [])
        ids += toks
        mask += [trained] * len(toks)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


def dropped_notice(dropped: int, kept: int, seq_len: int, where: str) -> str | None:
    """The start-up line about examples left out by read_examples, or None."""
    if not dropped:
        return None
    return (f"{where}: {dropped:,} of {dropped + kept:,} examples left out: no loss-bearing token within "
            f"data.seq_len={seq_len} (raise data.seq_len to keep them)")
