"""`expertmesh serve` as a real subprocess (plain, or under torchrun), and what every serving
test checks against: offline one-process `LLM.generate` answers of the same prompts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from distributed_utils import free_port
from test_server import CHATS, PROMPTS, _chat_ids, _stream_text

from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME

ENGINE_FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(1 << 24)]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
CLI = ["-m", "expertmesh.entrypoints.cli", "serve"]


def torchrun(nproc: int) -> list[str]:
    """torchrun on this host (its own rendezvous port), ready for `-m module`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
    ]


class ServeProcess:
    """`<launcher> -m expertmesh.entrypoints.cli serve ...` on a free port; its output in a log file.

    `launcher` is the python interpreter (default) or a torchrun command line; `command` replaces
    the whole command line (a node's wrapped torchrun, tests/netns.py) when given."""

    def __init__(
        self,
        flags: list[str],
        log_path: Path,
        launcher: list[str] | None = None,
        host: str = "127.0.0.1",
        env: dict[str, str] | None = None,
    ) -> None:
        self.port, self.log_path = free_port(), log_path
        self.url = f"http://{host}:{self.port}"
        launcher = launcher or [sys.executable]
        cmd = [*launcher, *CLI, "--host", host, "--port", str(self.port), *ENGINE_FLAGS, *flags]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True,  # so whatever is left at the end can be killed as a group
        )  # fmt: skip

    def wait_healthy(self, timeout: float = 90) -> ServeProcess:
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
            self.proc.send_signal(signal.SIGINT)  # uvicorn's own shutdown, then the ranks'
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left of the group (torchrun's ranks)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def one_process_refs() -> dict[str, list]:
    """Offline one-process references: completions of PROMPTS, and of each chat prompt."""
    llm = LLM(None, max_model_len=512, kv_cache_memory_bytes=1 << 24)
    chats = [{"prompt_token_ids": _chat_ids(llm.get_tokenizer(), c)} for c in CHATS]
    return {
        "completions": [o.outputs[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
        "chat": [o.outputs[0] for o in llm.generate(chats, GREEDY, use_tqdm=False)],
    }


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def check_answers_equal_one_process(url: str, refs: dict[str, list], count: int = 4) -> None:
    """Completions and chat, streaming or not, through the `openai` client: one process's text."""
    c = client(url)
    for prompt, expected in zip(PROMPTS[:count], refs["completions"][:count], strict=True):
        kw = dict(model=DEFAULT_SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        out = c.completions.create(**kw)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (expected.text, expected.finish_reason)
        assert out.usage.completion_tokens == len(expected.token_ids)
        assert _stream_text(c.completions.create(**kw, stream=True)) == (
            expected.text,
            expected.finish_reason,
        )
    for content, expected in zip(CHATS, refs["chat"], strict=True):
        messages = [{"role": "user", "content": content}]
        kw = dict(model=DEFAULT_SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        assert c.chat.completions.create(**kw).choices[0].message.content == expected.text
        assert _stream_text(c.chat.completions.create(**kw, stream=True))[0] == expected.text


def ask_concurrently(url: str) -> list[tuple[str, str | None]]:
    """Every prompt at once (odd ones streamed): (text, finish reason) in prompt order."""
    from concurrent.futures import ThreadPoolExecutor

    c = client(url)

    def ask(i: int) -> tuple[str, str | None]:
        kw = dict(model=DEFAULT_SERVED_NAME, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0)
        if i % 2:
            return _stream_text(c.completions.create(**kw, stream=True))
        choice = c.completions.create(**kw).choices[0]
        return choice.text, choice.finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(ask, range(len(PROMPTS))))
