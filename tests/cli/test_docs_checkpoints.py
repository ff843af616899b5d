"""docs/checkpoints.md's commands (its `<!-- test -->` block: tests/cli/doc_commands.py), run in order as written (with
a smaller model appended to each `shardfit train`, and the run directory that model gets in place of the page's), each
with the exit code the page states."""

from __future__ import annotations

import json
import re
from pathlib import Path

from shardfit.config import load_config
from shardfit.engine.optim import lr_at
from shardfit.train.run_config import default_run_dir
from tests.cli.doc_commands import commands, marked_blocks
from tests.cli.session import run_commands

DOC = Path(__file__).parents[2] / "docs" / "checkpoints.md"
SMALLER = ["--train.device=cpu", "--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--model.n_kv_heads=1",
           "--model.ffn_dim=64", "--data.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2",
           "--logging.log_every=50", "--logging.plot=false"]


def test_the_pages_commands_do_what_it_says(tmp_path, monkeypatch):
    [block] = marked_blocks(DOC)
    page = commands(block)
    monkeypatch.chdir(tmp_path)  # the recorded configs name paths as the commands gave them: relative to here
    page_dir = re.search(r"runs/tiny-[0-9a-f]{8}", DOC.read_text()).group(0)
    assert default_run_dir(load_config()) == Path(page_dir)  # plain `shardfit train` goes where the page says
    assert [c[0][:2] for c in page] == [["shardfit", "train"]] * 4 + [["shardfit", "export"], ["shardfit", "plot"]]
    rows = [{"prompt": f"{i} + {i} = ", "completion": f"{2 * i}"} for i in range(64)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = str(default_run_dir(load_config(None, SMALLER)))  # where the first command goes: its header says so
    argvs = [[a.replace(page_dir, run) for a in argv[1:]] for argv, _ in page]
    out = run_commands([[*a, *(SMALLER if a[0] == "train" else [])] for a in argvs], tmp_path)
    assert [p.returncode for p in out] == [code for _, code in page], [p.stderr for p in out]
    assert f"run dir {run}" in out[0].stdout
    assert "nothing to train: resumed at step 150" in out[1].stderr
    assert "resumed from" in out[2].stdout and "train.steps 150 -> 300" in out[2].stdout
    assert "step 300/300" in out[2].stdout and "step 150/300" not in out[2].stdout
    assert load_config(tmp_path / run / "config.toml").train.steps == 300  # the extension trained and recorded
    # the fine-tuning run: a new directory, the first run's weights and architecture, its own schedule from step 0
    tuned = tmp_path / re.search(r"run dir (runs/tiny-[0-9a-f]{8})", out[3].stdout).group(1)
    assert tuned != tmp_path / run and f"weights from {run}/checkpoints/step_00000300 (step 300" in out[3].stdout
    cfg = load_config(tuned / "config.toml")
    assert cfg.train.lr == 3e-4 and cfg.model.dim == 32  # the fine-tuning default under 100M parameters
    first = json.loads((tuned / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and first["start_step"] == 0 and first["lr"] == lr_at(0, cfg.train)
    assert (tmp_path / "tiny-hf" / "tokenizer.json").is_file() and (tmp_path / run / "metrics.png").is_file()
