"""Read documents from text, JSON lines and Parquet files, naming the file and line of anything unreadable."""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from shardfit.errors import ShardfitError
from shardfit.fsutil import HUB_ID

_EXT = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


def embedded_corpus() -> list[tuple[str, str]]:
    """The corpus shipped in the package: (text, name) per document."""
    root = resources.files("shardfit.data") / "corpus"
    docs = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            # Paragraphs are the documents: EOS between them teaches the model where text ends.
            for para in entry.read_text(encoding="utf-8").split("\n\n"):
                if para.strip():
                    docs.append((para.strip(), entry.name))
    return docs


def resolve_files(spec: str) -> list[Path]:
    """A file, a directory (every data file below it) or a glob, in sorted order; one line when it names nothing
    readable: a missing path (or one through a file, as if it were a directory), a glob that matches no file, a
    directory without data files, only empty files."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _EXT)
        if not files:
            raise ShardfitError("directory holds no .txt, .jsonl or .parquet files", where=spec,
                                fix="point data.path at the data files")
    elif glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec, recursive=True) if Path(p).is_file())
        if not files:
            raise ShardfitError("the glob matches no file", where=spec, fix="check data.path")
    else:
        parent = next((p for p in path.parents if p.is_file()), None)
        if parent is not None:
            raise ShardfitError(f"{parent} is a file, not a directory", where=spec, fix="check data.path")
        if HUB_ID.fullmatch(spec) and path.suffix.lower() not in _EXT and not path.parent.is_dir():
            raise ShardfitError(f"no such file or directory, and '{spec}' (a Hugging Face Hub dataset id?) is not "
                                "downloaded: shardfit reads local files only", where=spec,
                                fix=f"download it first: hf download {spec} --repo-type dataset --local-dir "
                                    f"{path.name}, then give data.path the files of the split to train on (a "
                                    f"file, directory or glob under {path.name}/)")
        raise ShardfitError("no such file or directory", where=spec, fix="check data.path")
    for p in files:
        check_utf8_name(p)
    if all(_size(p) == 0 for p in files):
        raise ShardfitError("is empty (0 bytes)" if len(files) == 1 else f"all {len(files)} files are empty",
                            where=str(files[0]) if len(files) == 1 else spec, fix="point data.path at the data")
    return files


def check_utf8_name(path: str | Path) -> None:
    """Refuse a path whose name is not valid UTF-8 (Python holds its bytes as lone surrogates, which every text it is
    written into -- a message, plan.json, a terminal -- fails to encode), naming it with the bytes escaped."""
    text = str(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise ShardfitError("the file name is not valid UTF-8", where=shown,
                            fix="rename it (e.g. convmv -f latin1 -t utf8), or move it out of the inputs") from None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1  # the reader names the file and the reason


def open_data(path: Path):
    """`open(path, "rb")`, or one line naming the file and why it cannot be read (permission, a directory...)."""
    try:
        return open(path, "rb")
    except OSError as e:
        raise ShardfitError(f"cannot read the file ({e.strerror or e})", where=str(path),
                            fix="check its permissions, or leave it out of data.path") from None


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): json.loads accepts a lone one, which then fails whoever
# encodes the text (every tokenizer). Lines without one (nearly all) skip the check.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def parse_json_line(raw: bytes, where: str) -> object:
    """One JSON-lines line as its object, or one line naming file:line and the fix: invalid UTF-8, invalid JSON, or a
    lone UTF-16 surrogate escape such as \\ud800 (valid JSON syntax, but no text: no tokenizer can encode it)."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ShardfitError(f"line is not valid UTF-8 (byte {e.start})", where=where,
                            fix="re-encode the file as UTF-8 or remove the line") from None
    except json.JSONDecodeError as e:
        raise ShardfitError(f"invalid JSON ({e.msg} at column {e.colno})", where=where,
                            fix="one JSON object per line") from None
    except RecursionError:
        raise ShardfitError("JSON nested too deeply", where=where, fix="one flat JSON object per line") from None
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ShardfitError(f"a lone UTF-16 surrogate escape (\\u{ord(e.object[e.start]):04x}) is not text",
                                where=where, fix="write the character itself or a valid surrogate pair, or remove "
                                                 "the line") from None
    return obj


def _format(path: Path, fmt: str, unknown: str | None = None) -> str:
    """The file format: fmt (data.file_format) unless auto, else from the extension; unknown: the format of a file
    with any other extension (text when data.format=text asks for documents), else an error."""
    if fmt != "auto":
        return fmt
    kind = _EXT.get(path.suffix.lower(), unknown)
    if kind is None:
        raise ShardfitError(f"cannot tell the file format from the extension '{path.suffix}'", where=str(path),
                            fix="set data.file_format to text, jsonl or parquet")
    return kind


def read_records(path: Path, file_fmt: str = "auto", first_only: bool = False, what: str = "fine-tuning examples",
                 text_fix: str = "convert the file, or set data.format=text to pretrain on it"
                 ) -> Iterator[tuple[object, str]]:
    """The records of a fine-tuning file as (object, where): JSON lines ('file:line'), a JSON array such as
    Alpaca's alpaca_data.json ('file:record N'), or Parquet rows ('file:row N'). first_only: the first record
    alone; of a Parquet file its columns (keys, values None), read from the schema without decoding a row group.
    A text file is refused naming `what` the records are, with `text_fix`."""
    kind = _format(path, file_fmt)
    if kind == "text":
        raise ShardfitError(f"{what} are read from JSON lines, JSON or Parquet files, not text", where=str(path),
                            fix=text_fix)
    if kind == "parquet":
        yield from _parquet_records(path, first_only)
        return
    with open_data(path) as f:
        head = f.read(64).lstrip()
        f.seek(0)
        if head.startswith(b"["):  # one JSON array, not JSON lines
            where = f"{path}:1"
            records = parse_json_line(f.read(), where)
            if not isinstance(records, list):  # a list of lists would be JSON lines of lists: refused per record
                raise ShardfitError("is not a JSON array of records", where=where, fix="one JSON object per line")
            for i, obj in enumerate(records[:1] if first_only else records, 1):
                yield obj, f"{path}:record {i}"
            return
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield parse_json_line(raw, f"{path}:{lineno}"), f"{path}:{lineno}"
                if first_only:
                    return


def _parquet_records(path: Path, first_only: bool) -> Iterator[tuple[dict, str]]:
    pf = _parquet_file(path)
    if first_only:
        yield dict.fromkeys(pf.schema_arrow.names), f"{path}:row 1"
        return
    row = 0
    for batch in pf.iter_batches():
        for obj in batch.to_pylist():
            row += 1
            yield obj, f"{path}:row {row}"


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ShardfitError("reading Parquet needs pyarrow", where=str(path),
                            fix="pip install 'shardfit[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends for corrupt files
        raise ShardfitError(f"not a readable Parquet file ({e})", where=str(path), fix="check the file") from None


def _read_text(path: Path) -> Iterator[tuple[str, str]]:
    """One document per file; decoded line by line so an error can name the line."""
    lines = []
    with open_data(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise ShardfitError(f"line is not valid UTF-8 (byte {e.start})", where=f"{path}:{lineno}",
                                    fix="re-encode the file as UTF-8 or remove the line") from None
    yield "".join(lines), str(path)


def _read_jsonl(path: Path, field: str, start: int = 0, end: int | None = None,
                first_line: int = 1) -> Iterator[tuple[str, str]]:
    """The lines that start in bytes [start, end) (`shardfit tokenize` splits large files at line boundaries);
    first_line is the number of the line at byte `start`, so errors still name the file's own line."""
    with open_data(path) as f:
        f.seek(start)
        pos = start
        for lineno, raw in enumerate(f, first_line):
            if end is not None and pos >= end:
                return
            pos += len(raw)
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            obj = parse_json_line(raw, where)
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(sorted(obj)) if isinstance(obj, dict) else type(obj).__name__
                raise ShardfitError(f"no '{field}' field (found: {keys})", where=where,
                                    fix="set data.text_field to the key that holds the text, or data.format to the "
                                        "layout of fine-tuning records (messages, sharegpt, alpaca, "
                                        "prompt_completion)")
            if not isinstance(obj[field], str):
                raise ShardfitError(f"'{field}' is {type(obj[field]).__name__}, not a string", where=where,
                                    fix="store the text as a JSON string")
            yield obj[field], where


def _read_parquet(path: Path, field: str, row_groups: tuple[int, int] | None = None,
                  first_row: int = 0) -> Iterator[tuple[str, str]]:
    """Rows of the text column; with row_groups=(a, b) only row groups a..b-1, whose first row is number
    first_row + 1 of the file (error messages name the file's own row)."""
    pf = _parquet_file(path)
    names = pf.schema_arrow.names
    if field not in names:
        raise ShardfitError(f"no column '{field}' (columns: {', '.join(names)})", where=str(path),
                            fix="set data.text_field to the column that holds the text")
    row = first_row
    groups = list(range(*row_groups)) if row_groups is not None else None
    for batch in pf.iter_batches(columns=[field], row_groups=groups):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                continue
            if not isinstance(value, str):
                raise ShardfitError(f"column '{field}' holds {type(value).__name__}, not text",
                                    where=f"{path}:row {row}",
                                    fix="point data.text_field at a string column")
            yield value, f"{path}:row {row}"


def read_documents(spec: str, fmt: str = "auto", field: str = "text",
                   unknown: str | None = None) -> Iterator[tuple[str, str]]:
    """(text, where) for every document; where is 'file:line' for error messages. fmt: the file format (auto: by
    extension; unknown: the format of other extensions, else they are refused)."""
    if not spec:
        yield from embedded_corpus()
        return
    for path in resolve_files(spec):
        kind = _format(path, fmt, unknown)
        if kind == "text":
            yield from _read_text(path)
        elif kind == "jsonl":
            yield from _read_jsonl(path, field)
        else:
            yield from _read_parquet(path, field)
