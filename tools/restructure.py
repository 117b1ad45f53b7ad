"""Move the loose config modules into `expertmesh/config/` and the CPU backend into `expertmesh/cpu/`,
and rewrite every reference to them (issue 34). Idempotent: a second run moves and rewrites nothing.

    python tools/restructure.py            # git mv, then rewrite imports, dotted names and paths
    python tools/restructure.py --check    # exit 1 if anything is left to move or rewrite

Made to be re-run after other branches merge: the rewriting reads every tracked (and untracked,
not ignored) text file under the rewritten roots, with regular expressions over module paths
(`expertmesh.layers.cpu_kernels`), `from PACKAGE import MODULE` statements (split where only some
names move) and file paths (`layers/cpu_kernels.py`, `expertmesh/model_source.py`, `csrc/`),
never a fixed list of files (but for SKIP).
README.md is left alone unless `--readme` is given. After rewriting, ruff sorts the imports of the
Python files it touched (when ruff is on PATH or in .venv).

`layers/quantization/` stays in `layers/`: it is the weight formats (how each checkpoint format is
read, sliced, held), which the layers own; the kernels' side of a format is in `cpu/`.
`sampling_params.py`, `outputs.py` stay at the root (the public API, as in vLLM), and so do
`registries.py`, `logger.py` and `forward_context.py` (used by every layer, not configuration).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "expertmesh"

# old module -> new module (dotted, under expertmesh)
MODULE_MOVES = {
    "config": "config",  # config.py -> config/__init__.py: `expertmesh.config` keeps its name
    "model_config": "config.model_config",
    "rope_config": "config.rope_config",
    "mla_config": "config.mla_config",
    "linear_attention_config": "config.linear_attention_config",
    "hf_config": "config.hf_config",
    "model_source": "config.model_source",
    "engine_args": "config.engine_args",
    "layers.cpu_kernels": "cpu.cpu_kernels",
    "layers.cpu_gemm": "cpu.cpu_gemm",
    "layers.cpu_attention_kernels": "cpu.cpu_attention_kernels",
    "layers.cpu_onednn": "cpu.cpu_onednn",
    "layers.cpu_features": "cpu.cpu_features",
    "layers.native_decode": "cpu.native_decode",
    "layers.native_desc": "cpu.native_desc",
    "layers.huge_pages": "cpu.huge_pages",
}
FILE_MOVES = {  # paths under expertmesh/ (a module's file, or a folder)
    **{
        f"{old.replace('.', '/')}.py": (
            "config/__init__.py" if new == "config" else f"{new.replace('.', '/')}.py"
        )
        for old, new in MODULE_MOVES.items()
    },
    "csrc": "cpu/csrc",
}
NEW_PACKAGES = {
    "cpu/__init__.py": '"""The CPU backend: our C kernels (csrc/, built on first use), their ctypes entry\n'
    "points, which matmul serves a weight (oneDNN / AMX, the panel GEMM), whole decode steps in one\n"
    'native call, and large weights on huge pages. Layers reach it through the weights they hold."""\n',
}
REWRITE_ROOTS = ("expertmesh", "tests", "benchmarks", "tools", "examples", "docs", "scripts")
REWRITE_FILES = ("pyproject.toml", "Makefile", "tests/README.md", "benchmarks/README.md")
TEXT_SUFFIXES = {
    ".py",
    ".md",
    ".toml",
    ".txt",
    ".sh",
    ".cfg",
    ".ini",
    ".yml",
    ".yaml",
    ".c",
    ".h",
    ".json",
    "",
}
SELF = Path(__file__).resolve()
# Not rewritten: this script and its test (they spell the old layout on purpose), and the package
# map, which lists files by their new folders by hand.
SKIP = ("tools/restructure.py", "tests/test_restructure.py", "docs/architecture.md")


def _dotted_rules() -> list[tuple[re.Pattern, str]]:
    rules = []
    for old, new in MODULE_MOVES.items():
        if old == new:
            continue
        # expertmesh.layers.cpu_kernels -> expertmesh.cpu.cpu_kernels (not a longer name's prefix)
        rules.append((re.compile(rf"(?<![\w.]){PKG}\.{re.escape(old)}(?![\w])"), f"{PKG}.{new}"))
    return rules


def _path_rules(csrc: bool = True) -> list[tuple[re.Pattern, str]]:
    """File paths; `csrc`: also csrc/ -> cpu/csrc/ (not inside cpu/, where csrc/ is relative)."""
    rules = []
    for old, new in FILE_MOVES.items():
        if old == "csrc":
            continue
        # layers/cpu_kernels.py, expertmesh/model_config.py -> their new paths. A bare root module
        # name (`model_config.py`) is left alone: it names the file wherever it lies.
        if "/" in old:
            rules.append((re.compile(rf"(?<![\w./-]){re.escape(old)}(?![\w])"), new))
        rules.append((re.compile(rf"(?<=\b{PKG}/){re.escape(old)}(?![\w])"), new))
    if not csrc:
        return rules
    # csrc/ (the C sources, package-data globs included) -> cpu/csrc/; never twice
    rules.append((re.compile(r"(?<![\w./-])csrc/"), "cpu/csrc/"))
    rules.append((re.compile(rf"(?<=\b{PKG}/)csrc\b"), "cpu/csrc"))
    return rules


# `from expertmesh.layers import cpu_gemm, huge_pages, linear` (one line or parenthesized)
FROM_IMPORT = re.compile(
    rf"^(?P<indent>[ \t]*)from (?P<pkg>{PKG}(?:\.\w+)*) import (?P<names>\([^)]*\)|[^\n#]+?)"
    r"(?P<comment>[ \t]*#[^\n]*)?$",
    re.MULTILINE,
)


def _rewrite_from_imports(text: str) -> str:
    def one(m: re.Match) -> str:
        pkg = m.group("pkg").removeprefix(PKG).lstrip(".")
        raw = m.group("names").strip().strip("()")
        names = [n.strip() for n in re.split(r",", re.sub(r"#[^\n]*", "", raw)) if n.strip()]
        by_pkg: dict[str, list[str]] = {}
        moved = False
        for name in names:
            base = name.split(" as ")[0].strip()
            old = f"{pkg}.{base}" if pkg else base
            new = MODULE_MOVES.get(old)
            if new is not None and new != old:
                moved = True
                new_pkg, _, new_name = new.rpartition(".")
                alias = name.split(" as ")[1].strip() if " as " in name else None
                text_name = (
                    new_name if alias is None and new_name == base else f"{new_name} as {alias or base}"
                )
                by_pkg.setdefault(new_pkg, []).append(text_name)
            else:
                by_pkg.setdefault(pkg, []).append(name)
        if not moved:
            return m.group(0)
        comment = m.group("comment") or ""
        lines = []
        for target, ns in by_pkg.items():
            mod = f"{PKG}.{target}" if target else PKG
            lines.append(f"{m.group('indent')}from {mod} import {', '.join(ns)}{comment}")
        return "\n".join(lines)

    return FROM_IMPORT.sub(one, text)


# What no general rule can say: data found relative to a moved module's own file.
SPECIAL = {
    "cpu/cpu_kernels.py": [
        ('Path(__file__).resolve().parent.parent / "csrc"', 'Path(__file__).resolve().parent / "csrc"'),
    ],
    "config/model_source.py": [
        (
            'os.path.dirname(__file__), "default_model"',
            'os.path.dirname(os.path.dirname(__file__)), "default_model"',
        ),
    ],
}


def _special(path: Path, text: str) -> str:
    rel = path.relative_to(ROOT / PKG).as_posix() if (ROOT / PKG) in path.parents else None
    for old, new in SPECIAL.get(rel, []):
        if new not in text:
            text = text.replace(old, new)
    return text


def _in_cpu(path: Path) -> bool:
    return (ROOT / PKG / "cpu") in path.parents


def rewrite(text: str, path: Path) -> str:
    out = text
    if path.suffix == ".py":
        out = _rewrite_from_imports(out)
    for pattern, repl in _dotted_rules() + _path_rules(csrc=not _in_cpu(path)):
        out = pattern.sub(repl, out)
    return _special(path, out)


def _files(readme: bool) -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *REWRITE_ROOTS, *REWRITE_FILES],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    if readme:
        listed.append("README.md")
    out = []
    for rel in sorted(set(listed)):
        p = ROOT / rel
        if rel in SKIP or p.resolve() == SELF or not p.is_file() or p.suffix not in TEXT_SUFFIXES:
            continue
        if "default_model" in p.parts or p.suffix == ".json":
            continue
        out.append(p)
    return out


def pending_moves() -> list[tuple[Path, Path]]:
    base = ROOT / PKG
    return [
        (base / old, base / new)
        for old, new in FILE_MOVES.items()
        if (base / old).exists() and not (base / new).exists()
    ]


def move(dry: bool) -> list[str]:
    done = []
    for src, dst in pending_moves():
        done.append(f"git mv {src.relative_to(ROOT)} {dst.relative_to(ROOT)}")
        if not dry:
            dst.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", str(src), str(dst)], cwd=ROOT, check=True)
    for rel, text in NEW_PACKAGES.items():
        p = ROOT / PKG / rel
        if not p.exists():
            done.append(f"create {p.relative_to(ROOT)}")
            if not dry:
                p.write_text(text)
                subprocess.run(["git", "add", str(p)], cwd=ROOT, check=True)
    return done


def _ruff() -> str | None:
    for candidate in (ROOT / ".venv" / "bin" / "ruff", shutil.which("ruff")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything is pending")
    ap.add_argument("--readme", action="store_true", help="rewrite README.md too")
    args = ap.parse_args(argv)
    actions = move(dry=args.check)
    changed = []
    for p in _files(args.readme):
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite(text, p)
        if new != text:
            changed.append(p)
            if not args.check:
                p.write_text(new)
    for a in actions:
        print(a)
    for p in changed:
        print(f"rewrote {p.relative_to(ROOT)}")
    py = [str(p) for p in changed if p.suffix == ".py"]
    ruff = _ruff()
    if py and not args.check and ruff:
        subprocess.run([ruff, "check", "--fix", "--select", "I", "--quiet", *py], cwd=ROOT, check=False)
        subprocess.run([ruff, "format", "--quiet", *py], cwd=ROOT, check=False)
    if not actions and not changed:
        print("nothing to do: the layout is already the new one")
    return 1 if args.check and (actions or changed) else 0


if __name__ == "__main__":
    sys.exit(main())
