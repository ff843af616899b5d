"""Issue 27, class 2: `shardfit export RUN_OR_STEP OUT`, from a checkpoint two ranks wrote, in one CPU process.

The export loads in transformers with the logits of the checkpoint, and its tokenizer files (the byte tokenizer's,
written as tokenizer.json) round-trip text through AutoTokenizer exactly as shardfit's tokenizer does. Each wrong
input is one line, exit 2, before anything is written.
"""

from __future__ import annotations

import json

import pytest
import torch

from shardfit.data.tokenizer import ByteTokenizer
from tests.cli.test_cli import _run

TEXT = "héllo wörld 🙂\n\ttabs  and a literal <eos>, <pad> and <bos>"


def test_export_loads_in_transformers_with_the_checkpoints_logits(two_rank_run, tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardfit.weights.local import load_dcp

    out = tmp_path / "hf"
    p = _run("export", str(two_rank_run), str(out), "--dtype", "float32")
    assert p.returncode == 0, p.stderr
    step = two_rank_run / "checkpoints" / "step_00000002"  # the run's newest, the one its directory names
    assert p.stdout.startswith(f"exported step 2 ({step}) to {out}: "), p.stdout
    assert "tokenizer byte (written as tokenizer.json)" in p.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= {f.name for f in out.iterdir()}

    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == ByteTokenizer().encode(TEXT) and tok.decode(ids) == TEXT  # special names in text stay bytes
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert tok.decode([*ids, 257, 258], skip_special_tokens=True) == ByteTokenizer().decode([*ids, 257, 258])

    ours, _ = load_dcp(str(two_rank_run), torch.device("cpu"), torch.float32)  # the newest checkpoint: step 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    x = torch.tensor([ids[:24]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 257


def _cases(run, tmp_path):
    """name -> (argv after `shardfit export`, what the one line must say)."""
    (tmp_path / "someone").mkdir()
    (tmp_path / "someone" / "notes.txt").write_text("keep me")
    (tmp_path / "empty_run").mkdir()
    return {
        "out holds foreign files": ([str(run), str(tmp_path / "someone")],
                                    "holds files an export would delete (notes.txt)"),
        "out is the run itself": ([str(run), str(run)], "holds files an export would delete"),
        "no such checkpoint": ([str(tmp_path / "missing"), str(tmp_path / "o1")], "checkpoint not found"),
        "a directory with no checkpoint": ([str(tmp_path / "empty_run"), str(tmp_path / "o2")],
                                           "no complete checkpoint here"),
        "a tokenizer that is not there": ([str(run), str(tmp_path / "o3"), "--tokenizer", "/nonexistent/t.json"],
                                          "the run's tokenizer /nonexistent/t.json is not found"),
        "a dtype it does not write": ([str(run), str(tmp_path / "o4"), "--dtype", "int8"], "invalid choice"),
    }


@pytest.mark.parametrize("case", ["out holds foreign files", "out is the run itself", "no such checkpoint",
                                  "a directory with no checkpoint", "a tokenizer that is not there",
                                  "a dtype it does not write"])
def test_wrong_input_is_one_line_and_writes_nothing(two_rank_run, tmp_path, case, capsys):
    from shardfit.cli.main import main

    argv, needle = _cases(two_rank_run, tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["export", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardfit: error:") and needle in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT, no OUT.tmp
    assert (tmp_path / "someone" / "notes.txt").read_text() == "keep me"


def test_a_step_directory_exports_that_step(two_rank_run, tmp_path, capsys):
    """An older step by name (in-process: the CLI's code path, without another interpreter start)."""
    from safetensors.torch import load_file

    from shardfit.cli.main import main

    step1 = two_rank_run / "checkpoints" / "step_00000001"
    assert main(["export", str(step1), str(tmp_path / "s1"), "--dtype=float32"]) == 0
    assert main(["export", str(two_rank_run), str(tmp_path / "s2"), "--dtype=float32"]) == 0
    a, b = load_file(tmp_path / "s1" / "model.safetensors"), load_file(tmp_path / "s2" / "model.safetensors")
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)  # two steps, two sets of weights
    assert main(["export", str(step1), str(tmp_path / "s1")]) == 0  # a previous export is replaced whole


def test_a_lora_run_exports_its_base_with_the_adapters_merged(tmp_path, capsys):
    """A LoRA run's checkpoint holds adapters only: the export is the rebuilt base with them merged in."""
    transformers = pytest.importorskip("transformers")
    from shardfit.cli.main import main
    from shardfit.weights.local import load_dcp
    from tests._dist import run_ranks
    from tests.helpers import train_small

    run_ranks(train_small, 1, str(tmp_path / "run"), "--lora.rank=4", "--train.steps=2", "--checkpoint.final=true")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf"), "--dtype=float32"]) == 0
    ours, _ = load_dcp(str(tmp_path / "run"), torch.device("cpu"), torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    x = torch.tensor([ByteTokenizer().encode(TEXT)[:24]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=1e-4, atol=1e-4)
