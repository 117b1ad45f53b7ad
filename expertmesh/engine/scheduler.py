"""Continuous batching with chunked prefill: each step spends a budget of
`max_num_batched_tokens` tokens, decodes first, then prompts part way through their prefill, then
new sequences; a prompt longer than what is left of the budget is split over steps (chunked
prefill; without it a prompt waits until it fits whole).

A sequence's next chunk starts at its `num_computed_tokens`; a new one starts after its prefix
cache hits (block_manager.py). Only a step that computes a sequence's last token samples for it.
When a running sequence needs a block and none is free, the newest running sequence not yet in
the step is preempted: its blocks are freed and it returns to the front of the queue, to be
recomputed (from whatever of it the prefix cache still holds).

With `exact_recompute` (deterministic mode) a preempted sequence is computed again the way it was
first computed, so its logprobs keep their bits: its prompt in the chunks it was first prefilled
in (`Sequence.prompt_chunk_ends`; a chunk that does not fit this step's budget waits for one that
does), its decoded positions as decode rows (`ScheduledBatch.replays`: one decode row a position,
each seeing the positions up to its own, as the speculative verify rows do). A recurrent layer's
prefill rounds apart from its decode steps (its convolution sums in another order; off our
kernels the chunked scan too), and an attention layer's prefill path apart from its paged decode.

The samples of an `n > 1` request share its prompt: with prefix caching, samples 1..n-1 wait
until sample 0 has computed the prompt, then start from its cached full blocks and compute only
the last partial block (without it each would compute the whole prompt again).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from expertmesh.config import SchedulerConfig
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)  # one new token each (and its draft)
    prefills: list[Sequence] = field(default_factory=list)  # several: a whole prompt or a chunk of it
    num_new: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens computed this step
    # seq_id -> the draft tokens a decoding sequence is verified with (spec_decode/): its
    # num_new counts them; it stays a decode, one decode row per token (model_runner.prepare).
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # seq_ids of decodes that recompute positions a preempted sequence had decoded: num_new decode
    # rows, the last sampled if it is the sequence's last token (exact_recompute)
    replays: set[int] = field(default_factory=set)

    def add(
        self, seq: Sequence, num_tokens: int, draft: list[int] | None = None, replay: bool = False
    ) -> None:
        (self.decodes if num_tokens == 1 or draft or replay else self.prefills).append(seq)
        self.num_new[seq.seq_id] = num_tokens
        if draft:
            self.drafts[seq.seq_id] = draft
        if replay:
            self.replays.add(seq.seq_id)

    @property
    def seqs(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new.values())

    def completes(self, seq: Sequence) -> bool:
        """Whether this step computes `seq`'s last token (and so samples its next one)."""
        drafted = len(self.drafts.get(seq.seq_id, ()))
        return seq.num_computed_tokens + self.num_new[seq.seq_id] - drafted == seq.num_tokens

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences a token is sampled for, in batch order (partial chunks are left out)."""
        return [s for s in self.seqs if self.completes(s)]

    def __bool__(self) -> bool:
        return bool(self.num_new)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, blocks: BlockManager, drafter=None, exact_recompute: bool = False
    ) -> None:
        self.config, self.blocks = config, blocks
        self.exact_recompute = exact_recompute
        self.drafter = drafter  # spec_decode.drafter.Drafter, or None: no speculation
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.first_samples: dict[str, Sequence] = {}  # request id -> sample 0 of an n > 1 request

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        if seq.index == 0 and seq.params.n > 1:
            self.first_samples[seq.request_id] = seq

    def _waits_for_its_prompt(self, seq: Sequence) -> bool:
        """A later sample whose sample 0 is still computing a prompt of at least one full block."""
        if seq.index == 0 or seq.scheduled_once or not self.blocks.enable_prefix_caching:
            return False
        first = self.first_samples.get(seq.request_id)
        if first is None or first.is_finished or first.num_computed_tokens >= len(first.prompt_token_ids):
            return False
        return (len(seq.prompt_token_ids) - 1) // self.blocks.block_size > 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        self._schedule_waiting(batch, budget)
        if self.drafter is not None:
            self.drafter.fill()  # MTP drafts: their lengths were planned above, their tokens now
        return batch

    def _chunk(self, remaining: int, budget: int) -> int:
        """Tokens to compute now of `remaining`: all, or a chunk, or none (it waits)."""
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else 0

    def _next(self, seq: Sequence, start: int, budget: int) -> tuple[int, bool]:
        """(tokens of `seq` to compute from `start` this step, whether they are replayed decode rows)."""
        prompt = len(seq.prompt_token_ids)
        if not self.exact_recompute or seq.num_tokens - start <= 1:
            return self.blocks.chunk_end(seq, start, self._chunk(seq.num_tokens - start, budget)), False
        if start >= prompt:  # positions it decoded before it was preempted
            return self._chunk(seq.num_tokens - start, budget), True
        n = self._chunk(prompt - start, budget)  # the prompt's chunks first, then decode rows
        later = [e for e in seq.prompt_chunk_ends if e > start]
        if later:  # one first chunk a step, whole (two merged would scan differently)
            if later[0] <= start + n:
                return later[0] - start, False
            if later[0] - start <= self.config.max_num_batched_tokens:
                return 0, False  # it waits for a step with room for the chunk
        return self.blocks.chunk_end(seq, start, n), False

    def _note_chunk(self, seq: Sequence, start: int, n: int, replay: bool) -> None:
        """Keep where a scheduled prompt chunk starts and ends (exact_recompute): a recompute
        after preemption cuts the prompt at the same places."""
        if self.exact_recompute and not replay and start < len(seq.prompt_token_ids):
            seq.prompt_chunk_ends = sorted({*seq.prompt_chunk_ends, *([start] if start else []), start + n})

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        # Decodes first (stable sort), so a long prompt's chunks never delay them.
        self._num_decoding = sum(s.num_uncomputed == 1 for s in self.running)
        # Whether any sequence may draft this step (the batch rule, checked once a step).
        drafting = self.drafter is not None and self.drafter.drafts_at(self._num_decoding)
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted for an earlier one in this loop
            n, replay = self._next(seq, seq.num_computed_tokens, budget)
            if n == 0 or not self._make_room(seq, seq.num_computed_tokens + n, batch):
                continue
            draft = self._draft(seq, budget) if drafting and seq.num_uncomputed == 1 else []
            self.blocks.grow(seq, seq.num_computed_tokens + n + len(draft))
            self._note_chunk(seq, seq.num_computed_tokens, n, replay)
            batch.add(seq, n + len(draft), draft, replay)
            budget -= n + len(draft)
        return budget

    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """A decoding sequence's draft, within the step's budget, its max_tokens (the token after
        the draft is always sampled) and the free blocks: a draft never preempts anyone."""
        room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
        left = seq.max_output_tokens() - len(seq.output_token_ids)
        limit = min(budget - 1, left - 1, room - seq.num_computed_tokens - 1)
        return self.drafter.draft(seq, limit)

    def _make_room(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Preempt the newest running sequences not in the step until `seq` can hold `num_tokens`;
        False (and `seq` preempted) when even that is not enough."""
        while not self.blocks.can_grow(seq, num_tokens):
            victims = [s for s in self.running if s is not seq and s.seq_id not in batch.num_new]
            if not victims:
                self._preempt(seq)
                return False
            self._preempt(victims[-1])
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        held: list[Sequence] = []  # later samples waiting for their prompt: they keep their place
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._waits_for_its_prompt(seq):
                held.append(self.waiting.popleft())
                continue
            hits = self.blocks.cached_prefix(seq)
            start = len(hits) * self.blocks.block_size
            n, replay = self._next(seq, start, budget)
            if n == 0 or not self.blocks.can_allocate(seq, hits, start + n):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, hits, start + n)
            if not seq.scheduled_once:
                seq.num_cached_tokens, seq.scheduled_once = start, True
            seq.status = SequenceStatus.RUNNING
            self._note_chunk(seq, start, n, replay)
            batch.add(seq, n, replay=replay)
            budget -= n
            self.running.append(seq)
        self.waiting.extendleft(reversed(held))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Return a finished (or aborted) sequence's blocks and forget it."""
        self.blocks.free(seq)
        if self.first_samples.get(seq.request_id) is seq:
            del self.first_samples[seq.request_id]
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
