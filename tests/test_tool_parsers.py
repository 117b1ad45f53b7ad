"""Each tool-call parser on text in its family's published format (content around the calls,
several calls, arguments of every JSON type), streamed in pieces of every size (the concatenated
stream equals the whole-text parse), and malformed (the text comes back as content, no call).
The reasoning parsers likewise."""

from __future__ import annotations

import json
import re

import pytest

from expertmesh.entrypoints.reasoning_parsers import ReasoningStream, get_reasoning_parser
from expertmesh.entrypoints.tool_parsers import ToolCall, ToolStream, get_tool_parser

W = {"city": "Paris", "days": 3, "metric": True, "hours": [1.5, None], "opts": {"lang": "fr"}}
S = {"query": 'say "hi"\n'}
GLM_W = {"city": "Paris", "days": 3, "metric": True}
PY_W = {"city": "Paris", "days": 3, "metric": True, "hours": [1.5, None]}
DS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>",
)


def _ds_v3(name: str, args: dict) -> str:
    return f"{DS[1]}function{DS[2]}{name}\n```json\n{json.dumps(args)}\n```{DS[3]}"


def _ds_v31(name: str, args: dict) -> str:
    return f"{DS[1]}{name}{DS[2]}{json.dumps(args)}{DS[3]}"


def _glm(name: str, args: dict) -> str:
    pairs = "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
        for k, v in args.items()
    )
    return f"<tool_call>{name}\n{pairs}</tool_call>"


# parser -> [(text, content, [(name, args)])]
CASES = {
    "hermes": [
        (
            "I will check.\n<tool_call>\n"
            f'{{"name": "get_weather", "arguments": {json.dumps(W)}}}\n</tool_call>\n'
            f'<tool_call>\n{{"name": "search", "arguments": {json.dumps(S)}}}\n</tool_call>',
            "I will check.\n\n",
            [("get_weather", W), ("search", S)],
        ),
        ("No tools needed: 1 < 2.", "No tools needed: 1 < 2.", []),
    ],
    "deepseek_v3": [
        (
            f"Let me see.{DS[0]}{_ds_v3('get_weather', W)}\n{_ds_v3('search', S)}{DS[4]}",
            "Let me see.",
            [("get_weather", W), ("search", S)],
        )
    ],
    "deepseek_v31": [
        (
            f"{DS[0]}{_ds_v31('get_weather', W)}{_ds_v31('search', S)}{DS[4]}",
            "",
            [("get_weather", W), ("search", S)],
        )
    ],
    "glm45": [
        (
            f"Checking.\n{_glm('get_weather', GLM_W)}\n{_glm('search', S)}",
            "Checking.\n\n",
            [("get_weather", GLM_W), ("search", S)],
        )
    ],
    "mistral": [
        (
            f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {json.dumps(W)}}}, '
            f'{{"name": "search", "arguments": {json.dumps(S)}}}]',
            "Sure. ",
            [("get_weather", W), ("search", S)],
        ),
        (
            f"[TOOL_CALLS]get_weather[ARGS]{json.dumps(W)}[TOOL_CALLS]search[ARGS]{json.dumps(S)}",
            "",
            [("get_weather", W), ("search", S)],
        ),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}', "", [("get_weather", W)]),
        (
            f'<|python_tag|>{{"name": "get_weather", "parameters": {json.dumps(W)}}}; '
            f'{{"name": "search", "parameters": {json.dumps(S)}}}',
            "",
            [("get_weather", W), ("search", S)],
        ),
        ("The answer is {not a call}.", "The answer is {not a call}.", []),
    ],
    "pythonic": [
        (
            "[get_weather(city='Paris', days=3, metric=True, hours=[1.5, None]), search(query='x')]",
            "",
            [("get_weather", PY_W), ("search", {"query": "x"})],
        ),
        ("<|python_start|>[search(query='say hi')]<|python_end|>", "", [("search", {"query": "say hi"})]),
        ("Plain [text] here.", "Plain [text] here.", []),
    ],
}  # fmt: skip
MALFORMED = {
    "hermes": [
        'Hi <tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',
        "<tool_call>not json",
        "<tool_call>[1]</tool_call>",
    ],
    "deepseek_v3": [
        f"{DS[0]}{DS[1]}function{DS[2]}f\n```json\n{{bad}}\n```{DS[3]}{DS[4]}",
        f"{DS[0]}{DS[1]}cut off",
    ],
    "deepseek_v31": [f"{DS[0]}{DS[1]}f{DS[2]}{{oops{DS[3]}{DS[4]}"],
    "glm45": [
        "<tool_call>f\nstray text<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
        "<tool_call>f\n<arg_key>a",
    ],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}', "[TOOL_CALLS]f[ARGS]{nope"],
    "llama3_json": ['{"name": "f", "parameters": {"a": 1}', '{"a": 1}', '{"name": "f", "parameters": [1]}'],
    "pythonic": ["[f(1)]", "[f(a=open('x'))]", "[f(a=1"],
}  # fmt: skip


def _stream(parser, text: str, size: int) -> tuple[str, list[ToolCall]]:
    stream, content, calls = ToolStream(parser), "", []
    for at in range(0, len(text), size):
        c, new = stream.feed(text[at : at + size])
        content, calls = content + c, calls + new
    c, new = stream.finish()
    return content + c, calls + new


def _as_pairs(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(CASES))
def test_published_format_whole_and_streamed_in_every_piece_size(name):
    parser = get_tool_parser(name)
    for text, content, calls in CASES[name]:
        got_content, got_calls = parser.parse(text)
        assert (got_content, _as_pairs(got_calls)) == (content, calls), text
        for size in range(1, len(text) + 1):
            assert _stream(parser, text, size) == (got_content, got_calls), (text, size)


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_calls_come_back_as_content(name):
    parser = get_tool_parser(name)
    for text in MALFORMED[name]:
        assert parser.parse(text) == (text, []), text
        for size in (1, 2, 3, 7, len(text)):
            assert _stream(parser, text, size) == (text, []), (text, size)


def test_a_stream_sends_each_call_once_it_closes():
    parser = get_tool_parser("hermes")
    stream = ToolStream(parser)
    assert stream.feed("Hi <tool") == ("Hi ", [])  # a possible marker is held back
    assert stream.feed('_call>{"name": "f", "arguments": {}}</tool_call>') == ("", [ToolCall("f", "{}")])
    assert stream.feed("<tool_call>") == ("", [])
    assert stream.finish() == ("<tool_call>", [])  # an unclosed call is content at the end


REASONING = {
    "deepseek_r1": [
        ("Let me think.\nOk.</think>\n\nThe answer is 4.", "Let me think.\nOk.", "The answer is 4."),
        ("<think>Hmm</think>Yes", "Hmm", "Yes"),
        ("still thinking when cut", "still thinking when cut", ""),
    ],
    "qwen3": [
        ("<think>\nplan\n</think>\n\nHello!", "\nplan\n", "Hello!"),
        ("Thinking is off: plain answer.", None, "Thinking is off: plain answer."),
        ("<thin>not a tag", None, "<thin>not a tag"),
    ],
    "glm45": [("<think>a < b</think>b > a", "a < b", "b > a")],
}


@pytest.mark.parametrize("name", sorted(REASONING))
def test_reasoning_parsers_whole_and_streamed(name):
    parser = get_reasoning_parser(name)
    for text, reasoning, content in REASONING[name]:
        assert parser.split(text) == (reasoning, content)
        for size in range(1, len(text) + 1):
            stream, r, c = ReasoningStream(parser), "", ""
            for at in range(0, len(text), size):
                dr, dc = stream.feed(text[at : at + size])
                r, c = r + dr, c + dc
            dr, dc = stream.finish()
            assert (r + dr, c + dc) == (reasoning or "", content), (text, size)


def test_unknown_parser_names_are_errors():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


# ---- gpt-oss harmony ----------------------------------------------------------------------------
H_CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>'
)
H_FINAL = (
    "<|channel|>analysis<|message|>2 + 2 is 4.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
)
H_RECIPIENT_FIRST = (
    '<|start|>assistant to=functions.search<|channel|>commentary json<|message|>{"query": "x"}'
)
H_BAD = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{bad<|call|>"


def _atoms(text: str) -> list[str]:
    """The text as a model emits it: each harmony marker one (special) token, other text by character."""
    out = []
    for part in re.split(r"(<\|[a-z_]+\|>)", text):
        out.extend([part] if part.startswith("<|") else list(part))
    return out


def _harmony_stream(text: str, size: int) -> tuple[str, str, list[ToolCall]]:
    rs, ts = ReasoningStream(get_reasoning_parser("openai_gptoss")), ToolStream(get_tool_parser("openai"))
    atoms, reasoning, content, calls = _atoms(text), "", "", []
    for at in range(0, len(atoms) + 1, size):
        piece = "".join(atoms[at : at + size])
        final = at + size >= len(atoms)
        r, c = rs.feed(piece)
        if final:
            r2, c2 = rs.finish()
            r, c = r + r2, c + c2
        c, new = ts.feed(c)
        if final:
            c2, more = ts.finish()
            c, new = c + c2, new + more
        reasoning, content, calls = reasoning + r, content + c, calls + new
        if final:
            break
    return reasoning, content, calls


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        (H_CALL, "Need the weather.", "", [("get_weather", {"city": "Paris", "days": 3})]),
        (
            H_CALL.removesuffix("<|call|>"),
            "Need the weather.",
            "",
            [("get_weather", {"city": "Paris", "days": 3})],
        ),
        (H_FINAL, "2 + 2 is 4.", "It is 4.", []),
        (H_RECIPIENT_FIRST, None, "", [("search", {"query": "x"})]),
        (H_BAD, None, "{bad", []),
        ("Plain text, no channels.", None, "Plain text, no channels.", []),
    ],
)
def test_harmony_reasoning_and_calls_whole_and_streamed_by_token(text, reasoning, content, calls):
    got_reasoning, rest = get_reasoning_parser("openai_gptoss").split(text)
    got_content, got_calls = get_tool_parser("openai").parse(rest)
    assert (got_reasoning, got_content, _as_pairs(got_calls)) == (reasoning, content, calls)
    for size in range(1, len(_atoms(text)) + 1):
        assert _harmony_stream(text, size) == (reasoning or "", got_content, got_calls), size
