"""The request body of `/v1/responses` (OpenAI's Responses API) and its mapping onto a chat
request: `instructions` and `input` become chat messages (function_call and function_call_output
items become assistant tool calls and tool messages), `tools` / `tool_choice` / `text.format`
become the chat fields. A field this server cannot honour is a 400 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from expertmesh.entrypoints.protocol import ChatCompletionRequest
from expertmesh.entrypoints.structured_api import APIFieldError


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
