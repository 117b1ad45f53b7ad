"""`expertmesh serve` under torchrun on this host (gloo): global rank 0 answers HTTP, every rank
steps in lockstep. TP2 (2 ranks) and DP2 x TP2 (4 ranks) answer the `openai` client exactly as
one process does; requests spread over both DP replicas; a killed rank and a frozen rank each
end the whole job, with a message naming the rank."""

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
    torchrun,
)

ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def refs():
    return one_process_refs()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    log = tmp_path_factory.mktemp("torchrun_tp2") / "serve.log"
    server = ServeProcess(["-tp", "2"], log, launcher=torchrun(2), env=ENV)
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def _long_request(url: str):
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


@pytest.mark.timeout(120)
def test_tp2_under_torchrun_equals_one_process(tp2, refs):
    check_answers_equal_one_process(tp2.url, refs)
    assert sorted(tp2.worker_pids()) == [0, 1], tp2.output()
    metrics = scrape(tp2.url)
    assert total(metrics, "expertmesh:kv_blocks_used") == 0
    assert metrics['expertmesh:requests_added_total{engine="0"}'] >= 14


@pytest.mark.time_bound
@pytest.mark.timeout(120)
def test_a_killed_rank_ends_the_torchrun_server_naming_it(tp2):
    pids = tp2.worker_pids()
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_long_request, tp2.url)
        wait_running(tp2.url)  # the request is running when the rank goes
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        answer = pending.result()
    assert answer.status_code == 503 and re.search(r"rank\(s\) \[1\]|rank 1\b", answer.text), answer.text
    code = tp2.proc.wait(60 * TIME_SCALE - (time.monotonic() - killed_at))  # the bound is the behaviour
    assert code != 0
    out = tp2.output()
    assert re.search(r"expertmesh serve stopping: .*(rank\(s\) \[1\]|rank 1\b)", out), out[-3000:]


@pytest.mark.timeout(150)
def test_dp2_tp2_under_torchrun_spreads_requests_and_equals_one_process(tmp_path, refs):
    server = ServeProcess(["-tp", "2", "-dp", "2"], tmp_path / "serve.log", launcher=torchrun(4), env=ENV)
    try:
        answers = ask_concurrently(server.wait_healthy(120).url)
        assert answers == [(r.text, r.finish_reason) for r in refs["completions"]]
        metrics = scrape(server.url)
        per_replica = [metrics[f'expertmesh:requests_added_total{{engine="{d}"}}'] for d in (0, 1)]
        assert sum(per_replica) == len(PROMPTS) and min(per_replica) >= 1, per_replica
        assert total(metrics, "expertmesh:kv_blocks_used") == 0
        assert total(metrics, "vllm:num_requests_running") == 0
        assert total(metrics, "expertmesh:all2all_bytes_sent_total") > 0  # DP: MoE tokens cross replicas
        assert sorted(server.worker_pids()) == [0, 1, 2, 3]
    finally:
        server.stop()


@pytest.mark.time_bound
@pytest.mark.timeout(120)
def test_a_frozen_rank_ends_the_torchrun_server_naming_it(tmp_path):
    flags = ["-tp", "2", "--distributed-timeout-seconds", "3"]
    server = ServeProcess(flags, tmp_path / "serve.log", launcher=torchrun(2), env=ENV)
    try:
        pids = server.wait_healthy().worker_pids()
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_long_request, server.url)
            wait_running(server.url)
            stopped_at = time.monotonic()
            os.kill(pids[1], signal.SIGSTOP)  # frozen, not dead
            with pytest.raises(httpx.TransportError):  # rank 0's watchdog ends its process
                pending.result()
        code = server.proc.wait(30 * TIME_SCALE)
        assert code != 0
        assert_within(time.monotonic() - stopped_at, 3 + 25, "the server's end after the freeze")
        assert re.search(r"expertmesh watchdog, rank 0: rank 1 stopped responding", server.output())
    finally:
        server.stop()
