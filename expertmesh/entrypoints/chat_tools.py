"""Chat completions with tools and reasoning: the serve flags (`--enable-auto-tool-choice`,
`--tool-call-parser`, `--reasoning-parser`), the messages and tools handed to the chat template,
and the renderer that turns generated text into `reasoning_content`, `content` and `tool_calls`
(whole, or as stream deltas).

tool_choice `required` and a named function are constrained by a grammar (structured_api.py), so
their text is the calls' JSON; `auto` is parsed from free text by the configured parser. Text
that does not parse as a call stays content (finish_reason as generated); parsed calls make the
finish_reason "tool_calls".
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from expertmesh.entrypoints.chat_tool_protocol import (
    FunctionCall,
    FunctionDelta,
    ToolAssistantMessage,
    ToolCallDelta,
    ToolCallOut,
    ToolChatChoice,
    ToolChatChunk,
    ToolChatResponse,
    ToolDelta,
    ToolStreamChoice,
)
from expertmesh.entrypoints.protocol import ChatCompletionResponse
from expertmesh.entrypoints.reasoning_parsers import (
    END,
    START,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from expertmesh.entrypoints.renderers import ChatRenderer, chat_logprobs, finish_reason_of
from expertmesh.entrypoints.structured_api import APIFieldError, constrain, tool_choice_kind
from expertmesh.entrypoints.tool_parsers import ToolCall, ToolParser, ToolStream, call_of, get_tool_parser
from expertmesh.outputs import RequestOutput
from expertmesh.sampling_params import SamplingParams


@dataclass
class ToolOptions:
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)  # unknown names fail at startup
        if self.reasoning_parser:
            get_reasoning_parser(self.reasoning_parser)


_options = ToolOptions()


def configure(options: ToolOptions) -> None:
    """The serve flags, set by the CLI before the app is built (every torchrun rank runs it too)."""
    global _options
    _options = options


def configured() -> ToolOptions:
    return _options


# ---- request side -------------------------------------------------------------------------------
def check_tool_request(body: Any, options: ToolOptions) -> None:
    if body.tool_choice == "auto" and body.tools and not options.enable_auto_tool_choice:
        raise APIFieldError(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
            "--tool-call-parser NAME",
            "tool_choice",
        )


def template_kwargs(body: Any) -> dict[str, Any]:
    """What apply_chat_template gets besides the messages: the tools (OpenAI's shape), unless
    tool_choice is none."""
    if not body.tools or body.tool_choice == "none":
        return {}
    return {"tools": [t.model_dump(exclude_none=True) for t in body.tools]}


def message_for_template(message: dict[str, Any]) -> dict[str, Any]:
    """Assistant tool calls carry their arguments as a JSON string over the API; templates iterate
    them as a mapping (`arguments | tojson`, `arguments.items()`), so they get the parsed object."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        call = dict(call)
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # the template sees the string as the client sent it
        call["function"] = fn
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"


# ---- text -> message -------------------------------------------------------------------------------
def constrained_calls(text: str, mode: str, forced: str | None) -> list[ToolCall] | None:
    """The calls a grammar-constrained output holds (named: its arguments object; required: a
    [{"name", "parameters"}] array), or None when the text is not that (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if mode == "named":
        return [ToolCall(forced, json.dumps(value, ensure_ascii=False))] if isinstance(value, dict) else None
    if not isinstance(value, list) or not value:
        return None
    calls = [call_of(v, ("parameters", "arguments")) for v in value]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class ToolChatRenderer(ChatRenderer):
    """ChatRenderer with reasoning_content and tool_calls split out of the text."""

    def __init__(
        self,
        model: str,
        n: int,
        top_logprobs: int | None,
        mode: str,
        tool_parser: ToolParser | None,
        reasoning: ReasoningParser | None,
        forced: str | None = None,
        specials: dict[int, str] | None = None,
    ) -> None:
        super().__init__(model, n, top_logprobs)
        self.mode, self.tool_parser, self.reasoning, self.forced = mode, tool_parser, reasoning, forced
        # Parsed outputs keep special tokens (markers such as [TOOL_CALLS] or a special <think> are
        # special tokens in some tokenizers); the end-of-sequence token's text is cut off again.
        self.specials = specials or {}
        if mode in ("required", "named"):
            self.reasoning = None  # the grammar shapes the whole output: there is no thinking part
        self._streams: dict[int, dict[str, Any]] = {}

    def split(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        if self.mode in ("required", "named"):
            calls = constrained_calls(content, self.mode, self.forced)
            return reasoning, ("" if calls else content), calls or []
        if self.mode == "auto" and self.tool_parser is not None:
            content, calls = self.tool_parser.parse(content)
            return reasoning, content, calls
        return reasoning, content, []

    def _trailing_specials(self, text: str, ids: list[int]) -> tuple[str, str]:
        """(text, cut): the special tokens that end `ids` (turn-end and stop tokens, never a
        parser's markers) cut off `text`."""
        keep = {START, END}
        if self.tool_parser is not None:
            keep.update((*self.tool_parser.starts, self.tool_parser.end or ""))
        cut, k = "", len(ids)
        while k and ids[k - 1] in self.specials and self.specials[ids[k - 1]] not in keep:
            cut = self.specials[ids[k - 1]] + cut
            k -= 1
        return (text[: len(text) - len(cut)], cut) if cut and text.endswith(cut) else (text, "")

    def _without_stop_token(self, text: str, ids: list[int], finish: str | None) -> str:
        return self._trailing_specials(text, ids)[0]

    def _stream_text(self, index: int, text: str, ids: list[int], final: bool) -> str:
        """A delta's text with trailing special tokens held back until text follows them (then
        they were content) or the stream ends (then they were the turn's end)."""
        st = self._state(index)
        kept, cut = self._trailing_specials(text, ids)
        if not kept:
            st["held"] += cut
            return ""
        out, st["held"] = st["held"] + kept, cut
        return out

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        choices = []
        for final in finals:
            for c in final.outputs:
                reasoning, content, calls = self.split(
                    self._without_stop_token(c.text, c.token_ids, c.finish_reason)
                )
                finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
                message = ToolAssistantMessage(
                    content=(content.strip() or None) if calls else content,
                    reasoning_content=reasoning,
                    tool_calls=[ToolCallOut(id=_call_id(), function=FunctionCall(**vars(t))) for t in calls],
                )
                lps = chat_logprobs(c.token_ids, c.logprobs, self.top) if self.top is not None else None
                choices.append(
                    ToolChatChoice(index=c.index, message=message, logprobs=lps, finish_reason=finish)
                )
        return ToolChatResponse(id=self.id, model=self.model, choices=choices, usage=self.usage(finals))

    # ---- streaming ----------------------------------------------------------------------------
    def _state(self, index: int) -> dict[str, Any]:
        if index not in self._streams:
            tools = self.tool_parser if self.mode == "auto" else None
            self._streams[index] = {
                "reasoning": ReasoningStream(self.reasoning) if self.reasoning else None,
                "tools": ToolStream(tools) if tools else None,
                "text": "",
                "calls": 0,
                "any_call": False,
                "held": "",
            }
        return self._streams[index]

    def _deltas(self, index: int, text: str, final: bool) -> tuple[ToolDelta, bool]:
        st = self._state(index)
        st["text"] += text
        if self.mode == "named":  # the text is the call's arguments: streamed as they come
            out = []
            if text:
                first = st["calls"] == 0
                fn = FunctionDelta(name=self.forced if first else None, arguments=text)
                out.append(ToolCallDelta(index=0, id=_call_id() if first else None,
                                         type="function" if first else None, function=fn))  # fmt: skip
                st["calls"] = 1
            done = final and constrained_calls(st["text"], "named", self.forced) is not None
            return ToolDelta(tool_calls=out or None), done
        if self.mode == "required":  # held whole: the calls come at the end
            if not final:
                return ToolDelta(), False
            _, content, calls = self.split(st["text"])
            return self._delta(st, "", content, calls), bool(calls)
        reasoning, content = "", text
        if st["reasoning"] is not None:
            reasoning, content = st["reasoning"].feed(text)
            if final:
                r2, c2 = st["reasoning"].finish()
                reasoning, content = reasoning + r2, content + c2
        calls: list[ToolCall] = []
        if st["tools"] is not None:
            content, calls = st["tools"].feed(content)
            if final:
                c2, more = st["tools"].finish()
                content, calls = content + c2, calls + more
        delta = self._delta(st, reasoning, content, calls)
        st["any_call"] = st["any_call"] or bool(calls)
        return delta, st["any_call"]

    def _delta(self, st: dict[str, Any], reasoning: str, content: str, calls: list[ToolCall]) -> ToolDelta:
        out = []
        for call in calls:
            fn = FunctionDelta(name=call.name, arguments=call.arguments)
            out.append(ToolCallDelta(index=st["calls"], id=_call_id(), type="function", function=fn))
            st["calls"] += 1
        return ToolDelta(content=content or None, reasoning_content=reasoning or None, tool_calls=out or None)

    def _chunk(self, choices: list, usage: Any = None) -> BaseModel:
        if any(isinstance(c, ToolStreamChoice) for c in choices):
            return ToolChatChunk(id=self.id, model=self.model, choices=choices, usage=usage)
        return super()._chunk(choices, usage)

    def stream_chunks(self, prompt_index: int, update: Any) -> list[BaseModel]:
        choices = []
        for d in update.deltas:
            finish = finish_reason_of(update, d.index)
            text = self._stream_text(d.index, d.text, d.token_ids, finish is not None)
            delta, has_calls = self._deltas(d.index, text, finish is not None)
            if has_calls and finish == "stop":
                finish = "tool_calls"
            lps = chat_logprobs(d.token_ids, d.logprobs, self.top) if self.top is not None else None
            if delta.empty() and finish is None and not (lps and lps.content):
                continue
            choices.append(ToolStreamChoice(index=d.index, delta=delta, logprobs=lps, finish_reason=finish))
        return [self._chunk(choices)] if choices else []


def chat_renderer(
    model: str,
    n: int,
    top: int | None,
    body: Any,
    options: ToolOptions,
    always: bool = False,
    specials: dict[int, str] | None = None,
) -> ChatRenderer:
    """The plain ChatRenderer when neither tools nor a reasoning parser are in play (unless `always`)."""
    mode = tool_choice_kind(body, options.enable_auto_tool_choice)
    reasoning = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
    if mode == "none" and reasoning is None and not always:
        return ChatRenderer(model, n, top)
    parser = get_tool_parser(options.tool_call_parser) if options.tool_call_parser else None
    forced = body.tool_choice.function.name if mode == "named" else None
    return ToolChatRenderer(model, n, top, mode, parser, reasoning, forced, specials)


_special_texts: dict[int, dict[int, str]] = {}


def special_texts(tokenizer: Any) -> dict[int, str]:
    """Special token id -> its text (computed once per tokenizer, on the caller's thread)."""
    key = id(tokenizer)
    if key not in _special_texts:
        ids = getattr(tokenizer, "all_special_ids", None) or []
        texts = dict(zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True)) if ids else {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        texts.update({i: t.content for i, t in added.items() if getattr(t, "special", False)})
        _special_texts[key] = texts
    return _special_texts[key]


async def prepare(
    engine: Any,
    body: Any,
    params: SamplingParams,
    options: ToolOptions,
    name: str,
    top: int | None,
    always: bool = False,
) -> tuple[SamplingParams, ChatRenderer]:
    """The chat request's tool and structured-output fields applied: checked, its constraint
    compiled into `params`, and the renderer that splits its output. When a parser reads the text,
    special tokens are kept in it (skip_special_tokens=False), as vLLM's parsers ask."""
    check_tool_request(body, options)
    params = await constrain(engine, body, params, options.enable_auto_tool_choice)
    specials = special_texts(engine.tokenizer) if engine.tokenizer is not None else {}
    renderer = chat_renderer(name, params.n, top, body, options, always, specials)
    if isinstance(renderer, ToolChatRenderer) and (renderer.reasoning or renderer.mode == "auto"):
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params, renderer
