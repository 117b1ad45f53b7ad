"""The package's import graph, read from the source with `ast` (imports inside functions
included): no import circle. The list of known circles was a ratchet while issue 34 broke them;
it is empty now and may only stay so. And, read the same way: no file of layers/ or models/ tests
which backend runs it (they take their compute from the model's ops, layers/ops.py), nor imports cpu/
(but models/build.py, which chooses the backend)."""

from __future__ import annotations

import ast
import re
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


# ---- layers/ and models/ never test which backend runs them (issue 34) ---------------------------
# They get their compute from the model's ops (layers/ops.py), chosen once (models/build.py
# select_ops); a branch on the backend inside them is what that seam replaced.
BACKEND_NAME = re.compile(r"kernel|cpu|onednn|moe_q|^library$", re.IGNORECASE)  # names, attributes
BACKEND_ENTRY = re.compile(r"kernel|cpu|onednn|moe_q|gemm|^lib$", re.IGNORECASE)  # probed attributes
BACKEND_CLASS = re.compile(r"(Ops|Kernels)$")


def _name(node: ast.AST) -> str:
    """The last part of a name or attribute (`kernels`, `self.kernels` -> kernels), else ""."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _backendish(node: ast.AST) -> bool:
    return bool(BACKEND_NAME.search(_name(node)))


def backend_tests(source: str) -> list[tuple[int, str]]:
    """(line, what) for each test of which backend runs: a kernel-ish name or attribute compared with
    None or taken as a truth value, a getattr / hasattr probe of a kernel-ish object or attribute,
    an isinstance against an Ops / Kernels class."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value is None for o in operands) and any(
                _backendish(o) for o in operands
            ):
                found.append((node.lineno, f"{ast.unparse(node)}: compared with None"))
        elif isinstance(node, (ast.If, ast.IfExp, ast.While)) and _backendish(node.test):
            found.append((node.lineno, f"{ast.unparse(node.test)}: taken as a truth value"))
        elif isinstance(node, ast.BoolOp):
            found += [
                (v.lineno, f"{ast.unparse(v)}: in {type(node.op).__name__}")
                for v in node.values
                if _backendish(v)
            ]
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and _backendish(node.operand):
            found.append((node.lineno, f"{ast.unparse(node)}: negated"))
        elif (
            isinstance(node, ast.Call) and _name(node.func) in ("getattr", "hasattr") and len(node.args) >= 2
        ):
            obj, attr = node.args[0], node.args[1]
            key = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else ""
            if _backendish(obj) or BACKEND_ENTRY.search(key):
                found.append((node.lineno, f"{ast.unparse(node)}: probes the backend"))
        elif isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(BACKEND_CLASS.search(_name(c)) for c in classes):
                found.append((node.lineno, f"{ast.unparse(node)}: asks the backend's class"))
    return found


def test_the_backend_test_finder_sees_each_kind():
    cases = [
        "if self.kernels is not None:\n    pass",
        "x = None if kernels is None else 1",
        "if self.kernels:\n    pass",
        "y = a and self.kernels",
        "z = not kernels",
        "f = getattr(kernels, 'moe_q_ex', None)",
        "f = getattr(self.act, 'moe_q_form', None)",
        "f = hasattr(lib, 'gemm_q')",
        "ok = isinstance(self.ops, CpuOps)",
        "if self.ops.library is None:\n    pass",
    ]
    for source in cases:
        assert backend_tests(source), source
    clean = (
        "y = self.ops.rms_norm(x, w, eps)\n"
        "if self.expand_forms is not None:\n    pass\n"
        "g = getattr(group, 'fixed_chunks', 0)\n"
    )
    assert backend_tests(clean) == []


def test_layers_and_models_never_test_which_backend_runs():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
        for package in ("layers", "models")
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, what in backend_tests(path.read_text())
    ]
    assert not found, (
        "take the op or weight form from the model's ops (layers/ops.py) instead:\n" + "\n".join(found)
    )


# ---- layers/ and models/ import nothing of cpu/ (issue 34) ------------------------------------------
# cpu/ implements what layers/ declares (the Ops protocol, the weight interfaces) and imports it; the
# reverse edge would make the two one package again. The backend is chosen in one module, which may
# name it; every other module of layers/ and models/ sees the backend's objects only as the protocols
# of layers/ops.py. Imports under `if TYPE_CHECKING:` count too (the reader walks the whole file).
CHOOSES_THE_BACKEND = frozenset({"models.build"})


def backend_imports(graph: dict[str, set[str]]) -> list[str]:
    """`module -> cpu module` for each import of cpu/ by layers/ or models/ (but the chooser)."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if a.split(".")[0] in ("layers", "models") and a not in CHOOSES_THE_BACKEND
        for b in targets
        if b.split(".")[0] == "cpu"
    )


def test_the_backend_import_finder_sees_one():
    graph = {
        "layers.linear": {"cpu.cpu_gemm", "layers.linear_weight"},
        "layers": {"cpu"},
        "models.decoder": {"layers.ops"},
        "models.build": {"cpu.ops"},  # the chooser may
        "cpu.ops": {"layers.ops"},  # the allowed direction
        "layers_extra": {"cpu.ops"},  # a name that only starts like the package
    }
    assert backend_imports(graph) == ["layers -> cpu", "layers.linear -> cpu.cpu_gemm"]
    assert "cpu.ops" in import_graph()["models.build"]  # the reader sees the chooser's import


def test_layers_and_models_import_nothing_of_cpu():
    found = backend_imports(import_graph())
    assert not found, (
        "layers/ and models/ take the backend from the model's ops (layers/ops.py; chosen in "
        "models/build.py select_ops): declare a protocol in layers/ops.py, or move the shared part "
        "below both packages (expertmesh/huge_pages.py, layers/linear_weight.py):\n" + "\n".join(found)
    )


MAX_LINES = 400  # issue 34: a source file longer than this hides a second concept: split it


def too_long(paths: list[Path], limit: int = MAX_LINES) -> list[str]:
    """'path: N lines' for every file over the limit."""
    return [f"{p}: {n} lines" for p in paths if (n := len(p.read_text().splitlines())) > limit]


def test_the_length_check_sees_a_long_file(tmp_path):
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    assert too_long([long, short]) == [f"{long}: {MAX_LINES + 1} lines"]


def test_no_package_source_file_passes_400_lines():
    sources = sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.c"), *PACKAGE.rglob("*.h")])
    assert len(sources) > 100
    assert not too_long(sources), f"split these by concept (docs/architecture.md): {too_long(sources)}"
