"""Reading /metrics back with prometheus_client's own parser (tests only)."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """Every sample of `url`/metrics: `name` or `name{label="v",...}` (model_name left out) -> value."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
            key = sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")
            out[key] = sample.value
    return out


def total(samples: dict[str, float], name: str) -> float:
    """The sum of `name` over its labels (DP replicas, finish reasons)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def wait_running(url: str, timeout: float = 60.0) -> None:
    """Return once the server reports a request running (an event read from /metrics, not a sleep)."""
    deadline = time.monotonic() + timeout
    while total(scrape(url), "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, f"no request running after {timeout} s"
        time.sleep(0.05)
