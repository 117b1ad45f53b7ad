"""Structured outputs and tool calls over HTTP with the official `openai` client: response_format
json_schema / json_object and vLLM's `structured_outputs` on both endpoints, `chat.completions.parse`
with a pydantic model, tool_choice required / named (grammar-constrained: arguments validate),
`auto` parsed by the hermes parser, reasoning split by deepseek_r1, streamed and not; every bad
field a 400 naming it, and the next request still served."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from test_server import ServerThread

from expertmesh import LLM
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME, build_app
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.chat_tools import ToolOptions

# A tools-aware template in the embedded model's role markup (its own template ignores tools):
# tools listed in a system turn, assistant calls in hermes form, tool results as their own turn.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools><|end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|tool|>\n"
    "<tool_response>{{ m.content }}</tool_response><|end|>\n{% elif m.role == 'assistant' and m.tool_calls %}"
    '<|assistant|>\n{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|end|>\n'
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 20},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
            },
            "required": ["query", "tags"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int
    pets: list[str]


@pytest.fixture(scope="module")
def servers():
    llm = LLM(None, max_model_len=1024, kv_cache_memory_bytes=1 << 24)
    llm.get_tokenizer().chat_template = TOOLS_TEMPLATE
    engine = AsyncEngine(llm)
    plain = build_app(engine, [DEFAULT_SERVED_NAME], tool_options=ToolOptions())
    tooled = build_app(engine, [DEFAULT_SERVED_NAME], tool_options=ToolOptions(True, "hermes", "deepseek_r1"))
    with ServerThread(plain) as a, ServerThread(tooled) as b:
        yield {
            "plain": openai.OpenAI(base_url=f"{a.url}/v1", api_key="x", max_retries=0),
            "tools": openai.OpenAI(base_url=f"{b.url}/v1", api_key="x", max_retries=0),
            "url": a.url,
            "tok": llm.get_tokenizer(),
        }
    engine.shutdown()


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": strict}}


NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 100, "maximum": 999},
        "kind": {"enum": ["a", "b"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "number"}},
                "required": ["k", "v"],
            },
            "maxItems": 3,
        },
    },
    "required": ["id", "kind", "items"],
}


def test_response_format_json_schema_chat_and_completions(servers):
    client = servers["plain"]
    for temperature, seed in ((0, None), (1.0, 1), (1.0, 2)):
        chat = client.chat.completions.create(
            model=DEFAULT_SERVED_NAME, messages=ASK, response_format=_schema_format(NESTED),
            temperature=temperature, seed=seed, max_tokens=200,
        )  # fmt: skip
        (choice,) = chat.choices
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), NESTED)
        comp = client.completions.create(
            model=DEFAULT_SERVED_NAME, prompt="Data:", max_tokens=200, temperature=temperature, seed=seed,
            extra_body={"response_format": _schema_format(NESTED)},
        )  # fmt: skip
        assert comp.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(comp.choices[0].text), NESTED)
    obj = client.chat.completions.create(
        model=DEFAULT_SERVED_NAME,
        messages=ASK,
        response_format={"type": "json_object"},
        max_tokens=100,
        temperature=0,
    )
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_openai_parse_with_a_pydantic_model(servers):
    parse = (
        getattr(servers["plain"].chat.completions, "parse", None)
        or servers["plain"].beta.chat.completions.parse
    )
    completion = parse(
        model=DEFAULT_SERVED_NAME, messages=ASK, response_format=Person, max_tokens=200, temperature=0
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and completion.choices[0].finish_reason == "stop"


def test_structured_outputs_extra_field_streamed_equals_whole(servers):
    client = servers["plain"]
    extra = {"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} [0-9]{2}"}}
    whole = client.completions.create(
        model=DEFAULT_SERVED_NAME, prompt="Hi", max_tokens=30, temperature=0, extra_body=extra
    )
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=DEFAULT_SERVED_NAME,
            prompt="Hi",
            max_tokens=30,
            temperature=0,
            extra_body=extra,
            stream=True,
        )
        if c.choices
    )
    assert whole.choices[0].text == text and whole.choices[0].finish_reason == "stop"
    import re

    assert re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{2}", text)
    chat = client.chat.completions.create(
        model=DEFAULT_SERVED_NAME,
        messages=ASK,
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}},
    )
    assert chat.choices[0].message.content in ("sunny", "rainy")


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("chat/completions", {"response_format": _schema_format({"type": "frobnicate"})}, "response_format"),
        ("completions", {"response_format": _schema_format({"type": "frobnicate"})}, "response_format"),
        ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("completions", {"structured_outputs": {"jsonn": {}}}, "structured_outputs"),
        ("chat/completions", {"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs"),
        ("chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
        ("chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
        (
            "chat/completions",
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        (
            "chat/completions",
            {"tools": TOOLS, "tool_choice": "auto"},
            "tool_choice",
        ),  # no --enable-auto-tool-choice
        (
            "chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("chat/completions", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ],
)
def test_bad_fields_are_400s_naming_them_and_the_next_request_works(servers, path, body, param):
    base = {"model": DEFAULT_SERVED_NAME, "max_tokens": 4}
    base.update({"messages": ASK} if path.startswith("chat") else {"prompt": "Hi"})
    r = httpx.post(f"{servers['url']}/v1/{path}", json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert httpx.post(f"{servers['url']}/v1/{path}", json=base, timeout=60).status_code == 200


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _streamed(client, **kwargs):
    content, finish, calls = "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
    return content, finish, [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("server", ["plain", "tools"])
def test_tool_choice_required_and_named_give_valid_calls(servers, server):
    client = servers[server]
    choices = ["required", {"type": "function", "function": {"name": "search"}}]
    for tool_choice in choices:
        for temperature, seed in ((0, None), (1.0, 4)):
            kwargs = dict(
                model=DEFAULT_SERVED_NAME, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                max_tokens=300, temperature=temperature, seed=seed, parallel_tool_calls=False,
            )  # fmt: skip
            whole = client.chat.completions.create(**kwargs)
            (choice,) = whole.choices
            assert choice.finish_reason == "tool_calls", choice
            calls = _calls(choice.message)
            assert len(calls) == 1 and not choice.message.content
            for name, args in calls:
                jsonschema.validate(args, SCHEMAS[name])
                assert tool_choice == "required" or name == "search"
            content, finish, streamed = _streamed(client, **kwargs)
            assert (content, finish, streamed) == ("", "tool_calls", calls)
            if tool_choice != "required":  # a named call's arguments stream as they are generated
                pieces = [
                    tc
                    for chunk in client.chat.completions.create(stream=True, **kwargs)
                    for ch in chunk.choices
                    for tc in ch.delta.tool_calls or []
                ]
                assert len(pieces) > 1 and pieces[0].function.name == "search" and pieces[0].id
                assert all(p.id is None and p.function.name is None for p in pieces[1:])


def _parsed_arguments(message: dict) -> dict:
    """What the server hands the template: assistant calls' arguments as objects."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def test_tools_and_tool_results_reach_the_template(servers):
    tok, client = servers["tok"], servers["plain"]
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "X"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    for msgs, tools in ((ASK, TOOLS), (messages, TOOLS), (messages, None)):
        expected = tok.apply_chat_template(
            [_parsed_arguments(m) for m in msgs], tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ("get_weather" in expected) == (tools is not None or msgs is messages)
        assert ("18 C, sunny" in expected) == (msgs is messages)
        kwargs = {"tools": tools} if tools else {}
        r = client.chat.completions.create(model=DEFAULT_SERVED_NAME, messages=msgs, max_tokens=2, **kwargs)
        assert r.usage.prompt_tokens == len(tok(expected, add_special_tokens=False)["input_ids"])


def _forced(client, regex: str, stream: bool, **extra):
    """The tiny model made to write `regex`'s text, as a model trained on the format would."""
    kwargs = dict(
        model=DEFAULT_SERVED_NAME, messages=ASK, max_tokens=120, temperature=0,
        extra_body={"structured_outputs": {"regex": regex}}, **extra,
    )  # fmt: skip
    if stream:
        return _streamed(client, **kwargs)
    r = client.chat.completions.create(**kwargs)
    return r.choices[0].message, r.choices[0].finish_reason


def test_auto_tool_calls_and_reasoning_parsed_from_text(servers):
    client = servers["tools"]
    args = {"city": "Paris", "unit": "celsius", "days": 2}
    call = '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(args) + "}</tool_call>"
    regex = r"Let me look\.</think>Checking\. " + _re_escape(call)
    message, finish = _forced(client, regex, False, tools=TOOLS)
    assert finish == "tool_calls" and message.content == "Checking."
    assert message.model_extra.get("reasoning_content") == "Let me look."
    assert _calls(message) == [("get_weather", args)]
    content, finish, calls = _streamed_raw(client, regex)
    assert content.strip() == "Checking." and finish == "tool_calls" and calls == _calls(message)
    # A malformed call is content, not a 500; without tools the text is never parsed as calls.
    bad = r"ok</think>" + _re_escape('<tool_call>{"name": get_weather}</tool_call>')
    message, finish = _forced(client, bad, False, tools=TOOLS)
    assert (
        finish == "stop"
        and message.content == '<tool_call>{"name": get_weather}</tool_call>'
        and not message.tool_calls
    )
    message, finish = _forced(client, r"hm</think>" + _re_escape(call), False)
    assert finish == "stop" and message.content == call and not message.tool_calls


def _streamed_raw(client, regex):
    return _streamed(
        client, model=DEFAULT_SERVED_NAME, messages=ASK, max_tokens=120, temperature=0, tools=TOOLS,
        extra_body={"structured_outputs": {"regex": regex}},
    )  # fmt: skip


def _re_escape(text: str) -> str:
    import re

    return re.escape(text)


# ---- /v1/responses --------------------------------------------------------------------------------
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def _response_calls(output) -> list[tuple[str, dict]]:
    return [(o.name, json.loads(o.arguments)) for o in output if o.type == "function_call"]


def test_responses_text_streamed_equals_whole_and_equals_chat(servers):
    for server in ("plain", "tools"):  # "tools" has the deepseek_r1 reasoning parser: all reasoning here
        client = servers[server]
        kwargs = dict(model=DEFAULT_SERVED_NAME, input="Hello there", max_output_tokens=12, temperature=0)
        whole = client.responses.create(**kwargs)
        chat = client.chat.completions.create(
            model=DEFAULT_SERVED_NAME, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12,
            temperature=0,
        )  # fmt: skip
        message = chat.choices[0].message
        reasoning = [o.content[0].text for o in whole.output if o.type == "reasoning"]
        assert whole.output_text == message.content and bool(message.content) == (server == "plain")
        assert reasoning == ([message.model_extra["reasoning_content"]] if server == "tools" else [])
        assert whole.usage.input_tokens == chat.usage.prompt_tokens
        assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        events = list(client.responses.create(stream=True, **kwargs))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        thoughts = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert events[0].type == "response.created" and events[-1].type.startswith("response.")
        assert deltas == whole.output_text == events[-1].response.output_text
        assert [thoughts] == (reasoning or [""])
        assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_responses_function_tools_and_json_format(servers):
    client = servers["plain"]
    for tool_choice in ("required", {"type": "function", "name": "get_weather"}):
        kwargs = dict(
            model=DEFAULT_SERVED_NAME, input="Weather in Paris?", tools=RESPONSES_TOOLS,
            tool_choice=tool_choice, max_output_tokens=300, temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        whole = client.responses.create(**kwargs)
        calls = _response_calls(whole.output)
        assert whole.status == "completed" and len(calls) == 1
        jsonschema.validate(calls[0][1], SCHEMAS[calls[0][0]])
        events = list(client.responses.create(stream=True, **kwargs))
        assert _response_calls(events[-1].response.output) == calls
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [(e.name, json.loads(e.arguments)) for e in done] == calls
        arg_deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert json.loads("".join(arg_deltas)) == calls[0][1]
        assert (len(arg_deltas) > 1) == (tool_choice != "required")
    fmt = {"type": "json_schema", "name": "out", "schema": NESTED, "strict": True}
    r = client.responses.create(
        model=DEFAULT_SERVED_NAME, input="Data", text={"format": fmt}, max_output_tokens=200, temperature=0
    )
    jsonschema.validate(json.loads(r.output_text), NESTED)


def test_responses_input_items_round_trip_and_rejections(servers):
    tok, client = servers["tok"], servers["plain"]
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
    ]
    r = client.responses.create(
        model=DEFAULT_SERVED_NAME,
        input=items,
        instructions="Be brief.",
        tools=RESPONSES_TOOLS,
        max_output_tokens=2,
    )
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]  # fmt: skip
    expected = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "18 C" in expected and r.usage.input_tokens == len(
        tok(expected, add_special_tokens=False)["input_ids"]
    )
    url = f"{servers['url']}/v1/responses"
    for body, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frobnicate"}}}},
            "text.format",
        ),
        ({"input": [{"type": "image_generation_call"}]}, "input"),
        ({"tools": RESPONSES_TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"foo_bar": 1}, "foo_bar"),
    ):
        got = httpx.post(url, json={"model": DEFAULT_SERVED_NAME, "input": "hi", **body}, timeout=60)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    ok = {
        "input": "hi",
        "max_output_tokens": 2,
        "store": False,
        "metadata": {"k": "v"},
        "truncation": "disabled",
    }
    assert httpx.post(url, json=ok, timeout=60).status_code == 200


def test_a_grammar_slower_than_the_compile_limit_fails_alone(servers, monkeypatch):
    from expertmesh.entrypoints import structured_api

    monkeypatch.setattr(structured_api, "COMPILE_TIMEOUT_S", 0.0)
    body = {"model": DEFAULT_SERVED_NAME, "prompt": "Hi", "max_tokens": 4}
    url = f"{servers['url']}/v1/completions"
    r = httpx.post(url, json={**body, "structured_outputs": {"regex": "[a-f]{3}-slow"}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    assert "longer than" in r.json()["error"]["message"]
    assert httpx.post(url, json=body, timeout=60).status_code == 200


def test_parsed_outputs_keep_special_tokens_but_not_the_stop_token(servers):
    """A parser must see markers that are special tokens in some tokenizers, so its requests keep
    special tokens; the end-of-sequence token is cut off again."""
    ask = dict(
        model=DEFAULT_SERVED_NAME, messages=[{"role": "user", "content": "Hello there"}], max_tokens=100
    )
    plain = servers["plain"].chat.completions.create(temperature=0, **ask).choices[0]
    parsed = servers["tools"].chat.completions.create(temperature=0, **ask).choices[0]  # deepseek_r1
    assert plain.finish_reason == parsed.finish_reason == "stop"
    # The embedded model closes its turn with <|end|> and </s> (both special): cut, as turn ends.
    assert parsed.message.model_extra["reasoning_content"] == plain.message.content
    streamed = _streamed_reasoning(servers["tools"], temperature=0, **ask)
    assert streamed == (plain.message.content, "")
    grammar = 'start: "ok</think>A" <[7]> "B"'  # <|end|> (id 7) is a special token of this tokenizer
    extra = {"structured_outputs": {"grammar": grammar}}
    kept = servers["tools"].chat.completions.create(temperature=0, extra_body=extra, **ask).choices[0]
    dropped = servers["plain"].chat.completions.create(temperature=0, extra_body=extra, **ask).choices[0]
    assert (kept.message.content, dropped.message.content) == ("A<|end|>B", "ok</think>AB")
    streamed = _streamed(servers["tools"], temperature=0, extra_body=extra, **ask)
    assert streamed[:2] == ("A<|end|>B", "stop")


def _streamed_reasoning(client, **kwargs) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            content += ch.delta.content or ""
    return reasoning, content


def test_logprobs_of_constrained_tokens_are_json_numbers(servers):
    """A grammar leaves fewer allowed tokens than top_logprobs asks for: the others are -inf,
    sent as -9999.0 (as vLLM does), not a 500."""
    r = servers["plain"].chat.completions.create(
        model=DEFAULT_SERVED_NAME, messages=ASK, max_tokens=5, logprobs=True, top_logprobs=5,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert content and all(t.logprob <= 0 for t in content)
    assert min(t.logprob for tok in content for t in tok.top_logprobs) == -9999.0
    comp = servers["plain"].completions.create(
        model=DEFAULT_SERVED_NAME,
        prompt="Hi",
        max_tokens=5,
        logprobs=3,
        extra_body={"structured_outputs": {"regex": "ab"}},
    )
    assert comp.choices[0].text == "ab" and -9999.0 in comp.choices[0].logprobs.top_logprobs[-1].values()


class GetWeather(BaseModel):
    city: str
    days: int


def test_openai_tool_helpers_parse_the_calls(servers):
    """openai.pydantic_function_tool + chat.completions.parse: the client parses the arguments."""
    client = servers["plain"]
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    tool = openai.pydantic_function_tool(GetWeather)
    for tool_choice in ({"type": "function", "function": {"name": "GetWeather"}}, "required"):
        completion = parse(
            model=DEFAULT_SERVED_NAME, messages=ASK, tools=[tool], tool_choice=tool_choice,
            max_tokens=200, temperature=0, parallel_tool_calls=False,
        )  # fmt: skip
        (call,) = completion.choices[0].message.tool_calls
        assert isinstance(call.function.parsed_arguments, GetWeather)
        assert completion.choices[0].finish_reason == "tool_calls"
