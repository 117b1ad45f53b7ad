"""--api-key: every route but /health and /metrics answers 401 without `Authorization: Bearer
<key>` (a wrong key too), and the key is never logged; EXPERTMESH_API_KEY is the CLI's default."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
from test_server import ServerThread

from expertmesh import LLM
from expertmesh.entrypoints import cli
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME, build_app
from expertmesh.entrypoints.async_engine import AsyncEngine

KEY = "sk-test-7f3a9c"


@pytest.fixture(scope="module")
def server(checkpoint):
    engine = AsyncEngine(LLM(checkpoint("mixtral"), max_model_len=128, kv_cache_memory_bytes=1 << 22))
    with ServerThread(build_app(engine, [DEFAULT_SERVED_NAME], api_key=KEY)) as s:
        yield s
    engine.shutdown()


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [5, 6]}),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method,route,body", ROUTES)
def test_every_route_needs_the_key(server, method, route, body, caplog):
    caplog.set_level(logging.DEBUG)
    url = f"{server.url}{route}"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code != 401, r.text
    assert KEY not in caplog.text


@pytest.mark.timeout(60)
def test_health_and_metrics_stay_open_and_the_openai_client_works(server):
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=DEFAULT_SERVED_NAME, prompt=[5, 6], max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_cli_takes_the_key_from_the_environment(monkeypatch):
    seen = {}
    monkeypatch.setattr("expertmesh.entrypoints.serve.serve", lambda *a: seen.setdefault("args", a))
    monkeypatch.setenv("EXPERTMESH_API_KEY", "from-env")
    cli.main(["serve", "--port", "1"])
    assert seen["args"][-1] == "from-env"
    seen.clear()
    cli.main(["serve", "--port", "1", "--api-key", "flag"])
    assert seen["args"][-1] == "flag"
