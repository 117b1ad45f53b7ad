"""Every relative link in the Markdown docs resolves: the file exists, and a `#fragment` names a
heading of the file it points into (GitHub's anchors). Docs move between files often (dated rounds
into docs/history/, the README into docs/); a link left behind fails here, not in a reader's
browser. Plain text, no imports of expertmesh: a few milliseconds."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
# (an optional "title" after a space is ignored). Reference-style links are not used here.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")


def doc_files() -> list[Path]:
    """The Markdown the project publishes: the README, docs/ (history included) and the folders'
    own READMEs."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted(p for p in ROOT.glob("*/README.md") if p.parent.name not in {".venv", "node_modules"})
    return [p for p in files if p.is_file()]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a fenced line reads as empty, so numbers still match)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_'
    removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.cache
def anchors(path: Path) -> set[str]:
    """Every anchor a Markdown file offers; a repeated heading gets GitHub's -1, -2 suffixes."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """'file:line: target (why)' for each relative link of `path` that does not resolve."""
    bad = []
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), 1):
        for target in LINK.findall(INLINE_CODE.sub("", line)):  # a link shown as code is not one
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}:{number}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment.lower() not in anchors(dest):
                bad.append(f"{where} (no heading with anchor #{fragment} in {dest.name})")
    return bad


# A page named in prose with a section in quotes: `docs/server.md, "Threads"`, `(benchmarks.md,
# "Dispatch figures")`. The name is looked up beside the page, at the root and in docs/.
SECTION_REF = re.compile(r'((?:[\w.-]+/)*[\w.-]+\.md)\)?[,:]?\s*\(?"([^"\n]{3,100})"')
BOLD = re.compile(r"\*\*(.+?)\*\*")
# A docs/ page named in source code or its comments (the C kernels and Python point there).
CODE_REF = re.compile(r"\bdocs/(?:[\w.-]+/)*[\w.-]+\.md\b")


@functools.cache
def named_places(path: Path) -> list[str]:
    """The headings of a page and its bold phrases (a bullet's lead-in is a place people name)."""
    lines = prose_lines(path.read_text(encoding="utf-8"))
    places = [m.group(2) for line in lines if (m := HEADING.match(line))]
    places += [b for line in lines for b in BOLD.findall(line)]
    return [p.replace("`", "").lower() for p in places]


def broken_section_names(path: Path) -> list[str]:
    """'file: page "section"' for each quoted section name that no heading or bold phrase of the
    page it names contains (prose joined across lines: a reference may wrap)."""
    text = " ".join(line.strip() for line in prose_lines(path.read_text(encoding="utf-8")))
    bad = []
    for page, section in SECTION_REF.findall(INLINE_CODE.sub(lambda m: m.group(0).strip("`"), text)):
        candidates = [path.parent / page, ROOT / page, ROOT / "docs" / page]
        dest = next((c for c in candidates if c.is_file()), None)
        if dest is None:
            bad.append(f'{path.relative_to(ROOT)}: {page} "{section}" (no such file)')
        elif not any(section.replace("`", "").lower() in place for place in named_places(dest)):
            bad.append(f'{path.relative_to(ROOT)}: {page} "{section}" (no such heading in {dest.name})')
    return bad


def source_files() -> list[Path]:
    return sorted(
        p
        for folder in ("expertmesh", "benchmarks", "tests", "tools", "examples")
        for p in (ROOT / folder).rglob("*")
        if p.suffix in {".py", ".c", ".h", ".sh"} and p.is_file() and p != Path(__file__).resolve()
    )  # this file's own examples are not references


# In code, a section named after a docs/ page with a comma: `docs/benchmarks.md, "Kernel figures"`
# (comment markers and line continuations dropped first, as a reference may wrap).
CODE_SECTION_REF = re.compile(r'\b(docs/(?:[\w.-]+/)*[\w.-]+\.md)\)?[,:]\s*\(?"([^"]{3,100})"')
COMMENT_LEAD = re.compile(r"^\s*(?:#+|//+|/\*+|\*+|\"\"\"|\'\'\')?\s*")


def code_section_refs(path: Path) -> list[tuple[str, str]]:
    """(page, section) for each section of a docs/ page named in `path`'s text."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    text = " ".join(COMMENT_LEAD.sub("", line).rstrip("\\ ").strip() for line in lines)
    return CODE_SECTION_REF.findall(text)


def test_the_docs_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in doc_files()}
    assert {"README.md", "docs/benchmarks.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    bad = broken_links(path)
    assert not bad, "broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_named_sections_exist(path: Path) -> None:
    bad = broken_section_names(path)
    assert not bad, "sections named in quotes that the page does not have:\n" + "\n".join(bad)


def test_docs_named_in_code_exist() -> None:
    bad = [
        f"{p.relative_to(ROOT)}: {ref}"
        for p in source_files()
        for ref in CODE_REF.findall(p.read_text(encoding="utf-8", errors="replace"))
        if not (ROOT / ref).is_file()
    ]
    assert not bad, "docs named in code that do not exist:\n" + "\n".join(bad)


def test_sections_named_in_code_exist() -> None:
    bad = [
        f'{p.relative_to(ROOT)}: {page} "{section}"'
        for p in source_files()
        for page, section in code_section_refs(p)
        if (ROOT / page).is_file()
        and not any(section.replace("`", "").lower() in place for place in named_places(ROOT / page))
    ]
    assert not bad, "sections named in code that the docs do not have:\n" + "\n".join(bad)


def test_the_checker_finds_what_is_broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself, on a page written here: a missing file, a missing anchor, and links
    that are fine (an existing file and heading, a URL, code) that it must leave alone."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading, with: punctuation\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Twice\n\n## Twice\n\n"
        "[ok](other.md) [ok](other.md#a-code-heading-with-punctuation) [ok](#twice-1) [ok](#page)\n"
        "[url](https://example.com/missing.md) `[code](missing-in-code.md)`\n"
        "```\n[fenced](missing-in-fence.md)\n```\n"
        "[gone](missing.md) ![gone](img/missing.png) [bad anchor](other.md#nowhere) [bad](#twice-2)\n"
    )
    bad = broken_links(page)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)",
        "img/missing.png (no such file)",
        "other.md#nowhere (no heading with anchor #nowhere in other.md)",
        "#twice-2 (no heading with anchor #twice-2 in page.md)",
    ]
    (tmp_path / "named.md").write_text(
        '# Named\n\nSee other.md, "A code heading" and (other.md, "Other\npage") and page.md, "Twice";\n'
        '`other.md` "with: punctuation" in code. **Bold lead-in**: text.\n\n'
        'Broken: other.md, "Nowhere"; named.md, "Bold lead"; gone.md, "Twice".\n'
    )
    code = tmp_path / "kernel.c"
    code.write_text(
        '/* Measured: docs/benchmarks.md, "Kernel\n * figures"; also docs/x.md: "Why" */ \\\n'
        'x = ["docs/a.md", "docs/b.md"]  # docs/c.md, "Z\n# and W"\n'
    )
    assert code_section_refs(code) == [
        ("docs/benchmarks.md", "Kernel figures"),
        ("docs/x.md", "Why"),
        ("docs/c.md", "Z and W"),
    ]
    assert [b.split(": ", 1)[1] for b in broken_section_names(tmp_path / "named.md")] == [
        'other.md "Nowhere" (no such heading in other.md)',
        'gone.md "Twice" (no such file)',
    ]
