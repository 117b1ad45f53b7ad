"""benchmarks/bench_serving.py's metrics follow vLLM's definitions (checked against the same numbers
computed by hand here), its arrivals are open-loop, and a bad flag fails naming itself."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_serving as bs  # noqa: E402


def test_summarize_matches_vllm_definitions() -> None:
    a = bs.Result(ok=True, ttft_s=0.1, latency_s=1.1, output_tokens=11, itl_s=[0.1] * 10)
    b = bs.Result(ok=True, ttft_s=0.3, latency_s=0.7, output_tokens=3, itl_s=[0.1, 0.3])
    bad = bs.Result(ok=False, error="HTTP 400: bad")
    s = bs.summarize([a, b, bad], duration=2.0)
    assert (s["requests"], s["failed"], s["first_error"]) == (3, 1, "HTTP 400: bad")
    assert s["output_tok_s"] == pytest.approx(14 / 2.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["p99_ttft_ms"] == pytest.approx(300.0)
    # TPOT per request: (latency - TTFT) / (tokens - 1) = 100 ms and 200 ms.
    assert s["mean_tpot_ms"] == pytest.approx(150.0) and s["p99_tpot_ms"] == pytest.approx(200.0)
    # ITL pooled over every gap of every request (12 gaps).
    assert s["mean_itl_ms"] == pytest.approx(1e3 * (1.0 + 0.4) / 12)
    assert s["p99_itl_ms"] == pytest.approx(300.0)


def test_arrivals_open_loop() -> None:
    assert bs.arrivals(5, math.inf, 0) == [0.0] * 5
    times = bs.arrivals(4000, 4.0, 1)
    assert times == sorted(times) and times[0] == 0.0
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.1)  # Poisson at 4 req/s


def test_bad_flags_name_themselves(capsys) -> None:
    with pytest.raises(SystemExit):
        bs.parse_args(["--rates", "4,-1"])
    assert "--rates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--servers", "expertmesh,nope"])
    assert "--servers" in capsys.readouterr().err
    assert bs.parse_args(["--quick"]).num_prompts == 24
