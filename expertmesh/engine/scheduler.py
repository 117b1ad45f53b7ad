"""Continuous batching: every step runs the running decodes plus as many new prefills as fit.

When a running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it returns to the front of the queue, to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from expertmesh.config import SchedulerConfig
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[Sequence] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_tokens for s in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config, self.blocks = config, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._schedule_decodes(batch)
        self._schedule_prefills(batch)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        kept: deque[Sequence] = deque()
        while self.running:
            seq = self.running.popleft()
            while not self.blocks.can_grow(seq, seq.num_tokens):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    break
            if not self.blocks.can_grow(seq, seq.num_tokens):
                self._preempt(seq)
                continue
            self.blocks.grow(seq, seq.num_tokens)
            batch.decodes.append(seq)
            kept.append(seq)
        self.running = kept

    def _schedule_prefills(self, batch: ScheduledBatch) -> None:
        budget = self.config.max_num_batched_tokens - len(batch.decodes)
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > budget or not self.blocks.can_grow(seq, seq.num_tokens):
                break
            self.waiting.popleft()
            self.blocks.grow(seq, seq.num_tokens)
            seq.status = SequenceStatus.RUNNING
            budget -= seq.num_tokens
            batch.prefills.append(seq)
            self.running.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Return a finished (or aborted) sequence's blocks and forget it."""
        self.blocks.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
