"""Counters of drafts and acceptance, named as vLLM's Prometheus metrics name them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_spec_tokens: int
    num_drafts: int = 0  # verifications of a non-empty draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position i

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification: the accepted ones plus the bonus (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }

    def clear(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.num_spec_tokens
