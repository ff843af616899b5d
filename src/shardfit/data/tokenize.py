"""`shardfit tokenize`: text, JSON lines or Parquet into a token shard directory (data/token_shards.py holds the
format, the writer and the reader), over worker processes, resumable, with progress on stderr.

Inputs are cut into segments (a text file, a line-aligned byte range of a JSON-lines file, a Parquet file) grouped
into pieces of about `piece_bytes` of input; each worker process tokenizes whole pieces and writes them through
ShardWriter, which records each finished piece, so a re-run after a kill does only the rest.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np

from shardfit.data.token_shards import ShardWriter, encode_batches, join_documents, token_dtype, tokenizer_identity
from shardfit.errors import ShardfitError

# ---------------------------------------------------------------------------------------------------------------
# Planning: inputs -> segments -> pieces


def _jsonl_ranges(path: Path, size: int, target: int) -> list[tuple[int, int, int]]:
    """(start, end, first line) byte ranges of about `target` bytes, cut after a newline. Reads the file once to
    number the lines (bytes.count runs at memory speed; no JSON is parsed here)."""
    ranges, start, line = [], 0, 1
    with open(path, "rb") as f:
        while start < size:
            end = size
            if start + target < size:
                f.seek(start + target - 1)
                f.readline()  # to the end of the line that holds byte start+target-1
                end = f.tell()
            f.seek(start)
            newlines, left = 0, end - start
            while left:
                block = f.read(min(left, 16 << 20))
                newlines += block.count(b"\n")
                left -= len(block)
            ranges.append((start, end, line))
            start, line = end, line + newlines
    return ranges


def _parquet_ranges(path: Path, size: int, target: int) -> list[dict]:
    """Runs of consecutive row groups of about `target` bytes of the file each (a row group is the smallest unit
    Parquet reads), from the footer alone. Each segment's bytes are its share of the file by uncompressed size, so
    the progress line still adds up to the file's size."""
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # unreadable: one segment, and the reader names the file with the fix
        return [{"file": str(path), "kind": "parquet", "bytes": size}]
    sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
    total = max(1, sum(sizes))
    out: list[dict] = []
    first, row, acc = 0, 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc * size / total >= target or i == len(sizes) - 1:
            rows = sum(meta.row_group(g).num_rows for g in range(first, i + 1))
            out.append({"file": str(path), "kind": "parquet", "row_groups": [first, i + 1], "first_row": row,
                        "bytes": round(acc * size / total)})
            first, row, acc = i + 1, row + rows, 0
    return out


def plan_pieces(inputs: list[str], fmt: str, piece_bytes: int) -> list[dict]:
    """Consecutive segments grouped into pieces of about piece_bytes of input each, in the order tokenize_documents
    reads them (inputs in order, each resolved like data.path)."""
    from shardfit.data.sources import _format, resolve_files

    segments = []
    for spec in inputs:
        for path in resolve_files(spec):
            kind, size = _format(path, fmt), path.stat().st_size
            if kind == "jsonl" and size > piece_bytes:
                segments += [{"file": str(path), "kind": kind, "start": a, "end": b, "first_line": line,
                              "bytes": b - a} for a, b, line in _jsonl_ranges(path, size, piece_bytes)]
            elif kind == "parquet" and size > piece_bytes:
                segments += _parquet_ranges(path, size, piece_bytes)
            else:  # a text file is one document; a small Parquet file one segment
                segments.append({"file": str(path), "kind": kind, "bytes": size})
    pieces: list[dict] = []
    for seg in segments:
        if not pieces or pieces[-1]["bytes"] >= piece_bytes:
            pieces.append({"index": len(pieces), "bytes": 0, "segments": []})
        pieces[-1]["segments"].append(seg)
        pieces[-1]["bytes"] += seg["bytes"]
    return pieces


def check_out_apart(inputs: list[str], out: str) -> None:
    """Refuse an --out inside an input directory (or among a glob's files): its shards (.json among them) would be
    read back as input by the next run of the same command."""
    from shardfit.data.sources import resolve_files

    target = Path(out).resolve()
    for spec in inputs:
        inside = Path(spec).is_dir() and target.is_relative_to(Path(spec).resolve())
        if inside or any(p.resolve().is_relative_to(target) for p in resolve_files(spec)):
            raise ShardfitError(f"--out lies inside the input directory {spec}: the next run would read its shards "
                                "as input", where=out, fix="pick an --out directory outside the inputs")


def default_piece_bytes(total_bytes: int) -> int:
    """~64 pieces for a small corpus (work for every core), at most 64 MiB each: a worker holds one piece's tokens
    in memory (64M byte-tokens: 128 MB as uint16, plus the batch being encoded)."""
    return int(min(64 << 20, max(1 << 20, total_bytes // 64)))


def _segment_texts(segment: dict, field: str) -> Iterator[str]:
    from shardfit.data.sources import _read_jsonl, _read_parquet, _read_text

    path = Path(segment["file"])
    if segment["kind"] == "text":
        reader = _read_text(path)
    elif segment["kind"] == "jsonl":
        reader = _read_jsonl(path, field, segment.get("start", 0), segment.get("end"), segment.get("first_line", 1))
    else:
        groups = segment.get("row_groups")
        reader = _read_parquet(path, field, tuple(groups) if groups else None, segment.get("first_row", 0))
    for text, _where in reader:
        yield text


# ---------------------------------------------------------------------------------------------------------------
# `shardfit tokenize`: pieces over worker processes, progress on stderr

_WORKER: dict = {}


def _init_worker(out: str, plan: dict, tokenizer_spec: str, field: str, counters, quiet_tokenizers: bool) -> None:
    if quiet_tokenizers:  # N worker processes each with all-core Rust threads would oversubscribe the CPU
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from shardfit.data.tokenizer import build_tokenizer

    _WORKER.update(writer=ShardWriter.reopen(out, plan), tokenizer=build_tokenizer(tokenizer_spec), field=field,
                   plan=plan, counters=counters)


def _tokenize_piece(index: int) -> tuple[int, dict]:
    w = _WORKER
    piece, (docs, tokens, chars) = w["plan"]["pieces"][index], w["counters"]
    seen = [0]

    def texts():
        for seg in piece["segments"]:
            for text in _segment_texts(seg, w["field"]):
                seen[0] += len(text)
                yield text

    parts, counted = [], 0
    for batch in encode_batches(texts(), w["tokenizer"], np.dtype(w["plan"]["dtype"])):
        parts += batch
        with docs.get_lock(), tokens.get_lock(), chars.get_lock():  # one update per 1,024 documents
            docs.value += len(batch)
            tokens.value += sum(len(a) for a in batch)
            chars.value += seen[0] - counted
        counted = seen[0]
    counts = w["writer"].write_piece(index, *join_documents(parts, np.dtype(w["plan"]["dtype"])))
    with chars.get_lock():
        chars.value -= counted  # the parent now counts the piece's exact input bytes
    return index, counts


def _fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Progress(threading.Thread):
    """Documents, tokens, tokens/s and ETA on stderr, once a second (rewritten in place on a terminal)."""

    def __init__(self, counters, total_bytes: int, stream, interval: float = 1.0):
        super().__init__(daemon=True)
        self.counters, self.total_bytes, self.stream, self.interval = counters, total_bytes, stream, interval
        self.finished_bytes = self.skipped_bytes = self.skipped_tokens = self.skipped_docs = 0
        self.t0, self.stop_event = time.perf_counter(), threading.Event()
        self.tty = getattr(stream, "isatty", lambda: False)()

    def line(self) -> str:
        docs, tokens, chars = (c.value for c in self.counters)
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        done = self.finished_bytes + chars
        rate_bytes = max(done - self.skipped_bytes, 0) / elapsed
        left = max(self.total_bytes - done, 0)
        eta = _fmt_time(left / rate_bytes) if rate_bytes > 0 else "?"
        return (f"tokenize: {docs + self.skipped_docs:,} documents, {tokens + self.skipped_tokens:,} tokens, "
                f"{tokens / elapsed / 1e6:.2f}M tokens/s, {min(done / max(self.total_bytes, 1), 1):.0%} of input, "
                f"ETA {eta}")

    def run(self) -> None:
        while not self.stop_event.wait(self.interval):
            self.stream.write(("\r" + self.line()) if self.tty else self.line() + "\n")
            self.stream.flush()

    def stop(self, finished: bool) -> None:
        """The last line on success; on failure only a newline after an in-place line, so the error reads alone."""
        self.stop_event.set()
        if self.is_alive():
            self.join()
        if finished:
            self.stream.write(("\r" if self.tty else "") + self.line() +
                              f", {_fmt_time(time.perf_counter() - self.t0)} elapsed\n")
        elif self.tty:
            self.stream.write("\n")
        self.stream.flush()


def tokenize_to_shards(inputs: list[str], out: str, tokenizer_spec: str = "byte", fmt: str = "auto",
                       field: str = "text", workers: int | None = None, piece_bytes: int | None = None,
                       progress=None, stop_after: int | None = None) -> dict | None:
    """`shardfit tokenize`: the manifest of the finished directory. progress: a text stream (default stderr).
    stop_after=k (tests) returns None after k pieces, as if the run had been killed there."""
    import multiprocessing as mp

    from shardfit.data.sources import check_utf8_name, resolve_files
    from shardfit.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(tokenizer_spec)
    if not inputs:
        raise ShardfitError("no input files", where="shardfit tokenize", fix="give text, JSONL or Parquet inputs")
    check_utf8_name(out)
    check_out_apart(inputs, out)
    if piece_bytes is None:
        piece_bytes = default_piece_bytes(sum(p.stat().st_size for s in inputs for p in resolve_files(s)))
    pieces = plan_pieces(inputs, fmt, piece_bytes)
    for piece in pieces:  # an input rewritten since an interrupted run must not resume into it
        for seg in piece["segments"]:
            seg["mtime_ns"] = Path(seg["file"]).stat().st_mtime_ns
    writer = ShardWriter(out, {"inputs": list(inputs), "input_format": fmt, "text_field": field,
                               "tokenizer": tokenizer_identity(tokenizer_spec, tokenizer),
                               "dtype": token_dtype(tokenizer.vocab_size).name, "pieces": pieces})
    if writer.complete:
        return writer.finish()
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    # fork where there is one: a spawned worker re-imports the parent's main module (the CLI's imports, torch
    # among them when the caller loaded it: ~3 s a worker on a 2-core box). Forking is safe here: the executor
    # forks every worker at the first submit, before the progress thread starts, and the parent has built its
    # tokenizer but never run it (no Rust thread pool).
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    counters = tuple(ctx.Value("q", 0) for _ in range(3))
    bar = _Progress(counters, sum(p["bytes"] for p in pieces), progress or sys.stderr)
    todo = []
    for p in pieces:
        counts = writer.done(p["index"])
        if counts is None:
            todo.append(p["index"])
        else:
            bar.finished_bytes += p["bytes"]
            bar.skipped_bytes += p["bytes"]
            bar.skipped_tokens += counts["tokens"]
            bar.skipped_docs += counts["documents"]
    init = (str(writer.out), writer.plan, tokenizer_spec, field, counters, workers > 1)
    ok, pool = False, None
    try:
        if workers == 1 or len(todo) <= 1:
            _init_worker(*init[:-1], False)
            results: Iterable = map(_tokenize_piece, todo)
        else:
            # An executor, not multiprocessing.Pool: a worker that dies (killed, out of memory) fails the run with
            # BrokenProcessPool instead of being replaced forever.
            pool = ProcessPoolExecutor(min(workers, len(todo)), mp_context=ctx, initializer=_init_worker,
                                       initargs=init)
            results = (f.result() for f in as_completed([pool.submit(_tokenize_piece, i) for i in todo]))
        bar.start()
        try:
            for finished, (index, _counts) in enumerate(results, 1):
                bar.finished_bytes += pieces[index]["bytes"]
                if stop_after is not None and finished >= stop_after:
                    return None
            ok = True
        except BrokenProcessPool:  # a worker killed (the OOM killer, a signal): the finished pieces are kept
            raise ShardfitError("a worker process died (killed by a signal or the out-of-memory killer)",
                                where="shardfit tokenize", fix="re-run the same command: it resumes after the "
                                "pieces already finished (with fewer --workers if memory ran out)") from None
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    finally:
        bar.stop(ok)
    return writer.finish()
