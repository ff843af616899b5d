"""docs/memory.md's `shardfit plan` command (its `<!-- test -->` block: tests/cli/doc_commands.py), run as written:
its exit code, and the output the page shows (`<!-- test-output -->`). Flag lines must appear as shown; a line with
figures must appear up to its first figure (the planner's numbers may move by a rounding; its words, the proposals'
kinds and order, and the flags to add may not)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.cli.doc_commands import commands, marked_blocks, marked_outputs
from tests.cli.session import run_commands

DOC = Path(__file__).parents[2] / "docs" / "memory.md"


def test_the_pages_plan_prints_what_it_shows(tmp_path):
    page = [c for block in marked_blocks(DOC) for c in commands(block)]
    out = run_commands([argv[1:] for argv, _ in page], tmp_path)
    assert [p.returncode for p in out] == [code for _, code in page], [p.stderr for p in out]
    printed = "\n".join(p.stdout for p in out)
    [shown] = marked_outputs(DOC)
    at = 0
    for line in shown.splitlines():
        if line.strip() in ("", "..."):
            continue
        figure = re.search(r"\d+\.\d", line)
        expected = (line[:figure.start()] if figure and not line.lstrip().startswith("--") else line).strip()
        found = printed.find(expected, at)
        assert found >= 0, f"not printed (in this order): {expected!r}\n{printed}"
        at = found + len(expected)
