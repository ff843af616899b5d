"""docs/preference.md's worked example, run as a user types it on the CPU (tests/cli/doc_commands.py marks): DPO on
the tiny model with the byte tokenizer starts at loss log 2 (the policy is the reference), learns, and writes TRL's
metrics to metrics.jsonl and the reference's log-probs beside them; fine-tuning refuses the same file with the fix.
The one end-to-end run of preference training through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tests.cli.doc_commands import commands, marked_blocks, marked_files, marked_outputs
from tests.cli.session import run_commands

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "preference.md"
TRL = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
       "logps/rejected", "loss")


def test_the_pages_dpo_example_does_what_it_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in marked_files(DOC).items():
        (tmp_path / name).write_text(text * 6)
    page = [c for block in marked_blocks(DOC) for c in commands(block)]
    assert all(argv[0] == "shardfit" for argv, _ in page)
    argvs = [[*argv[1:], "--logging.plot=false"] for argv, _ in page]
    out = run_commands(argvs, tmp_path)
    assert [p.returncode for p in out] == [code for _, code in page], [p.stderr[-2000:] for p in out]
    printed = out[0].stdout
    for line in marked_outputs(DOC)[0].splitlines():  # the page's lines, up to its "..."
        assert line.split("...")[0].split(" in 0.9 s")[0] in printed, line
    records = [json.loads(r) for r in (tmp_path / "runs/dpo/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") == "train"]
    assert len(steps) == 4 and all(k in r for r in steps for k in TRL)
    # the policy is the reference at step 1: margins 0 up to rounding (the step shares each pair's prompt, the
    # reference pass packs the sequences its own way: the same sums in another order)
    assert abs(steps[0]["loss"] - math.log(2)) < 1e-5 and abs(steps[0]["rewards/margins"]) < 1e-6
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["rewards/margins"] > 0
    assert (tmp_path / "runs/dpo/reference_logprobs.npz").is_file()
    assert "fix: --preference.objective=dpo" in out[1].stderr
