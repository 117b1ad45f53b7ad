"""OpenAI wire format: the server's request and response bodies (pydantic models); how the
engine's outputs map onto them (whole responses and stream chunks) is renderers.py.

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
