"""The engine behind the server: one thread owns an `EngineClient` (an LLMEngine in this process,
or the mp executor's workers) and steps it while any request is active, so requests from many
clients join the running batch (continuous batching).

asyncio callers never touch the engine: they send closures to the engine thread, which runs them
between steps, and get per-step `Update`s back on their own asyncio queue. A caller that stops
listening (client disconnected, task cancelled) aborts its request, which frees its KV blocks.

Tokenization, chat templates and the token-id checks run in a small thread pool, each thread with
its own copy of the tokenizer (its Rust object is not safe to share across threads, and
truncation changes its state), so a huge prompt delays neither the event loop nor the engine
thread, hence no other request. Text is tokenized only up to `max_model_len + 1` tokens: enough
to know a prompt is too long.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from expertmesh.engine.client import EngineClient, SeqProgress, StepResult
from expertmesh.engine.incremental_text import IncrementalText
from expertmesh.engine.request_checks import as_token_ids
from expertmesh.entrypoints.metrics import RequestMetrics
from expertmesh.entrypoints.openmp_pool import release_thread_pool
from expertmesh.outputs import Logprob, RequestOutput
from expertmesh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from expertmesh.entrypoints.llm import LLM

log = logging.getLogger("expertmesh")
HEALTH_POLL_S = 1.0  # while idle, how often the engine thread checks the engine (mp workers) is alive
TOKENIZER_THREADS = 4  # prompts tokenized at once; one huge prompt holds only one of them


class PromptRejected(ValueError):
    """The engine refused the request (too long, empty, no tokenizer, ...): a client error."""


class EngineDead(RuntimeError):
    """The engine thread has stopped (an exception in a step, a dead worker, or shut down)."""


@dataclass
class SeqDelta:
    """What one sequence added in one step (streaming requests only)."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    text: str


@dataclass
class Update:
    deltas: list[SeqDelta] = field(default_factory=list)
    final: RequestOutput | None = None  # set on a request's last update


def coalesce(first: Update, then: Update) -> Update:
    """Two consecutive updates of one request as one: each sequence's tokens, logprobs and text
    joined in order, the later `final`."""
    merged = {d.index: SeqDelta(d.index, list(d.token_ids), d.logprobs, d.text) for d in first.deltas}
    for d in then.deltas:
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = d
            continue
        m.token_ids += d.token_ids
        if m.logprobs is not None or d.logprobs is not None:
            m.logprobs = [*(m.logprobs or []), *(d.logprobs or [])]
        m.text += d.text
    return Update(sorted(merged.values(), key=lambda d: d.index), then.final)


class _Channel:
    """Carries one request's results from the engine thread to the asyncio loop awaiting them."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.updates: asyncio.Queue[Update | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()

    def push(self, item: Update | BaseException) -> None:
        self._call(self.updates.put_nowait, item)

    def on_added(self, error: BaseException | None) -> None:
        self._call(self._settle, error)

    def _settle(self, error: BaseException | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is gone: nobody is listening
            pass


@dataclass
class _Tracked:
    """The engine thread's view of one active request."""

    channel: _Channel
    stream: bool
    params: SamplingParams
    tokens: list[list[int]]  # output tokens so far, per sequence (streams decode them)
    texts: list[IncrementalText]


class AsyncEngine:
    """Serves concurrent asyncio callers from an `LLM` (one process or mp) or any EngineClient."""

    def __init__(self, engine: LLM | EngineClient) -> None:
        self.client: EngineClient = engine.engine_client() if hasattr(engine, "engine_client") else engine
        self.tokenizer = self.client.tokenizer
        self.max_model_len = self.client.max_model_len
        self.on_failure: Callable[[BaseException], None] | None = None  # called on the engine thread
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._active: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._tokens_total = 0
        self._token_names: dict[int, str] = {}  # logprobs' decoded_token by id (engine thread only)
        self._error: BaseException | None = None
        self.metrics: dict[str, Any] = {}  # the engine's numbers after the last step (see _snapshot)
        self.request_metrics = RequestMetrics(lambda: self.metrics)  # what /metrics exports
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="expertmesh-tokenizer")
        self._local = threading.local()  # each pool thread's own tokenizer
        self._snapshot()
        # The model was loaded (and warmed) on this thread: free its OpenMP pool, so the engine
        # thread's is the only one and steps as fast as offline (see openmp_pool.py).
        if release_thread_pool():
            log.debug("released the loading thread's OpenMP pool: the engine thread steps with the only one")
        self._thread = threading.Thread(target=self._run, name="expertmesh-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side ---------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, if anything did."""
        return self._error

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = False,
        add_special_tokens: bool = True,
    ) -> AsyncGenerator[Update, None]:
        """Per-step updates of one request, ending with the one whose `final` is set.

        Raises PromptRejected before the first update when the engine refuses the prompt.
        Leaving early (break, cancellation) aborts the request.
        """
        rid = f"req-{next(self._ids)}"
        arrival = time.monotonic()
        channel = _Channel(asyncio.get_running_loop())
        finished = added = False
        try:
            ids = await self.in_pool(self._prepare, prompt, add_special_tokens)
            text = prompt if isinstance(prompt, str) else None
            self._submit(lambda: self._add(rid, ids, text, params, stream, channel, arrival))
            added = True
            await channel.accepted
            while not finished:
                item = await channel.updates.get()
                if isinstance(item, BaseException):
                    raise item
                # A reader that fell behind gets every queued step in one update (one event).
                pending: BaseException | None = None
                while item.final is None and not channel.updates.empty():
                    more = channel.updates.get_nowait()
                    if isinstance(more, BaseException):
                        pending = more
                        break
                    item = coalesce(item, more)
                finished = item.final is not None
                yield item
                if pending is not None:
                    raise pending
        finally:
            if added and not finished:
                self.abort(rid)

    async def in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on a tokenizer thread (see the module doc); its exceptions come back."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def thread_tokenizer(self) -> Any:
        """This pool thread's own tokenizer (None without one)."""
        tok = getattr(self._local, "tokenizer", None)
        if tok is None and self.tokenizer is not None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    def _prepare(self, prompt: str | list[int], add_special: bool) -> list[int]:
        """Token ids of a prompt, checked for type and length, on a tokenizer thread."""
        limit = self.max_model_len
        if isinstance(prompt, str):
            tok = self.thread_tokenizer()
            if tok is None:
                raise PromptRejected("this model has no tokenizer; send the prompt as token ids")
            ids = tok(prompt, add_special_tokens=add_special, truncation=True, max_length=limit + 1)[
                "input_ids"
            ]
            if len(ids) > limit:
                raise PromptRejected(
                    f"the prompt has more than {limit} tokens, longer than max_model_len={limit}"
                )
            return ids
        ids, error = as_token_ids(prompt)
        if error:
            raise PromptRejected(error)
        if len(ids) > limit:
            raise PromptRejected(f"the prompt has {len(ids)} tokens, longer than max_model_len={limit}")
        return ids

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id), quiet=True)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(None)
        self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def _submit(self, command: Callable[[], None], quiet: bool = False) -> None:
        if not self.is_alive:
            if quiet:
                return
            raise EngineDead(f"the engine is not running ({self._error or 'shut down'})")
        self._commands.put(command)

    # ---- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        # After a failure the thread stays up, only to turn new requests away.
        while self._apply_commands(block=not self._has_work()):
            if self._error is None:
                try:
                    if self._has_work():
                        start = time.monotonic()
                        result = self.client.step()
                        # Metrics first: a client that has its answer must see its blocks freed.
                        self._snapshot()
                        for rid in result.started:
                            self.request_metrics.scheduled(rid, start)
                        self._publish(result)
                    else:
                        self.client.check_health()  # an mp worker may die while all is idle
                except Exception as exc:  # every waiting caller must hear about it
                    self._fail(exc)
            self._snapshot()

    def _has_work(self) -> bool:
        return self._error is None and self.client.has_unfinished_requests()

    def _fail(self, exc: Exception) -> None:
        log.exception("engine step failed; the server will answer 503 from now on")
        self._error = exc
        for tracked in self._active.values():
            tracked.channel.push(EngineDead(f"the engine failed: {exc!r}"))
        self._active.clear()
        if self.on_failure is not None:
            self.on_failure(exc)

    def _apply_commands(self, block: bool) -> bool:
        """Run queued commands (waiting a while for one when idle); False once asked to stop."""
        try:
            command = self._commands.get(block=block, timeout=HEALTH_POLL_S if block else None)
        except queue.Empty:
            return True
        while command is not None:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _add(
        self,
        rid: str,
        ids: list[int],
        text: str | None,
        params: SamplingParams,
        stream: bool,
        channel: _Channel,
        arrival: float,
    ) -> None:
        if self._error is not None:
            channel.on_added(EngineDead(f"the engine failed: {self._error!r}"))
            return
        try:
            error = self.client.add_request(rid, ids, params, text)
        except Exception as exc:  # a bad request must not stop the engine
            channel.on_added(PromptRejected(str(exc)))
            return
        if error:
            channel.on_added(PromptRejected(error))
            return
        self.request_metrics.arrived(rid, arrival, len(ids))
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        n = params.n
        self._active[rid] = _Tracked(
            channel, stream, params, [[] for _ in range(n)], [IncrementalText(hold) for _ in range(n)]
        )
        channel.on_added(None)

    def _abort(self, rid: str) -> None:
        if self._active.pop(rid, None) is not None:
            self.client.abort_request(rid)
            self.request_metrics.aborted(rid)

    def _publish(self, result: StepResult) -> None:
        done = {out.request_id: out for out in result.finished}
        for rid, tracked in list(self._active.items()):
            final, progress = done.get(rid), result.progress.get(rid, [])
            gained = sum(len(p.token_ids) for p in progress)
            self._tokens_total += gained
            self.request_metrics.gained(rid, gained)
            deltas = self._deltas(tracked, progress, final) if tracked.stream else []
            if final is not None:
                del self._active[rid]
                self.request_metrics.finished(rid, final)
                if final.error:  # refused where it ran (the driver's checks let it through)
                    tracked.channel.push(PromptRejected(final.error))
                    continue
                self._name_tokens(final)
            if deltas or final is not None:
                tracked.channel.push(Update(deltas, final))

    def _deltas(
        self, tracked: _Tracked, progress: list[SeqProgress], final: RequestOutput | None
    ) -> list[SeqDelta]:
        """Each sequence's new tokens and text; at the end, every sequence's last piece of text."""
        gained = {p.index: p for p in progress}
        no_logprobs = [] if tracked.params.logprobs is not None else None
        deltas = []
        for i, (tokens, text) in enumerate(zip(tracked.tokens, tracked.texts, strict=True)):
            p = gained.get(i)
            if p is None and final is None:
                continue
            new = p.token_ids if p is not None else []
            tokens.extend(new)
            logprobs = p.logprobs if p is not None else no_logprobs
            self._name_tokens_in(logprobs or [])
            if final is not None:
                full, done = final.outputs[i].text, True
            elif p is not None and p.final_text is not None:
                full, done = p.final_text, True
            else:
                skip = tracked.params.skip_special_tokens
                full, done = text.decoded(tokens, lambda ids, s=skip: self.client.decode(ids, s)), False
            deltas.append(SeqDelta(i, list(new), logprobs, text.delta(full, done)))
        return deltas

    def _name_tokens(self, out: RequestOutput) -> None:
        for completion in out.outputs:
            self._name_tokens_in(completion.logprobs or [])
        self._name_tokens_in([e for e in out.prompt_logprobs or () if e])  # echo's prompt logprobs

    def _name_tokens_in(self, logprobs: list[dict[int, Logprob]]) -> None:
        """Fill in each logprob's token text here, the only thread that uses the tokenizer. A
        token's name never changes, so each id is decoded once (a dict lookup a token after)."""
        names = self._token_names
        for entry in logprobs:
            for token_id, lp in entry.items():
                if lp.decoded_token is None:
                    name = names.get(token_id)
                    if name is None:
                        name = names[token_id] = self.client.decode([token_id], False)
                    lp.decoded_token = name

    def _snapshot(self) -> None:
        """Numbers for /metrics, read by the server thread: one dict swap, no locking."""
        stats = dict(self.client.stats())  # engine/client.py's merge_stats shape: lists by DP replica
        used = [
            total - free
            for total, free in zip(stats["kv_blocks_total"], stats["kv_blocks_free"], strict=True)
        ]
        self.metrics = {**stats, "generation_tokens_total": self._tokens_total, "kv_blocks_used": used}
