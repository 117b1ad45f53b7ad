"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min.

Among the occurrences of the longest matching suffix, the latest one followed by k tokens is taken
(recent text is the likeliest to be copied again); when none has k tokens after it, the earliest
(the longest continuation there is). A sequence without a match drafts nothing and decodes as usual.
"""

from __future__ import annotations

import numpy as np


def _aligned(pos: int, width: int) -> bool:
    return pos % width == 0


def _latest(data: bytes, sub: bytes, end: int, width: int) -> int:
    """Byte offset of the last token-aligned occurrence of `sub` inside data[:end], or -1."""
    pos = data.rfind(sub, 0, end)
    while pos > 0 and not _aligned(pos, width):  # a match across token boundaries: look earlier
        pos = data.rfind(sub, 0, pos + len(sub) - 1)
    return pos


def _earliest(data: bytes, sub: bytes, end: int, width: int) -> int:
    """Byte offset of the first token-aligned occurrence of `sub` inside data[:end], or -1."""
    pos = data.find(sub, 0, end)
    while pos > 0 and not _aligned(pos, width):
        pos = data.find(sub, pos + 1, end)
    return pos


def propose_ngram(tokens: np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens` (1-D int array: prompt + output so far).

    The search runs over the tokens' bytes (bytes.rfind / find, C loops that need no array built
    per step): an occurrence of the suffix's bytes counts only at a token boundary."""
    length = len(tokens)
    if k < 1 or length < lookup_min + 1:
        return []
    data, width = tokens.tobytes(), tokens.itemsize
    if _earliest(data, data[(length - lookup_min) * width :], (length - 1) * width, width) < 0:
        return []  # not even the shortest suffix repeats (most steps of text that does not copy)
    for n in range(min(lookup_max, length - 1), lookup_min - 1, -1):
        suffix = data[(length - n) * width :]
        # The latest earlier copy followed by k tokens lies in tokens[: length - k] (k >= 1 keeps it
        # before the suffix itself); else the earliest copy anywhere before the last token.
        pos = _latest(data, suffix, max(0, length - k) * width, width)
        if pos < 0:
            pos = _earliest(data, suffix, (length - 1) * width, width)
        if pos >= 0:
            start = pos // width + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int) -> None:
        self.k, self.lookup_min, self.lookup_max = k, lookup_min, lookup_max

    def propose(self, tokens: np.ndarray, limit: int) -> list[int]:
        """At most min(k, limit) tokens continuing `tokens` (prompt + output so far)."""
        k = min(self.k, limit)
        if k < 1:
            return []
        return propose_ngram(tokens, k, self.lookup_min, self.lookup_max)


class TokenBuffer:
    """A sequence's tokens as a growing int32 array (half the bytes the lookup searches of int64),
    appended to rather than rebuilt each step."""

    def __init__(self) -> None:
        self.data = np.empty(64, dtype=np.int32)
        self.size = 0

    def sync(self, seq) -> np.ndarray:
        """`seq`'s tokens (a sequence's tokens only ever grow: preemption keeps them)."""
        n = seq.num_tokens
        if n > self.size:
            if n > len(self.data):
                grown = np.empty(max(n, 2 * len(self.data)), dtype=np.int32)
                grown[: self.size] = self.data[: self.size]
                self.data = grown
            self.data[self.size : n] = seq.tokens(self.size, n)
            self.size = n
        return self.data[:n]
