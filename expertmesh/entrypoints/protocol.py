"""OpenAI wire format: the server's request and response bodies (pydantic models), and how the
engine's outputs map onto them (whole responses and stream chunks).

Constraints on request fields live here so that a bad value becomes a 400 naming the field
before anything reaches the engine. Unknown request fields are ignored, as OpenAI's are.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from expertmesh.entrypoints.async_engine import Update
from expertmesh.entrypoints.structured_api import StructuredFields, ToolFields  # structured outputs hook
from expertmesh.outputs import Logprob, RequestOutput

Stop = str | list[str] | None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- errors -----------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- requests -----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-text


class CompletionRequest(SamplingFields, StructuredFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed on to the template

    role: str
    content: str | list[dict[str, Any]] | None = ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string (text parts joined)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return message


class ChatCompletionRequest(SamplingFields, ToolFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


# ---- responses ----------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer
    def _without_nones(self) -> dict[str, str]:
        # OpenAI sends the role only in a choice's first chunk.
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "expertmesh"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- engine outputs -> response bodies --------------------------------------------------------
def _text(lp: Logprob) -> str:
    return lp.decoded_token or ""


def _finite(logprob: float) -> float:
    """A token a grammar forbids has logprob -inf, which JSON cannot carry: -9999.0, as vLLM sends."""
    return max(logprob, -9999.0)


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, offset: int = 0
) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for token, entry in zip(token_ids, logprobs or []):
        chosen = entry[token]
        out.tokens.append(_text(chosen))
        out.token_logprobs.append(_finite(chosen.logprob))
        out.top_logprobs.append({_text(lp): _finite(lp.logprob) for lp in entry.values()})
        out.text_offset.append(offset)
        offset += len(_text(chosen))
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, top: int) -> ChatLogprobs:
    def one(lp: Logprob) -> TopLogprob:
        return TopLogprob(token=_text(lp), logprob=_finite(lp.logprob), bytes=list(_text(lp).encode()))

    content = []
    for token, entry in zip(token_ids, logprobs or []):
        best = sorted((lp for lp in entry.values() if (lp.rank or 0) <= top), key=lambda lp: lp.rank or 0)
        chosen = one(entry[token])
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=[one(lp) for lp in best]))
    return ChatLogprobs(content=content)


def add_usage(usage: UsageInfo, final: RequestOutput) -> None:
    usage.prompt_tokens += len(final.prompt_token_ids)
    usage.completion_tokens += sum(len(c.token_ids) for c in final.outputs)
    usage.total_tokens = usage.prompt_tokens + usage.completion_tokens


def _finish_reason(update: Update, index: int) -> str | None:
    return update.final.outputs[index].finish_reason if update.final is not None else None


class Renderer:
    """Turns one HTTP request's engine outputs into OpenAI bodies (whole, or as stream chunks)."""

    prefix = "cmpl"

    def __init__(self, model: str, n: int) -> None:
        self.id, self.model, self.n = new_id(self.prefix), model, n

    def stream_start(self) -> list[BaseModel]:
        return []

    def stream_chunks(self, prompt_index: int, update: Update) -> list[BaseModel]:
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        raise NotImplementedError

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        raise NotImplementedError

    def usage(self, finals: list[RequestOutput]) -> UsageInfo:
        usage = UsageInfo()
        for final in finals:
            add_usage(usage, final)
        return usage


class CompletionRenderer(Renderer):
    def __init__(self, model: str, n: int, logprobs: bool) -> None:
        super().__init__(model, n)
        self.logprobs = logprobs
        self.offsets: dict[int, int] = {}  # choice index -> characters streamed so far

    def stream_chunks(self, prompt_index: int, update: Update) -> list[BaseModel]:
        choices = []
        for d in update.deltas:
            index, finish = prompt_index * self.n + d.index, _finish_reason(update, d.index)
            if not d.text and finish is None and not (self.logprobs and d.token_ids):
                continue  # nothing to say yet (text held back)
            lps = None
            if self.logprobs:
                lps = completion_logprobs(d.token_ids, d.logprobs, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(d.text)
            choices.append(CompletionChoice(index=index, text=d.text, logprobs=lps, finish_reason=finish))
        return [CompletionResponse(id=self.id, model=self.model, choices=choices)] if choices else []

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return CompletionResponse(id=self.id, model=self.model, choices=[], usage=usage)

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        choices = [
            CompletionChoice(
                index=i * self.n + c.index,
                text=c.text,
                logprobs=completion_logprobs(c.token_ids, c.logprobs) if self.logprobs else None,
                finish_reason=c.finish_reason,
            )
            for i, final in enumerate(finals)
            for c in final.outputs
        ]
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=self.usage(finals))


class ChatRenderer(Renderer):
    prefix = "chatcmpl"

    def __init__(self, model: str, n: int, top_logprobs: int | None) -> None:
        super().__init__(model, n)
        self.top = top_logprobs  # None: no logprobs asked for

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> BaseModel:
        return ChatCompletionChunk(id=self.id, model=self.model, choices=choices, usage=usage)

    def stream_start(self) -> list[BaseModel]:
        role = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatStreamChoice(index=i, delta=role) for i in range(self.n)])]

    def stream_chunks(self, prompt_index: int, update: Update) -> list[BaseModel]:
        choices = []
        for d in update.deltas:
            finish = _finish_reason(update, d.index)
            if not d.text and finish is None and not (self.top is not None and d.token_ids):
                continue
            lps = chat_logprobs(d.token_ids, d.logprobs, self.top) if self.top is not None else None
            delta = DeltaMessage(content=d.text)
            choices.append(ChatStreamChoice(index=d.index, delta=delta, logprobs=lps, finish_reason=finish))
        return [self._chunk(choices)] if choices else []

    def usage_chunk(self, usage: UsageInfo) -> BaseModel:
        return self._chunk([], usage)

    def response(self, finals: list[RequestOutput]) -> BaseModel:
        choices = [
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=c.text),
                logprobs=chat_logprobs(c.token_ids, c.logprobs, self.top) if self.top is not None else None,
                finish_reason=c.finish_reason,
            )
            for final in finals
            for c in final.outputs
        ]
        return ChatCompletionResponse(id=self.id, model=self.model, choices=choices, usage=self.usage(finals))
