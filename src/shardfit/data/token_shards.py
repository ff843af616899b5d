"""Token shards: a corpus tokenized once (`shardfit tokenize`), then memory-mapped by every training rank.
The directory layout, file by file: docs/data.md, "Token shards".

Every file is written under a `.tmp` name and renamed, so each is complete or absent: plan.json first (a re-run
checks it and resumes), then per piece tokens_NNNNN.npy (uint16 when the vocabulary fits, else uint32; EOS after
each document), starts_NNNNN.npy (document starts in the piece, int64) and done_NNNNN.json (a re-run skips the
piece), then doc_starts.npy (every document's start in the whole stream), and manifest.json last: a directory
without one is refused; its max_id is checked against the model's vocabulary.
Invariant: the pieces laid end to end are the stream that packing.tokenize_documents makes from the same files
(same documents, same order, same EOS), though they are tokenized in parallel.
Reading: the pieces are never joined; TokenStream maps each one and answers a slice of the logical concatenation
with a view into one map, copying only a window that straddles two pieces (seq_len + 1 tokens). Ids are checked
against the model's vocabulary when the directory is opened (each piece's max_id in the manifest) and again in every
window read (its max: seq_len + 1 tokens), so a piece changed after its manifest was written is one line naming it,
not an index error in the embedding. Writing: a full disk is one line naming the directory and the space the write
needed (DiskFull); every file is written with plain writes (a memory map would die of SIGBUS on a full disk).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from shardfit.errors import ShardfitError
from shardfit.fsutil import full_disk_error, write_atomic

FORMAT = "shardfit.tokens/1"
MANIFEST, PLAN = "manifest.json", "plan.json"
UINT16_VOCAB = 1 << 16  # ids 0..65535 fit uint16: half the disk and page cache of uint32
ENCODE_BATCH = 1024  # documents per tokenizer call (HF tokenizers parallelise inside a batch)


def encode_batches(texts: Iterable[str], tokenizer, dtype=np.uint32) -> Iterator[list[np.ndarray]]:
    """Each non-empty document as token ids followed by EOS (when the tokenizer has one), ENCODE_BATCH documents at
    a time. The one place that decides how text becomes the token stream: tokenize_documents (on the fly) and the
    shard writer both use it, so shards and on-the-fly tokenization cannot drift apart."""
    eos = tokenizer.eos_id
    batch: list[str] = []

    def encode() -> list[np.ndarray]:
        out = []
        for ids in tokenizer.encode_batch(batch):
            # Filled straight in the target dtype (no list copy for the EOS, no uint32 then astype): numpy refuses
            # a Python int that does not fit, so a tokenizer whose ids exceed its vocab_size cannot wrap silently.
            arr = np.empty(len(ids) + (eos is not None), dtype)
            try:
                arr[:len(ids)] = ids
            except OverflowError as e:
                raise ShardfitError(f"{e}: a token id does not fit {np.dtype(dtype).name}", where="tokenizer",
                                    fix="the tokenizer's vocab_size is below its largest id; check it") from None
            if eos is not None:
                arr[-1] = eos
            out.append(arr)
        batch.clear()
        return out

    for text in texts:
        if text:
            batch.append(text)
        if len(batch) >= ENCODE_BATCH:
            yield encode()
    if batch:
        yield encode()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32)


def tokenizer_identity(spec: str, tokenizer) -> dict:
    """What decides the ids: the byte tokenizer, or the tokenizer.json's bytes and the EOS id. The spec (a path)
    is kept for messages only: the same file elsewhere is the same tokenizer."""
    if spec == "byte":
        return {"spec": "byte", "kind": "byte", "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}
    path = Path(spec)
    path = path / "tokenizer.json" if path.is_dir() else path
    return {"spec": str(spec), "kind": "tokenizer.json", "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}


# ---------------------------------------------------------------------------------------------------------------
# Reading a shard directory


def shard_dir_state(path: str) -> str | None:
    """'complete' (a manifest), 'partial' (tokenize's files but no manifest) or None (not a shard directory)."""
    d = Path(path) if path else None
    if d is None or not d.is_dir():
        return None
    if (d / MANIFEST).is_file():
        return "complete"
    if (d / PLAN).is_file() or any(d.glob("tokens_*.npy")) or any(d.glob("done_*.json")):
        return "partial"
    return None


class TokenStream:
    """The pieces' token arrays as one logical 1-D stream: len() and slices, like the array it stands for. With
    vocab_size, every slice is checked against it, a bad id named with its piece's file (`names`)."""

    def __init__(self, arrays: list[np.ndarray], names: list[str] | None = None, vocab_size: int | None = None):
        kept = [i for i, a in enumerate(arrays) if len(a)]
        self.arrays = [arrays[i] for i in kept]
        self.names = [names[i] for i in kept] if names is not None else [f"piece {i}" for i in kept]
        self.vocab_size = vocab_size
        self.ends = np.cumsum([len(a) for a in self.arrays], dtype=np.int64)  # a few entries: one per piece
        self.dtype = self.arrays[0].dtype if self.arrays else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenStream takes contiguous slices only")
        a, b, _ = key.indices(len(self))
        if b <= a:
            return np.zeros(0, self.dtype)
        i = int(np.searchsorted(self.ends, a, side="right"))
        parts = []
        while a < b:
            first = int(self.ends[i - 1]) if i else 0
            take = min(b, int(self.ends[i])) - a
            parts.append(np.asarray(self.arrays[i][a - first:a - first + take]))  # a view, not a copy
            if self.vocab_size is not None:
                check_token_ids(int(parts[-1].max()), self.vocab_size, self.names[i],
                                fix=f"{RETOKENIZE} with the model's tokenizer")
            a += take
            i += 1
        # Within one piece: the view itself. Across a boundary: only these few tokens are copied.
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _load_npy(path: Path, dtype, length: int, where: str | None = None) -> np.ndarray:
    """Memory-map one array and check it against the manifest (a stat and a header read: no token is touched)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ShardfitError("missing: the manifest lists it", where=str(path), fix=RETOKENIZE) from None
    except (OSError, ValueError) as e:  # a directory, unreadable, a truncated header or body, not .npy
        raise ShardfitError(f"cannot map {path.name} ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                            where=str(path), fix=RETOKENIZE) from None
    if arr.ndim != 1 or arr.dtype != np.dtype(dtype) or len(arr) != length:
        raise ShardfitError(f"{path.name} holds {arr.dtype}[{len(arr)}], the manifest says {np.dtype(dtype)}"
                            f"[{length}]", where=str(path), fix=RETOKENIZE)
    return arr


RETOKENIZE = "re-run shardfit tokenize into an empty --out directory"
# What a manifest must hold to be opened: key -> type (bool is no int here), and each piece's keys.
_MANIFEST_KEYS = {"format": str, "tokenizer": dict, "dtype": str, "tokens": int, "documents": int, "pieces": list}
_PIECE_KEYS = {"index": int, "tokens": int}
SCAN_CHUNK = 1 << 24  # tokens per numpy max() when an older manifest lacks max_id: bounded memory, any corpus size


def _is(value, kind) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def check_manifest(manifest, where: str) -> None:
    """Every key open_token_shards reads, with its type, and the counts adding up: one line naming manifest.json."""
    def bad(what: str):
        raise ShardfitError(f"incomplete or corrupt manifest: {what}", where=where, fix=RETOKENIZE)

    if not isinstance(manifest, dict):
        bad(f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != FORMAT:
        raise ShardfitError(f"manifest format {manifest.get('format')!r}, expected {FORMAT!r}", where=where,
                            fix="re-run shardfit tokenize with this version of shardfit")
    for key, kind in _MANIFEST_KEYS.items():
        if not _is(manifest.get(key), kind):
            bad(f"'{key}' is {'missing' if key not in manifest else repr(manifest[key])[:40]}, not {kind.__name__}")
    if manifest["dtype"] not in ("uint16", "uint32"):
        bad(f"dtype {manifest['dtype']!r} is neither uint16 nor uint32")
    for i, piece in enumerate(manifest["pieces"]):
        if not isinstance(piece, dict) or not all(_is(piece.get(k), t) and piece[k] >= 0 for k, t in
                                                  _PIECE_KEYS.items()):
            bad(f"piece {i} lacks a non-negative index and token count")
    if sum(p["tokens"] for p in manifest["pieces"]) != manifest["tokens"] or min(manifest["tokens"],
                                                                                 manifest["documents"]) < 0:
        bad(f"the pieces' tokens do not add up to tokens={manifest['tokens']}")


def check_token_ids(max_id: int, vocab_size: int, where: str, fix: str | None = None) -> None:
    """Refuse a token id the model has no embedding row for (an index error on the GPU, mid-run, otherwise)."""
    if max_id >= vocab_size:
        raise ShardfitError(f"token id {max_id} is beyond the model's vocabulary (model.vocab_size={vocab_size})",
                            where=where, fix=fix or f"set model.vocab_size > {max_id}, or re-tokenize with the "
                                                    "model's tokenizer")


def max_token_id(arrays: Iterable[np.ndarray]) -> int:
    """The largest id of the arrays (-1 when empty), read SCAN_CHUNK tokens at a time."""
    best = -1
    for arr in arrays:
        for i in range(0, len(arr), SCAN_CHUNK):
            best = max(best, int(arr[i:i + SCAN_CHUNK].max()))
    return best


def _check_starts(starts: np.ndarray, tokens: int, where: str) -> None:
    """Document starts ascend from 0 and lie inside the stream (positions would be garbage otherwise); read in
    chunks of SCAN_CHUNK: 8 bytes a document."""
    if not len(starts):
        return
    if starts[0] != 0 or starts[-1] >= tokens:
        raise ShardfitError("document starts do not lie inside the token stream", where=where, fix=RETOKENIZE)
    for i in range(0, len(starts) - 1, SCAN_CHUNK):
        part = np.asarray(starts[i:i + SCAN_CHUNK + 1])
        if not np.all(part[1:] > part[:-1]):
            raise ShardfitError("document starts are not ascending", where=where, fix=RETOKENIZE)


def open_token_shards(path: str, tokenizer_spec: str, tokenizer,
                      vocab_size: int | None = None) -> tuple[TokenStream, np.ndarray, dict]:
    """(token stream, document starts, manifest) of a complete shard directory, memory-mapped: opening it reads
    the manifest and the .npy headers only, so start-up costs the same at 2 million or 2 billion tokens. With
    vocab_size, the ids are checked against it: the manifest's max_id, or for a manifest written before max_id
    existed a scan of the tokens (bounded memory, one pass)."""
    d = Path(path)
    if shard_dir_state(path) == "partial":
        raise ShardfitError("unfinished token shard directory (no manifest.json)", where=path,
                            fix="re-run the same `shardfit tokenize` command to finish it")
    where = str(d / MANIFEST)
    try:
        manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise ShardfitError(f"unreadable manifest.json ({e})", where=where, fix=RETOKENIZE) from None
    check_manifest(manifest, where)
    want, have = tokenizer_identity(tokenizer_spec, tokenizer), manifest["tokenizer"]
    if {k: v for k, v in want.items() if k != "spec"} != {k: v for k, v in have.items() if k != "spec"}:
        raise ShardfitError(f"the shards were made with tokenizer {have.get('spec')!r}, but data.tokenizer is "
                            f"{tokenizer_spec!r} (a different tokenizer)", where=path,
                            fix=f"set --data.tokenizer={have.get('spec')}, or re-tokenize with --tokenizer "
                                f"{tokenizer_spec}")
    pieces = [p for p in manifest["pieces"] if p["tokens"]]
    names = [str(d / f"tokens_{p['index']:05d}.npy") for p in pieces]
    arrays = [_load_npy(Path(n), manifest["dtype"], p["tokens"]) for n, p in zip(names, pieces)]
    starts = _load_npy(d / "doc_starts.npy", np.int64, manifest["documents"])
    _check_starts(starts, manifest["tokens"], str(d / "doc_starts.npy"))
    if vocab_size is not None:
        for name, p in zip(names, pieces):  # each piece's largest id, where the manifest records it
            if _is(p.get("max_id"), int):
                check_token_ids(p["max_id"], vocab_size, name)
        max_id = manifest.get("max_id")
        if not _is(max_id, int):
            max_id = max_token_id(arrays)
        check_token_ids(max_id, vocab_size, path)
    return TokenStream(arrays, names, vocab_size), starts, manifest


def join_documents(parts: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Documents (each with its EOS) laid end to end, and where each starts (int64): the stream's two arrays."""
    if not parts:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    starts = np.zeros(len(parts), np.int64)
    np.cumsum([len(p) for p in parts[:-1]], out=starts[1:])
    return np.concatenate(parts).astype(dtype, copy=False), starts


# ---------------------------------------------------------------------------------------------------------------
# Writing


def _save_npy(path: Path, arr: np.ndarray) -> None:
    """arr as path (.npy), whole or absent: header and data by plain writes under a .tmp name, then renamed (numpy's
    own writer loses a full disk's errno in a short fwrite)."""
    tmp = path.with_name(path.name + ".tmp")
    arr = np.ascontiguousarray(arr)
    try:
        with open(tmp, "wb") as f:
            np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
            f.write(memoryview(arr).cast("B"))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ShardWriter:
    """Writes pieces into `out` in any order, over any number of runs, then the global starts and the manifest.

    `plan` (inputs, options, tokenizer, dtype, pieces) is stored first. A piece's done_ file records a key of its
    definition (its segments, their sizes and mtimes, and the options), so a re-run reuses exactly the pieces whose
    input and options are unchanged and redoes the rest: after a kill, everything finished is kept; after an input
    was fixed (a bad line), only its pieces are redone. A complete directory (manifest) is never rewritten."""

    def __init__(self, out: str | Path, plan: dict):
        self.out, self.plan = Path(out), json.loads(json.dumps({"format": FORMAT, **plan}))  # as stored in JSON
        plan_text = json.dumps(self.plan, indent=1)
        state = shard_dir_state(str(self.out))
        self.complete = state == "complete"
        if self.complete:
            try:
                stored = json.loads((self.out / PLAN).read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                stored = None
            if stored != self.plan:
                raise ShardfitError("the directory holds finished token shards of other inputs or options",
                                    where=str(out), fix="pick a new --out directory (or delete this one)")
            return
        if self.out.exists() and not self.out.is_dir():
            raise ShardfitError("--out is a file, not a directory", where=str(out), fix="pick a new --out directory")
        if state is None and self.out.exists() and any(self.out.iterdir()):
            raise ShardfitError("--out directory is not empty and holds no token shards", where=str(out),
                                fix="pick a new or empty --out directory")
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a parent that is a file, no permission, a read-only file system
            raise ShardfitError(f"cannot create the directory ({e.strerror or e})", where=str(out),
                                fix="pick an --out directory you can write") from None
        with self.space("plan.json", len(plan_text)):
            write_atomic(self.out / PLAN, plan_text)

    @contextlib.contextmanager
    def space(self, what: str, needed: int):
        """A full disk while writing `what` (about `needed` bytes) as one line naming --out (DiskFull)."""
        try:
            yield
        except Exception as e:
            disk = full_disk_error(e, self.out, what, "free space there (or pick another --out), then re-run the same "
                                   "command: the pieces already written are kept", needed)
            if disk is None:
                raise
            raise disk from None

    @classmethod
    def reopen(cls, out: str | Path, plan: dict) -> ShardWriter:
        """In a worker process: the directory and plan its parent has already checked."""
        self = cls.__new__(cls)
        self.out, self.plan, self.complete = Path(out), plan, False
        return self

    def _name(self, kind: str, index: int, ext: str = "npy") -> Path:
        return self.out / f"{kind}_{index:05d}.{ext}"

    def _key(self, index: int) -> str:
        options = {k: v for k, v in self.plan.items() if k not in ("pieces", "inputs")}
        text = json.dumps({"piece": self.plan["pieces"][index], "options": options}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def done(self, index: int) -> dict | None:
        """The piece's counts if it was finished with today's definition (by this run or an earlier one)."""
        try:
            counts = json.loads(self._name("done", index, "json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return None  # absent, or (impossible with write_atomic) torn: the piece is redone
        return counts if counts.get("key") == self._key(index) else None

    def write_piece(self, index: int, tokens: np.ndarray, starts: np.ndarray) -> dict:
        """Both arrays under .tmp names, renamed, then the done_ file: a piece killed half-way has no done_ file."""
        if tokens.dtype != np.dtype(self.plan["dtype"]) or starts.dtype != np.int64:
            raise TypeError(f"piece arrays must be {self.plan['dtype']} and int64")
        self._name("done", index, "json").unlink(missing_ok=True)  # a stale piece of an older plan
        counts = {"tokens": int(len(tokens)), "documents": int(len(starts)), "key": self._key(index),
                  "max_id": int(tokens.max()) if len(tokens) else -1}  # checked against the model's vocabulary
        with self.space(f"token shard piece {index}", tokens.nbytes + starts.nbytes):
            _save_npy(self._name("tokens", index), tokens)
            _save_npy(self._name("starts", index), starts)
            write_atomic(self._name("done", index, "json"), json.dumps(counts))
        return counts

    def finish(self) -> dict:
        """doc_starts.npy (each piece's starts shifted by the tokens before it), then manifest.json, last."""
        if self.complete:
            return json.loads((self.out / MANIFEST).read_text(encoding="utf-8"))
        counts = [self.done(p["index"]) for p in self.plan["pieces"]]
        missing = [p["index"] for p, c in zip(self.plan["pieces"], counts) if c is None]
        if missing:
            raise RuntimeError(f"pieces {missing[:5]} are not finished")
        total_docs = sum(c["documents"] for c in counts)
        if not total_docs:
            raise ShardfitError("the inputs hold no text", where=", ".join(self.plan["inputs"]),
                                fix="check the inputs and --text-field")
        tmp = self.out / "doc_starts.npy.tmp"
        # Written piece by piece: memory stays one piece's starts, whatever the corpus.
        offset = 0
        with self.space("doc_starts.npy", 8 * total_docs):
            try:
                with open(tmp, "wb") as f:
                    np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False,
                                                             "shape": (total_docs,)})
                    for p, c in zip(self.plan["pieces"], counts):
                        local = np.load(self._name("starts", p["index"]), allow_pickle=False)
                        f.write(memoryview((local + offset).astype("<i8")).cast("B"))
                        offset += c["tokens"]
                os.replace(tmp, self.out / "doc_starts.npy")
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        for p, c in zip(self.plan["pieces"], counts):  # a piece finished by an older shardfit has no max_id
            if "max_id" not in c:
                c["max_id"] = max_token_id([np.load(self._name("tokens", p["index"]), mmap_mode="r")])
        manifest = {**self.plan, "tokens": offset, "documents": total_docs,
                    "max_id": max(c["max_id"] for c in counts),
                    "pieces": [{**p, "tokens": c["tokens"], "documents": c["documents"], "max_id": c["max_id"]}
                               for p, c in zip(self.plan["pieces"], counts)]}
        text = json.dumps(manifest, indent=1)
        with self.space("manifest.json", len(text)):
            write_atomic(self.out / MANIFEST, text)
        for p in self.plan["pieces"]:  # now redundant with doc_starts.npy and the manifest
            for leftover in (self._name("starts", p["index"]), self._name("done", p["index"], "json")):
                leftover.unlink(missing_ok=True)
        self.complete = True
        return manifest
