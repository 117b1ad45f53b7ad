"""Wire models of chat completions that carry tool calls and reasoning: the whole response's
message (`reasoning_content`, `content`, `tool_calls`) and the stream's deltas, which leave out
every field that is None as OpenAI's stream does."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, model_serializer

from expertmesh.entrypoints.protocol import ChatCompletionChunk, ChatCompletionResponse, ChatLogprobs


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class ToolAssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ToolChatChoice(BaseModel):
    index: int
    message: ToolAssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ToolChatResponse(ChatCompletionResponse):
    choices: list[ToolChatChoice]  # type: ignore[assignment]


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, str]:
        return {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta


class ToolDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, Any]:
        out = {"role": self.role, "content": self.content, "reasoning_content": self.reasoning_content}
        out = {k: v for k, v in out.items() if v is not None}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        return out

    def empty(self) -> bool:
        return not (self.role or self.content or self.reasoning_content or self.tool_calls)


class ToolStreamChoice(BaseModel):
    index: int
    delta: ToolDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ToolChatChunk(ChatCompletionChunk):
    choices: list[ToolStreamChoice]  # type: ignore[assignment]
