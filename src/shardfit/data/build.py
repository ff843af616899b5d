"""Which data set a config asks for: the factory on top of data/ (dataset -> packing / sft / sft_packed -> here).

Fine-tuning items are examples (packed into rows, one padded example per row, or unpadded for token-budget
micro-batches); pretraining items are windows of the token stream, with document starts when data.document_mask is
on. Validation comes from data.val_path or holds out data.val_fraction. Token ids beyond the vocabulary, and a
validation set inside the training set, are refused here, before any training.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from shardfit.data.dataset import ShuffledDataset
from shardfit.data.mode import holds_examples
from shardfit.data.packing import PackedDataset, tokenize_documents
from shardfit.data.preference import PreferencePairs, read_units
from shardfit.data.sft import ExampleDataset, dropped_notice, read_examples
from shardfit.data.sft_packed import PackedExamples
from shardfit.data.sources import resolve_files
from shardfit.data.token_shards import check_token_ids, open_token_shards, shard_dir_state
from shardfit.data.tokenizer import build_tokenizer
from shardfit.data.unpaired import UnpairedExamples, unpaired_pieces
from shardfit.errors import ShardfitError


def build_dataset(data_cfg, vocab_size: int, token_budget: bool = False) -> tuple[ShuffledDataset, object]:
    """The training set alone (see build_datasets)."""
    train, _val, tokenizer = build_datasets(data_cfg, vocab_size, token_budget)
    return train, tokenizer


def build_datasets(data_cfg, vocab_size: int,
                   token_budget: bool = False) -> tuple[ShuffledDataset, ShuffledDataset | None, object]:
    """(training set, validation set or None, tokenizer).

    Fine-tuning items are examples: packed into rows (data.pack), one padded example per row, or, for token-budget
    micro-batches, unpadded examples that the batcher lays end to end. Pretraining items are windows of the token
    stream, with document starts when data.document_mask is on. Validation comes from data.val_path (read like
    data.path) or holds out data.val_fraction of the training items; it is visited in order. Token ids beyond
    vocab_size, and a validation set inside the training set, are refused. The training set's `header` holds the
    start-up lines about its format, chat template and truncation, its `notices` those about examples left out and
    validation items also in training (the trainer prints both); its `info` the format and the template applied."""
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ShardfitError(f"tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is {vocab_size}",
                            where="model.vocab_size", fix=f"set model.vocab_size >= {tokenizer.vocab_size}")
    if data_cfg.val_path and same_files(data_cfg.path, data_cfg.val_path):
        raise ShardfitError(f"names the same files as data.path ({data_cfg.path}): the validation loss would "
                            "measure the training data", where="data.val_path",
                            fix="give held-out files, or data.val_fraction to hold out part of data.path")
    if data_cfg.path and data_cfg.format != "text" and shard_dir_state(data_cfg.path) is None and \
            holds_examples(data_cfg):
        return _fine_tuning(data_cfg, vocab_size, tokenizer, resolve_files(data_cfg.path), token_budget)

    def stream(path: str, where: str) -> tuple[PackedDataset, list[np.ndarray] | None]:
        """The dataset, and its documents when read from text (None for memory-mapped token shards)."""
        if shard_dir_state(path) is not None:  # `shardfit tokenize` output: memory-mapped, nothing read whole
            if data_cfg.mode == "sft":
                raise ShardfitError("token shards hold a pretraining token stream, not fine-tuning examples",
                                    where=path, fix="use data.mode=pretrain (or auto) with token shards")
            tokens, starts, _manifest = open_token_shards(path, data_cfg.tokenizer, tokenizer, vocab_size)
            docs = None
        else:
            tokens, starts = tokenize_documents(path, data_cfg.file_format, data_cfg.text_field, tokenizer,
                                                "text" if data_cfg.format == "text" else None)
            check_token_ids(int(tokens.max()), vocab_size, where)  # in memory already: one pass, no copy
            docs = np.split(tokens, starts[1:]) if data_cfg.val_path else None  # views, for the overlap check
        return PackedDataset(tokens, data_cfg.seq_len, data_cfg.seed, where=where,
                             doc_starts=starts if data_cfg.document_mask else None), docs

    train, train_docs = stream(data_cfg.path, data_cfg.path or "embedded corpus")
    val, notices = None, []
    if data_cfg.val_path:
        val, val_docs = stream(data_cfg.val_path, data_cfg.val_path)
        if train_docs is not None and val_docs is not None:  # shards: compared by path above, not read whole
            notices.append(overlap_notice(train_docs, val_docs, "document"))
    elif data_cfg.val_fraction > 0:
        train, val = train.holdout(data_cfg.val_fraction)
    if val is not None:
        val.ordered = True
    why = ("the embedded corpus" if not data_cfg.path else "token shards" if shard_dir_state(data_cfg.path)
           else "data.format=text" if data_cfg.format == "text" else "data.mode=pretrain"
           if data_cfg.mode == "pretrain" else "no fine-tuning records in data.path")
    head = (f"data: text documents for pretraining ({why}), {train.num_windows:,} training windows of "
            f"{data_cfg.seq_len + 1} tokens, no chat template")
    train.header, train.notices = (head,), tuple(n for n in notices if n)
    train.info = {"format": "text", "template": "none"}
    return train, val, tokenizer


def _fine_tuning(data_cfg, vocab_size: int, tokenizer, files: list[Path],
                 token_budget: bool) -> tuple[ShuffledDataset, ShuffledDataset | None, object]:
    """build_datasets for fine-tuning examples. The training set's header: its format, chat template, size and
    truncation (counted after any held-out split, a warning with the fix above WARN_TRUNCATED); its notices:
    examples left out and validation items also in training; its `info`: the format and the template applied (the
    trainer saves the template in config.toml)."""
    notices: list[str | None] = []

    def read(spec: str, spec_files: list[Path]):
        found = read_examples(spec_files, data_cfg, tokenizer, spec)
        check_token_ids(max((int(ids.max()) for ids, _ in found.examples), default=-1), vocab_size, spec)
        notices.append(dropped_notice(found.dropped, len(found.examples), data_cfg.seq_len, spec))
        return found

    got = read(data_cfg.path, files)
    cls = PackedExamples if data_cfg.pack and not token_budget else ExampleDataset
    make = lambda ex, where, ordered=False: cls(ex, data_cfg.seq_len, data_cfg.seed, got.pad, where,  # noqa: E731
                                                ordered)
    examples, val, template = got.examples, None, got.template
    if data_cfg.val_path:
        val_got = read(data_cfg.val_path, resolve_files(data_cfg.val_path))
        notices.append(overlap_notice([ids for ids, _ in examples], [ids for ids, _ in val_got.examples],
                                      "example"))
        val = make(val_got.examples, data_cfg.val_path, True)
        if template == "none":
            template = val_got.template
    elif data_cfg.val_fraction > 0:
        examples, val_ex = holdout(examples, data_cfg.val_fraction, data_cfg.seed)
        val = make(val_ex, f"{files[0]} (held out)", True)
    train = make(examples, str(files[0]))
    cut = train.truncation
    held = f" (+{len(val.examples):,} for validation)" if val is not None else ""
    head = (f"data: {got.format} ({got.origin}), chat template: {got.template_text}; {len(examples):,} training "
            f"examples{held}, {cut.kept:,} tokens after truncation at data.seq_len={data_cfg.seq_len} "
            f"({cut.describe()})")
    train.header = tuple(n for n in [head, cut.warning(data_cfg.seq_len)] if n)
    train.notices = tuple(n for n in notices if n)
    train.info = {"format": got.format, "template": template}
    return train, val, tokenizer


def build_preference(data_cfg, vocab_size: int, objective: str) -> tuple[PreferencePairs, PreferencePairs | None,
                                                                       object]:
    """(training units, validation units or None, tokenizer) for preference.objective: pairs (data/preference.py),
    or KTO's labelled examples (data/unpaired.py). Validation from data.val_path, or data.val_fraction of the
    units held out; visited in order. The training set's header: the start-up lines; its info: format, template."""
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    if not data_cfg.path:
        raise ShardfitError("preference training needs preference records", where="data.path",
                            fix="give JSON lines of {\"prompt\", \"chosen\", \"rejected\"} (docs/preference.md)")
    if data_cfg.val_path and same_files(data_cfg.path, data_cfg.val_path):
        raise ShardfitError(f"names the same files as data.path ({data_cfg.path}): the validation metrics would "
                            "measure the training data", where="data.val_path",
                            fix="give held-out files, or data.val_fraction to hold out part of data.path")
    kto = objective == "kto"
    how = dict(records_of=unpaired_pieces, group=1) if kto else {}

    def read(spec: str):
        got = read_units(resolve_files(spec), data_cfg, tokenizer, spec, **how)
        seqs = [s for u in got.units for s in ([u[0]] if kto else u)]
        check_token_ids(max(int(ids.max()) for ids, _ in seqs), vocab_size, spec)
        return got

    def make(units: list, where: str, ordered: bool = False) -> PreferencePairs:
        ds = (UnpairedExamples([u[0] for u in units], [u[1] for u in units], data_cfg.seq_len, data_cfg.seed, where)
              if kto else PreferencePairs(units, data_cfg.seq_len, data_cfg.seed, where))
        ds.ordered = ordered
        return ds

    files = resolve_files(data_cfg.path)
    got = read(data_cfg.path)
    units, val = got.units, None
    if data_cfg.val_path:
        val = make(read(data_cfg.val_path).units, data_cfg.val_path, True)
    elif data_cfg.val_fraction > 0:
        units, held = holdout(units, data_cfg.val_fraction, data_cfg.seed)
        if kto and min(len(units), len(held)) < 2:  # each set's KL reference point reads another's completion
            raise ShardfitError(f"data.val_fraction={data_cfg.val_fraction} splits {len(units) + len(held)} KTO "
                                f"examples into {len(units)} to train on and {len(held)} held out; each needs 2 (an "
                                "example's KL sequence takes another's completion)", where="data.val_fraction",
                                fix="give a fraction that leaves 2 or more on each side, or data.val_path")
        val = make(held, f"{files[0]} (held out)", True)
    train = make(units, str(files[0]))
    cut, unit = train.truncation, train.unit
    what = "preference pairs"
    if kto:
        good = int(train.labels.sum())
        what = f"KTO examples, {good:,} desirable and {len(units) - good:,} not"
    left = (f", {got.dropped:,} left out (no trained token within data.seq_len)" if got.dropped else "")
    held = f" (+{val.num_windows:,} for validation)" if val is not None else ""
    train.header = tuple(n for n in [
        f"data: {what} ({data_cfg.path}), chat template: {got.template_text}; {len(units):,} {unit}{held}"
        f"{left}, {cut.kept:,} tokens after truncation at data.seq_len={data_cfg.seq_len} ({cut.describe()})",
        cut.warning(data_cfg.seq_len)] if n)
    train.info = {"format": "unpaired" if kto else "preference", "template": got.template}
    return train, val, tokenizer


def holdout(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    """(training, validation) examples: a seeded `fraction` of them held out, each list in file order."""
    n = len(examples)
    n_val = max(1, int(round(n * fraction)))
    if n_val >= n:
        raise ShardfitError(f"data.val_fraction={fraction} leaves no training example of {n}",
                            where="data.val_fraction", fix="use a smaller fraction")
    val = set(np.random.default_rng([seed, 7919]).permutation(n)[:n_val].tolist())
    return ([e for i, e in enumerate(examples) if i not in val], [e for i, e in enumerate(examples) if i in val])


def same_files(a: str, b: str) -> bool:
    """Whether two data specs name the same files (or the same shard directory), however they are spelled."""
    def files(spec: str) -> set[str]:
        if not spec or shard_dir_state(spec) is not None:
            return {os.path.realpath(spec)} if spec else set()
        try:
            return {os.path.realpath(f) for f in resolve_files(spec)}
        except ShardfitError:
            return set()  # reported with its reason when the data set is read
    return bool(a) and bool(b) and files(a) == files(b) != set()


def overlap_notice(train: list[np.ndarray], val: list[np.ndarray], unit: str) -> str | None:
    """Refuse a validation set whose every item is also a training item (by a hash of its tokens); a notice with
    the count when some are; None when none are."""
    def digest(ids: np.ndarray) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()

    seen = {digest(ids) for ids in train}
    shared = sum(digest(ids) in seen for ids in val)
    if val and shared == len(val):
        raise ShardfitError(f"every one of the {len(val):,} validation {unit}s is also a training {unit}: the "
                            "validation loss would measure the training data", where="data.val_path",
                            fix="give held-out data, or data.val_fraction to hold out part of data.path")
    if shared:
        return (f"data.val_path: {shared:,} of {len(val):,} validation {unit}s are also in the training data "
                "(their loss is not held out)")
    return None
