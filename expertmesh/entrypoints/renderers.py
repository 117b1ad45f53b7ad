"""The engine's outputs -> OpenAI's response bodies (protocol.py): logprobs in the legacy and the
chat shapes, usage, and a `Renderer` per route that builds the whole response or its stream
chunks from the engine's updates."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from expertmesh.entrypoints.async_engine import Update
from expertmesh.entrypoints.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    new_id,
    prompt_logprobs_body,
)
from expertmesh.outputs import Logprob, RequestOutput


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


def finish_reason_of(update: Update, index: int) -> str | None:
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
            index, finish = prompt_index * self.n + d.index, finish_reason_of(update, d.index)
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
            finish = finish_reason_of(update, d.index)
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
