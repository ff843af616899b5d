"""No import circle among shardfit's modules, lazy (function-level) imports included.

The graph is read from the source (every `import` and `from ... import` statement, anywhere in a file), so the
test needs no import of its own and sees imports that only run inside functions. An edge goes to the module a
statement names (`from shardfit.a import b` -> shardfit.a.b when b is a module, else shardfit.a); the package
`__init__` that Python runs on the way is not counted as an edge of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for f in sorted((SRC / "shardfit").rglob("*.py")):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, f in mods.items():
        package = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, `level - 1` packages up
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            edges[name] |= {t for t in targets if t in mods and t != name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circle_among_modules():
    assert _cycles(_edges(_modules())) == []


def test_the_check_finds_a_circle_when_there_is_one():
    """The detector itself: a planted two-module and a three-module circle are reported, a chain is not."""
    edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}, "g": set()}
    assert sorted(_cycles(edges)) == [["a", "b"], ["c", "d", "e"]]
    mods = _modules()
    assert "shardfit.train.engine" in mods and "shardfit.parallel.step_runner" in _edges(mods)["shardfit.train.engine"]


def _reached(edges: dict[str, set[str]], roots: list[str]) -> set[str]:
    """Every module the roots import, directly or through others (lazy imports included)."""
    seen, stack = set(roots), list(roots)
    while stack:
        for w in edges[stack.pop()] - seen:
            seen.add(w)
            stack.append(w)
    return seen


def _package(mods: dict[str, Path], name: str) -> list[str]:
    return [m for m in mods if m == name or m.startswith(name + ".")]


def test_the_doctor_needs_neither_models_nor_parallel():
    """shardfit.doctor (the doctor: forensics of measured snapshots and traces) stays below models/ and parallel/;
    prediction, which builds models on meta and asks parallel/ for the layout, lives in shardfit.plan."""
    mods = _modules()
    edges = _edges(mods)
    doctor = _package(mods, "shardfit.doctor")
    assert "shardfit.doctor.examine" in doctor and "shardfit.doctor.profile_trace" in doctor
    above = {m for m in _reached(edges, doctor) if m.split(".")[1] in ("models", "parallel", "plan", "train")}
    assert above == set()
    # the walk itself: the planner does reach models/ and parallel/ (through the same kind of lazy imports)
    planner = {m.split(".")[1] for m in _reached(edges, _package(mods, "shardfit.plan"))}
    assert {"models", "parallel"} <= planner
