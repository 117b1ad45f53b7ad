"""The package's import graph, read from the source with `ast` (imports inside functions
included): no import circle. The list of known circles was a ratchet while issue 34 broke them;
it is empty now and may only stay so."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "expertmesh"

KNOWN_CIRCLES: set[frozenset[str]] = set()  # issue 34 broke the last five; keep it empty


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (absolute and relative, at any depth of the file)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    module = ".".join([*base, node.module] if node.module else base)
                    targets = [f"expertmesh.{module}" if module else "expertmesh"]
                else:
                    targets = [node.module or ""]
                targets += [f"{targets[0]}.{a.name}" for a in node.names]
            for t in targets:
                if t.startswith("expertmesh."):
                    short = t.removeprefix("expertmesh.")
                    if short in modules and short != name:
                        graph[name].add(short)
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_reader_sees_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == {frozenset({"a", "b", "c"})}
    assert "distributed.layout" in import_graph()["distributed.moe_plan"]  # reads real imports


def test_no_import_circle_beyond_the_known_ones():
    found = circles(import_graph())
    new = [sorted(c) for c in found - KNOWN_CIRCLES]
    gone = [sorted(c) for c in KNOWN_CIRCLES - found]
    assert not new, f"new import circles (break them: move the shared part below both): {new}"
    assert not gone, (
        f"these circles are gone: remove them from KNOWN_CIRCLES and docs/architecture.md: {gone}"
    )
