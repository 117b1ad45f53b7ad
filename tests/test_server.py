"""The OpenAI-compatible server, over real HTTP with the official `openai` client: the same text
as offline `LLM.generate`, streaming or not; many concurrent clients; blocks freed after
disconnects; OpenAI-style 400s that leave other requests alone."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn
from distributed_utils import free_port
from prom import scrape, total

from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME, build_app
from expertmesh.entrypoints.async_engine import AsyncEngine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "tools", "checkable_prompts.json")) as f:
    PROMPTS = [c["prompt"] for c in json.load(f)][:8]
CHATS = ["What is your name?", "Hi", "Where do you live?"]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
SHORT = SamplingParams(temperature=0, max_tokens=8)
SAMPLED = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=MAX_TOKENS)


class ServerThread:
    """A real uvicorn server on a free port, in a thread of this process."""

    def __init__(self, app) -> None:
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def _chat_ids(tok, content: str) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def served():
    """(server, offline references): references come from the same LLM before it starts serving."""
    llm = LLM(None, max_model_len=1024, kv_cache_memory_bytes=1 << 24)
    tok = llm.get_tokenizer()
    chat_prompts = [{"prompt_token_ids": _chat_ids(tok, c)} for c in CHATS]
    refs = {
        "greedy": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        "short": llm.generate(PROMPTS, SHORT, use_tqdm=False),
        "chat": llm.generate(chat_prompts, GREEDY, use_tqdm=False),
        "sampled": llm.generate(PROMPTS[:2], SAMPLED, use_tqdm=False),
        "stop": llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[" 8", "e"]), use_tqdm=False
        ),
    }
    engine = AsyncEngine(llm)
    with ServerThread(build_app(engine, [DEFAULT_SERVED_NAME])) as server:
        yield server, refs
    engine.shutdown()


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _metrics(server: ServerThread) -> dict[str, float]:
    """Each metric's value summed over DP replicas, by short name (`kv_blocks_used`, ...)."""
    samples = scrape(server.url)
    return {name: total(samples, full) for name, full in METRIC_NAMES.items()}


METRIC_NAMES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "generation_tokens_total": "vllm:generation_tokens_total",
    "kv_blocks_used": "expertmesh:kv_blocks_used",
    "kv_blocks_free": "expertmesh:kv_blocks_free",
}


def _stream_text(stream) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.timeout(60)
def test_health_models_metrics(served):
    server, _ = served
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert [m.id for m in _client(server).models.list()] == [DEFAULT_SERVED_NAME]
    samples = scrape(server.url)
    names = {k.split("{")[0] for k in samples}
    for name in (
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_sum", "vllm:request_queue_time_seconds_count",
        "expertmesh:kv_blocks_free", "expertmesh:all2all_bytes_sent_total",
    ):  # fmt: skip
        assert name in names, name
    assert 'vllm:num_requests_running{engine="0"}' in samples  # one sample per DP replica


@pytest.mark.timeout(60)
def test_request_metrics_count_what_was_served(served):
    """Sequential requests: every counter and histogram count moves by exactly what they did."""
    server, _ = served
    client = _client(server)
    before = scrape(server.url)
    tokens = prompt_tokens = 0
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=5, temperature=0)
        tokens += out.usage.completion_tokens
        prompt_tokens += out.usage.prompt_tokens
    after = scrape(server.url)

    def moved(name: str) -> float:
        return total(after, name) - total(before, name)

    assert moved("vllm:prompt_tokens_total") == prompt_tokens
    assert moved("vllm:generation_tokens_total") == tokens
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert moved(f"vllm:{hist}_seconds_count") == 3, hist
    # One token per step per request: every token after the first is one inter-token gap.
    assert moved("vllm:inter_token_latency_seconds_count") == tokens - 3
    assert moved("vllm:request_success_total") == 3
    assert after["vllm:e2e_request_latency_seconds_sum"] >= after["vllm:time_to_first_token_seconds_sum"]
    assert total(after, "expertmesh:kv_blocks_used") == 0
    assert after['vllm:kv_cache_usage_perc{engine="0"}'] == 0.0


@pytest.mark.timeout(60)
def test_completions_equal_offline_streaming_or_not(served):
    server, refs = served
    client = _client(server)
    for prompt, ref in zip(PROMPTS, refs["greedy"], strict=True):
        out = client.completions.create(
            model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        expected = ref.outputs[0]
        assert out.choices[0].text == expected.text, prompt
        assert out.choices[0].finish_reason == expected.finish_reason
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
        stream = client.completions.create(
            model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert _stream_text(stream) == (expected.text, expected.finish_reason), prompt


@pytest.mark.timeout(60)
def test_chat_equal_offline_streaming_or_not(served):
    server, refs = served
    client = _client(server)
    for content, ref in zip(CHATS, refs["chat"], strict=True):
        messages = [{"role": "user", "content": content}]
        kw = dict(model=DEFAULT_SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        out = client.chat.completions.create(**kw)
        expected = ref.outputs[0]
        assert out.choices[0].message.content == expected.text, content
        assert out.choices[0].message.role == "assistant"
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert _stream_text(client.chat.completions.create(**kw, stream=True)) == (
            expected.text,
            expected.finish_reason,
        )
        parts = [{"role": "user", "content": [{"type": "text", "text": content}]}]
        assert (
            client.chat.completions.create(**{**kw, "messages": parts}).choices[0].message.content
            == expected.text
        )


@pytest.mark.timeout(60)
def test_n_seed_stop_logprobs_and_usage_chunk(served):
    server, refs = served
    client = _client(server)
    out = client.completions.create(
        model=DEFAULT_SERVED_NAME, prompt=PROMPTS[:2], n=2, temperature=0.8, seed=7, max_tokens=MAX_TOKENS
    )
    expected = [c.text for r in refs["sampled"] for c in r.outputs]
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == expected
    for prompt, ref in zip(PROMPTS, refs["stop"], strict=True):
        kw = dict(
            model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=[" 8", "e"]
        )
        assert client.completions.create(**kw).choices[0].text == ref.outputs[0].text
        assert _stream_text(client.completions.create(**kw, stream=True))[0] == ref.outputs[0].text, prompt
    lp = client.completions.create(
        model=DEFAULT_SERVED_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2
    )
    assert len(lp.choices[0].logprobs.tokens) == 3 and all(
        len(t) >= 2 for t in lp.choices[0].logprobs.top_logprobs
    )
    assert "".join(lp.choices[0].logprobs.tokens) == lp.choices[0].text
    chat = client.chat.completions.create(
        model=DEFAULT_SERVED_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(chat)
    assert chunks[-1].usage.completion_tokens == 3 and not chunks[-1].choices
    content = [
        c for chunk in chunks for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content
    ]
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


@pytest.mark.timeout(90)
def test_32_concurrent_clients_then_every_block_free(served):
    server, refs = served
    expected = {p: r.outputs[0].text for p, r in zip(PROMPTS, refs["short"], strict=True)}

    def client_session(k: int) -> list[bool]:
        client, ok = _client(server), []
        for j in range(4):
            prompt = PROMPTS[(k + j) % len(PROMPTS)]
            kw = dict(model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=8, temperature=0)
            if (k + j) % 2:
                text = _stream_text(client.completions.create(**kw, stream=True))[0]
            else:
                text = client.completions.create(**kw).choices[0].text
            ok.append(text == expected[prompt])
        return ok

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client_session, range(32)))
    assert all(all(r) for r in results), results
    metrics = _metrics(server)
    assert metrics["kv_blocks_used"] == 0 and metrics["kv_blocks_free"] > 0
    assert metrics["num_requests_running"] == 0 and metrics["num_requests_waiting"] == 0


def _wait_all_blocks_free(server: ServerThread) -> dict[str, float]:
    deadline = time.monotonic() + 20
    while (m := _metrics(server))["kv_blocks_used"] or m["num_requests_running"]:
        assert time.monotonic() < deadline, f"blocks still held after the client left: {m}"
        time.sleep(0.1)
    return m


@pytest.mark.timeout(60)
def test_disconnect_aborts_and_frees_blocks(served):
    server, _ = served
    max_tokens = 1000  # far more than can be generated before the client hangs up
    body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    before = _metrics(server)["generation_tokens_total"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(4):  # a few chunks arrive, then we hang up
            assert next(lines) is not None
        assert _metrics(server)["kv_blocks_used"] > 0
    after = _wait_all_blocks_free(server)["generation_tokens_total"]
    assert after - before < max_tokens, "the streaming request ran to the end: not aborted"

    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up waiting
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    final = _wait_all_blocks_free(server)["generation_tokens_total"]
    assert final - after < max_tokens, "the non-streaming request ran to the end: not aborted"


@pytest.mark.timeout(60)
def test_bad_requests_are_openai_400s_and_disturb_nobody(served):
    server, refs = served
    client = _client(server)
    kw = dict(model=DEFAULT_SERVED_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True)
    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(lambda: _stream_text(client.completions.create(**kw)))
        cases = [
            ({"model": "no-such-model"}, "model"),
            ({"max_tokens": 0}, "max_tokens"),
            ({"temperature": -0.5}, "temperature"),
            ({"prompt": "word " * 1100}, "prompt"),
            ({"prompt": ["Hello", "word " * 1100]}, "prompt"),  # the good one is aborted too
        ]
        for change, param in cases:
            args = {"model": DEFAULT_SERVED_NAME, "prompt": "Hello", "max_tokens": 4, **change}
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(**args)
            assert err.value.status_code == 400
            body = err.value.response.json()["error"]
            assert set(body) == {"message", "type", "param", "code"} and body["param"] == param, body
        raw = httpx.post(
            f"{server.url}/v1/chat/completions",
            content=b'{"messages": [',
            headers={"Content-Type": "application/json"},
            timeout=10,
        )
        assert raw.status_code == 400 and "malformed JSON" in raw.json()["error"]["message"]
        expected = refs["greedy"][0].outputs[0]
        assert bystander.result(timeout=30) == (expected.text, expected.finish_reason)
    assert _metrics(server)["kv_blocks_used"] == 0


@pytest.mark.timeout(60)
def test_no_chat_template_is_a_400_and_a_failed_engine_a_503(checkpoint):
    llm = LLM(checkpoint("phimoe"), max_model_len=128, kv_cache_memory_bytes=1 << 22)
    engine = AsyncEngine(llm)
    try:
        with ServerThread(build_app(engine, ["tiny"])) as server:
            client = _client(server)
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            assert "no chat template" in err.value.response.json()["error"]["message"]
            out = client.completions.create(model="tiny", prompt="The", max_tokens=4, temperature=0)
            assert 1 <= out.usage.completion_tokens <= 4

            def broken_step():
                raise RuntimeError("simulated engine failure")

            llm.llm_engine.step = broken_step  # the next step fails: its callers get a 503, not a hang
            with pytest.raises(openai.InternalServerError) as err:
                client.completions.create(model="tiny", prompt="The", max_tokens=4)
            assert err.value.status_code == 503 and "simulated engine failure" in str(err.value)
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    finally:
        engine.shutdown()
