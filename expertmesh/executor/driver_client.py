"""The server's EngineClient over ranks that step together: the driver of step-level serving.

The ranks are either an mp executor's spawned workers (mp_executor.py) or the processes of a
torchrun job (torchrun_executor.py); both carry one round the same way: every rank gets the
round's adds and aborts, every rank runs one engine step, and each replica leader's StepResult
comes back. Adds and aborts are queued here and sent with the next step; each request goes to
the least-loaded DP replica (fewest active sequences, lowest index on a tie). Every rank steps
every round, so the DP lockstep inside LLMEngine.step holds; the driver keeps stepping while any
request is active anywhere (it knows them all), so every rank agrees when to stop.
"""

from __future__ import annotations

from typing import Any, Protocol

from expertmesh.engine.client import StepResult, merge_stats
from expertmesh.engine.detokenizer import Detokenizer
from expertmesh.engine.request_checks import as_token_ids, validate_request
from expertmesh.sampling_params import SamplingParams


class StepTransport(Protocol):
    """How one round reaches every rank (mp pipes, or torch.distributed collectives)."""

    dp_size: int
    leaders: list[int]  # each DP replica's leader rank, by replica
    ready_info: dict[int, Any]  # rank -> {"limits": prompt limits, "stats": rank stats}

    def step(self, adds: list[tuple], aborts: list[str]) -> dict[int, StepResult]: ...

    def check_workers(self) -> None:
        """Raise, naming the rank, when a rank can no longer step (called while idle)."""

    def shutdown(self) -> None: ...


class DriverClient:
    def __init__(self, transport: StepTransport, tokenizer: Any) -> None:
        self.executor, self.tokenizer = transport, tokenizer
        self._limits: dict[str, int] = transport.ready_info[transport.leaders[0]]["limits"]
        self.max_model_len = self._limits["max_model_len"]
        self._detok = Detokenizer(tokenizer, ())  # text only: the ranks decide when to stop
        self._adds: list[tuple[int, str, list[int], SamplingParams, str | None]] = []
        self._aborts: list[str] = []
        self._placed: dict[str, tuple[int, int]] = {}  # active request -> (replica, sequences)
        self._load = [0] * transport.dp_size  # active sequences per replica
        ready = {r: info["stats"] for r, info in transport.ready_info.items()}
        self._stats = merge_stats(ready, transport.leaders)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> str | None:
        error = validate_request(prompt_token_ids, params, **self._limits)  # the rule every rank applies
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
        if len(unsent) == len(self._adds):  # already with the ranks: they must drop it
            self._aborts.append(request_id)
        self._adds = unsent

    def has_unfinished_requests(self) -> bool:
        return bool(self._placed or self._aborts)

    def step(self) -> StepResult:
        adds, aborts = self._adds, self._aborts
        self._adds, self._aborts = [], []
        replies = self.executor.step(adds, aborts)
        self._stats = merge_stats({r: reply.stats for r, reply in replies.items()}, self.executor.leaders)
        merged = StepResult(stats=self._stats)
        for rank in self.executor.leaders:
            merged.progress.update(replies[rank].progress)
            merged.finished += replies[rank].finished
            merged.started += replies[rank].started
        for out in merged.finished:
            self._release(out.request_id)
        return merged

    def _release(self, request_id: str) -> None:
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self._load[placed[0]] -= placed[1]

    def check_health(self) -> None:
        self.executor.check_workers()

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._detok.decode(token_ids, skip_special_tokens)

    def stats(self) -> dict[str, Any]:
        return self._stats

    def close(self) -> None:
        self.executor.shutdown()
