"""`/v1/responses` (OpenAI's Responses API, what the Agents SDK and Codex CLI speak), on top of the
chat path: `instructions` and `input` become chat messages (function_call and
function_call_output items become assistant tool calls and tool messages), `tools` / `tool_choice`
/ `text.format` become the chat fields, and the generated text is split the same way (reasoning,
text, function calls). Non-streaming and streaming (the typed `response.*` events).

`previous_response_id` and `conversation` need stored responses, which this server does not keep:
a 400 naming them (send the whole conversation as `input` instead).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from expertmesh.entrypoints import chat_tools
from expertmesh.entrypoints.protocol import ChatCompletionRequest, Renderer, UsageInfo, _finish_reason
from expertmesh.entrypoints.structured_api import APIFieldError
from expertmesh.outputs import RequestOutput


class ResponsesTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """Unknown fields are a 400 naming them; known fields this server cannot honour are accepted
    only at their no-op values (`_UNSUPPORTED`), else a 400 naming them too."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    # Pure metadata: accepted and ignored (nothing is stored either way).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # Known, honoured only at these values.
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt: Any = None


# field -> the values it may take here (what the API does when it is left out)
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "reasoning": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "max_tool_calls": (None,),
    "top_logprobs": (None, 0),
    "prompt": (None,),
}


# ---- request -> chat ----------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return "".join(parts)
    return ""


def to_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIFieldError(f"input[{i}].role must be user, assistant, system or developer", "input")
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content_text(item.get("content")),
                }
            )
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments", "{}")}}  # fmt: skip
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": _content_text(item.get("output")),
                }
            )
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the template (as chat templates drop it)
        else:
            raise APIFieldError(f"input[{i}].type {kind!r} is not supported here", "input")
    return messages


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise APIFieldError(
            "previous_response_id is not supported: this server stores no responses; send the whole "
            "conversation as `input`",
            "previous_response_id",
        )
    for name, allowed in _UNSUPPORTED.items():
        if getattr(body, name) not in allowed:
            raise APIFieldError(f"{name} is not supported by this server (only {allowed!r})", name)
    if body.conversation is not None:
        raise APIFieldError(
            "conversation is not supported: send the whole conversation as `input`", "conversation"
        )
    fields: dict[str, Any] = {"model": body.model, "messages": to_messages(body), "stream": body.stream}
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    if body.tool_choice is not None:
        tc = body.tool_choice
        fields["tool_choice"] = (
            tc if isinstance(tc, str) else {"type": "function", "function": {"name": tc.name}}
        )
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        rf: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            rf["json_schema"] = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = rf
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p),
                        ("parallel_tool_calls", body.parallel_tool_calls)):  # fmt: skip
        if value is not None:
            fields[name] = value
    try:
        return ChatCompletionRequest(**fields)
    except ValueError as exc:  # pydantic: a field of the converted request is out of range
        raise APIFieldError(f"invalid request: {exc}", "input") from exc


# ---- chat output -> response objects -----------------------------------------------------------------
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRenderer(Renderer):
    """Responses bodies and stream events from the engine's outputs; the text is split by the chat
    renderer of the same request (reasoning parser, tool parser or grammar-constrained calls)."""

    prefix = "resp"

    def __init__(self, model: str, body: ResponsesRequest, chat: chat_tools.ToolChatRenderer) -> None:
        super().__init__(model, 1)
        self.body, self.chat, self.created = body, chat, int(time.time())
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # output items so far (streaming), in order
        self.open: dict[str, dict[str, Any]] = {}  # kind (reasoning / message) -> its open item

    def _snapshot(
        self, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None
    ) -> dict:
        usage = None
        incomplete = None
        if final is not None:
            u = self.usage([final])
            usage = {
                "input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }  # fmt: skip
            if final.outputs and final.outputs[0].finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model,
            "output": output, "usage": usage, "incomplete_details": incomplete, "error": None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "temperature": b.temperature, "top_p": b.top_p, "metadata": b.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "tool_choice": b.tool_choice if isinstance(b.tool_choice, str) else
            (b.tool_choice.model_dump() if b.tool_choice else "auto"),
            "text": {"format": {"type": "text"}} if b.text is None
            else b.text.model_dump(exclude_none=True, by_alias=True),
            "store": False,
        }  # fmt: skip

    @staticmethod
    def _message(text: str, item_id: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _reasoning(text: str, item_id: str) -> dict[str, Any]:
        return {
            "type": "reasoning",
            "id": item_id,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    @staticmethod
    def _call(name: str, arguments: str, item_id: str, call_id: str) -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
                "arguments": arguments, "status": "completed"}  # fmt: skip

    def response(self, finals: list[RequestOutput]) -> BaseModel | dict:  # type: ignore[override]
        final = finals[0]
        c = final.outputs[0]
        reasoning, content, calls = self.chat.split(
            self.chat._without_stop_token(c.text, c.token_ids, c.finish_reason)
        )
        output = []
        if reasoning is not None:
            output.append(self._reasoning(reasoning, _item_id("rs")))
        if content.strip() or not calls:
            output.append(self._message(content.strip() if calls else content, _item_id("msg")))
        for c in calls:
            output.append(self._call(c.name, c.arguments, _item_id("fc"), _item_id("call")))
        return _Body(self._snapshot("completed", output, final))

    # ---- streaming -------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq, **fields}

    def stream_start(self) -> list[Any]:
        snapshot = self._snapshot("in_progress", [])
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open(self, kind: str, events: list) -> dict[str, Any]:
        if kind in self.open:
            return self.open[kind]
        if kind == "message":
            self._close("reasoning", events)
        item = (self._message("", _item_id("msg"), "in_progress") if kind == "message"
                else self._reasoning("", _item_id("rs")))  # fmt: skip
        index = len(self.items)
        self.items.append(item)
        self.open[kind] = item
        events.append(self._event("response.output_item.added", output_index=index, item=_empty(item)))
        part = (
            {"type": "output_text", "text": "", "annotations": []}
            if kind == "message"
            else {"type": "reasoning_text", "text": ""}
        )
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))  # fmt: skip
        return item

    def _close(self, kind: str, events: list) -> None:
        item = self.open.pop(kind, None)
        if item is None:
            return
        index = self.items.index(item)
        text = item["content"][0]["text"]
        done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        events.append(self._event(done, item_id=item["id"], output_index=index, content_index=0, text=text))
        events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0]))  # fmt: skip
        item["status"] = "completed" if kind == "message" else item.get("status")
        if kind == "reasoning":
            item.pop("status", None)
        events.append(self._event("response.output_item.done", output_index=index, item=item))

    def _close_call(self, events: list) -> None:
        item = self.open.pop("call", None)
        if item is None:
            return
        index = self.items.index(item)
        item["status"] = "completed"
        events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"],
                                  name=item["name"]))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=index, item=item))

    def stream_chunks(self, prompt_index: int, update: Any) -> list[Any]:
        events: list[Any] = []
        for d in update.deltas:
            finish = _finish_reason(update, d.index)
            text = self.chat._stream_text(d.index, d.text, d.token_ids, finish is not None)
            delta, _ = self.chat._deltas(d.index, text, finish is not None)
            if delta.reasoning_content:
                item = self._open("reasoning", events)
                item["content"][0]["text"] += delta.reasoning_content
                events.append(self._event("response.reasoning_text.delta", item_id=item["id"],
                                          output_index=self.items.index(item), content_index=0,
                                          delta=delta.reasoning_content))  # fmt: skip
            if delta.content and (delta.content.strip() or "message" in self.open):
                item = self._open("message", events)
                item["content"][0]["text"] += delta.content
                events.append(self._event("response.output_text.delta", item_id=item["id"],
                                          output_index=self.items.index(item), content_index=0,
                                          delta=delta.content, logprobs=[]))  # fmt: skip
            for call in delta.tool_calls or []:
                if call.id is not None:  # a new call (a named one then streams its arguments)
                    self._close_call(events)
                    self._close("reasoning", events)
                    self._close("message", events)
                    item = self._call(call.function.name or "", "", _item_id("fc"), call.id)
                    item["status"] = "in_progress"
                    self.items.append(item)
                    self.open["call"] = item
                    events.append(
                        self._event(
                            "response.output_item.added", output_index=len(self.items) - 1, item=dict(item)
                        )
                    )
                item = self.open["call"]
                args = call.function.arguments or ""
                item["arguments"] += args
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=args))  # fmt: skip
            if update.final is not None:
                if not self.items:  # an empty answer is still one (empty) message
                    self._open("message", events)
                self._close_call(events)
                self._close("reasoning", events)
                self._close("message", events)
                snapshot = self._snapshot("completed", self.items, update.final)
                kind = "response.completed" if snapshot["status"] == "completed" else "response.incomplete"
                events.append(self._event(kind, response=snapshot))
        return events

    def usage_chunk(self, usage: UsageInfo) -> Any:
        return None


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, "content": []} if "content" in item else dict(item)


class _Body(dict):
    """A dict with the model_dump the server's JSON path calls."""

    def model_dump(self) -> dict[str, Any]:
        return dict(self)


@dataclass(frozen=True)
class ChatServing:
    """The chat-completions steps the Responses route reuses, handed over by api_server.build_app
    (which imports this module, so this one does not import it back)."""

    responses: dict[int | str, dict[str, Any]]  # the OpenAPI responses of a generate route
    model_name: Callable[[FastAPI, Any], str]
    sampling_params: Callable[..., Any]
    chat_prompt: Callable[[Any, ChatCompletionRequest], str]
    serve: Callable[..., Awaitable[Response]]


def add_routes(app: FastAPI, engine: Any, options: chat_tools.ToolOptions, srv: ChatServing) -> None:
    """POST /v1/responses on `app` (called by build_app)."""

    @app.post("/v1/responses", responses=srv.responses)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        chat = to_chat(body)
        name = srv.model_name(app, chat)
        params = srv.sampling_params(chat, chat.max_tokens, None)
        try:
            params, inner = await chat_tools.prepare(engine, chat, params, options, name, None, always=True)
        except APIFieldError as exc:  # the chat field's Responses name
            exc.param = "text.format" if exc.param == "response_format" else exc.param
            raise
        prompt = await engine.in_pool(srv.chat_prompt, engine, chat)
        renderer = ResponsesRenderer(name, body, inner)
        return await srv.serve(request, engine, chat, [prompt], params, renderer, add_special_tokens=False)
