"""benchmarks/bench_serving.py's metrics follow vLLM's definitions (checked against the same numbers
computed by hand here), its arrivals are open-loop, its two workloads give the lengths asked for
behind one shared prefix, and a bad flag fails naming itself."""

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
    # P50 by nearest rank (the lower of two), E2E the request latencies.
    assert s["p50_ttft_ms"] == pytest.approx(100.0) and s["p50_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_e2e_ms"] == pytest.approx(900.0) and s["p99_e2e_ms"] == pytest.approx(1100.0)
    assert s["request_s"] == pytest.approx(1.0)


def test_arrivals_open_loop() -> None:
    assert bs.arrivals(5, math.inf, 0) == [0.0] * 5
    times = bs.arrivals(4000, 4.0, 1)
    assert times == sorted(times) and times[0] == 0.0
    assert (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.1)  # Poisson at 4 req/s


class _Ids:
    """A tokenizer stand-in whose text is its ids, so a prompt's tokens can be read back."""

    def __len__(self) -> int:
        return 100

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


def test_workloads_lengths_and_shared_prefix() -> None:
    fixed = bs.parse_args(
        ["--num-prompts", "5", "--input-len", "12", "--output-len", "7", "--shared-prefix", "4"]
    )
    jobs = bs.make_jobs(_Ids(), fixed, seed=1)
    ids = [list(map(int, j.prompt.split())) for j in jobs]
    assert [len(i) for i in ids] == [16] * 5 and [j.max_tokens for j in jobs] == [7] * 5
    assert all(i[:4] == ids[0][:4] for i in ids) and len({tuple(i[4:]) for i in ids}) == 5
    assert all(3 <= t < 100 for i in ids for t in i)  # never pad, bos or eos
    # Another run: fresh prompts behind the same prefix.
    again = [list(map(int, j.prompt.split())) for j in bs.make_jobs(_Ids(), fixed, seed=2)]
    assert again[0][:4] == ids[0][:4] and again[0][4:] != ids[0][4:]
    args = ["--workload", "sharegpt", "--requests", "200", "--max-prompt", "64", "--max-output", "32"]
    mix = bs.make_jobs(_Ids(), bs.parse_args(args), seed=3)
    p_lens = [len(j.prompt.split()) for j in mix]
    o_lens = [j.max_tokens for j in mix]
    assert min(p_lens) >= 4 and max(p_lens) == 64 and len(set(p_lens)) > 20  # long tail, clipped
    assert min(o_lens) >= 4 and max(o_lens) <= 32 and sorted(o_lens)[100] < sorted(p_lens)[100]


def test_bad_flags_name_themselves(capsys) -> None:
    with pytest.raises(SystemExit):
        bs.parse_args(["--rates", "4,-1"])
    assert "--rates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--servers", "expertmesh,nope"])
    assert "--servers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--shared-prefix", "-1"])
    assert "--shared-prefix" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--workload", "sharegpt", "--max-prompt", "900", "--max-output", "200"])
    assert "--max-model-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bs.parse_args(["--workload", "nope"])
    assert "--workload" in capsys.readouterr().err
    assert bs.parse_args(["--quick"]).num_prompts == 24


def _sse_server(tokens: int, finish: str, usage: bool):
    """A mock /v1/completions that streams `tokens` one-token chunks, then `finish`."""
    import json

    import httpx

    def handler(request: httpx.Request) -> httpx.Response:
        chunks = [{"choices": [{"text": f"t{i}", "finish_reason": None}]} for i in range(tokens)]
        chunks.append({"choices": [{"text": "", "finish_reason": finish}]})
        if usage:
            chunks.append({"choices": [], "usage": {"completion_tokens": tokens}})
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    return httpx.AsyncClient(base_url="http://bench", transport=httpx.MockTransport(handler))


@pytest.mark.parametrize("usage", [True, False])  # with usage (vLLM, expertmesh) or without (llama.cpp)
def test_a_request_stopped_short_is_a_failure(usage: bool) -> None:
    import asyncio

    async def ask(tokens: int, finish: str) -> bs.Result:
        async with _sse_server(tokens, finish, usage) as client:
            body = {"prompt": "x", "max_tokens": 8}
            return await bs.one_request(client, body, 0.0, 0.0, stream=True)

    full = asyncio.run(ask(8, "length"))
    assert full.ok and full.output_tokens == 8, full
    short = asyncio.run(ask(3, "stop"))
    assert not short.ok and short.output_tokens == 3 and "stopped after 3 of 8" in short.error, short
    s = bs.summarize([full, short], duration=1.0)
    assert s["failed"] == 1 and s["output_tok_s"] == 8 and "stopped after 3 of 8" in s["first_error"]


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_max_concurrency_bounds_the_requests_in_flight(limit: int) -> None:
    import asyncio
    import json

    import httpx

    live, peak = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        await asyncio.sleep(0.01)  # let the other due requests start, if they may
        live -= 1
        chunks = [
            {"choices": [{"text": "t", "finish_reason": "length"}]},
            {"usage": {"completion_tokens": 1}},
        ]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    jobs = [bs.Job("x", 1)] * 6
    load = bs.run_load(
        "http://bench", "expertmesh", jobs, math.inf, 0, True, limit, httpx.MockTransport(handler)
    )
    results, _ = asyncio.run(load)
    assert all(r.ok for r in results), [r.error for r in results]
    assert peak == (limit or len(jobs)), peak  # all six at once without a limit


def test_a_server_from_another_source_tree(tmp_path, capsys) -> None:
    (tmp_path / "expertmesh").mkdir()
    args = bs.parse_args(["--servers", f"expertmesh@{tmp_path},expertmesh", "--model", "m"])
    cmd, env = bs.server_cmd(args, args.servers[0], 8000)
    assert env["PYTHONPATH"] == str(tmp_path) and cmd[1:3] == ["serve", "m"], cmd
    cmd, env = bs.server_cmd(args, args.servers[1], 8000)
    assert env.get("PYTHONPATH") == bs.os.environ.get("PYTHONPATH") and cmd[1:3] == ["serve", "m"]
    for bad in (f"expertmesh@{tmp_path / 'none'}", f"vllm@{tmp_path}"):
        with pytest.raises(SystemExit):
            bs.parse_args(["--servers", bad])
        assert "--servers" in capsys.readouterr().err
