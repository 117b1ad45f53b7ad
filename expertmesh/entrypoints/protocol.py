"""OpenAI wire format: the server's request and response bodies (pydantic models), and how the
engine's outputs map onto them (whole responses and stream chunks).

Constraints on request fields live here so that a bad value becomes a 400 naming the field
before anything reaches the engine. No field is silently dropped: an unknown field is a 400
naming it (extra="forbid"), and a known field set to a value we cannot honour is a 400 naming it
(`unsupported`). Pure metadata (METADATA_FIELDS) is accepted and has no effect on the output.
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
# Accepted and without effect on the output: OpenAI's bookkeeping and routing hints.
METADATA_FIELDS = (
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier",
)  # fmt: skip

# Implemented by the structured-outputs / tools / reasoning work; until then a 400 naming the field
# when set (to anything but null). Kept in this one list so that work can take fields out of it.
# (response_format, structured_outputs, tools, tool_choice, parallel_tool_calls: structured_api.py)
NOT_YET_SUPPORTED = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "reasoning_effort", "chat_template_kwargs",
)  # fmt: skip


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events: none here, harmless


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    # vLLM's extra sampling fields (SamplingParams' names and meanings)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False  # generate max_tokens even past end-of-text
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    # metadata: accepted, no effect (METADATA_FIELDS)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # NOT_YET_SUPPORTED: typed loosely here, refused by `unsupported` when set
    guided_json: Any = None  # vLLM's old spelling of structured_outputs
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    reasoning_effort: Any = None
    chat_template_kwargs: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to a value this server cannot honour, else None."""
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs", "prompt_logprobs is not supported with stream=true; ask without stream"
        for name in NOT_YET_SUPPORTED:
            if getattr(self, name) is not None:
                hint = "; send structured_outputs instead" if name.startswith("guided_") else ""
                return name, f"{name} is not supported by this server yet{hint}"
        return None


class CompletionRequest(SamplingFields, StructuredFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: the prompt and its logprobs
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return (
                "suffix",
                "suffix (insertion) is not supported: the models served here do not fill in the middle",
            )
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of other than n is not supported (as in vLLM V1): sample n and rank them"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens=0 is only meaningful with echo=true"
        return super().unsupported()


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
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template already holds BOS
    # OpenAI fields honoured only at their text-only defaults
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.modalities is not None and self.modalities != ["text"]:
            return "modalities", "only the text modality is served here"
        why = {
            "audio": "audio output is not supported (text models only)",
            "prediction": "predicted outputs are not supported",
            "web_search_options": "web search is not supported",
            "verbosity": "verbosity is a hint of OpenAI's own models, not supported here",
            "functions": "functions (deprecated) is not supported; use tools",
            "function_call": "function_call (deprecated) is not supported; use tool_choice",
            "moderation": "moderation is not supported",
            "prompt_cache_options": "prompt_cache_options is not supported (prefix caching is automatic)",
        }
        for name, reason in why.items():
            if getattr(self, name) is not None:
                return name, reason
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", "continue_final_message needs add_generation_prompt=false"
        return super().unsupported()


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


# ---- responses ----------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


# vLLM's prompt_logprobs in a response: per prompt token (the first null) {token id: logprob info}
PromptLogprobs = list[dict[str, dict[str, Any]] | None] | None


def prompt_logprobs_body(final: RequestOutput) -> PromptLogprobs:
    if final.prompt_logprobs is None:
        return None

    def one(lp: Logprob) -> dict[str, Any]:
        return {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}

    return [None if e is None else {str(t): one(lp) for t, lp in e.items()} for e in final.prompt_logprobs]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs = None


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
    prompt_logprobs: PromptLogprobs = None


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
    token_ids: list[int],
    logprobs: list[dict[int, Logprob]] | None,
    offset: int = 0,
    top: int | None = None,
    out: CompletionLogprobs | None = None,
    none_text: str = "",
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs; an entry of None (the prompt's first token under echo) gives null."""
    out = out if out is not None else CompletionLogprobs()
    for token, entry in zip(token_ids, logprobs or [], strict=False):
        if entry is None:
            out.tokens.append(none_text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(out.tokens[-1])
            continue
        chosen = entry[token]
        out.tokens.append(_text(chosen))
        out.token_logprobs.append(_finite(chosen.logprob))
        kept = (
            entry.values()
            if top is None
            else [lp for lp in entry.values() if (lp.rank or 0) <= top or lp is chosen]
        )
        out.top_logprobs.append({_text(lp): _finite(lp.logprob) for lp in kept})
        out.text_offset.append(offset)
        offset += len(_text(chosen))
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]] | None, top: int) -> ChatLogprobs:
    def one(lp: Logprob) -> TopLogprob:
        return TopLogprob(token=_text(lp), logprob=_finite(lp.logprob), bytes=list(_text(lp).encode()))

    content = []
    for token, entry in zip(token_ids, logprobs or [], strict=False):  # no logprobs: nothing to pair
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
    def __init__(
        self,
        model: str,
        n: int,
        logprobs: bool,
        echo: list[tuple[str, str]] | None = None,
        generate: bool = True,
    ) -> None:
        super().__init__(model, n)
        self.logprobs = logprobs
        self.offsets: dict[int, int] = {}  # choice index -> characters streamed so far
        # echo: per prompt, (its text, its first token's text); generate=False: max_tokens=0
        self.echo, self.generate = echo, generate

    def _choice(self, i: int, final: RequestOutput, c: Any) -> CompletionChoice:
        plp = prompt_logprobs_body(final)
        if self.echo is None:
            lps = completion_logprobs(c.token_ids, c.logprobs) if self.logprobs else None
            return CompletionChoice(
                index=i * self.n + c.index, text=c.text, logprobs=lps, finish_reason=c.finish_reason,
                prompt_logprobs=plp,
            )  # fmt: skip
        text, first = self.echo[i]
        lps = None
        if self.logprobs:
            prompt_lps = final.prompt_logprobs or [None] * len(final.prompt_token_ids)
            lps = completion_logprobs(final.prompt_token_ids, prompt_lps, none_text=first)
            if self.generate:
                completion_logprobs(c.token_ids, c.logprobs, len(text), out=lps)
        finish = c.finish_reason if self.generate else "length"
        body = text + c.text if self.generate else text
        return CompletionChoice(
            index=i * self.n + c.index, text=body, logprobs=lps, finish_reason=finish, prompt_logprobs=plp
        )

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
        choices = [self._choice(i, final, c) for i, final in enumerate(finals) for c in final.outputs]
        usage = self.usage(finals)
        if not self.generate:  # max_tokens=0: the one token run to get there is not an output
            usage.completion_tokens, usage.total_tokens = 0, usage.prompt_tokens
        return CompletionResponse(id=self.id, model=self.model, choices=choices, usage=usage)


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
        return ChatCompletionResponse(
            id=self.id, model=self.model, choices=choices, usage=self.usage(finals),
            prompt_logprobs=prompt_logprobs_body(finals[0]),
        )  # fmt: skip
