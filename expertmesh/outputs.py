"""Result objects with vLLM's shape: RequestOutput -> CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # Set when the request could not run (e.g. its prompt exceeds max_model_len); outputs are empty.
    error: str | None = None
    # Prompt tokens whose K/V came from the prefix cache (vLLM's field; None when it never ran).
    num_cached_tokens: int | None = None
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
