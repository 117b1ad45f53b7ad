"""An HTTP request's fields -> the engine's inputs: the served model name, `SamplingParams`, the
prompts (completion prompts, the chat template, truncation, echo) and /tokenize, /detokenize.
Every bad value is an `APIError` naming its field. The tokenizer steps run in the engine's
thread pool (`AsyncEngine.in_pool`), off the event loop."""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI

from expertmesh.entrypoints import chat_tools
from expertmesh.entrypoints.api_errors import APIError
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.protocol import ChatCompletionRequest, SamplingFields, TokenizeRequest
from expertmesh.sampling_params import SamplingParams


def reject_unsupported(body: SamplingFields) -> None:
    found = body.unsupported()
    if found is not None:
        raise APIError(found[1], found[0], "unsupported_parameter")


def tokenizer_or_400(engine: AsyncEngine, param: str) -> Any:
    tok = engine.thread_tokenizer()
    if tok is None:
        raise APIError("this model has no tokenizer", param, "no_tokenizer")
    return tok


def tokenize_body(engine: AsyncEngine, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        tok = tokenizer_or_400(engine, "prompt")
        return list(tok(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    chat = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt)
    text = chat_prompt(engine, chat)
    return list(tokenizer_or_400(engine, "messages")(text, add_special_tokens=False)["input_ids"])


def detokenize_ids(engine: AsyncEngine, tokens: list[int]) -> str:
    tok = tokenizer_or_400(engine, "tokens")
    vocab = len(tok)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens", "invalid_value"
        )
    return tok.decode(tokens)


def truncated(
    engine: AsyncEngine, prompts: list[str | list[int]], keep: int, special: bool
) -> list[list[int]]:
    """Each prompt as token ids, only its last `keep` (truncate_prompt_tokens)."""
    out = []
    for p in prompts:
        ids = (
            tokenizer_or_400(engine, "prompt")(p, add_special_tokens=special)["input_ids"]
            if isinstance(p, str)
            else p
        )
        out.append(list(ids)[-keep:])
    return out


def echo_texts(engine: AsyncEngine, prompts: list[str | list[int]]) -> list[tuple[str, str]]:
    """Per prompt, its text (token-id prompts decoded) and its first token's text, for echo."""
    tok = tokenizer_or_400(engine, "echo")
    out = []
    for p in prompts:
        ids = p if isinstance(p, list) else tok(p, add_special_tokens=True)["input_ids"]
        text = p if isinstance(p, str) else tok.decode(p)
        out.append((text, tok.decode(ids[:1]) if ids else ""))
    return out


def model_name(app: FastAPI, body: SamplingFields) -> str:
    names = app.state.names
    if body.model is None:
        return names[0]
    if body.model not in names:
        raise APIError(
            f"the model {body.model!r} does not exist; served: {names}", "model", "model_not_found"
        )
    return body.model


def to_sampling_params(
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


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("the prompt is empty", "prompt", "invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # one prompt of token ids
    return list(prompt)


def chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest) -> str:
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
