"""What the scheduler asks for a decoding sequence's draft: the proposer behind the adaptive gate,
and the counters of what verification accepted."""

from __future__ import annotations

from typing import Any

from expertmesh.engine.sequence import Sequence
from expertmesh.spec_decode.adaptive import AdaptiveGate, SpecState
from expertmesh.spec_decode.config import SpeculativeConfig
from expertmesh.spec_decode.ngram import NgramProposer
from expertmesh.spec_decode.stats import SpecDecodeStats


class Drafter:
    def __init__(self, config: SpeculativeConfig, adaptive: bool = True, mtp: Any = None) -> None:
        """`mtp`: the MTP proposer (spec_decode/mtp.py) when config.method is "mtp"."""
        if (config.method == "mtp") != (mtp is not None):
            raise ValueError(f"speculative_config method={config.method!r} has no drafter here")
        self.config = config
        self.mtp = mtp
        self.proposer = (
            NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
            if mtp is None
            else None
        )
        self.gate = AdaptiveGate() if adaptive else None
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.max_batch = config.max_batch

    @staticmethod
    def _state(seq: Sequence) -> SpecState:
        state = getattr(seq, "spec_state", None)
        if state is None:
            state = seq.spec_state = SpecState()
        return state

    def draft(self, seq: Sequence, limit: int, num_decoding: int = 1) -> list[int]:
        """Draft tokens for decoding sequence `seq`, at most `limit` (its token budget, max_tokens);
        none while more than `max_batch` sequences decode (`num_decoding`)."""
        if limit < 1 or num_decoding > self.max_batch or getattr(seq, "grammar", None) is not None:
            return []  # structured outputs: the grammar's state cannot be rolled back
        state = self._state(seq)
        if self.gate is not None and not self.gate.may_draft(state):
            return []
        if self.mtp is not None:
            return self.mtp.propose(seq, limit)
        return self.proposer.propose(state.tokens.sync(seq), limit)

    def describe(self) -> str:
        """One line for people: the acceptance so far."""
        s, c = self.stats, self.config
        return (
            f"speculative decoding ({c.method}, k={c.num_speculative_tokens}): acceptance rate "
            f"{s.acceptance_rate:.2f} ({s.num_accepted_tokens} of {s.num_draft_tokens} draft tokens in "
            f"{s.num_drafts} drafts), mean acceptance length {s.mean_acceptance_length:.2f}"
        )

    def observe(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        self.stats.observe(num_draft, num_accepted)
        if self.gate is not None:
            self.gate.observe(self._state(seq), num_draft, num_accepted)
