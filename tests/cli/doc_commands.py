"""The commands a page in docs/ shows, read as a user would type them, for the tests that run them (so that a page
cannot drift from the code). The pages mark what a test runs:

  <!-- test -->              on the line before a ```bash fence: a test runs that block's commands, in order;
  <!-- test-file: NAME -->   on the line before any fence: a test writes that block's text to NAME first;
  <!-- test-output -->       on the line before any fence: what the tested commands print (a test checks the lines
                             it names in its docstring).

In a marked bash block: one command a line; a line ending in `\\` continues on the next; `#` starts a comment, and
`(exit N)` in it is the exit code the page says the command ends with (0 when it says none). Run them with
`tests.cli.session.run_commands`: one subprocess, each command through the CLI's own entry point.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

_MARKED = re.compile(r"^<!-- (test|test-output|test-file: (\S+)) -->\n```\w*\n(.*?)^```", re.S | re.M)


def marked_blocks(page: Path) -> list[str]:
    """The text of every bash block marked `<!-- test -->`, in page order."""
    return [m.group(3) for m in _MARKED.finditer(page.read_text()) if m.group(1) == "test"]


def marked_files(page: Path) -> dict[str, str]:
    """name -> text of every block marked `<!-- test-file: NAME -->`."""
    return {m.group(2): m.group(3) for m in _MARKED.finditer(page.read_text()) if m.group(2)}


def marked_outputs(page: Path) -> list[str]:
    """The text of every block marked `<!-- test-output -->`, in page order."""
    return [m.group(3) for m in _MARKED.finditer(page.read_text()) if m.group(1) == "test-output"]


def commands(block: str) -> list[tuple[list[str], int]]:
    """(argv, the exit code the page states) for each command of a block."""
    out, pending = [], ""
    for line in block.splitlines():
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        command, _, comment = line.partition(" #") if not line.startswith("#") else ("", "", line)
        if not command.strip():
            continue
        code = re.search(r"\(exit (\d+)\)", comment)
        out.append((shlex.split(command), int(code.group(1)) if code else 0))
    return out
