"""Tool-call parsers, registered by the name vLLM's `--tool-call-parser` uses.

A parser is a small declaration: the markers that open (and, where the format has one, close) a
call, and `parse(text) -> (content, calls)`. A call whose body is malformed stays in the content,
so a model's bad call reaches the client as text, never as a 500. `ToolStream` runs any parser on
a stream: content before the first marker goes out as it comes; from the marker on, text is held
and each call is sent once its close marker arrives (or at the end), so the concatenated stream
equals the whole-text parse.
"""

from __future__ import annotations

from expertmesh.entrypoints.tool_parsers import formats  # noqa: F401 -- registers the parsers
from expertmesh.entrypoints.tool_parsers.base import (  # noqa: F401 -- the package's API
    TOOL_PARSERS,
    ToolCall,
    ToolParser,
    call_of,
    register,
)


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def tool_parser_names() -> list[str]:
    return sorted(TOOL_PARSERS)


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin a marker (held back from content)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class ToolStream:
    """One choice's stream through a parser: feed() text deltas, finish() at the end; both return
    (content delta, new calls)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser, self.text = parser, ""
        self.sent_content = ""
        self.sent_calls: list[ToolCall] = []

    def _start(self) -> int | None:
        if self.parser.at_start_only:
            stripped = self.text.lstrip()
            if not stripped:
                return None
            lead = len(self.text) - len(stripped)
            if any(stripped.startswith(m) for m in self.parser.starts):
                return lead
            if any(m.startswith(stripped) for m in self.parser.starts):
                return None  # could still become a marker
            return -1  # plain text: no call can follow
        found = [i for i in (self.text.find(m) for m in self.parser.starts) if i >= 0]
        return min(found) if found else None

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        start = self._start()
        if start == -1:
            out, self.sent_content = self.text[len(self.sent_content) :], self.text
            return out, []
        if start is None:  # no marker yet: send what cannot be the start of one
            safe = (
                0
                if self.parser.at_start_only
                else len(self.text) - _held_suffix(self.text, self.parser.starts)
            )
            out = self.text[len(self.sent_content) : safe] if safe > len(self.sent_content) else ""
            self.sent_content += out
            return out, []
        out = self.text[len(self.sent_content) : start] if start > len(self.sent_content) else ""
        self.sent_content += out
        calls: list[ToolCall] = []
        end = self.parser.end
        if end and end in self.text[start:]:
            closed = self.text[: self.text.rindex(end) + len(end)]
            _, done = self.parser.parse(closed)
            if done[: len(self.sent_calls)] == self.sent_calls:
                calls = done[len(self.sent_calls) :]
                self.sent_calls += calls
        return out, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.parse(self.text)
        if content.startswith(self.sent_content):
            out = content[len(self.sent_content) :]
        else:  # cannot happen for the registered parsers (text before a marker is content)
            out = ""
        new = calls[len(self.sent_calls) :] if calls[: len(self.sent_calls)] == self.sent_calls else []
        self.sent_content += out
        self.sent_calls += new
        return out, new
