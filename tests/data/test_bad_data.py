"""Bad data (issue 22, classes 3 and 5): each case writes a small data set and builds the datasets as training does;
every one is refused with one line naming the file (file:line where there is one) and the fix, never a traceback
or a run that trains nothing. A few rows run `python -m shardfit train` as a user would."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shardfit.config import load_config
from shardfit.data.build import build_datasets
from shardfit.data.sft import read_examples
from shardfit.data.tokenize import tokenize_to_shards
from shardfit.data.tokenizer import ByteTokenizer
from shardfit.errors import ShardfitError

ROOT = Path(__file__).resolve().parents[2]
SFT = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "3+3=", "completion": "6"}]
CHAT = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]


def _jsonl(rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _shards(d: Path, text: str = "some text to tokenize\n\nand another document\n") -> Path:
    (d / "src").mkdir(exist_ok=True)
    (d / "src" / "c.txt").write_text(text)
    tokenize_to_shards([str(d / "src" / "c.txt")], str(d / "shards"), workers=1, progress=io.StringIO())
    return d / "shards"


def _edit_manifest(d: Path, edit) -> Path:
    out = _shards(d)
    m = json.loads((out / "manifest.json").read_text())
    m = edit(m)
    (out / "manifest.json").write_text(json.dumps(m))
    return out


def _rewrite_piece(d: Path, change, drop_max_id: bool = False) -> Path:
    """Piece 0's tokens replaced by change(tokens); with drop_max_id, the manifest of an older shardfit."""
    out = _edit_manifest(d, lambda m: {k: v for k, v in m.items() if k != "max_id" or not drop_max_id})
    np.save(out / "tokens_00000.npy", change(np.load(out / "tokens_00000.npy")))
    return out


def _with_id(tokens: np.ndarray, token_id: int) -> np.ndarray:
    out = tokens.copy()
    out[len(out) // 2] = token_id
    return out


def _files(d: Path, files: dict) -> None:
    for name, content in files.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            p.mkdir()
        else:
            p.write_bytes(content)


# (case, files to write {name: bytes, None: a directory} or a function of tmp_path giving data.path, data.path
#  relative to tmp_path, extra overrides, what the line must say). Where is named in each needle.
CASES = [
    ("lone surrogate in a text field", {"d.jsonl": _jsonl([{"text": "ok"}, b'{"text": "bad \\ud800 here"}'])},
     "d.jsonl", [], r"d.jsonl:2: a lone UTF-16 surrogate escape \(\\ud800\) is not text; fix: "),
    ("lone low surrogate in a completion", {"d.jsonl": _jsonl([*SFT, b'{"prompt": "a", "completion": "\\udc00"}'])},
     "d.jsonl", [], r"d.jsonl:3: a lone UTF-16 surrogate escape \(\\udc00\)"),
    ("lone surrogate in a chat message", {"d.jsonl": _jsonl([*CHAT, b'{"messages": [{"role": "user", "content": '
                                                                    b'"\\uDBFF"}, {"role": "assistant", '
                                                                    b'"content": "x"}]}'])},
     "d.jsonl", [], r"d.jsonl:2: a lone UTF-16 surrogate escape"),
    ("invalid UTF-8 in fine-tuning data", {"d.jsonl": _jsonl([*SFT, b'{"prompt": "\xff", "completion": "x"}'])},
     "d.jsonl", ["--data.mode=sft"], r"d.jsonl:3: line is not valid UTF-8 \(byte \d+\); fix: re-encode"),
    ("invalid UTF-8 in pretraining JSON lines", {"d.jsonl": _jsonl([{"text": "a"}, b'{"text": "\xc3("}'])},
     "d.jsonl", [], r"d.jsonl:2: line is not valid UTF-8"),
    ("invalid UTF-8 in a text file", {"t.txt": b"fine\nbad \xfe\n"}, "t.txt", [], r"t.txt:2: line is not valid UTF-8"),
    ("JSON nested too deeply", {"d.jsonl": _jsonl([b"[" * 100000 + b"]" * 100000])}, "d.jsonl", [],
     r"d.jsonl:1: JSON nested too deeply"),
    ("an empty file", {"e.txt": b""}, "e.txt", [], r"e.txt: is empty \(0 bytes\); fix: point data.path"),
    ("a directory of empty files", {"d/a.txt": b"", "d/b.jsonl": b""}, "d", [], r"d: all 2 files are empty"),
    ("a directory with no data files", {"d/notes.csv": b"a,b\n"}, "d", [], r"d: directory holds no .txt"),
    ("a glob matching nothing", {"d/a.txt": b"x"}, "d/*.jsonl", [], r"d/\*.jsonl: the glob matches no file"),
    ("a file where a directory is expected", {"a.txt": b"x"}, "a.txt/more/b.jsonl", [],
     r"a.txt/more/b.jsonl: .*a.txt is a file, not a directory"),
    ("a missing path", {}, "nothing.jsonl", [], r"nothing.jsonl: no such file or directory"),
    ("every prompt longer than seq_len", {"d.jsonl": _jsonl([{"prompt": "p" * 80, "completion": "c"}] * 3)},
     "d.jsonl", ["--data.seq_len=32"], r"d.jsonl: none of the 3 examples has a loss-bearing token within "
                                       r"data.seq_len=32 .*fix: raise data.seq_len"),
    ("every chat's assistant turn past seq_len", {"d.jsonl": _jsonl([{"messages": [
        {"role": "user", "content": "u" * 60}, {"role": "assistant", "content": "a"}]}] * 2)},
     "d.jsonl", ["--data.seq_len=32", "--data.pack=false"], r"d.jsonl: none of the 2 examples"),
    ("validation set a copy of the training set", {"t.jsonl": _jsonl(SFT), "v.jsonl": _jsonl(SFT[::-1])},
     "t.jsonl", ["--data.val_path=VAL/v.jsonl"], r"data.val_path: every one of the 2 validation examples is also a "
                                                  r"training example"),
    ("validation path spelled differently", {"t.jsonl": _jsonl(SFT)}, "t.jsonl", ["--data.val_path=VAL/./t.jsonl"],
     r"data.val_path: names the same files as data.path"),
    ("pretraining validation documents all in training", {"t.txt": b"a document long enough to train on\n" * 20,
                                                          "v/t.txt": b"a document long enough to train on\n" * 20},
     "t.txt", ["--data.val_path=VAL/v", "--data.seq_len=32"], r"every one of the 1 validation documents"),
    ("token ids beyond the vocabulary (manifest max_id)", lambda d: _edit_manifest(d, lambda m: {**m, "max_id": 400}),
     "", [], r"shards: token id 400 is beyond the model's vocabulary \(model.vocab_size=264\); fix: set "
             r"model.vocab_size > 400"),
    ("token ids beyond the vocabulary (old manifest: scanned)",
     lambda d: _rewrite_piece(d, lambda t: _with_id(t, 300), drop_max_id=True), "", [],
     r"shards: token id 300 is beyond the model's vocabulary"),
    ("manifest without pieces", lambda d: _edit_manifest(d, lambda m: {k: v for k, v in m.items() if k != "pieces"}),
     "", [], r"manifest.json: incomplete or corrupt manifest: 'pieces' is missing, not list; fix: re-run"),
    ("manifest with a float dtype", lambda d: _edit_manifest(d, lambda m: {**m, "dtype": "float32"}), "", [],
     r"manifest.json: incomplete or corrupt manifest: dtype 'float32' is neither"),
    ("manifest that is a list", lambda d: _edit_manifest(d, lambda m: [m]), "", [],
     r"manifest.json: incomplete or corrupt manifest: a JSON list"),
    ("manifest whose counts disagree", lambda d: _edit_manifest(d, lambda m: {**m, "tokens": m["tokens"] + 1}), "",
     [], r"manifest.json: .*do not add up"),
    ("manifest piece without a token count",
     lambda d: _edit_manifest(d, lambda m: {**m, "pieces": [{"index": 0}]}), "", [], r"piece 0 lacks"),
    ("a missing piece file", lambda d: (_shards(d) / "tokens_00000.npy").unlink() or d / "shards", "", [],
     r"tokens_00000.npy: missing: the manifest lists it"),
    ("a piece file shorter than the manifest says",
     lambda d: _rewrite_piece(d, lambda t: t[:3]), "", [], r"tokens_00000.npy: .*holds uint16\[3\], "
                                                                           r"the manifest says uint16\[\d+\]"),
    ("a piece file of the wrong dtype",
     lambda d: _rewrite_piece(d, lambda t: t.astype(np.uint32)), "", [], r"tokens_00000.npy: .*holds uint32\[45\]"),
    ("a piece file cut mid-body", lambda d: _truncate(_shards(d) / "tokens_00000.npy", 140) or d / "shards", "", [],
     r"tokens_00000.npy: cannot map tokens_00000.npy"),
    ("a piece that is a directory",
     lambda d: _replace_with_dir(_shards(d) / "tokens_00000.npy") or d / "shards", "", [],
     r"tokens_00000.npy: cannot map"),
    ("document starts outside the stream",
     lambda d: np.save(_shards(d) / "doc_starts.npy", np.array([5], np.int64)) or d / "shards",
     "", [], r"doc_starts.npy: document starts do not lie inside"),
]


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def _replace_with_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _build(tmp_path, files, path, extra):
    if callable(files):
        path = str(files(tmp_path))
    else:
        _files(tmp_path, files)
        path = str(tmp_path / path)
    extra = [e.replace("VAL/", f"{tmp_path}/") for e in extra]
    cfg = load_config(None, [f"--data.path={path}", *extra])
    return build_datasets(cfg.data, cfg.model.vocab_size)


@pytest.mark.parametrize("case, files, path, extra, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_data_is_one_line_naming_the_file(tmp_path, case, files, path, extra, needle):
    with pytest.raises(ShardfitError) as e:
        _build(tmp_path, files, path, extra)
    msg = str(e.value)
    assert "\n" not in msg and "fix: " in msg, msg
    import re

    assert re.search(needle, msg), msg


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files without read permission")
def test_unreadable_file_is_one_line(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(_jsonl(SFT))
    (tmp_path / "d.jsonl").chmod(0)
    with pytest.raises(ShardfitError, match=r"d.jsonl: cannot read the file \(Permission denied\)"):
        _build(tmp_path, {}, "d.jsonl", [])


def test_unreadable_file_is_one_line_as_root_too(tmp_path, monkeypatch):
    """The same refusal whoever runs the suite: open() fails as it does without read permission."""
    import builtins

    from shardfit.data import sources

    real = builtins.open

    def deny(path, *a, **kw):
        if str(path).endswith("b.txt"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(sources, "open", deny, raising=False)
    _files(tmp_path, {"d/a.txt": b"fine text\n" * 40, "d/b.txt": b"hidden\n"})
    with pytest.raises(ShardfitError, match=r"b.txt: cannot read the file \(Permission denied\); fix: check its"):
        _build(tmp_path, {}, "d", [])


# Chat templates: the renderer is the tokenizer's (tokenizer_config.json beside data.tokenizer), the ids the byte
# tokenizer's, so no tokenizer.json is needed to render.
TEMPLATES = [
    ("raise_exception", "{% if messages[0]['role'] != 'system' %}{{ raise_exception('roles must alternate "
                        "system/user/assistant') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     r"d.jsonl:1: the chat template refuses this conversation: roles must alternate system/user/assistant; fix: "),
    ("syntax error", "{% for m in messages %}{{ m['content'] }}",
     r"tokenizer_config.json chat_template: the chat template has a Jinja syntax error \(.*template line 1\)"),
    ("unknown filter", "{% for m in messages %}{{ m['content'] | shout }}{% endfor %}",
     r"tokenizer_config.json chat_template: the chat template has a Jinja syntax error \(No filter named 'shout'"),
    ("runtime type error", "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}",
     r"d.jsonl:1: the chat template failed \(TypeError"),
    ("sandbox refusal", "{{ messages.__class__.__mro__ }}", r"d.jsonl:1: the chat template failed \(SecurityError"),
    ("every assistant token masked", "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}"
                                     "{% endif %}{% endfor %}",
     r"d.jsonl: none of the 1 examples has a loss-bearing token .*check the chat template's masks"),
]


@pytest.mark.parametrize("case, template, needle", TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_bad_chat_template_is_one_line(tmp_path, case, template, needle):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "d.jsonl").write_bytes(_jsonl(CHAT))
    cfg = SimpleNamespace(tokenizer=str(tmp_path / "tokenizer.json"), seq_len=64, path=str(tmp_path / "d.jsonl"),
                          format="auto", file_format="auto", chat_template="auto")
    with pytest.raises(ShardfitError) as e:
        read_examples([tmp_path / "d.jsonl"], cfg, ByteTokenizer())
    import re

    assert re.search(needle, str(e.value)) and "\n" not in str(e.value), str(e.value)


def test_some_examples_left_out_and_partial_overlap_are_notices(tmp_path):
    rows = [*SFT, {"prompt": "p" * 80, "completion": "c"}]
    _files(tmp_path, {"t.jsonl": _jsonl(rows), "v.jsonl": _jsonl([SFT[0], {"prompt": "9+9=", "completion": "18"}])})
    train, val, _ = _build(tmp_path, {}, "t.jsonl", ["--data.seq_len=32", f"--data.val_path={tmp_path}/v.jsonl"])
    assert len(train.examples) == 2 and len(val.examples) == 2
    assert train.header[0].startswith("data: prompt_completion (detected from ")
    assert train.notices == (f"{tmp_path}/t.jsonl: 1 of 3 examples left out: no loss-bearing token within "
                             "data.seq_len=32 (raise data.seq_len to keep them)",
                             "data.val_path: 1 of 2 validation examples are also in the training data (their loss "
                             "is not held out)")
    train, _, _ = _build(tmp_path, {}, "v.jsonl", [])
    assert train.notices == ()  # nothing to say


def test_new_manifests_record_the_largest_id(tmp_path):
    out = _shards(tmp_path, "ab\n\nba\n")
    m = json.loads((out / "manifest.json").read_text())
    assert m["max_id"] == 257  # EOS of the byte tokenizer, above 'a' and 'b'
    train, _, _ = _build(tmp_path, lambda d: out, "", ["--data.seq_len=4"])
    assert train.n_tokens == 8  # one text file is one document: its 7 bytes and EOS


CLI_CASES = [
    ({"d.jsonl": _jsonl([*SFT, b'{"prompt": "\\ud800", "completion": "x"}'])}, "d.jsonl",
     "d.jsonl:3: a lone UTF-16 surrogate escape"),
    ({"d.jsonl": _jsonl([{"prompt": "p" * 80, "completion": "c"}] * 2)}, "d.jsonl",
     "none of the 2 examples has a loss-bearing token within data.seq_len=32"),
    (lambda d: _edit_manifest(d, lambda m: {**m, "max_id": 999}), "", "token id 999 is beyond the model's vocabulary"),
]


def _cli_args(tmp_path, files, path) -> list[str]:
    data = files(tmp_path) if callable(files) else (_files(tmp_path, files) or tmp_path / path)
    return [f"--data.path={data}", "--data.seq_len=32", "--train.steps=1", f"--logging.run_dir={tmp_path / 'run'}"]


@pytest.fixture(scope="module")
def in_one_session(tmp_path_factory):
    """needle -> (its subprocess.CompletedProcess, its directory) of the cases after the first, through the CLI's
    entry point in one subprocess (tests/cli/session.py: the interpreter and torch started once; the first case is
    a process of its own: the exit code and stderr at the file descriptor)."""
    from tests.cli.session import run_commands

    dirs = [tmp_path_factory.mktemp("bad_data") for _ in CLI_CASES[1:]]
    argvs = [["train", *_cli_args(d, files, path)] for d, (files, path, _) in zip(dirs, CLI_CASES[1:])]
    done = run_commands(argvs, cwd=tmp_path_factory.getbasetemp(), cwds=dirs)
    return {needle: (p, d) for (_, _, needle), p, d in zip(CLI_CASES[1:], done, dirs)}


@pytest.mark.parametrize("files, path, needle", CLI_CASES)
def test_cli_refuses_bad_data_with_one_line(tmp_path, files, path, needle, request):
    if needle == CLI_CASES[0][2]:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        r = subprocess.run([sys.executable, "-m", "shardfit", "train", *_cli_args(tmp_path, files, path)],
                           capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    else:
        r, tmp_path = request.getfixturevalue("in_one_session")[needle]
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("shardfit: error: ") and needle in lines[0], lines
    assert "Traceback" not in r.stderr and not (tmp_path / "run").exists()
