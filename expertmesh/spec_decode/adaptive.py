"""Per sequence: whether to draft at all, and how long a draft to propose.

Pause. A rejected draft costs a wider forward for nothing; on text that does not repeat itself that
would make decoding slower than without speculation. Each sequence keeps a decayed count of drafted
and accepted tokens; while its acceptance is below `min_acceptance` it skips drafting for a number
of steps that doubles with each failed retry (up to `max_backoff`).

Length. A copying sequence accepts long runs, a wandering one a token or two; a fixed k wastes verify
rows on the second and leaves tokens on the table on the first. From the sequence's recent drafts
the gate estimates q, the chance that the next draft token is accepted given the ones before it
were (accepted tokens / (accepted tokens + rejections), decayed, so a copy run shows within a few
steps); a draft of d tokens then yields 1 + q + ... + q^d tokens in expectation, for a step that
costs about 1 + ROW_COST * d one-row steps, and the gate proposes the d <= k with the most tokens
per cost. ROW_COST is a fixed guess, not a measurement: replayed offline with the measured step-cost
curves of an overhead-bound tiny model and of a random Mixtral whose rows route to new experts, the
lengths it chose were within 0.07x (in speedup) of those each model's own curve gives
(docs/speculative_decoding.md), and a fixed number keeps every rank of a replica deciding alike,
from the broadcast acceptance only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from expertmesh.spec_decode.ngram import TokenBuffer

DECAY = 0.8  # weight of the past in the per-sequence counts of the pause rule
RUN_DECAY = 0.6  # ... and in the length rule's (a copy run starts and ends abruptly)
ROW_COST = 0.1  # a verify row's assumed cost, in one-row decode steps (see the module docstring)
PRIOR = (3.0, 1.0)  # (accepted, rejections) a sequence starts with: q = 0.75, a draft of ~5


@dataclass
class SpecState:
    drafted: float = 0.0
    accepted: float = 0.0
    skip: int = 0  # steps left without drafting
    backoff: int = 0  # length of the next pause
    tokens: TokenBuffer = field(default_factory=TokenBuffer)  # the sequence's tokens, for the proposer
    run_accepted: float = PRIOR[0]  # the length rule's decayed accepted tokens
    run_rejected: float = PRIOR[1]  # ... and rejections (drafts cut short)


@lru_cache(maxsize=4096)
def best_length(q_64: int, k: int) -> int:
    """The draft length d in 1..k with the most expected tokens (1 + q + ... + q^d) per step cost
    (1 + ROW_COST * d), q = q_64 / 64 (quantised, so the answers are cached)."""
    q = q_64 / 64
    best, best_d, expected, power = 0.0, 1, 1.0, 1.0
    for d in range(1, k + 1):
        power *= q
        expected += power
        value = expected / (1 + ROW_COST * d)
        if value > best:
            best, best_d = value, d
    return best_d


class AdaptiveGate:
    def __init__(self, min_acceptance: float = 0.3, min_backoff: int = 4, max_backoff: int = 64) -> None:
        self.min_acceptance, self.min_backoff, self.max_backoff = min_acceptance, min_backoff, max_backoff

    def may_draft(self, state: SpecState) -> bool:
        if state.skip > 0:
            state.skip -= 1
            return False
        return True

    @staticmethod
    def length(state: SpecState, k: int) -> int:
        """How many tokens (1..k) to draft now (see the module docstring)."""
        q = state.run_accepted / (state.run_accepted + state.run_rejected)
        return best_length(round(q * 64), k)

    def observe(self, state: SpecState, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        state.run_accepted = RUN_DECAY * state.run_accepted + accepted
        state.run_rejected = RUN_DECAY * state.run_rejected + (accepted < drafted)
        state.drafted = DECAY * state.drafted + drafted
        state.accepted = DECAY * state.accepted + accepted
        if state.accepted < self.min_acceptance * state.drafted:
            state.backoff = min(self.max_backoff, max(self.min_backoff, 2 * state.backoff))
            state.skip = state.backoff
            state.drafted = state.accepted = 0.0  # the next try starts afresh
        else:
            state.backoff = 0
