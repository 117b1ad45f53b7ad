"""Speculation switched off for a while per sequence whose drafts keep being rejected.

A rejected draft costs a wider forward for nothing; on text that does not repeat itself that would
make decoding slower than without speculation. Each sequence keeps a decayed count of drafted and
accepted tokens; while its acceptance is below `min_acceptance` it skips drafting for a number of
steps that doubles with each failed retry (up to `max_backoff`). Every rank of a replica sees the
same broadcast acceptance, so every rank takes the same decisions (and drafts the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from expertmesh.spec_decode.ngram import TokenBuffer

DECAY = 0.8  # weight of the past in the per-sequence counts


@dataclass
class SpecState:
    drafted: float = 0.0
    accepted: float = 0.0
    skip: int = 0  # steps left without drafting
    backoff: int = 0  # length of the next pause
    tokens: TokenBuffer = field(default_factory=TokenBuffer)  # the sequence's tokens, for the proposer


class AdaptiveGate:
    def __init__(self, min_acceptance: float = 0.3, min_backoff: int = 4, max_backoff: int = 64) -> None:
        self.min_acceptance, self.min_backoff, self.max_backoff = min_acceptance, min_backoff, max_backoff

    def may_draft(self, state: SpecState) -> bool:
        if state.skip > 0:
            state.skip -= 1
            return False
        return True

    def observe(self, state: SpecState, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        state.drafted = DECAY * state.drafted + drafted
        state.accepted = DECAY * state.accepted + accepted
        if state.accepted < self.min_acceptance * state.drafted:
            state.backoff = min(self.max_backoff, max(self.min_backoff, 2 * state.backoff))
            state.skip = state.backoff
            state.drafted = state.accepted = 0.0  # the next try starts afresh
        else:
            state.backoff = 0
