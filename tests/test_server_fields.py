"""Every field of OpenAI's completions and chat-completions request schemas (the `openai`
package's own TypedDicts) and vLLM's sampling extras: honoured (its effect checked against an
offline run or transformers) or a 400 naming it; unknown fields are a 400 naming them; echo with
logprobs gives transformers' prompt log-softmax; /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

import httpx
import pytest
import torch
from openai.types.chat.completion_create_params import CompletionCreateParamsBase as ChatParams
from openai.types.completion_create_params import CompletionCreateParamsBase as CompletionParams
from test_server import ServerThread

from expertmesh import LLM, SamplingParams
from expertmesh.config.model_source import DEFAULT_MODEL_DIR
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME, build_app
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.protocol import METADATA_FIELDS, NOT_YET_SUPPORTED

PROMPT = "The capital of France is"
MSGS = [{"role": "user", "content": "Hi"}]
N = 8


@pytest.fixture(scope="module")
def served():
    """(server, a second LLM for offline references: the served one belongs to its engine thread)."""
    engine = AsyncEngine(LLM(None, max_model_len=512, kv_cache_memory_bytes=1 << 23))
    ref = LLM(None, max_model_len=512, kv_cache_memory_bytes=1 << 23)
    with ServerThread(build_app(engine, [DEFAULT_SERVED_NAME])) as server:
        yield server, ref
    engine.shutdown()


def _post(server, route, body):
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


def _bad(server, route, body, param):
    r = _post(server, route, body)
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["param"] == param, r.text
    return r.json()["error"]["message"]


def _ids(resp):
    return resp.json()["choices"][0]["text"]


# An example value and how each OpenAI field is treated: "effect" fields have a test of their
# effect in this file or tests/test_server.py; "reject" fields are a 400 naming them when set.
COMPLETION_FIELDS = {
    "model": ("effect", DEFAULT_SERVED_NAME),  # test_server: a wrong model is a 404-style 400
    "prompt": ("effect", PROMPT),
    "best_of": ("reject", 3),
    "echo": ("effect", True),
    "frequency_penalty": ("effect", 1.0),
    "logit_bias": ("effect", {"5": 10}),
    "logprobs": ("effect", 2),
    "max_tokens": ("effect", 4),
    "n": ("effect", 2),
    "presence_penalty": ("effect", 1.0),
    "seed": ("effect", 3),
    "stop": ("effect", ["x"]),
    "stream_options": ("effect", {"include_usage": True}),
    "suffix": ("reject", "tail"),
    "temperature": ("effect", 0.5),
    "top_p": ("effect", 0.5),
    "user": ("metadata", "u1"),
}
CHAT_FIELDS = {
    "messages": ("effect", MSGS),
    "model": ("effect", DEFAULT_SERVED_NAME),
    "audio": ("reject", {"voice": "alloy", "format": "wav"}),
    "frequency_penalty": ("effect", 1.0),
    "function_call": ("reject", "auto"),
    "functions": ("reject", [{"name": "f"}]),
    "logit_bias": ("effect", {"5": 10}),
    "logprobs": ("effect", True),
    "max_completion_tokens": ("effect", 4),
    "max_tokens": ("effect", 4),
    "metadata": ("metadata", {"k": "v"}),
    "modalities": ("reject", ["text", "audio"]),
    "moderation": ("reject", {"type": "x"}),
    "n": ("effect", 2),
    "parallel_tool_calls": ("effect", False),  # tests/test_server_tools.py
    "prediction": ("reject", {"type": "content", "content": "x"}),
    "presence_penalty": ("effect", 1.0),
    "prompt_cache_key": ("metadata", "k"),
    "prompt_cache_options": ("reject", {"x": 1}),
    "prompt_cache_retention": ("metadata", "24h"),
    "reasoning_effort": ("reject", "low"),
    "response_format": ("effect", {"type": "json_object"}),  # tests/test_server_tools.py
    "safety_identifier": ("metadata", "s"),
    "seed": ("effect", 3),
    "service_tier": ("metadata", "auto"),
    "stop": ("effect", ["x"]),
    "store": ("metadata", False),
    "stream_options": ("effect", {"include_usage": True}),
    "temperature": ("effect", 0.5),
    "tool_choice": ("effect", "auto"),  # no tools: nothing to call; with tools: test_server_tools.py
    "tools": ("effect", [{"type": "function", "function": {"name": "f"}}]),  # test_server_tools.py
    "top_logprobs": ("effect", 2),
    "top_p": ("effect", 0.5),
    "user": ("metadata", "u1"),
    "verbosity": ("reject", "low"),
    "web_search_options": ("reject", {}),
}


@pytest.mark.timeout(120)
def test_schema_walk_every_field_is_honoured_or_rejected(served):
    """Each key of the openai package's request TypedDicts is in the table above (a new field
    of the schema fails this test until it is classified), and behaves as the table says."""
    server, _ = served
    assert set(CompletionParams.__annotations__) == set(COMPLETION_FIELDS)
    assert set(ChatParams.__annotations__) == set(CHAT_FIELDS)
    for route, fields, base in (
        ("/v1/completions", COMPLETION_FIELDS, {"prompt": PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", CHAT_FIELDS, {"messages": MSGS, "max_tokens": 2}),
    ):
        for name, (kind, value) in fields.items():
            body = {**base, name: value}
            if name == "top_logprobs":
                body["logprobs"] = True
            if kind == "reject":
                _bad(server, route, body, name)
            else:
                r = _post(server, route, body)
                assert r.status_code == 200, (name, r.text)
                assert (kind == "metadata") == (name in METADATA_FIELDS), name
    for name in NOT_YET_SUPPORTED:  # vLLM fields with nothing behind them here yet
        assert "not supported" in _bad(server, "/v1/chat/completions", {"messages": MSGS, name: {}}, name)


@pytest.mark.timeout(60)
def test_unknown_fields_are_a_400_naming_them_and_the_next_request_works(served):
    server, _ = served
    assert "foo_bar" in _bad(server, "/v1/completions", {"prompt": PROMPT, "foo_bar": 1}, "foo_bar")
    _bad(server, "/v1/chat/completions", {"messages": MSGS, "frobnicate": True}, "frobnicate")
    _bad(server, "/v1/chat/completions", {"messages": MSGS, "stream_options": {"bogus": 1}}, "stream_options")
    assert _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_penalty", 0),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("logit_bias", {"abc": 1}),
        ("logit_bias", {"5": 500}),
        ("allowed_token_ids", []),
        ("bad_words", [""]),
        ("min_tokens", 100),
        ("top_k", -5),
        ("min_p", 2),
        ("truncate_prompt_tokens", 0),
        ("prompt_logprobs", -1),
        ("max_tokens", 0),
    ],
)
def test_bad_values_are_a_400_naming_the_param(served, field, value):
    server, _ = served
    _bad(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, field: value}, field)


@pytest.mark.timeout(120)
def test_sampling_extras_equal_the_offline_engine(served):
    """Each vLLM extra (and OpenAI's penalties and logit_bias) gives the tokens the offline
    SamplingParams gives; those are checked against transformers in test_sampling_surface.py."""
    server, llm = served
    tok = llm.get_tokenizer()
    plain = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=N), use_tqdm=False)[0]
    first = plain.outputs[0].token_ids[0]
    cases = [
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"logit_bias": {str(first): -100}},
        {"allowed_token_ids": [first, 100, 200]},
        {"bad_words": [tok.decode([first]).strip()]},
        {"min_tokens": 6, "stop_token_ids": [first]},
        {"top_k": 3, "min_p": 0.1, "temperature": 1.0, "seed": 4},
        {"truncate_prompt_tokens": 3},
        {"stop": [plain.outputs[0].text[4:7]], "include_stop_str_in_output": True},
        {"stop": [plain.outputs[0].text[4:7]]},
        {"skip_special_tokens": False, "ignore_eos": True},
    ]
    stopped = [c for c in cases if "stop" in c]
    assert stopped[0]["stop"][0].strip()  # a stop string the greedy text holds
    for extra in cases:
        kw = {k: {int(t): b for t, b in v.items()} if k == "logit_bias" else v for k, v in extra.items()}
        kw.setdefault("temperature", 0)
        want = llm.generate(PROMPT, SamplingParams(max_tokens=N, **kw), use_tqdm=False)[0]
        body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "logprobs": 0, **extra}
        got = _post(server, "/v1/completions", body)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == want.outputs[0].text, extra
    # and at least the bias changed the answer (so the comparison can fail)
    biased = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": N, "temperature": 0,
                                               "logit_bias": {str(first): -100}})  # fmt: skip
    assert _ids(biased) != plain.outputs[0].text


@pytest.mark.timeout(120)
def test_echo_logprobs_equal_transformers_log_softmax(served):
    """lm-evaluation-harness's log-likelihood request: echo + logprobs + max_tokens=0."""
    from transformers import AutoModelForCausalLM

    server, llm = served
    ids = llm.get_tokenizer()(PROMPT)["input_ids"]
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
                                          "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == PROMPT and r.json()["usage"]["completion_tokens"] == 0
    lps = choice["logprobs"]
    assert len(lps["token_logprobs"]) == len(ids) and lps["token_logprobs"][0] is None
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = [float(ref[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lps["token_logprobs"][1:] == pytest.approx(want, abs=2e-4)
    tok = llm.get_tokenizer()
    assert lps["tokens"] == [tok.decode([t]) for t in ids]  # BOS included, as vLLM echoes it
    # echo with generation: the prompt, then the completion (its logprobs after the prompt's)
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 0,
                                          "temperature": 0})  # fmt: skip
    choice = r.json()["choices"][0]
    offline = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert choice["text"] == PROMPT + offline.text
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids) + 3
    _bad(server, "/v1/completions", {"prompt": PROMPT, "echo": True, "stream": True}, "echo")


@pytest.mark.timeout(60)
def test_prompt_logprobs_field_and_chat_extras(served):
    server, llm = served
    ref = llm.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False
    )[0]
    for route, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": MSGS}),
    ):
        r = _post(server, route, {**body, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
        assert r.status_code == 200, r.text
        plp = r.json()["prompt_logprobs"] if "chat" in route else r.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and all(len(e) in (2, 3) for e in plp[1:])
        if "chat" not in route:
            assert [{int(t): v["logprob"] for t, v in e.items()} for e in plp[1:]] == [
                {t: lp.logprob for t, lp in e.items()} for e in ref.prompt_logprobs[1:]
            ]
        _bad(server, route, {**body, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs")
    # truncate_prompt_tokens cuts a prompt longer than max_model_len before the length check
    long = _post(
        server, "/v1/completions", {"prompt": "word " * 700, "max_tokens": 2, "truncate_prompt_tokens": 5}
    )
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 5, long.text
    r = _post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3, "temperature": 0,
                                               "add_generation_prompt": False})  # fmt: skip
    assert r.status_code == 200, r.text
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=False)
    want = llm.generate(
        [{"prompt_token_ids": tok(text, add_special_tokens=False)["input_ids"]}],
        SamplingParams(temperature=0, max_tokens=3),
        use_tqdm=False,
    )[0]
    assert r.json()["choices"][0]["message"]["content"] == want.outputs[0].text


@pytest.mark.timeout(60)
def test_tokenize_and_detokenize(served):
    server, llm = served
    tok = llm.get_tokenizer()
    r = _post(server, "/tokenize", {"prompt": PROMPT})
    assert r.json() == {"count": len(tok(PROMPT)["input_ids"]), "max_model_len": 512,
                        "tokens": tok(PROMPT)["input_ids"]}  # fmt: skip
    no_bos = _post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert no_bos == tok(PROMPT, add_special_tokens=False)["input_ids"]
    chat = _post(server, "/tokenize", {"messages": MSGS}).json()["tokens"]
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    assert chat == tok(text, add_special_tokens=False)["input_ids"]
    assert _post(server, "/detokenize", {"tokens": no_bos}).json() == {"prompt": tok.decode(no_bos)}
    _bad(server, "/detokenize", {"tokens": [10**9]}, "tokens")
    _bad(server, "/tokenize", {"prompt": "x", "messages": MSGS}, "messages")
    _bad(server, "/tokenize", {"prompt": "x", "extra": 1}, "extra")
