"""One interface for stepping an engine request by request, wherever its ranks run.

The server's engine thread (entrypoints/async_engine.py) drives an `EngineClient`: add and abort
requests, step, and read what each request gained in that step. `EngineStepper` is the client
for an `LLMEngine` in this process (one rank); it is also what each mp worker runs, and the mp
driver (executor/mp_client.py) merges the workers' step results into the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from expertmesh.engine.expert_load import GAUGE_EVERY, gauges
from expertmesh.engine.llm_engine import LLMEngine
from expertmesh.engine.sequence import Sequence
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
    stats: dict[str, Any] = field(default_factory=dict)  # metric name -> value, see EngineStepper.stats


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
        return None

    def abort_request(self, request_id: str) -> None:
        # Only requests this engine holds: an mp worker hears of every replica's aborts.
        if self._seqs.pop(request_id, None) is not None:
            del self._seen[request_id]
            self.engine.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def step(self) -> StepResult:
        finished = self.engine.step()
        progress = {rid: p for rid in self._seqs if (p := self._progress(rid))}
        for out in finished:
            self._seqs.pop(out.request_id, None)
            self._seen.pop(out.request_id, None)
        return StepResult(progress, finished, self.stats())

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

    def stats(self) -> dict[str, Any]:
        """The /metrics numbers of this rank (counters since start, gauges now)."""
        stats, sched, traffic = self.engine.stats(), self.engine.scheduler, self.engine.traffic()
        return {
            "num_requests_running": len(sched.running),
            "num_requests_waiting": len(sched.waiting),
            "kv_blocks_total": stats["kv_blocks_total"],
            "kv_blocks_free": stats["kv_blocks_free"],
            "num_preemptions_total": stats["preemptions"],
            "all2all_bytes_sent_total": traffic["bytes_sent"],
            "all2all_bytes_received_total": traffic["bytes_received"],
            "dp_replica_requests_total": [self._num_added],  # one entry per DP replica
            **gauges(self._expert_load()),
        }

    def _expert_load(self) -> dict[str, Any] | None:
        """A fresh snapshot every GAUGE_EVERY forwards: a collective, taken at the same step on
        every rank (they all call stats() after every step)."""
        load = self.engine.expert_load
        if load is not None and (self._load is None or load.steps - self._load_step >= GAUGE_EVERY):
            self._load, self._load_step = load.snapshot(), load.steps
        return self._load

    def close(self) -> None:
        pass
