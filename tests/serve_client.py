"""Asks a running `expertmesh serve` what the serving tests ask, through the `openai` client, and
prints the answers as JSON (run inside a network namespace, where the test process cannot reach:
tests/test_multinode.py). Usage: serve_client.py URL [--wait SECONDS]."""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx
from prom import scrape, total
from serve_utils import MAX_TOKENS, ask_concurrently, client
from test_server import CHATS, PROMPTS, _stream_text

from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME


def _wait(url: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"serve at {url} did not become healthy within {seconds} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--wait", type=float, default=150)
    args = parser.parse_args()
    _wait(args.url, args.wait)
    c = client(args.url)
    kw = dict(model=DEFAULT_SERVED_NAME, max_tokens=MAX_TOKENS, temperature=0)
    completions, streamed, chat = [], [], []
    for prompt in PROMPTS[:4]:
        choice = c.completions.create(prompt=prompt, **kw).choices[0]
        completions.append([choice.text, choice.finish_reason])
        streamed.append(list(_stream_text(c.completions.create(prompt=prompt, stream=True, **kw))))
    for content in CHATS:
        messages = [{"role": "user", "content": content}]
        chat.append(c.chat.completions.create(messages=messages, **kw).choices[0].message.content)
    concurrent = [list(a) for a in ask_concurrently(args.url)]
    samples = scrape(args.url)
    per_replica = {k: v for k, v in samples.items() if k.startswith("expertmesh:requests_added_total")}
    metrics = {"kv_blocks_used": total(samples, "expertmesh:kv_blocks_used"), "requests_added": per_replica}
    out = dict(completions=completions, streamed=streamed, chat=chat, concurrent=concurrent, metrics=metrics)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
