import json

import pytest

from shardfit.data import read_documents, tokenize_corpus
from shardfit.data.tokenizer import ByteTokenizer
from shardfit.errors import ShardfitError


def test_embedded_corpus_is_shipped():
    docs = list(read_documents(""))
    assert len(docs) > 20 and sum(len(t) for t, _ in docs) > 10_000


def test_reads_text_jsonl_parquet_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("first file\nline two\n")
    lines = [json.dumps({"text": "json doc", "id": 1}), "", json.dumps({"text": "é"})]
    (tmp_path / "b.jsonl").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": ["pq one", None, "pq two"]}), tmp_path / "c.parquet")
    docs = [t for t, _ in read_documents(str(tmp_path / "a.txt"))]
    assert docs == ["first file\nline two\n"]
    assert [t for t, _ in read_documents(str(tmp_path / "b.jsonl"))] == ["json doc", "é"]
    assert [t for t, _ in read_documents(str(tmp_path / "c.parquet"), field="content")] == ["pq one", "pq two"]
    assert len(list(read_documents(str(tmp_path / "*.txt")))) == 1
    with pytest.raises(ShardfitError):  # the directory mixes a parquet file whose column is not 'text'
        list(read_documents(str(tmp_path)))


@pytest.mark.parametrize("name, content, field, needle", [
    ("bad.jsonl", b'{"text": "ok"}\n{"text": broken}\n', "text", "bad.jsonl:2: invalid JSON"),
    ("bad.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', "text", "bad.jsonl:2: no 'text' field (found: body)"),
    ("bad.jsonl", b'{"text": 5}\n', "text", "bad.jsonl:1: 'text' is int, not a string"),
    ("bad.txt", b"fine\nfine\n\xff\xfe broken\n", "text", "bad.txt:3: line is not valid UTF-8"),
    ("bad.jsonl", b'{"text": "ok"}\n\xff\n', "text", "bad.jsonl:2: line is not valid UTF-8"),
    ("x.bin", b"data", "text", "cannot tell the file format"),
])
def test_bad_files_name_file_and_line(tmp_path, name, content, field, needle):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ShardfitError) as e:
        list(read_documents(str(tmp_path / name), field=field))
    assert needle in str(e.value) and "fix:" in str(e.value)


def test_wrong_parquet_column_and_missing_paths(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ShardfitError, match=r"c.parquet: no column 'text' \(columns: body\)"):
        list(read_documents(str(tmp_path / "c.parquet")))
    with pytest.raises(ShardfitError, match="no such file"):
        list(read_documents(str(tmp_path / "nope.txt")))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ShardfitError, match="holds no text"):
        tokenize_corpus(str(tmp_path / "empty.jsonl"), "auto", "text", ByteTokenizer())


def test_a_hub_dataset_id_gets_the_download_command(tmp_path, monkeypatch):
    """data.path=ORG/NAME that is no local path: the hf download command, as model.path's Hub ids get; a missing
    file with a data extension, or under a directory that exists, is a missing file."""
    from shardfit.data.sources import resolve_files

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ShardfitError) as e:
        resolve_files("HuggingFaceH4/ultrachat_200k")
    assert str(e.value) == (
        "HuggingFaceH4/ultrachat_200k: no such file or directory, and 'HuggingFaceH4/ultrachat_200k' (a Hugging Face "
        "Hub dataset id?) is not downloaded: shardfit reads local files only; fix: download it first: hf download "
        "HuggingFaceH4/ultrachat_200k --repo-type dataset --local-dir ultrachat_200k, then give data.path the files "
        "of the split to train on (a file, directory or glob under ultrachat_200k/)")
    (tmp_path / "data").mkdir()
    for missing in ("chats/train.jsonl", "data/train"):
        with pytest.raises(ShardfitError) as e:
            resolve_files(missing)
        assert str(e.value) == f"{missing}: no such file or directory; fix: check data.path"
