"""`shardfit tokenize` and the data path where they used to end in a traceback: a worker killed mid-run, a full disk,
token shards holding ids the model has no row for, a file name that is not valid UTF-8, an output directory inside
the input directory. Each is one line naming where, exit 2 from the CLI, and nothing half-written left behind."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardfit.data.tokenize as tokenize_module
from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.data.build import build_datasets
from shardfit.data.tokenize import tokenize_to_shards
from shardfit.errors import ShardfitError
from tests._disk import small_disk

ROOT = Path(__file__).resolve().parents[2]


def _text(d: Path, n: int = 40, size: int = 3000) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"doc{i:03d}.txt").write_text(f"document {i} " + "some words to tokenize " * (size // 23))
    return d


def _die_on_piece_2(index: int):
    if index == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
    return _real_piece(index)


_real_piece = tokenize_module._tokenize_piece


def test_a_killed_worker_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    src = _text(tmp_path / "in")
    monkeypatch.setattr(tokenize_module, "_tokenize_piece", _die_on_piece_2)  # forked workers inherit it
    args = ["tokenize", str(src), "--out", str(tmp_path / "out"), "--workers", "2"]
    monkeypatch.setattr(tokenize_module, "default_piece_bytes", lambda total: 8192)
    assert main(args) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("shardfit")]
    assert len(err) == 1 and err[0].startswith("shardfit: error: shardfit tokenize: a worker process died"), err
    assert "fix: re-run the same command" in err[0]
    monkeypatch.setattr(tokenize_module, "_tokenize_piece", _real_piece)
    assert main(args) == 0 and (tmp_path / "out" / "manifest.json").is_file()


def test_a_full_disk_is_one_line_nothing_half_written_and_resumes(tmp_path):
    src = _text(tmp_path / "in", n=60, size=20000)
    with small_disk(tmp_path / "disk", 4 << 20) as disk:
        out = disk.path / "shards"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        cmd = [sys.executable, "-m", "shardfit", "tokenize", str(src), "--out", str(out), "--workers", "2"]
        disk.fill(slack=256 << 10)
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300,
                           preexec_fn=disk.preexec(256 << 10))
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("shardfit")]
        assert r.returncode == 2 and len(errors) == 1, r.stderr
        assert errors[0].startswith(f"shardfit: error: {out}: could not write ") and "the disk is full (" in errors[0]
        assert "fix: free space" in errors[0] and "Traceback" not in r.stderr, errors[0]
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # complete files or none
        assert not (out / "manifest.json").exists()
        disk.free()
        again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, preexec_fn=disk.preexec())
        assert again.returncode == 0, again.stderr
        assert json.loads((out / "manifest.json").read_text())["documents"] == 60


def _lying_shards(tmp_path: Path) -> Path:
    """Shards whose piece holds id 300 (every 10th token: in every window) while the manifest says the largest is
    257 (the piece was changed after it was written)."""
    out = tmp_path / "shards"
    tokenize_to_shards([str(_text(tmp_path / "in", n=2, size=400))], str(out), workers=1, progress=io.StringIO())
    tokens = np.load(out / "tokens_00000.npy")
    tokens[::10] = 300
    np.save(out / "tokens_00000.npy", tokens)
    return out


def test_shard_ids_beyond_the_vocabulary_are_one_line_naming_the_shard(tmp_path):
    out = _lying_shards(tmp_path)
    cfg = load_config(None, [f"--data.path={out}", "--data.seq_len=32"])
    train, _, _ = build_datasets(cfg.data, cfg.model.vocab_size)  # the manifest says nothing is wrong
    with pytest.raises(ShardfitError) as e:
        for k in range(train.num_windows):
            train.row(k)
    assert str(e.value) == (f"{out / 'tokens_00000.npy'}: token id 300 is beyond the model's vocabulary "
                            "(model.vocab_size=264); fix: re-run shardfit tokenize into an empty --out directory "
                            "with the model's tokenizer")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["pieces"][0]["max_id"] = 300  # a manifest that says so is refused at opening, naming the piece
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardfitError, match=r"tokens_00000.npy: token id 300 is beyond the model's vocabulary"):
        build_datasets(cfg.data, cfg.model.vocab_size)


def test_the_cli_trains_on_lying_shards_with_one_line(tmp_path):
    out = _lying_shards(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "shardfit", "train", f"--data.path={out}", "--data.seq_len=32",
                        "--train.steps=2", "--train.global_batch=4", "--train.micro_batch=4",
                        f"--logging.run_dir={tmp_path / 'run'}", "--logging.progress=none"],
                       capture_output=True, text=True, env=env, timeout=300)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("shardfit")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "tokens_00000.npy: token id 300 is beyond the model's vocabulary (model.vocab_size=264)" in errors[0]


def test_a_file_name_that_is_not_utf8_is_one_line(tmp_path, capsys):
    src = _text(tmp_path / "in", n=2, size=100)
    (src / os.fsdecode(b"bad\xff.txt")).write_text("text")
    assert main(["tokenize", str(src), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"shardfit: error: {src}/bad\\xff.txt: the file name is not valid UTF-8; fix: rename it (e.g. "
                   "convmv -f latin1 -t utf8), or move it out of the inputs"], err
    bad_out = tmp_path / os.fsdecode(b"out\xfe")
    (src / os.fsdecode(b"bad\xff.txt")).unlink()
    assert main(["tokenize", str(src), "--out", str(bad_out)]) == 2
    assert "out\\xfe: the file name is not valid UTF-8" in capsys.readouterr().err
    cfg = load_config(None, [f"--data.path={src}", "--data.seq_len=32"])
    (src / os.fsdecode(b"bad\xff.txt")).write_text("text")
    with pytest.raises(ShardfitError, match=r"bad\\xff.txt: the file name is not valid UTF-8"):
        build_datasets(cfg.data, cfg.model.vocab_size)


def test_an_output_directory_inside_the_input_is_refused(tmp_path, capsys):
    src = _text(tmp_path / "in", n=3, size=100)
    assert main(["tokenize", str(src), "--out", str(src / "shards")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{src / 'shards'}: --out lies inside the input directory {src}" in err[0], err
    assert not (src / "shards").exists()
    assert main(["tokenize", str(src / "*.txt"), "--out", str(tmp_path / "elsewhere")]) == 0
