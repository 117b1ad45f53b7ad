"""entrypoints/metrics.py on its own: request timings from given clock values, engine numbers from
a snapshot (per replica, per label set), and the rules for adding an engine metric."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from expertmesh.entrypoints import metrics as m
from expertmesh.outputs import CompletionOutput, RequestOutput

SNAPSHOT = {
    "num_requests_running": [2, 0],
    "num_requests_waiting": [1, 3],
    "kv_blocks_total": [100, 100],
    "kv_blocks_free": [75, 100],
    "kv_blocks_used": [25, 0],
    "num_preemptions_total": [0, 4],
    "requests_added_total": [5, 6],
    "all2all_bytes_sent_total": 1234,
}


def _samples(rm: m.RequestMetrics) -> dict[str, float]:
    body, content_type = rm.exposition()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _output(reason: str) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, "x", [5, 6, 7], None, None, reason)], True)


def test_request_timings_from_the_clock_values_given():
    rm = m.RequestMetrics(lambda: SNAPSHOT)
    rm.set_model_name("tiny")
    rm.arrived("a", 10.0, prompt_tokens=7)
    rm.scheduled("a", 10.5)
    rm.gained("a", 1, now=11.0)  # first token: TTFT 1.0
    rm.gained("a", 0, now=11.1)  # nothing gained: no observation
    rm.gained("a", 1, now=11.25)  # gap 0.25
    rm.gained("a", 1, now=11.75)  # gap 0.5
    rm.finished("a", _output("length"), now=12.0)
    rm.arrived("b", 11.0, prompt_tokens=3)
    rm.aborted("b")
    rm.finished("b", _output("stop"), now=13.0)  # already gone: not counted again
    got = _samples(rm)
    assert got["vllm:time_to_first_token_seconds_count"] == 1
    assert got["vllm:time_to_first_token_seconds_sum"] == pytest.approx(1.0)
    assert got["vllm:inter_token_latency_seconds_count"] == 2
    assert got["vllm:inter_token_latency_seconds_sum"] == pytest.approx(0.75)
    assert got["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(2.0)
    assert got["vllm:request_queue_time_seconds_sum"] == pytest.approx(0.5)
    assert got["vllm:prompt_tokens_total"] == 10 and got["vllm:generation_tokens_total"] == 3
    assert got["vllm:request_success_total{finished_reason=length}"] == 1
    assert got["vllm:request_success_total{finished_reason=abort}"] == 1
    assert got["vllm:request_success_total{finished_reason=stop}"] == 0


def test_engine_numbers_per_replica_and_missing_ones_as_zero():
    got = _samples(m.RequestMetrics(lambda: SNAPSHOT))
    assert got["vllm:num_requests_running{engine=0}"] == 2 and got["vllm:num_requests_waiting{engine=1}"] == 3
    assert (
        got["vllm:kv_cache_usage_perc{engine=0}"] == 0.25 and got["vllm:kv_cache_usage_perc{engine=1}"] == 0
    )
    assert got["vllm:num_preemptions_total{engine=1}"] == 4
    assert got["expertmesh:all2all_bytes_sent_total"] == 1234
    # An engine without a prefix cache (or an older stats dict): 0, not an error.
    assert got["vllm:prefix_cache_hits_total"] == 0 and got["expertmesh:all2all_bytes_received_total"] == 0


def test_adding_an_engine_metric_with_its_own_labels(monkeypatch):
    monkeypatch.setattr(m, "ENGINE_METRICS", list(m.ENGINE_METRICS))
    load = {(0, 1): 7, (1, 3): 2}  # (layer, expert) -> tokens routed in the last step
    m.add_engine_metric(
        m.EngineMetric(
            "expertmesh:expert_load", "gauge", "Tokens per expert.", lambda s: load, ("layer", "expert")
        )
    )
    got = _samples(m.RequestMetrics(lambda: SNAPSHOT))
    assert got["expertmesh:expert_load{expert=1,layer=0}"] == 7
    assert got["expertmesh:expert_load{expert=3,layer=1}"] == 2
    with pytest.raises(ValueError, match="expertmesh:expert_load"):
        m.add_engine_metric(m.EngineMetric("expertmesh:expert_load", "gauge", "again", lambda s: 0))
