"""The server's EngineClient over an mp executor: the driver of step-level serving.

Adds and aborts are queued here and sent with the next step to every worker; each request goes
to the least-loaded DP replica (fewest active sequences, lowest index on a tie). Every worker
steps every round, so the DP lockstep inside LLMEngine.step holds; the driver keeps stepping
while any request is active anywhere (it knows them all), so every rank agrees when to stop.
Replica leaders report progress and finished requests; this merges them into one StepResult.
"""

from __future__ import annotations

from typing import Any

from expertmesh.engine.client import StepResult
from expertmesh.engine.detokenizer import Detokenizer
from expertmesh.engine.expert_load import gauges
from expertmesh.engine.llm_engine import as_token_ids, validate_request
from expertmesh.executor.mp_executor import MPExecutor
from expertmesh.sampling_params import SamplingParams

# Every rank moves its own MoE traffic: these are summed over all ranks, the rest over leaders.
PER_RANK_STATS = ("all2all_bytes_sent_total", "all2all_bytes_received_total")
EXPERT_GAUGES = tuple(gauges(None))


class MPEngineClient:
    def __init__(self, executor: MPExecutor, tokenizer: Any) -> None:
        self.executor, self.tokenizer = executor, tokenizer
        self._limits: dict[str, int] = executor.ready_info[0]["limits"]
        self.max_model_len = self._limits["max_model_len"]
        self._detok = Detokenizer(tokenizer, ())  # text only: the workers decide when to stop
        self._adds: list[tuple[int, str, list[int], SamplingParams, str | None]] = []
        self._aborts: list[str] = []
        self._placed: dict[str, tuple[int, int]] = {}  # active request -> (replica, sequences)
        self._load = [0] * executor.dp_size  # active sequences per replica
        self._stats = self._merge_stats({r: info["stats"] for r, info in executor.ready_info.items()})

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> str | None:
        error = validate_request(prompt_token_ids, params, **self._limits)  # the rule every worker applies
        if error:
            return error
        prompt_token_ids = as_token_ids(prompt_token_ids)[0]
        replica = min(range(len(self._load)), key=self._load.__getitem__)
        self._load[replica] += params.n
        self._placed[request_id] = (replica, params.n)
        self._adds.append((replica, request_id, list(prompt_token_ids), params, prompt))
        return None

    def abort_request(self, request_id: str) -> None:
        if request_id not in self._placed:
            return
        self._release(request_id)
        unsent = [add for add in self._adds if add[1] != request_id]
        if len(unsent) == len(self._adds):  # already with the workers: they must drop it
            self._aborts.append(request_id)
        self._adds = unsent

    def has_unfinished_requests(self) -> bool:
        return bool(self._placed or self._aborts)

    def step(self) -> StepResult:
        adds, aborts = self._adds, self._aborts
        self._adds, self._aborts = [], []
        replies = self.executor.step(adds, aborts)
        merged = StepResult(stats=self._merge_stats({r: reply.stats for r, reply in replies.items()}))
        for rank in self.executor.leaders:
            merged.progress.update(replies[rank].progress)
            merged.finished += replies[rank].finished
        for out in merged.finished:
            self._release(out.request_id)
        self._stats = merged.stats
        return merged

    def _release(self, request_id: str) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self._load[placed[0]] -= placed[1]

    def _merge_stats(self, per_rank: dict[int, dict[str, Any]]) -> dict[str, Any]:
        leaders = [per_rank[r] for r in self.executor.leaders]
        by_replica = "dp_replica_requests_total"
        merged: dict[str, Any] = {
            k: sum(s[k] for s in leaders) for k in leaders[0] if k != by_replica and k not in EXPERT_GAUGES
        }
        merged.update({k: per_rank[0][k] for k in EXPERT_GAUGES})  # the same on every rank
        for key in PER_RANK_STATS:
            merged[key] = sum(s[key] for s in per_rank.values())
        merged[by_replica] = [s[by_replica][0] for s in leaders]
        return merged

    def check_health(self) -> None:
        self.executor.check_workers()

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._detok.decode(token_ids, skip_special_tokens)

    def stats(self) -> dict[str, Any]:
        return self._stats

    def close(self) -> None:
        self.executor.shutdown()
