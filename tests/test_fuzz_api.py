"""Fuzzing the HTTP API from its own OpenAPI schema (schemathesis, over real HTTP): no request the
schema allows, nor ones it forbids, gets a 5xx or an undocumented status, and afterwards every KV
block is free and a plain request still answers as offline `LLM.generate`. Bounded: a fixed
number of examples per operation, derandomized, so it takes seconds in `make test`."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance
from test_server import ServerThread

from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.api_server import build_app
from expertmesh.entrypoints.async_engine import AsyncEngine

PROMPT = "Hello, my name is"


@pytest.fixture(scope="module")
def fuzzed_server():
    llm = LLM(None, max_model_len=48, kv_cache_memory_bytes=1 << 21, max_num_seqs=32)
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    engine = AsyncEngine(llm)
    with ServerThread(build_app(engine, ["tiny"], max_request_body_bytes=1 << 16)) as server:
        yield server, engine, expected.outputs[0].text
    engine.shutdown()


# The schema comes from the app itself (no engine is needed to describe the routes).
schema = schemathesis.openapi.from_dict(build_app(None, ["tiny"]).openapi())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


@pytest.mark.timeout(120)
@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_from_its_schema(case, fuzzed_server):
    server, _, _ = fuzzed_server
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)


@pytest.mark.timeout(120)
def test_after_the_fuzzing_the_engine_is_whole(fuzzed_server):
    """Order-independent: it fuzzes every operation itself (a few derandomized schema cases each,
    whatever ran before it), sends bad requests of its own (each a 4xx), then the engine answers as
    offline LLM.generate with every KV block free."""
    server, engine, text = fuzzed_server
    sent = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy())
        @settings(
            max_examples=2,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case):
            case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)
            sent.append(case.operation.label)

        fuzz()
    assert len(set(sent)) == len(list(schema.get_all_operations())), sorted(set(sent))
    bad = [
        b"{not json",
        b'{"model": "tiny", "prompt": "x", "max_tokens": "six"}',
        b'{"model": "tiny", "prompt": "x", "temperature": -1}',
        b'{"model": "tiny", "prompt": [[1e30]]}',
        b'{"model": "tiny", "prompt": "x", "n": 100000, "max_tokens": 40}',
    ]
    for raw in bad:
        r = httpx.post(
            f"{server.url}/v1/completions",
            content=raw,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text[:300])
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    assert engine.is_alive and sum(engine.metrics["kv_blocks_used"]) == 0
