"""`shardfit tokenize` shards: the same stream as on-the-fly tokenization, memory-mapped, resumable, refused when
unfinished, and training batches identical to those built from the text."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.data.batching import budget_batches
from shardfit.data.build import build_datasets
from shardfit.data.packing import tokenize_documents
from shardfit.data.token_shards import TokenStream, open_token_shards, shard_dir_state, token_dtype
from shardfit.data.tokenize import tokenize_to_shards
from shardfit.data.tokenizer import ByteTokenizer
from shardfit.errors import ShardfitError

SMALL_PIECES = 4096  # bytes of input per piece: a few KB of test data make several pieces and split JSONL files


def _corpus(root, n_docs=400, seed=0):
    """A directory of JSON lines (two files, one with blank lines and an empty text) and text files in a subfolder."""
    rng = np.random.default_rng(seed)
    words = ["shard", "token", "window", "rank", "é", "日本", "step", "loss", "\n"]
    (root / "sub").mkdir(parents=True)
    for name, count in (("a.jsonl", n_docs), ("b.jsonl", n_docs // 4)):
        with open(root / name, "w", encoding="utf-8") as f:
            for i in range(count):
                text = "" if i == 3 else " ".join(rng.choice(words, int(rng.integers(1, 60))))
                f.write(json.dumps({"text": f"{name} {text}" if text else "", "id": i}) + "\n")
                if i % 50 == 7:
                    f.write("\n")
    for i in range(3):
        (root / "sub" / f"t{i}.txt").write_text(f"text file {i}\n" + "line of text\n" * (i * 40), encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return _corpus(tmp_path_factory.mktemp("corpus"))


def _shards(inputs, out, **kw):
    kw.setdefault("workers", 1)
    kw.setdefault("piece_bytes", SMALL_PIECES)
    return tokenize_to_shards([str(i) for i in inputs], str(out), progress=io.StringIO(), **kw)


@pytest.mark.parametrize("which", ["a.jsonl", "sub/t2.txt", "."])
def test_shards_hold_the_on_the_fly_stream_and_document_starts(corpus, tmp_path, which):
    spec = corpus / which
    manifest = _shards([spec], tmp_path / "out")
    tokens, starts, _ = open_token_shards(str(tmp_path / "out"), "byte", ByteTokenizer())
    want_tokens, want_starts = tokenize_documents(str(spec), "auto", "text", ByteTokenizer())
    assert tokens.dtype == np.uint16 and starts.dtype == np.int64
    assert np.array_equal(tokens[0:len(tokens)], want_tokens) and np.array_equal(starts, want_starts)
    assert manifest["tokens"] == len(want_tokens) and manifest["documents"] == len(want_starts)
    if which == "a.jsonl":  # one file, split at line boundaries into several pieces
        assert len(manifest["pieces"]) > 3 and all(isinstance(a, np.memmap) for a in tokens.arrays)
    assert not list((tmp_path / "out").glob("*.tmp")) and not list((tmp_path / "out").glob("done_*"))
    assert token_dtype(259) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(128256) == np.uint32


def test_token_stream_slices_across_pieces():
    parts = [np.arange(0, 5), np.arange(5, 5), np.arange(5, 12), np.arange(12, 13)]
    stream, whole = TokenStream(parts), np.arange(13)
    for a in range(14):
        for b in range(a, 14):
            assert np.array_equal(stream[a:b], whole[a:b])
    assert len(stream) == 13 and np.shares_memory(stream[6:9], parts[2])  # inside a piece: a view


def _cfg(path, *extra):
    return load_config(None, [f"--data.path={path}", "--data.seq_len=32", "--data.val_fraction=0.1",
                              "--data.document_mask=true", *extra]).data


def test_training_batches_from_shards_equal_those_from_text(corpus, tmp_path):
    _shards([corpus], tmp_path / "out")
    text_train, text_val, _ = build_datasets(_cfg(corpus), 259)
    shard_train, shard_val, _ = build_datasets(_cfg(tmp_path / "out"), 259)
    assert isinstance(shard_train.tokens, TokenStream)  # mapped, not loaded
    assert (shard_train.num_windows, shard_val.num_windows) == (text_train.num_windows, text_val.num_windows)

    def same(x, y):
        return all(torch.equal(getattr(a, f), getattr(b, f)) for a, b in zip(x, y)
                   for f in ("input_ids", "labels", "position_ids"))

    epoch = text_train.num_windows // 8
    for step in [*range(6), epoch + 1, 3 * epoch]:  # the first steps, the next epoch, a resumed run's step
        for rank in (0, 1):
            assert same(text_train.step_batches(step, 8, 2, rank, 2), shard_train.step_batches(step, 8, 2, rank, 2))
    assert any(mb.position_ids is not None for mb in shard_train.step_batches(0, 8, 8, 0, 1))  # documents inside
    for k in range(text_val.num_windows):  # the hold-out: the same windows, in order
        assert all(np.array_equal(a, b) for a, b in zip(text_val.row(k)[:3], shard_val.row(k)[:3]))
    assert same(list(budget_batches(text_train, 16, 8, 64, 0, 1)), list(budget_batches(shard_train, 16, 8, 64, 0, 1)))


def test_interrupted_tokenize_resumes_to_the_same_shards(corpus, tmp_path):
    out, ref = tmp_path / "out", tmp_path / "ref"
    _shards([corpus], ref)
    assert _shards([corpus], out, stop_after=2) is None  # killed after two pieces
    assert shard_dir_state(str(out)) == "partial"
    with pytest.raises(ShardfitError, match="unfinished token shard directory") as e:
        build_datasets(_cfg(out), 259)
    assert "\n" not in str(e.value) and "re-run the same `shardfit tokenize`" in str(e.value)
    (out / "tokens_00002.npy.tmp").write_bytes(b"half a piece")  # the third piece was being written
    (out / "tokens_00003.npy").write_bytes(b"renamed, but its done_ file never written")
    first = (out / "tokens_00000.npy").stat().st_mtime_ns
    manifest = _shards([corpus], out)
    assert (out / "tokens_00000.npy").stat().st_mtime_ns == first  # the finished piece was kept, not redone
    assert manifest == json.loads((ref / "manifest.json").read_text())
    for f in sorted(p.name for p in ref.iterdir()):
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert _shards([corpus], out) == manifest  # a finished directory: nothing to do
    with pytest.raises(ShardfitError, match="other inputs or options"):
        _shards([corpus / "a.jsonl"], out)


def test_bad_line_is_named_in_a_later_piece_and_a_fixed_input_resumes(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "x" * 100}) for i in range(200)]
    lines[150] = '{"text": broken'
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(ShardfitError, match=r"d\.jsonl:151: invalid JSON"):
        _shards([tmp_path / "d.jsonl"], out)
    lines[150] = json.dumps({"text": "fixed"})
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    _shards([tmp_path / "d.jsonl"], out)  # the same command after the fix: the plan follows the new file
    tokens, _, _ = open_token_shards(str(out), "byte", ByteTokenizer())
    assert np.array_equal(tokens[0:len(tokens)], tokenize_documents(str(tmp_path / "d.jsonl"), "auto", "text",
                                                                    ByteTokenizer())[0])


def test_refusals_are_one_line(corpus, tmp_path, capsys):
    out = tmp_path / "out"
    _shards([corpus / "a.jsonl"], out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer"] = {"spec": "llama/tokenizer.json", "kind": "tokenizer.json", "sha256": "0" * 64,
                             "vocab_size": 128256, "eos_id": 128001}
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardfitError, match="made with tokenizer 'llama/tokenizer.json', but data.tokenizer is "
                                            "'byte'.*--data.tokenizer=llama/tokenizer.json"):
        build_datasets(_cfg(out), 259)
    (out / "tokens_00001.npy").write_bytes((out / "tokens_00001.npy").read_bytes()[:200])  # truncated
    (out / "manifest.json").unlink()
    (out / "manifest.json").write_text(json.dumps({**manifest, "tokenizer": json.loads(
        (out / "plan.json").read_text())["tokenizer"]}))
    with pytest.raises(ShardfitError, match="tokens_00001.npy"):
        build_datasets(_cfg(out), 259)
    with pytest.raises(ShardfitError, match="pretraining token stream"):
        build_datasets(_cfg(out, "--data.mode=sft"), 259)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.md").write_text("mine")
    assert main(["tokenize", str(corpus / "a.jsonl"), "--out", str(tmp_path / "other"), "--workers=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardfit: error: {tmp_path / 'other'}: --out directory is not empty and holds no token shards;"
                   " fix: pick a new or empty --out directory"]


def test_parallel_workers_and_progress(corpus, tmp_path):
    log = io.StringIO()
    manifest = tokenize_to_shards([str(corpus)], str(tmp_path / "out"), workers=2, piece_bytes=SMALL_PIECES,
                                  progress=log)
    assert manifest == _shards([corpus], tmp_path / "ref")
    last = log.getvalue().strip().splitlines()[-1]
    assert f"{manifest['documents']:,} documents, {manifest['tokens']:,} tokens" in last
    assert "tokens/s" in last and "100% of input" in last and "ETA" in last


def test_train_runs_on_a_shard_directory(corpus, tmp_path, capsys):
    assert main(["tokenize", str(corpus), "--out", str(tmp_path / "shards"), "--workers", "1"]) == 0
    assert "train with --data.path=" in capsys.readouterr().out
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "shardfit", "train", "--train.device=cpu", "--model.dim=32",
                        "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
                        "--data.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2", "--train.steps=2",
                        "--logging.log_every=1", f"--data.path={tmp_path / 'shards'}",
                        f"--logging.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr
    tokens = json.loads((tmp_path / "shards" / "manifest.json").read_text())["tokens"]
    assert f"{tokens:,} tokens of data" in p.stdout and "step 2/2" in p.stdout


def test_parquet_and_a_tokenizer_json_give_the_on_the_fly_stream(corpus, tmp_path):
    """The writer's other input and tokenizer kinds: Parquet rows (a file of several row groups, cut into pieces of
    whole row groups) and a Hugging Face tokenizer.json (uint16 ids)."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from shardfit.data.tokenizer import build_tokenizer

    texts = [json.loads(line)["text"] for line in (corpus / "a.jsonl").read_text(encoding="utf-8").splitlines()
             if line.strip()]
    pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet", row_group_size=40)
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|eot|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.decoder = decoders.ByteLevel()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tk.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    spec = str(tok_dir / "tokenizer.json")
    _shards([tmp_path / "docs.parquet"], tmp_path / "out", tokenizer_spec=spec)
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert len(plan["pieces"]) > 2 and all("row_groups" in s for p in plan["pieces"] for s in p["segments"])
    tokens, starts, _ = open_token_shards(str(tmp_path / "out"), spec, build_tokenizer(spec))
    want_tokens, want_starts = tokenize_documents(str(tmp_path / "docs.parquet"), "auto", "text",
                                                  build_tokenizer(spec))
    assert len(starts) == len([t for t in texts if t]) and tokens.dtype == np.uint16
    assert np.array_equal(tokens[0:len(tokens)], want_tokens) and np.array_equal(starts, want_starts)
