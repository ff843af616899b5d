"""data.chat_template=PATH (issue 38): a Jinja file's template renders the fine-tuning examples, is recorded by its
path, exported as the tokenizer's template and applied by `shardfit generate`; a bad path is one line."""

import json

import pytest

from shardfit.cli.generate import training_template
from shardfit.config import load_config
from shardfit.data import build_dataset
from shardfit.data.chat import export_template
from shardfit.data.tokenizer import ByteTokenizer
from shardfit.errors import ShardfitError

# a ChatML-like template (not shardfit's plain one): a role line, the content, an end marker
CHATML = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}<<end>>\n{% endfor %}"
          "{% if add_generation_prompt %}<<assistant>>{% endif %}")
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture
def jinja(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # given relative: recorded as the absolute path
    (tmp_path / "chatml.jinja").write_text(CHATML)
    return tmp_path / "chatml.jinja"


def test_a_jinja_file_renders_the_examples_and_is_recorded_by_its_path(tmp_path, jinja):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": CHAT}) + "\n")
    cfg = load_config(None, [f"--data.path={data}", "--data.chat_template=chatml.jinja", "--data.seq_len=64",
                             "--data.pack=false"])
    assert cfg.data.chat_template == str(jinja)
    ds, _ = build_dataset(cfg.data, cfg.model.vocab_size)
    inputs, labels = ds.pair(0)
    tok = ByteTokenizer()
    assert tok.decode([int(t) for t in inputs]).startswith("<<user>>hi<<end>>\n<<assistant>>hello<<end>>")
    assert tok.decode([int(t) for t in labels if t != -100 and t < 256]) == "hello<<end>>\n"  # the answer only
    assert ds.info["template"] == str(jinja)  # what the trainer writes into the run's config.toml
    assert f"chat template: the template of {jinja};" in ds.header[0]
    assert load_config(None, [f"--data.chat_template={jinja}"]).data.chat_template == str(jinja)  # reads back


def test_the_export_holds_the_files_template_and_generate_applies_it(tmp_path, jinja):
    out = tmp_path / "export"
    out.mkdir()
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "the tokenizer's own"}))
    export_template(out, str(jinja))
    assert (out / "chat_template.jinja").read_text() == CHATML
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML  # read first by HF
    renderer, line = training_template("byte", None, {"chat_template": str(jinja), "where": "run/config.toml"})
    assert renderer.render(CHAT[:1], True) == "<<user>>hi<<end>>\n<<assistant>>"
    assert f"the template of {jinja} (data.chat_template={jinja} in run/config.toml)" in line
    jinja.unlink()  # gone since the run: one line, not the tokenizer's template instead
    with pytest.raises(ShardfitError, match=rf"^data.chat_template={jinja}: cannot read the chat template \(No such "
                                            r"file or directory\); fix: restore the file"):
        training_template("byte", None, {"chat_template": str(jinja)})


@pytest.mark.parametrize("case", ["missing", "directory", "empty", "not utf-8", "a name", "nothing"])
def test_a_bad_template_path_is_one_line(tmp_path, case):
    value = {"missing": tmp_path / "nope.jinja", "directory": tmp_path, "empty": tmp_path / "e.jinja",
             "not utf-8": tmp_path / "b.jinja", "a name": "chatml", "nothing": ""}[case]
    (tmp_path / "e.jinja").write_text(" \n")
    (tmp_path / "b.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ShardfitError) as e:
        load_config(None, [f"--data.chat_template={value}"])
    msg = str(e.value)
    want = {"missing": f"'{value}' is neither one of auto, tokenizer, plain, none nor a file",
            "directory": f"{value} is a directory, not a Jinja chat template file",
            "empty": f"{value} is empty", "not utf-8": f"cannot read {value} (",
            "a name": "'chatml' is neither one of auto, tokenizer, plain, none nor a file",
            "nothing": "'' is neither one of auto, tokenizer, plain, none nor a file"}[case]
    assert msg.startswith(f"data.chat_template: {want}") and "\n" not in msg, msg
    assert msg.endswith("fix: give a readable UTF-8 file") if case == "not utf-8" else msg.endswith(
        "fix: give the path of a Jinja chat template file, or one of auto, tokenizer, plain, none")
