"""What the scheduler asks for a decoding sequence's draft: the proposer behind the adaptive gate,
and the counters of what verification accepted."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from expertmesh.engine.sequence import Sequence
from expertmesh.spec_decode.adaptive import AdaptiveGate, SpecState
from expertmesh.spec_decode.config import SpeculativeConfig
from expertmesh.spec_decode.mtp import MTPProposer
from expertmesh.spec_decode.ngram import NgramProposer
from expertmesh.spec_decode.stats import SpecDecodeStats

if TYPE_CHECKING:
    from expertmesh.config import EngineConfig
    from expertmesh.engine.model_runner import ModelRunner

log = logging.getLogger("expertmesh")


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
        # MTP: the drafts planned in this step's scheduling, (sequence, its draft list) each: the
        # lists hold placeholders until `fill` runs the MTP layer over all of them at once.
        self.planned: list[tuple[Sequence, list[int]]] = []

    @staticmethod
    def _state(seq: Sequence) -> SpecState:
        state = getattr(seq, "spec_state", None)
        if state is None:
            state = seq.spec_state = SpecState()
        return state

    def drafts_at(self, num_decoding: int) -> bool:
        """Whether sequences draft in a step where `num_decoding` decode: none while more than
        `max_batch` do (asked once a step, so a wide batch pays nothing per sequence)."""
        return num_decoding <= self.max_batch

    def draft(self, seq: Sequence, limit: int) -> list[int]:
        """Draft tokens for decoding sequence `seq`, at most `limit` (its token budget, max_tokens,
        the free KV slots), in a step where `drafts_at` said yes."""
        if limit < 1 or getattr(seq, "grammar", None) is not None:
            return []  # structured outputs: the grammar's state cannot be rolled back
        state = self._state(seq)
        if self.gate is not None and not self.gate.may_draft(state):
            return []
        if self.mtp is not None:
            draft = [0] * self.mtp.plan(seq, limit)  # filled in by `fill`
            if draft:
                self.planned.append((seq, draft))
            return draft
        if self.gate is not None:  # the length the sequence's recent acceptance pays for
            limit = min(limit, self.gate.length(state, self.config.num_speculative_tokens))
        return self.proposer.propose(state.tokens.sync(seq), limit)

    def fill(self) -> None:
        """After a step's scheduling: the MTP drafts planned in it computed (in place, so the batch's
        lists hold them). Every rank calls it each step: the MTP layer's collectives run in it."""
        if self.mtp is None:
            return
        planned, self.planned = self.planned, []
        drafts = self.mtp.run([(seq, len(d)) for seq, d in planned])
        for (_, draft), tokens in zip(planned, drafts, strict=True):
            draft[:] = tokens

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


def build_drafter(config: EngineConfig, runner: ModelRunner, block_size: int) -> Drafter | None:
    """The engine's drafter for its `speculative_config` (None without one). Hybrid models verify
    too: their recurrent layers keep the state after each draft position (state_cache.DraftStates)."""
    spec = config.speculative_config
    if spec is None:
        return None
    log.info("speculative decoding: %s", spec)
    if spec.method != "mtp":
        return Drafter(spec)
    pp = runner.groups.pp
    if pp.rank_in_group == pp.world_size - 1 and getattr(runner.model, "mtp", None) is None:
        # the builder attaches it to the last stage for method="mtp"; the runner keeps the hidden states
        raise ValueError("speculative_config method='mtp': the model was built without its MTP layer")
    return Drafter(spec, mtp=MTPProposer(runner, spec.num_speculative_tokens, block_size))
