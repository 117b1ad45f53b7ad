"""`expertmesh serve` over several ranks (mp workers on gloo), as a real subprocess: TP2 answers
exactly as offline one-process `LLM.generate` (completions and chat, streaming or not), DP2
spreads concurrent requests over both replicas, and a killed worker stops the server with a
message naming its rank."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from expect import TIME_SCALE, assert_within
from prom import scrape, total, wait_running
from serve_utils import (
    PROMPTS,
    ServeProcess,
    ask_concurrently,
    check_answers_equal_one_process,
    one_process_refs,
)


@pytest.fixture(scope="module")
def refs():
    return one_process_refs()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    server = ServeProcess(["--tensor-parallel-size", "2"], tmp_path_factory.mktemp("tp2") / "serve.log")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.mark.timeout(90)
def test_tp2_completions_and_chat_equal_one_process(tp2, refs):
    check_answers_equal_one_process(tp2.url, refs)
    metrics = scrape(tp2.url)
    assert total(metrics, "expertmesh:kv_blocks_used") == 0
    assert metrics['expertmesh:requests_added_total{engine="0"}'] >= 14
    assert total(metrics, "expertmesh:all2all_bytes_sent_total") == 0  # TP only: no token exchange


@pytest.mark.time_bound
@pytest.mark.timeout(90)
def test_a_killed_worker_fails_requests_and_stops_the_server_naming_the_rank(tp2):
    pids = tp2.worker_pids()
    assert sorted(pids) == [0, 1], tp2.output()
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{tp2.url}/v1/completions", json=body, timeout=30)
        wait_running(tp2.url)  # the request is running when the worker goes
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        answer = pending.result()
    assert answer.status_code == 503 and "worker rank 1 of 2" in answer.text, answer.text
    code = tp2.proc.wait(30 * TIME_SCALE - (time.monotonic() - killed_at))  # the bound is the behaviour
    assert code != 0
    assert re.search(r"expertmesh serve stopped: mp executor: worker rank 1 of 2 .* died", tp2.output())


@pytest.mark.timeout(90)
def test_dp2_spreads_concurrent_requests_over_both_replicas(tmp_path, refs):
    server = ServeProcess(["--data-parallel-size", "2"], tmp_path / "serve.log")
    try:
        answers = ask_concurrently(server.wait_healthy().url)
        assert answers == [(r.text, r.finish_reason) for r in refs["completions"]]
        metrics = scrape(server.url)
        per_replica = [metrics[f'expertmesh:requests_added_total{{engine="{d}"}}'] for d in (0, 1)]
        assert sum(per_replica) == len(PROMPTS) and min(per_replica) >= 1, per_replica
        assert total(metrics, "expertmesh:kv_blocks_used") == 0
        assert total(metrics, "vllm:num_requests_running") == 0
        assert metrics["vllm:time_to_first_token_seconds_count"] == len(PROMPTS)
        assert total(metrics, "expertmesh:all2all_bytes_sent_total") > 0  # DP: MoE tokens cross replicas
    finally:
        server.stop()


@pytest.mark.time_bound
@pytest.mark.timeout(90)  # like its neighbours: most of it is the server's start on a shared machine
def test_a_stopped_worker_stops_the_server_naming_the_rank(tmp_path):
    flags = ["--tensor-parallel-size", "2", "--distributed-timeout-seconds", "3"]
    server = ServeProcess(flags, tmp_path / "serve.log")
    try:
        pids = server.wait_healthy().worker_pids()
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
            wait_running(server.url)
            stopped_at = time.monotonic()
            os.kill(pids[1], signal.SIGSTOP)  # frozen, not dead: it hung every request before
            answer = pending.result()
        # Named by the driver's heartbeat check or by rank 0's watchdog, whichever is first.
        named = r"rank 1 (of 2 \(pid \d+\) )?stopped responding"
        assert answer.status_code == 503 and re.search(named, answer.text), answer.text
        code = server.proc.wait(20 * TIME_SCALE)
        assert code != 0
        assert_within(time.monotonic() - stopped_at, 3 + 15, "the server's end after the stop")
        assert re.search(r"(?s)expertmesh serve stopped: mp executor: worker .*" + named, server.output())
    finally:
        server.stop()
