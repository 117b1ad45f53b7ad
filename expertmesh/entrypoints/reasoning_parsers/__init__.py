"""Reasoning parsers, registered by the name vLLM's `--reasoning-parser` uses: the text a model
writes between `<think>` and `</think>` goes to `reasoning_content`, the rest to `content`.

- deepseek_r1: the chat template opens `<think>` in the prompt, so the output is reasoning until
  `</think>` (a leading `<think>` is dropped too); without `</think>` it is all reasoning.
- qwen3, glm45: reasoning only when the output opens with `<think>` (thinking can be switched off,
  and then the output is plain content); it closes at `</think>`.
- openai_gptoss: gpt-oss's harmony analysis channel (entrypoints/harmony.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from expertmesh.entrypoints import harmony

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # True: the template opened <think> already
    splitter: Callable[[str], tuple[str | None, str]] | None = None  # a format without <think>

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole output."""
        if self.splitter is not None:
            return self.splitter(text)
        stripped = text.lstrip()
        opened = stripped.startswith(START)
        if not (opened or self.starts_in_reasoning):
            return None, text
        body = stripped[len(START) :] if opened else text
        if END not in body:
            return body, ""
        reasoning, content = body.split(END, 1)
        return reasoning, content.lstrip("\n")


REASONING_PARSERS = {
    p.name: p
    for p in (
        ReasoningParser("deepseek_r1", True),
        ReasoningParser("qwen3", False),
        ReasoningParser("glm45", False),
        ReasoningParser("openai_gptoss", False, harmony.split_reasoning),
    )
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """One choice's stream: feed() text deltas -> (reasoning delta, content delta); the pieces
    concatenate to `split` of the whole text."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser, self.text = parser, ""
        self.sent_reasoning, self.sent_content = 0, 0

    def _emit(self, final: bool) -> tuple[str, str]:
        reasoning, content = self.parser.split(self.text)
        if not final:
            # Undecided (the text could still open <think>), or a partial </think> at its end: hold.
            stripped = self.text.lstrip()
            if len(stripped) < len(START) and START.startswith(stripped):
                return "", ""
            if reasoning is not None and END not in self.text:
                reasoning = _without_partial(reasoning, END)
        r = (reasoning or "")[self.sent_reasoning :]
        c = content[self.sent_content :]
        self.sent_reasoning += len(r)
        self.sent_content += len(c)
        return r, c

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        return self._emit(final=True)


def _without_partial(text: str, marker: str) -> str:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text
