"""One generation stream: prompt tokens, generated tokens, its KV blocks and its sampling state."""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from expertmesh.outputs import Logprob
from expertmesh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from expertmesh.engine.incremental_text import IncrementalText

_ids = itertools.count()


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(
        self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, max_len: int
    ) -> None:
        self.seq_id = next(_ids)
        self.request_id, self.index, self.params = request_id, index, params
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # leading tokens whose K/V are in the cache
        # Prompt tokens found in the prefix cache when the sequence was first scheduled (vLLM's
        # RequestOutput.num_cached_tokens), and the prefix-cache keys of its full blocks so far.
        self.num_cached_tokens = 0
        self.block_keys: list[bytes] = []
        self.num_keyed_blocks = 0  # leading blocks of block_table already offered to the cache
        self.state_slot: int | None = None  # its row of the recurrent-state cache (hybrid models)
        self.scheduled_once = False
        self.max_len = max_len  # prompt + output never exceeds this (max_model_len, KV capacity)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""
        self.stop_scan: IncrementalText | None = None  # the detokenizer's stop-string state
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Prompt logprobs by token index (the first has none, as in vLLM), when asked for.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self.num_preemptions = 0
        # Where its prompt's prefill chunks ended (and a prefix hit started it) when first computed:
        # a recompute after preemption cuts there too (deterministic mode, engine/scheduler.py).
        self.prompt_chunk_ends: list[int] = []
        # A per-request generator makes seeded sampling independent of the rest of the batch.
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V the next steps must still compute (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    def max_output_tokens(self) -> int:
        limit = self.max_len - len(self.prompt_token_ids)
        return limit if self.params.max_tokens is None else min(limit, self.params.max_tokens)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason, self.stop_reason = reason, stop_reason
