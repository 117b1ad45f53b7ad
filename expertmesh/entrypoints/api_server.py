"""OpenAI-compatible HTTP server: `expertmesh serve [MODEL]` (FastAPI + uvicorn).

Endpoints: /health, /v1/models, /v1/completions, /v1/chat/completions (both with `stream`),
/tokenize, /detokenize (vLLM's shapes), /metrics (Prometheus, entrypoints/metrics.py). With an
API key every route but /health and /metrics needs `Authorization: Bearer <key>` (401 otherwise).
Every error has OpenAI's body, {"error": {message, type, param, code}}, and touches only the
request that caused it. A request body larger than
`max_request_body_bytes` (default 4 MiB) is refused with 413 before it is read whole; chat
templates and tokenization run off the event loop (async_engine.py).

This file builds the app and its routes; a request's fields become the engine's inputs in
request_mapping.py, the engine's updates a response in response_streams.py, errors OpenAI's body
in api_errors.py, and the API key and body limit are api_middleware.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

# structured outputs / tools / responses hook
from expertmesh.entrypoints import chat_tools, responses_api, structured_api
from expertmesh.entrypoints.api_errors import APIError, add_error_handlers
from expertmesh.entrypoints.api_middleware import ApiKey, BodyLimit
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from expertmesh.entrypoints.renderers import CompletionRenderer
from expertmesh.entrypoints.request_mapping import (
    chat_prompt,
    completion_prompts,
    detokenize_ids,
    echo_texts,
    model_name,
    reject_unsupported,
    to_sampling_params,
    tokenize_body,
    truncated,
)
from expertmesh.entrypoints.response_streams import serve_request

DEFAULT_SERVED_NAME = "expertmesh-default"
DEFAULT_MAX_BODY_BYTES = 4 << 20

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
    add_error_handlers(app)

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
        name = model_name(app, body)
        reject_unsupported(body)
        if body.echo and body.stream:
            raise APIError(
                "echo is not supported with stream=true; ask without stream", "echo", "invalid_value"
            )
        generate = body.max_tokens != 0  # 0 with echo: the prompt and its logprobs only (run one token)
        prompt_lps = body.logprobs if body.echo and body.logprobs is not None else body.prompt_logprobs
        params = to_sampling_params(body, body.max_tokens if generate else 1, body.logprobs, prompt_lps)
        params = await structured_api.constrain(engine, body, params)  # structured outputs hook
        prompts = completion_prompts(body.prompt)
        echo = await engine.in_pool(echo_texts, engine, prompts) if body.echo else None
        if body.truncate_prompt_tokens is not None:  # cut before the length check, as vLLM does
            prompts = await engine.in_pool(truncated, engine, prompts, body.truncate_prompt_tokens, True)
        renderer = CompletionRenderer(name, params.n, body.logprobs is not None, echo, generate)
        return await serve_request(request, engine, body, prompts, params, renderer, add_special_tokens=True)

    @app.post("/v1/chat/completions", responses=GENERATE_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        name = model_name(app, body)
        reject_unsupported(body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = to_sampling_params(
            body, body.max_completion_tokens or body.max_tokens, top, body.prompt_logprobs
        )
        params, renderer = await chat_tools.prepare(engine, body, params, tools, name, top)  # tools hook
        prompt = await engine.in_pool(chat_prompt, engine, body)  # a template can be slow: off the loop
        if body.truncate_prompt_tokens is not None:
            keep, special = body.truncate_prompt_tokens, body.add_special_tokens
            prompt = (await engine.in_pool(truncated, engine, [prompt], keep, special))[0]
        # The template already holds the special tokens (BOS): by default do not add them twice.
        return await serve_request(
            request, engine, body, [prompt], params, renderer, add_special_tokens=body.add_special_tokens
        )

    @app.post("/tokenize", responses={400: _ERROR})
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(
                "send exactly one of prompt and messages", "prompt" if body.prompt is None else "messages"
            )
        ids = await engine.in_pool(tokenize_body, engine, body)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses={400: _ERROR})
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return {"prompt": await engine.in_pool(detokenize_ids, engine, body.tokens)}

    responses_api.add_routes(app, engine, tools, GENERATE_RESPONSES)  # /v1/responses hook
    return app
