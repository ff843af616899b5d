"""The pages cannot point at what is not there: README.md, docs/*.md and benchmarks/README.md.

- every relative Markdown link `[text](path#anchor)` names a file that exists and, with an anchor, a heading of that
  file (GitHub's heading ids) or an explicit `<a id="...">`;
- every repository path written in backticks in README.md and docs/*.md (`docs/...`, `src/...`, `tests/...`,
  `benchmarks/...`, `examples/...`; globs and placeholders aside) exists;
- every config key a page names (`--section.key`, or `section.key` in backticks) is a key of the schema, or an old
  spelling the loader still accepts (config/spellings.py);
- every figure in the README's table of headline figures is in benchmarks/README.md, on the row the line links to.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shardfit.config import Config, config_to_dict
from shardfit.config.spellings import RENAMED

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
SECTIONS = ("model", "lora", "data", "train", "parallel", "compute", "checkpoint", "logging", "memory", "preference",
            "serve")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """GitHub's ids for the page's headings (lower case, punctuation dropped, spaces to hyphens, -1, -2 ... for
    repeats), and the page's explicit <a id="..."> / <a name="...">."""
    ids, seen = set(), {}
    text = page.read_text()
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", _prose(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        ids.add(slug if n == 0 else f"{slug}-{n}")
    return ids | set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))


def _links(page: Path) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", _prose(page.read_text()))
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(page):
    bad = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(file):
            bad.append(f"{target}: no heading or <a id> '{anchor}' in {file.relative_to(ROOT)}")
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES[:-1], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_in_backticks_exists(page):
    paths = re.findall(r"`((?:docs|src|tests|benchmarks|examples)/[^`\s]*)`", page.read_text())
    missing = [p for p in paths if not re.search(r"[*<>{}\[\]$]|\.\.\.", p)
               and not (ROOT / p.split("#")[0].split("::")[0].rstrip("/.,:")).exists()]
    assert not missing, missing


def test_every_config_key_a_page_names_exists():
    keys = {f"{s}.{k}" for s, table in config_to_dict(Config()).items() if isinstance(table, dict) for k in table}
    unknown = []
    for page in PAGES:
        text = page.read_text()
        named = re.findall(r"--([a-z]+\.[a-z_0-9]+)", text)
        named += [k for k in re.findall(r"`([a-z]+\.[a-z_0-9]+)(?:[ =][^`]*)?`", text) if k.split(".")[0] in SECTIONS]
        unknown += [f"{page.relative_to(ROOT)}: {k}" for k in named
                    if k.split(".")[0] in SECTIONS and k not in keys and k not in RENAMED
                    and k.rsplit(".", 1)[1] not in ("py", "md", "toml", "json")]  # a file such as checkpoint.py
    assert not unknown, unknown


def test_the_readmes_headline_figures_are_the_benchmarks_rows():
    readme = (ROOT / "README.md").read_text()
    table = re.search(r"^## What it does that others don't\n(.*?)^## ", readme, re.S | re.M).group(1)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert 4 <= len(rows) <= 6, rows
    bench = (ROOT / "benchmarks" / "README.md").read_text()
    for row in rows:
        anchor = re.search(r"\(benchmarks/README\.md#([\w-]+)\)", row)
        assert anchor, f"no link to benchmarks/README.md: {row}"
        line = next(b for b in bench.splitlines() if f'<a id="{anchor.group(1)}">' in b)
        figures = re.findall(r"\d+(?:,\d{3})*(?:\.\d+)?x?", re.sub(r"\(.*?\)", "", row.split("|")[2]))
        assert figures and all(f in line for f in figures), (row, line)
