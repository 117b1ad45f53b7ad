"""The engine's updates -> an HTTP response: one JSON body, or server-sent events with `stream`;
several prompts of one request merged as they come; a client that leaves aborts its requests."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from expertmesh.entrypoints.api_errors import ClientGone, error_response
from expertmesh.entrypoints.async_engine import AsyncEngine, EngineDead, PromptRejected, Update
from expertmesh.entrypoints.protocol import ErrorInfo, SamplingFields, UsageInfo
from expertmesh.entrypoints.renderers import ChatRenderer, Renderer, add_usage
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")


async def serve_request(
    request: Request,
    engine: AsyncEngine,
    body: SamplingFields,
    prompts: list[str | list[int]],
    params: SamplingParams,
    renderer: Renderer,
    add_special_tokens: bool,
) -> Response:
    gens = [engine.generate(p, params, body.stream, add_special_tokens) for p in prompts]
    try:
        firsts = await _unless_disconnected(request, _first_updates(gens))
    except PromptRejected as exc:
        param = "messages" if isinstance(renderer, ChatRenderer) else "prompt"
        return error_response(400, str(exc), param, _rejection_code(str(exc)))
    except ClientGone:
        return Response(status_code=499)
    updates = _merged(gens, firsts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(request, updates, renderer, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        finals = await _unless_disconnected(request, _finals(updates, len(gens)))
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(renderer.response(finals).model_dump())


def _rejection_code(message: str) -> str:
    too_long = "max_model_len" in message or "KV cache" in message
    return "context_length_exceeded" if too_long else "invalid_prompt"


async def _first_updates(gens: list[AsyncGenerator[Update, None]]) -> list[Update]:
    """Each request's first update; a rejection (or cancellation) closes, so aborts, them all."""
    try:
        results = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
    except BaseException:  # cancelled: the client left while its prompts were starting
        await _close(gens)
        raise
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await _close(gens)
        raise errors[0]
    return list(results)


async def _close(gens: list[AsyncGenerator[Update, None]]) -> None:
    for gen in gens:
        await gen.aclose()  # a generator closed before its final update aborts its request


async def _merged(
    gens: list[AsyncGenerator[Update, None]], firsts: list[Update]
) -> AsyncGenerator[tuple[int, Update], None]:
    """(prompt index, update) from every request as they come; closing it aborts what is left."""
    out: asyncio.Queue[tuple[int, Update | BaseException]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncGenerator[Update, None]) -> None:
        try:
            async for update in gen:
                out.put_nowait((i, update))
        except Exception as exc:
            out.put_nowait((i, exc))

    live = [i for i, first in enumerate(firsts) if first.final is None]
    tasks = [asyncio.create_task(pump(i, gens[i])) for i in live]
    try:
        for i, first in enumerate(firsts):
            yield i, first
        remaining = len(live)
        while remaining:
            i, item = await out.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.final is not None
            yield i, item
    finally:
        for task in tasks:
            task.cancel()  # cancelling a pump aborts its request in the engine
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(gens)


async def _finals(updates: AsyncGenerator[tuple[int, Update], None], count: int) -> list[Any]:
    finals: list[Any] = [None] * count
    async for i, update in updates:
        if update.final is not None:
            finals[i] = update.final
    return finals


async def _sse(
    request: Request,
    updates: AsyncGenerator[tuple[int, Update], None],
    renderer: Renderer,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    usage = UsageInfo()
    try:
        for chunk in renderer.stream_start():
            yield _event(chunk)
        async for i, update in updates:
            if await request.is_disconnected():
                log.info("client disconnected mid-stream; aborting its request")
                return
            for chunk in renderer.stream_chunks(i, update):
                yield _event(chunk)
            if update.final is not None:
                add_usage(usage, update.final)
        if include_usage:
            yield _event(renderer.usage_chunk(usage))
    except (EngineDead, PromptRejected) as exc:
        yield _event({"error": ErrorInfo(message=str(exc), type="server_error").model_dump()})
    finally:
        await updates.aclose()  # aborts whatever is still running
    yield "data: [DONE]\n\n"


def _event(chunk: Any) -> str:
    data = chunk if isinstance(chunk, dict) else chunk.model_dump()
    if data.get("usage", 0) is None:  # only the include_usage chunk carries usage
        del data["usage"]
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (which aborts its engine requests) if the client leaves first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
