"""One interface for stepping an engine request by request, wherever its ranks run.

The server's engine thread (entrypoints/async_engine.py) drives an `EngineClient`: add and abort
requests, step, and read what each request gained in that step. `EngineStepper` is the client
for an `LLMEngine` in this process (one rank); it is also what each mp worker runs, and the mp
driver (executor/driver_client.py, over the mp workers or torchrun's ranks) merges the ranks'
step results into the same shape (`merge_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from expertmesh.engine.expert_load import GAUGE_EVERY, gauges
from expertmesh.engine.llm_engine import LLMEngine
from expertmesh.engine.sequence import Sequence, SequenceStatus
from expertmesh.outputs import Logprob, RequestOutput
from expertmesh.sampling_params import SamplingParams


@dataclass
class SeqProgress:
    """What one sequence gained in one step."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    final_text: str | None = None  # set in the step the sequence finished (cut at a stop string)


@dataclass
class StepResult:
    progress: dict[str, list[SeqProgress]] = field(default_factory=dict)  # only requests that gained
    finished: list[RequestOutput] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)  # this rank's numbers: EngineStepper.rank_stats
    started: list[str] = field(default_factory=list)  # requests scheduled for the first time this step


class EngineClient(Protocol):
    tokenizer: Any
    max_model_len: int

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> str | None:
        """Queue a request; returns why it cannot run (nothing is queued then), else None."""

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> StepResult: ...

    def check_health(self) -> None:
        """Raise if the engine can no longer step (called while idle)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class EngineStepper:
    """EngineClient over the LLMEngine of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self._seqs: dict[str, list[Sequence]] = {}
        self._seen: dict[str, list[int]] = {}  # output tokens already reported, per sequence
        self._num_added = 0
        self._unstarted: set[str] = set()  # added, never scheduled yet
        self._load: dict[str, Any] | None = None  # the last expert load snapshot, and its step
        self._load_step = -1

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> str | None:
        req = self.engine.add_request(request_id, prompt_token_ids, params, prompt)
        if req.error:
            self.engine.abort_request(request_id)  # drop it: it never runs
            return req.error
        self._seqs[request_id], self._seen[request_id] = req.seqs, [0] * len(req.seqs)
        self._num_added += 1
        self._unstarted.add(request_id)
        return None

    def abort_request(self, request_id: str) -> None:
        # Only requests this engine holds: an mp worker hears of every replica's aborts.
        if self._seqs.pop(request_id, None) is not None:
            del self._seen[request_id]
            self._unstarted.discard(request_id)
            self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> StepResult:
        finished = self.engine.step()
        started = [rid for rid in self._unstarted if self._was_scheduled(rid)]
        self._unstarted.difference_update(started)
        progress = {rid: p for rid in self._seqs if (p := self._progress(rid))}
        for out in finished:
            self._seqs.pop(out.request_id, None)
            self._seen.pop(out.request_id, None)
            self._unstarted.discard(out.request_id)
        return StepResult(progress, finished, self.rank_stats(), started)

    def _was_scheduled(self, request_id: str) -> bool:
        """Has any sequence of this request left the waiting queue (run, or finished)?"""
        return any(s.status != SequenceStatus.WAITING for s in self._seqs.get(request_id, ()))

    def _progress(self, request_id: str) -> list[SeqProgress]:
        seen, out = self._seen[request_id], []
        for seq in self._seqs[request_id]:
            start, end = seen[seq.index], len(seq.output_token_ids)
            if end == start:
                continue
            seen[seq.index] = end
            logprobs = seq.logprobs[start:end] if seq.logprobs is not None else None
            text = self.engine.detok.final_text(seq) if seq.is_finished else None
            out.append(SeqProgress(seq.index, seq.output_token_ids[start:end], logprobs, text))
        return out

    def check_health(self) -> None:
        pass

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self.engine.detok.decode(token_ids, skip_special_tokens)

    def rank_stats(self) -> dict[str, Any]:
        """This rank's numbers (counters since start, gauges now); `merge_stats` combines ranks."""
        stats, sched, traffic = self.engine.stats(), self.engine.scheduler, self.engine.traffic()
        return {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_blocks_total": stats["kv_blocks_total"],
            "kv_blocks_free": stats["kv_blocks_free"],
            "num_preemptions_total": stats["preemptions"],
            "prefix_cache_hits_total": stats["prefix_cache_hits"],  # tokens
            "prefix_cache_queries_total": stats["prefix_cache_queries"],
            "requests_added_total": self._num_added,
            "all2all_bytes_sent_total": traffic["bytes_sent"],
            "all2all_bytes_received_total": traffic["bytes_received"],
            "spec_decode_num_drafts_total": stats.get("spec_decode_num_drafts", 0),
            "spec_decode_num_draft_tokens_total": stats.get("spec_decode_num_draft_tokens", 0),
            "spec_decode_num_accepted_tokens_total": stats.get("spec_decode_num_accepted_tokens", 0),
            "spec_decode_num_accepted_tokens_per_pos": list(
                stats.get("spec_decode_num_accepted_tokens_per_pos", [])
            ),
            **gauges(self._expert_load()),
        }

    def _expert_load(self) -> dict[str, Any] | None:
        """A fresh snapshot every GAUGE_EVERY forwards: a collective, taken at the same step on
        every rank (they all call rank_stats() after every step)."""
        load = self.engine.expert_load
        if load is not None and (self._load is None or load.steps - self._load_step >= GAUGE_EVERY):
            self._load, self._load_step = load.snapshot(), load.steps
        return self._load

    def stats(self) -> dict[str, Any]:
        """The /metrics numbers of this engine, in `merge_stats`'s shape (one DP replica)."""
        return merge_stats({0: self.rank_stats()}, [0])

    def close(self) -> None:
        pass


# Numbers of a DP replica (read from its leader): one list entry per replica once merged.
REPLICA_STATS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_blocks_total",
    "kv_blocks_free",
    "num_preemptions_total",
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
    "requests_added_total",
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos",  # a list by draft position
)
# Every rank moves its own MoE traffic: summed over all ranks.
RANK_STATS = ("all2all_bytes_sent_total", "all2all_bytes_received_total")
# The same on every rank (a collective snapshot: engine/expert_load.py): read from the first.
SHARED_STATS = tuple(gauges(None))


def merge_stats(per_rank: dict[int, dict[str, Any]], leaders: list[int]) -> dict[str, Any]:
    """Ranks' `rank_stats` as one dict: REPLICA_STATS as a list by DP replica (from `leaders`,
    replica order), RANK_STATS summed over every rank, SHARED_STATS from the lowest rank; a key a
    rank lacks counts as 0 (or as no samples)."""
    merged: dict[str, Any] = {k: [per_rank[r].get(k, 0) for r in leaders] for k in REPLICA_STATS}
    for key in RANK_STATS:
        merged[key] = sum(s.get(key, 0) for s in per_rank.values())
    first = per_rank[min(per_rank)]
    for key in SHARED_STATS:
        merged[key] = first.get(key, {})
    return merged
