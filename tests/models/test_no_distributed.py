"""models/ holds no distributed code: no module under src/shardfit/models imports torch.distributed, directly or
through the shardfit modules it imports (lazy imports included; read from the source, as tests/test_import_graph.py
reads it)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
MODELS = SRC / "shardfit" / "models"


def _imports(path: Path) -> set[str]:
    """Every module an import statement in `path` names ("from torch import distributed" names torch.distributed)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _source(module: str) -> Path | None:
    """The file of a shardfit module (a package's __init__), None for other modules."""
    base = SRC.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if module.startswith("shardfit") and path.is_file():
            return path
    return None


def distributed_imports(roots: list[Path]) -> list[str]:
    """'a -> b -> torch.distributed...' for each torch.distributed import reached from `roots` through shardfit."""
    found, seen = [], set()
    todo = [(root, str(root.relative_to(SRC))) for root in roots]
    while todo:
        path, chain = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in sorted(_imports(path)):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                found.append(f"{chain} -> {name}")
            elif (dep := _source(name)) is not None:
                todo.append((dep, f"{chain} -> {name}"))
    return found


def test_models_import_no_torch_distributed():
    files = sorted(MODELS.glob("*.py"))
    assert len(files) > 3
    assert distributed_imports(files) == []


def test_the_walk_finds_a_distributed_import(tmp_path, monkeypatch):
    """The check itself: a lazy import inside a function and one reached through another shardfit module."""
    pkg = tmp_path / "shardfit"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from torch import distributed\n")
    (pkg / "b.py").write_text("import shardfit.a\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    assert distributed_imports([pkg / "b.py"]) == ["shardfit/b.py -> shardfit.a -> torch.distributed"]
