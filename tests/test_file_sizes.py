"""No source file over 500 lines (docs/architecture.md, "Rules that hold everywhere"): a module that grows is split on
a seam, one concern a file, not trimmed of its comments to fit."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
LIMIT = 500


def _long_files(root: Path, limit: int) -> dict[str, int]:
    """Each .py file under `root` of more than `limit` lines, with its count."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        n = len(f.read_text(encoding="utf-8").splitlines())
        if n > limit:
            out[str(f.relative_to(root.parent))] = n
    return out


def test_no_source_file_over_500_lines():
    long = _long_files(SRC / "shardfit", LIMIT)
    assert not long, f"over {LIMIT} lines (split each on a seam): {long}"


def test_the_count_sees_a_long_file(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "big.py").write_text("x = 1\n" * (LIMIT + 1))
    (tmp_path / "pkg" / "ok.py").write_text("x = 1\n" * LIMIT)
    assert _long_files(tmp_path / "pkg", LIMIT) == {"pkg/big.py": LIMIT + 1}
