"""Incremental detokenization: a sequence's text grown a few tokens at a time (constant work a
token), for the server's streams and the engine's stop strings."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    """Emits the new suffix of a sequence's text each step.

    `decoded` builds the text incrementally, as vLLM's detokenizer does: each step decodes only
    the tokens since the last stable point plus the few before them (their context: a suffix
    alone can decode differently, a SentencePiece word's leading space), so a token costs the
    same at position 10 and 10,000. `delta` holds back what may still change: an incomplete
    UTF-8 character, or a tail that could be the start of a stop string (the finished text, the
    engine's whole decode, is cut before it).
    """

    def __init__(self, hold: int) -> None:
        self.sent, self.hold = "", hold
        self.text = ""  # the stable text decoded so far
        self.prefix = self.read = 0  # tokens[prefix:read]: the context; tokens[read:]: not yet in text

    def decoded(self, tokens: list[int], decode: Callable[[list[int]], str]) -> str:
        """The text of `tokens` (which only grow), decoding only its last few tokens."""
        context = decode(tokens[self.prefix : self.read])
        window = decode(tokens[self.prefix :])
        if len(window) > len(context) and not window.endswith("\ufffd"):
            self.text += window[len(context) :]
            self.prefix, self.read = self.read, len(tokens)
        return self.text

    def delta(self, text: str, finished: bool) -> str:
        if not finished:
            if text.endswith("\ufffd"):
                return ""
            text = text[: max(0, len(text) - self.hold)]
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new
