"""Prompt-lookup (n-gram) drafts: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, for n from prompt_lookup_max down to prompt_lookup_min.

Among the occurrences of the longest matching suffix, the latest one followed by k tokens is taken
(recent text is the likeliest to be copied again); when none has k tokens after it, the earliest
(the longest continuation there is). A sequence without a match drafts nothing and decodes as usual.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(tokens: np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens` (1-D int array: prompt + output so far)."""
    length = len(tokens)
    if k < 1 or length < lookup_min + 1:
        return []
    # Candidate ends j (< length - 1, so a token follows) of an earlier copy of the suffix; match[j]
    # counts how many of the suffix's tokens, read backwards, agree there (capped at lookup_max).
    ends = np.flatnonzero(tokens[: length - 1] == tokens[-1])
    if ends.size == 0:
        return []
    match = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for m in range(1, min(lookup_max, length - 1)):
        back = ends - m
        ok = alive & (back >= 0)
        ok[ok] = tokens[back[ok]] == tokens[length - 1 - m]
        match += ok
        alive = ok
        if not alive.any():
            break
    for n in range(min(lookup_max, int(match.max())), lookup_min - 1, -1):
        hits = ends[match >= n]
        if hits.size == 0:
            continue
        full = hits[hits + k < length]  # followed by k tokens
        start = (full[-1] if full.size else hits[0]) + 1
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
    """A sequence's tokens as a growing int64 array, appended to rather than rebuilt each step."""

    def __init__(self) -> None:
        self.data = np.empty(64, dtype=np.int64)
        self.size = 0

    def sync(self, seq) -> np.ndarray:
        """`seq`'s tokens (a sequence's tokens only ever grow: preemption keeps them)."""
        n = seq.num_tokens
        if n > self.size:
            if n > len(self.data):
                grown = np.empty(max(n, 2 * len(self.data)), dtype=np.int64)
                grown[: self.size] = self.data[: self.size]
                self.data = grown
            self.data[self.size : n] = seq.tokens(self.size, n)
            self.size = n
        return self.data[:n]
