"""`/v1/responses` (OpenAI's Responses API, what the Agents SDK and Codex CLI speak), on top of the
chat path: `instructions` and `input` become chat messages (function_call and
function_call_output items become assistant tool calls and tool messages), `tools` / `tool_choice`
/ `text.format` become the chat fields, and the generated text is split the same way (reasoning,
text, function calls). Non-streaming and streaming (the typed `response.*` events).

`previous_response_id` and `conversation` need stored responses, which this server does not keep:
a 400 naming them (send the whole conversation as `input` instead).

The request body and its mapping onto a chat request are responses_protocol.py; this file renders
the chat output as response objects and adds the route.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from expertmesh.entrypoints import chat_tools
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.protocol import UsageInfo
from expertmesh.entrypoints.renderers import Renderer, finish_reason_of
from expertmesh.entrypoints.request_mapping import chat_prompt, model_name, to_sampling_params
from expertmesh.entrypoints.response_streams import serve_request
from expertmesh.entrypoints.responses_protocol import ResponsesRequest, to_chat
from expertmesh.entrypoints.structured_api import APIFieldError
from expertmesh.outputs import RequestOutput


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
            finish = finish_reason_of(update, d.index)
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


def add_routes(
    app: FastAPI,
    engine: AsyncEngine,
    options: chat_tools.ToolOptions,
    openapi: dict[int | str, dict[str, Any]],
) -> None:
    """POST /v1/responses on `app` (called by build_app; `openapi`: a generate route's responses)."""

    @app.post("/v1/responses", responses=openapi)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        chat = to_chat(body)
        name = model_name(app, chat)
        params = to_sampling_params(chat, chat.max_tokens, None)
        try:
            params, inner = await chat_tools.prepare(engine, chat, params, options, name, None, always=True)
        except APIFieldError as exc:  # the chat field's Responses name
            exc.param = "text.format" if exc.param == "response_format" else exc.param
            raise
        prompt = await engine.in_pool(chat_prompt, engine, chat)
        renderer = ResponsesRenderer(name, body, inner)
        return await serve_request(
            request, engine, chat, [prompt], params, renderer, add_special_tokens=False
        )
