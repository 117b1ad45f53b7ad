"""OpenAI-compatible HTTP server: `expertmesh serve [MODEL]` (FastAPI + uvicorn).

Endpoints: /health, /v1/models, /v1/completions, /v1/chat/completions (both with `stream`),
/tokenize, /detokenize (vLLM's shapes), /metrics (Prometheus, entrypoints/metrics.py). With an
API key every route but /health and /metrics needs `Authorization: Bearer <key>` (401 otherwise).
Every error has OpenAI's body, {"error": {message, type, param, code}}, and touches only the
request that caused it. A request body larger than
`max_request_body_bytes` (default 4 MiB) is refused with 413 before it is read whole; chat
templates and tokenization run off the event loop (async_engine.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# structured outputs / tools / responses hook
from expertmesh.entrypoints import chat_tools, responses_api, structured_api
from expertmesh.entrypoints.async_engine import AsyncEngine, EngineDead, PromptRejected, Update
from expertmesh.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatRenderer,
    CompletionRenderer,
    CompletionRequest,
    DetokenizeRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    Renderer,
    SamplingFields,
    TokenizeRequest,
    UsageInfo,
    add_usage,
)
from expertmesh.sampling_params import SamplingParams

log = logging.getLogger("expertmesh")
DEFAULT_SERVED_NAME = "expertmesh-default"
DEFAULT_MAX_BODY_BYTES = 4 << 20


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


# What the routes answer, for the OpenAPI schema (the API is fuzzed from it: tests/test_fuzz_api.py).
_ERROR = {"model": ErrorResponse}
HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "The engine is running", "content": {}},
    503: {"description": "The engine has stopped", "content": {}},
}
GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion (JSON), or server-sent events with `stream`",
          "content": {"application/json": {}, "text/event-stream": {}}},
    400: {**_ERROR, "description": "Invalid request (the error names the parameter)"},
    413: {**_ERROR, "description": "Request body larger than max_request_body_bytes"},
    499: {"description": "The client disconnected first", "content": {}},
    503: {**_ERROR, "description": "The engine has stopped"},
}  # fmt: skip


class ApiKey:
    """ASGI middleware: 401 unless `Authorization: Bearer <key>`, on every route but the open ones."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app: Any, key: str) -> None:
        self.app, self._expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in self.OPEN:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self._expected):  # the key itself is never logged
            response = error_response(
                401, "a valid API key is required: Authorization: Bearer <key>", None, "invalid_api_key"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: 413 for a body over `limit` bytes, by its Content-Length or as it streams in."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            status = 413 if declared.isdigit() else 400
            return await error_response(status, self._message(declared.decode(errors="replace")))(
                scope, receive, send
            )
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # a chunked body without a length: stop reading it here
                raise HTTPException(413, self._message(f"more than {self.limit}"))
            return message

        await self.app(scope, limited, send)

    def _message(self, size: str) -> str:
        return f"the request body ({size} bytes) exceeds max_request_body_bytes={self.limit}"


def build_app(
    engine: AsyncEngine,
    served_model_names: list[str],
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    tool_options: chat_tools.ToolOptions | None = None,
    api_key: str | None = None,
) -> FastAPI:
    app = FastAPI(title="expertmesh", docs_url=None, redoc_url=None)
    tools = tool_options or chat_tools.configured()  # structured outputs / tools hook
    app.state.engine, app.state.names = engine, list(served_model_names)
    app.add_middleware(BodyLimit, limit=max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)  # added last: runs first, before the body is read
    _add_error_handlers(app)

    @app.get("/health", response_class=Response, responses=HEALTH_RESPONSES)
    async def health() -> Response:
        return Response(status_code=200 if engine.is_alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [ModelCard(id=name, max_model_len=engine.max_model_len) for name in app.state.names]
        return ModelList(data=cards).model_dump()

    if engine is not None:  # (None: only the OpenAPI schema is wanted)
        engine.request_metrics.set_model_name(app.state.names[0])

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        body, content_type = engine.request_metrics.exposition()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions", responses=GENERATE_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        name = _model_name(app, body)
        _reject_unsupported(body)
        if body.echo and body.stream:
            raise APIError(
                "echo is not supported with stream=true; ask without stream", "echo", "invalid_value"
            )
        generate = body.max_tokens != 0  # 0 with echo: the prompt and its logprobs only (run one token)
        prompt_lps = body.logprobs if body.echo and body.logprobs is not None else body.prompt_logprobs
        params = _sampling_params(body, body.max_tokens if generate else 1, body.logprobs, prompt_lps)
        params = await structured_api.constrain(engine, body, params)  # structured outputs hook
        prompts = _completion_prompts(body.prompt)
        echo = await engine.in_pool(_echo_texts, engine, prompts) if body.echo else None
        if body.truncate_prompt_tokens is not None:  # cut before the length check, as vLLM does
            prompts = await engine.in_pool(_truncated, engine, prompts, body.truncate_prompt_tokens, True)
        renderer = CompletionRenderer(name, params.n, body.logprobs is not None, echo, generate)
        return await _serve(request, engine, body, prompts, params, renderer, add_special_tokens=True)

    @app.post("/v1/chat/completions", responses=GENERATE_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        name = _model_name(app, body)
        _reject_unsupported(body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = _sampling_params(
            body, body.max_completion_tokens or body.max_tokens, top, body.prompt_logprobs
        )
        params, renderer = await chat_tools.prepare(engine, body, params, tools, name, top)  # tools hook
        prompt = await engine.in_pool(_chat_prompt, engine, body)  # a template can be slow: off the loop
        if body.truncate_prompt_tokens is not None:
            keep, special = body.truncate_prompt_tokens, body.add_special_tokens
            prompt = (await engine.in_pool(_truncated, engine, [prompt], keep, special))[0]
        # The template already holds the special tokens (BOS): by default do not add them twice.
        return await _serve(
            request, engine, body, [prompt], params, renderer, add_special_tokens=body.add_special_tokens
        )

    @app.post("/tokenize", responses={400: _ERROR})
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(
                "send exactly one of prompt and messages", "prompt" if body.prompt is None else "messages"
            )
        ids = await engine.in_pool(_tokenize, engine, body)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses={400: _ERROR})
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return {"prompt": await engine.in_pool(_detokenize, engine, body.tokens)}

    serving = responses_api.ChatServing(
        GENERATE_RESPONSES, _model_name, _sampling_params, _chat_prompt, _serve
    )
    responses_api.add_routes(app, engine, tools, serving)  # /v1/responses hook
    return app


def _reject_unsupported(body: SamplingFields) -> None:
    found = body.unsupported()
    if found is not None:
        raise APIError(found[1], found[0], "unsupported_parameter")


def _tokenizer_or_400(engine: AsyncEngine, param: str) -> Any:
    tok = engine.thread_tokenizer()
    if tok is None:
        raise APIError("this model has no tokenizer", param, "no_tokenizer")
    return tok


def _tokenize(engine: AsyncEngine, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        tok = _tokenizer_or_400(engine, "prompt")
        return list(tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
    text = _chat_prompt(engine, chat)
    return list(_tokenizer_or_400(engine, "messages")(text, add_special_tokens=False)["input_ids"])


def _detokenize(engine: AsyncEngine, tokens: list[int]) -> str:
    tok = _tokenizer_or_400(engine, "tokens")
    vocab = len(tok)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens", "invalid_value"
        )
    return tok.decode(tokens)


def _truncated(
    engine: AsyncEngine, prompts: list[str | list[int]], keep: int, special: bool
) -> list[list[int]]:
    """Each prompt as token ids, only its last `keep` (truncate_prompt_tokens)."""
    out = []
    for p in prompts:
        ids = (
            _tokenizer_or_400(engine, "prompt")(p, add_special_tokens=special)["input_ids"]
            if isinstance(p, str)
            else p
        )
        out.append(list(ids)[-keep:])
    return out


def _echo_texts(engine: AsyncEngine, prompts: list[str | list[int]]) -> list[tuple[str, str]]:
    """Per prompt, its text (token-id prompts decoded) and its first token's text, for echo."""
    tok = _tokenizer_or_400(engine, "echo")
    out = []
    for p in prompts:
        ids = p if isinstance(p, list) else tok(p, add_special_tokens=True)["input_ids"]
        text = p if isinstance(p, str) else tok.decode(p)
        out.append((text, tok.decode(ids[:1]) if ids else ""))
    return out


# ---- request -> engine ------------------------------------------------------------------------
def _model_name(app: FastAPI, body: SamplingFields) -> str:
    names = app.state.names
    if body.model is None:
        return names[0]
    if body.model not in names:
        raise APIError(
            f"the model {body.model!r} does not exist; served: {names}", "model", "model_not_found"
        )
    return body.model


def _sampling_params(
    body: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    try:
        return SamplingParams(
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=body.logit_bias,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
        )
    except (TypeError, ValueError) as exc:
        field = re.match(r"SamplingParams\.(\w+)=", str(exc))
        raise APIError(str(exc), field.group(1) if field else None, "invalid_value") from exc


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("the prompt is empty", "prompt", "invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # one prompt of token ids
    return list(prompt)


def _chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest) -> str:
    tok = engine.thread_tokenizer()
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(
            "the model's tokenizer has no chat template, so /v1/chat/completions cannot build a prompt; "
            "use /v1/completions",
            "messages",
            "no_chat_template",
        )
    messages = [chat_tools.message_for_template(m.for_template()) for m in body.messages]
    try:
        return tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            **chat_tools.template_kwargs(body),
        )
    except Exception as exc:  # a template that rejects these messages is the client's problem
        raise APIError(f"the chat template failed on these messages: {exc}", "messages") from exc


async def _serve(
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


# ---- engine -> response -------------------------------------------------------------------------
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


# ---- errors --------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    def handler(
        status: int, param: str | None = None, code: str | None = None
    ) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:
        async def handle(_: Request, exc: Exception) -> JSONResponse:
            return error_response(status, str(exc), param, code)

        return handle

    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.code)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, None)

    async def field_error(_: Request, exc: structured_api.APIFieldError) -> JSONResponse:
        return error_response(400, str(exc), exc.param, "invalid_value")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(structured_api.APIFieldError, field_error)  # structured outputs hook
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDead, handler(503, code="engine_dead"))


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's 422 becomes OpenAI's 400, naming the first bad field."""
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON body: {err.get('msg')}", None, "invalid_json")
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    if err.get("type") == "extra_forbidden":  # no field is silently dropped
        return error_response(400, f"unknown field {where!r}", loc[0] if loc else None, "unknown_parameter")
    return error_response(400, f"{where}: {err.get('msg')}", loc[0] if loc else None, "invalid_value")
