"""/metrics: Prometheus exposition by `prometheus_client`, with vLLM's metric names where vLLM
has one (`vllm:` prefix, labels `model_name` and `engine` = the DP replica) and `expertmesh:`
for the rest.

Two sources. Request-level numbers (TTFT, inter-token latency, end-to-end latency, queue time,
tokens, finished requests) are observed by the AsyncEngine's engine thread as steps complete
(`RequestMetrics`). Engine-level numbers (running/waiting, KV blocks, preemptions, prefix cache,
all2all bytes) are read at scrape time from the engine's last stats snapshot (`ENGINE_METRICS`,
one row each). To export a new engine number: put it in `EngineStepper.rank_stats` (and in
`REPLICA_STATS` or `RANK_STATS` of engine/client.py) and add an `EngineMetric` row, here or with
`add_engine_metric` from the module that owns the number.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from expertmesh.outputs import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 40.0, 80.0)  # fmt: skip


@dataclass(frozen=True)
class EngineMetric:
    """One exported engine number. `read(snapshot)` gives a number, a list (one per DP replica:
    label `engine`), or a dict {label values: number} for `labels`."""

    name: str
    kind: str  # "gauge" or "counter"
    help: str
    read: Callable[[dict[str, Any]], Any]
    labels: tuple[str, ...] = ()


def _get(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda snap: snap.get(key, 0)


def _samples(key: str) -> Callable[[dict[str, Any]], dict]:
    return lambda snap: snap.get(key, {})


def _per_position(snap: dict[str, Any]) -> dict[tuple[str, str], int]:
    """Accepted draft tokens by (DP replica, draft position)."""
    per_replica = snap.get("spec_decode_num_accepted_tokens_per_pos", [])
    return {(str(e), str(i)): n for e, row in enumerate(per_replica) for i, n in enumerate(row or [])}


def _kv_usage(snap: dict[str, Any]) -> list[float]:
    return [
        used / total if total else 0.0
        for used, total in zip(snap["kv_blocks_used"], snap["kv_blocks_total"], strict=True)
    ]


ENGINE_METRICS: list[EngineMetric] = [
    EngineMetric("vllm:num_requests_running", "gauge", "Sequences in the running batch.",
                 _get("num_requests_running")),
    EngineMetric("vllm:num_requests_waiting", "gauge", "Sequences waiting to be scheduled.",
                 _get("num_requests_waiting")),
    EngineMetric("vllm:kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0-1).", _kv_usage),
    EngineMetric("vllm:num_preemptions", "counter", "Sequences preempted (blocks freed, recomputed later).",
                 _get("num_preemptions_total")),
    EngineMetric("vllm:prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache.",
                 _get("prefix_cache_queries_total")),
    EngineMetric("vllm:prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache.",
                 _get("prefix_cache_hits_total")),
    # Speculative decoding (spec_decode/stats.py); absent without a speculative_config.
    EngineMetric("vllm:spec_decode_num_drafts", "counter", "Drafts verified (sequence-steps with a draft).",
                 _get("spec_decode_num_drafts_total")),
    EngineMetric("vllm:spec_decode_num_draft_tokens", "counter", "Draft tokens verified.",
                 _get("spec_decode_num_draft_tokens_total")),
    EngineMetric("vllm:spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.",
                 _get("spec_decode_num_accepted_tokens_total")),
    EngineMetric("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
                 "Draft tokens accepted at each draft position.", _per_position, ("engine", "position")),
    EngineMetric("expertmesh:kv_blocks_used", "gauge", "KV cache blocks in use.", _get("kv_blocks_used")),
    EngineMetric("expertmesh:kv_blocks_free", "gauge", "KV cache blocks free.", _get("kv_blocks_free")),
    EngineMetric("expertmesh:requests_added", "counter", "Requests each DP replica was given.",
                 _get("requests_added_total")),
    EngineMetric("expertmesh:all2all_bytes_sent", "counter", "Bytes the MoE token exchange sent (all ranks).",
                 _get("all2all_bytes_sent_total")),
    EngineMetric("expertmesh:all2all_bytes_received", "counter",
                 "Bytes the MoE token exchange received (all ranks).", _get("all2all_bytes_received_total")),
    # Expert load (engine/expert_load.py), refreshed every GAUGE_EVERY forwards.
    EngineMetric("expertmesh:expert_load_pairs", "gauge",
                 "(token, expert) pairs routed to each expert since start.",
                 _samples("expert_load_pairs"), ("layer", "expert")),
    EngineMetric("expertmesh:expert_ep_rank_pairs", "gauge",
                 "(token, expert) pairs each EP rank computed since start.",
                 _samples("expert_ep_rank_pairs"), ("layer", "ep_rank")),
    EngineMetric("expertmesh:expert_load_imbalance", "gauge",
                 "Max over mean of the EP ranks' pairs, per MoE layer.",
                 _samples("expert_load_imbalance"), ("layer",)),
]  # fmt: skip


def add_engine_metric(metric: EngineMetric) -> None:
    """Export one more engine number (its name must be new)."""
    if any(m.name == metric.name for m in ENGINE_METRICS):
        raise ValueError(f"an engine metric named {metric.name!r} exists already")
    ENGINE_METRICS.append(metric)


class _EngineCollector:
    """Yields ENGINE_METRICS from the latest snapshot at each scrape."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], model_name: Callable[[], str]) -> None:
        self.snapshot, self.model_name = snapshot, model_name

    def collect(self) -> Iterator[Metric]:
        snap, model = self.snapshot(), self.model_name()
        for m in ENGINE_METRICS:
            value = m.read(snap)
            family = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
            if isinstance(value, list):
                metric = family(m.name, m.help, labels=["model_name", "engine"])
                for i, v in enumerate(value):
                    metric.add_metric([model, str(i)], v)
            elif isinstance(value, dict):
                metric = family(m.name, m.help, labels=["model_name", *m.labels])
                for key, v in value.items():
                    metric.add_metric([model, *map(str, key)], v)
            else:
                metric = family(m.name, m.help, labels=["model_name"])
                metric.add_metric([model], value)
            yield metric


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None


class RequestMetrics:
    """The server's registry: request-level observations plus the engine collector."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.model_name = ""
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token: arrival to the first token.",
            labels, registry=self.registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Time between the steps that gave a request tokens.",
            labels, registry=self.registry, buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to the last token.",
            labels, registry=self.registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.queue = Histogram(
            "vllm:request_queue_time_seconds", "Arrival to the start of the step that first scheduled it.",
            labels, registry=self.registry, buckets=LATENCY_BUCKETS,
        )  # fmt: skip
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of requests accepted.", labels,
                                     registry=self.registry)  # fmt: skip
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry)  # fmt: skip
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               [*labels, "finished_reason"], registry=self.registry)  # fmt: skip
        self.registry.register(_EngineCollector(snapshot, lambda: self.model_name))
        self._timing: dict[str, _Timing] = {}

    def set_model_name(self, name: str) -> None:
        """The `model_name` label (the first served name); every series is shown from 0 on."""
        self.model_name = name
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prompt_tokens, self.generation_tokens):
            metric.labels(name)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(name, reason)

    def exposition(self) -> tuple[bytes, str]:
        """The /metrics body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- called on the engine thread ---------------------------------------------------------
    def arrived(self, rid: str, arrival: float, prompt_tokens: int) -> None:
        self._timing[rid] = _Timing(arrival)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)

    def scheduled(self, rid: str, step_start: float) -> None:
        timing = self._timing.get(rid)
        if timing is not None:
            self.queue.labels(self.model_name).observe(max(0.0, step_start - timing.arrival))

    def gained(self, rid: str, tokens: int, now: float | None = None) -> None:
        timing = self._timing.get(rid)
        if timing is None or tokens == 0:
            return
        now = time.monotonic() if now is None else now
        self.generation_tokens.labels(self.model_name).inc(tokens)
        if timing.first_token is None:
            timing.first_token = now
            self.ttft.labels(self.model_name).observe(now - timing.arrival)
        else:
            self.itl.labels(self.model_name).observe(now - timing.last_token)
        timing.last_token = now

    def finished(self, rid: str, out: RequestOutput, now: float | None = None) -> None:
        timing = self._timing.pop(rid, None)
        if timing is None:
            return
        now = time.monotonic() if now is None else now
        self.e2e.labels(self.model_name).observe(now - timing.arrival)
        reason = out.outputs[0].finish_reason if out.outputs else "error"
        self.success.labels(self.model_name, reason or "error").inc()

    def aborted(self, rid: str) -> None:
        if self._timing.pop(rid, None) is not None:
            self.success.labels(self.model_name, "abort").inc()
