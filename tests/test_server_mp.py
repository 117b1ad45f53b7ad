"""`expertmesh serve` over several ranks (mp workers on gloo), as a real subprocess: TP2 answers
exactly as offline one-process `LLM.generate` (completions and chat, streaming or not), DP2
spreads concurrent requests over both replicas, and a killed worker stops the server with a
message naming its rank."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from distributed_utils import free_port
from prom import scrape, total
from test_server import CHATS, PROMPTS, _chat_ids, _stream_text

from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME

ENGINE_FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(1 << 24)]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


class ServeProcess:
    """`python -m expertmesh.entrypoints.cli serve ...` on a free port; its output in a log file."""

    def __init__(self, flags: list[str], log_path: Path) -> None:
        self.port, self.log_path = free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "expertmesh.entrypoints.cli", "serve", "--port", str(self.port)]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*cmd, *ENGINE_FLAGS, *flags], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 60) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while not self._healthy():
            assert self.proc.poll() is None, f"serve exited: {self.output()}"
            assert time.monotonic() < deadline, f"serve did not start: {self.output()}"
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        return self.log_path.read_text()

    def worker_pids(self) -> dict[int, int]:
        return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", self.output())}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's own shutdown, then the workers'
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def refs():
    """Offline one-process references: completions of PROMPTS, and of each chat prompt."""
    llm = LLM(None, max_model_len=512, kv_cache_memory_bytes=1 << 24)
    chats = [{"prompt_token_ids": _chat_ids(llm.get_tokenizer(), c)} for c in CHATS]
    return {
        "completions": [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
        "chat": [o.outputs[0] for o in llm.generate(chats, GREEDY, use_tqdm=False)],
    }


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    server = ServeProcess(["--tensor-parallel-size", "2"], tmp_path_factory.mktemp("tp2") / "serve.log")
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.timeout(90)
def test_tp2_completions_and_chat_equal_one_process(tp2, refs):
    client = _client(tp2.url)
    for prompt, expected in zip(PROMPTS[:4], refs["completions"]):
        kw = dict(model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        out = client.completions.create(**kw)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (expected.text, expected.finish_reason)
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert _stream_text(client.completions.create(**kw, stream=True)) == (
            expected.text,
            expected.finish_reason,
        )
    for content, expected in zip(CHATS, refs["chat"]):
        messages = [{"role": "user", "content": content}]
        kw = dict(model=DEFAULT_SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert client.chat.completions.create(**kw).choices[0].message.content == expected.text
        assert _stream_text(client.chat.completions.create(**kw, stream=True))[0] == expected.text
    metrics = scrape(tp2.url)
    assert total(metrics, "expertmesh:kv_blocks_used") == 0
    assert metrics['expertmesh:requests_added_total{engine="0"}'] >= 14
    assert total(metrics, "expertmesh:all2all_bytes_sent_total") == 0  # TP only: no token exchange


@pytest.mark.timeout(90)
def test_a_killed_worker_fails_requests_and_stops_the_server_naming_the_rank(tp2):
    pids = tp2.worker_pids()
    assert sorted(pids) == [0, 1], tp2.output()
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{tp2.url}/v1/completions", json=body, timeout=30)
        time.sleep(0.5)  # the request is running when the worker goes
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        answer = pending.result()
    assert answer.status_code == 503 and "worker rank 1 of 2" in answer.text, answer.text
    code = tp2.proc.wait(30 - (time.monotonic() - killed_at))
    assert code != 0
    assert re.search(r"expertmesh serve stopped: mp executor: worker rank 1 of 2 .* died", tp2.output())


@pytest.mark.timeout(90)
def test_dp2_spreads_concurrent_requests_over_both_replicas(tmp_path, refs):
    server = ServeProcess(["--data-parallel-size", "2"], tmp_path / "serve.log")
    try:
        client = _client(server.wait_healthy().url)

        def ask(i: int) -> tuple[str, str | None]:
            kw = dict(model=DEFAULT_SERVED_NAME, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0)
            if i % 2:
                return _stream_text(client.completions.create(**kw, stream=True))
            choice = client.completions.create(**kw).choices[0]
            return choice.text, choice.finish_reason

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(ask, range(len(PROMPTS))))
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


@pytest.mark.timeout(90)  # like its neighbours: most of it is the server's start on a shared machine
def test_a_stopped_worker_stops_the_server_naming_the_rank(tmp_path):
    flags = ["--tensor-parallel-size", "2", "--distributed-timeout-seconds", "3"]
    server = ServeProcess(flags, tmp_path / "serve.log")
    try:
        pids = server.wait_healthy().worker_pids()
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=30)
            time.sleep(0.5)
            stopped_at = time.monotonic()
            os.kill(pids[1], signal.SIGSTOP)  # frozen, not dead: it hung every request before
            answer = pending.result()
        # Named by the driver's heartbeat check or by rank 0's watchdog, whichever is first.
        named = r"rank 1 (of 2 \(pid \d+\) )?stopped responding"
        assert answer.status_code == 503 and re.search(named, answer.text), answer.text
        code = server.proc.wait(20)
        assert code != 0 and time.monotonic() - stopped_at < 3 + 15
        assert re.search(r"(?s)expertmesh serve stopped: mp executor: worker .*" + named, server.output())
    finally:
        server.stop()
