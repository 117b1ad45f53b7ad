"""distributed_executor_backend="mp": `LLM(..., tensor_parallel_size=2)` in a plain script.

The engine is SPMD, so this executor spawns one worker process per rank, each building the
engine exactly as under torchrun (see worker.py), and drives them from the caller's process
with one of two protocols. Whole calls: each `generate` call is split over the DP replicas
(round robin; every rank of a replica gets the same prompts), sent to every worker, and
answered from each replica's leader, in input order. Steps (the server, see driver_client.py): each
`step` sends every worker the requests to add and abort, and every worker runs one engine step.
While waiting it watches every worker's process sentinel: a worker that dies or raises is
reported with its rank within a second and the others are shut down, never waited on. This
process hosts the workers' rendezvous store (as torchrun's agent does), so it also reads their
watchdog heartbeats: a worker that stops beating for `distributed_timeout_seconds` (frozen) is
named and every worker is ended. Ctrl-C during `generate` asks the workers to abort that call's
requests (they agree on the step, see worker.py) before it is re-raised; one that lands while
the call is being sent is held until every worker has it, and a second one while they abort
shuts them down.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as torch_mp

from expertmesh.distributed.layout import ParallelLayout
from expertmesh.distributed.watchdog import DEFAULT_TIMEOUT_S, HeartbeatMonitor
from expertmesh.executor.worker import recv, send, worker_main
from expertmesh.outputs import RequestOutput
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")
STARTUP_HINT = (
    "Workers are spawned and import the caller's main module again: a script must create the "
    "LLM under `if __name__ == '__main__':` (the worker's own error is printed above)"
)


class WorkerError(RuntimeError):
    """A worker process died or raised; the executor has shut every worker down."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MPExecutor:
    def __init__(self, llm_kwargs: dict[str, Any]) -> None:
        tp, dp, pp = (llm_kwargs.get(f"{k}_parallel_size", 1) for k in ("tensor", "data", "pipeline"))
        self.layout = ParallelLayout(dp, pp, tp, bool(llm_kwargs.get("enable_expert_parallel")))
        self.world_size, self.dp_size = dp * pp * tp, dp
        ctx, port = torch_mp.get_context("spawn"), _free_port()
        timeout_s = float(llm_kwargs.get("distributed_timeout_seconds") or DEFAULT_TIMEOUT_S)
        # The store outlives any worker: a dead rank 0 takes no rendezvous down with it.
        self._store = dist.TCPStore(
            "127.0.0.1", port, None, True, timedelta(seconds=2 * timeout_s + 10), wait_for_workers=False
        )
        self._monitor = HeartbeatMonitor(
            dist.PrefixStore("attempt0/", self._store), self.world_size, timeout_s
        )
        self._procs, self._conns = [], []
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.world_size, port, llm_kwargs, child_end),
                name=f"expertmesh-rank{rank}",
                daemon=True,  # a last resort: multiprocessing ends daemons when the caller exits
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        # Runs on shutdown(), on garbage collection, or at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        self.last_split: list[list[int]] = []  # prompt indices per DP replica in the last call
        # Each replica speaks through its first pipeline stage's TP rank 0.
        self.leaders = [self.layout.rank_of(d, 0, 0) for d in range(dp)]
        self._death_hint = f". {STARTUP_HINT}"  # a worker dying while it starts: most often this
        self.ready_info: dict[int, Any] = self._wait_for("ready")  # rank -> prompt limits, stats
        self._death_hint = ""
        pids = ", ".join(f"rank {r} pid {p}" for r, p in enumerate(self.pids))
        log.info("mp executor: %d workers ready (%s)", self.world_size, pids)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids, by rank."""
        return [p.pid for p in self._procs]

    def generate(self, prompts: list[Any], params: list[SamplingParams]) -> list[RequestOutput]:
        self._check_open()
        split = [list(range(d, len(prompts), self.dp_size)) for d in range(self.dp_size)]
        self.last_split = split
        try:
            with _interrupts_after():  # every rank gets the call, or none: lockstep
                for rank in range(self.world_size):
                    mine = split[self.layout.coords(rank)[0]]
                    self._send(rank, ("generate", [prompts[i] for i in mine], [params[i] for i in mine]))
            replies = self._wait_for("done")
        except KeyboardInterrupt:
            try:
                self._abort_call()
            except KeyboardInterrupt:  # a second Ctrl-C while the workers abort: stop them all
                log.warning("interrupted again: shutting the workers down")
                self.shutdown()
            raise
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for d, indices in enumerate(split):
            leader = self.layout.rank_of(d, 0, 0)  # first pipeline stage, TP rank 0
            for i, out in zip(indices, replies[leader], strict=True):
                outputs[i] = out
        return outputs  # type: ignore[return-value]

    @property
    def is_moe(self) -> bool:
        return bool(self.ready_info[0].get("moe"))

    def expert_load(self) -> dict[str, Any]:
        """The workers' expert load statistics (every rank computes them together; rank 0's)."""
        self._check_open()
        with _interrupts_after():
            for rank in range(self.world_size):
                self._send(rank, ("expert_load",))
        return self._wait_for("expert_load")[0]

    def step(self, adds: list[tuple], aborts: list[str]) -> dict[int, Any]:
        """One engine step on every rank (lockstep needs all of them); each rank's StepResult.

        `adds` are (DP replica, request id, prompt ids, params, prompt text): every worker gets
        them all and takes its replica's; `aborts` go to every worker.
        """
        self._check_open()
        with _interrupts_after():
            for rank in range(self.world_size):
                self._send(rank, ("step", adds, aborts))
        return self._wait_for("stepped")

    def check_workers(self) -> None:
        """Raise WorkerError, naming the rank, if a worker has died (or the executor is shut down)."""
        self._check_open()
        if any(p.exitcode is not None for p in self._procs):
            self._blame({}, [])
        self._check_heartbeats()

    def _check_heartbeats(self) -> None:
        stalled = self._monitor.stalled()
        if stalled is not None:
            self._fail(stalled[0], f"stopped responding ({stalled[1]})")

    def shutdown(self) -> None:
        self._finalizer()

    def _abort_call(self) -> None:
        """Ctrl-C during a call: the workers drop its requests at one agreed step and answer."""
        log.warning("interrupted: asking the workers to abort this call's requests")
        with _interrupts_after():
            for rank in range(self.world_size):
                self._send(rank, ("abort",))
        self._wait_for("done")  # what they answer (the aborted call) is dropped

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise WorkerError("the mp executor was shut down; create a new LLM")

    def _send(self, rank: int, message: Any) -> None:
        try:
            send(self._conns[rank], message)
        except OSError:
            self._fail(rank, "cannot be reached (its pipe is closed: it died)")

    def _wait_for(self, kind: str) -> dict[int, Any]:
        """One `kind` reply from every rank; a worker that dies or reports an error raises."""
        pending: dict[Connection, int] = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = [p.sentinel for p in self._procs]
        replies: dict[int, Any] = {}
        while pending:
            ready = wait([*pending, *sentinels], timeout=1.0)
            errors: dict[int, str] = {}
            closed: list[int] = []
            for conn in [c for c in ready if c in pending]:
                rank = pending.pop(conn)
                try:
                    got, payload = recv(conn)
                except (EOFError, OSError):
                    closed.append(rank)
                    continue
                if got != kind:
                    errors[rank] = payload if got == "error" else f"answered {got!r}, not {kind!r}"
                replies[rank] = payload
            if errors or closed or any(p.exitcode is not None for p in self._procs):
                self._blame(errors, closed)
            if pending:
                self._check_heartbeats()
        return replies

    def _blame(self, errors: dict[int, str], closed: list[int]) -> None:
        """Something failed: let the other workers settle, then name the cause and raise.

        A peer's death makes the others' collectives fail too, so a worker that died without a
        word (killed, crashed) is named before one that reported an error.
        """
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            alive = [p.sentinel for p in self._procs if p.exitcode is None]
            if not alive or not wait(alive, timeout=deadline - time.monotonic()):
                break
        for rank, conn in enumerate(self._conns):
            words = _last_words(conn)
            if words is not None:
                errors.setdefault(rank, words)
        dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None or r in closed]
        silent = [r for r in dead if r not in errors]
        named = [r for r, e in errors.items() if "expertmesh watchdog" in e]
        if named:  # a watchdog names the rank that stopped answering (and may have ended it)
            self._fail(min(named), f"ended the run:\n{errors[min(named)]}")
        if silent or not errors:
            rank = (silent or dead)[0]
            self._fail(rank, f"died (exit code {self._procs[rank].exitcode})", self._death_hint)
        rank = min(errors)
        self._fail(rank, f"raised:\n{errors[rank]}")

    def _fail(self, rank: int, what: str, hint: str = "") -> None:
        pid = self._procs[rank].pid
        self._finalizer.detach()
        _stop_workers(self._procs, self._conns, graceful=False)
        raise WorkerError(
            f"mp executor: worker rank {rank} of {self.world_size} (pid {pid}) {what}; "
            f"every other worker was shut down{hint}"
        )


@contextlib.contextmanager
def _interrupts_after():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block and hand it to the handler it was for
    (Python's default raises KeyboardInterrupt) when the block ends: a message sent to some ranks
    and not others would leave the workers out of lockstep. Outside the main thread, where Python
    runs no signal handler, the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[Any] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held and callable(previous):
        previous(signal.SIGINT, held[0])


def _last_words(conn: Connection) -> str | None:
    """The error a worker sent before it exited, if it sent one."""
    try:
        while conn.poll():
            got, payload = recv(conn)
            if got == "error":
                return payload
    except (EOFError, OSError):
        pass
    return None


def _stop_workers(procs: list[Any], conns: list[Connection], graceful: bool = True) -> None:
    """Ask the workers to stop, then terminate, then kill whatever is left: none survives."""
    if graceful:
        for conn in conns:
            try:
                send(conn, ("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 5
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
