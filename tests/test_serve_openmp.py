"""The server's engine thread owns the only OpenMP worker pool (entrypoints/openmp_pool.py): the
AsyncEngine frees the pool its constructing thread built while loading, so libgomp does not
throttle the engine thread's workers. Checked by counting the process's OS threads (a libgomp
pool's workers are threads that exit when it is freed), in a fresh process with 2 OpenMP threads,
and the engine's answer checked against offline generate in the same process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import asyncio, json, os, threading
import torch
from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.openmp_pool import loaded_libgomp, release_thread_pool

def unmanaged():  # OS threads that are not Python threads: OpenMP workers (and other runtimes')
    return len(os.listdir("/proc/self/task")) - threading.active_count()

out = {"libgomp": loaded_libgomp() is not None}
torch.ones(1 << 22).add_(1)  # a parallel region on this thread: its pool is built
out["helper"] = [unmanaged(), release_thread_pool(), unmanaged()]
torch.ones(1 << 22).add_(1)  # and rebuilt by the next region
out["rebuilt"] = unmanaged()

llm = LLM(None, max_model_len=256, kv_cache_memory_bytes=1 << 22)
params = SamplingParams(temperature=0, max_tokens=6)
ref = llm.generate(["The engine thread"], params)[0].outputs[0].token_ids  # this thread computes
before = unmanaged()
engine = AsyncEngine(llm)
after_start = unmanaged()

async def ask():
    async for update in engine.generate("The engine thread", params):
        if update.final is not None:
            return update.final.outputs[0].token_ids

got = asyncio.run(ask())
out["engine"] = [before, after_start, unmanaged(), got == ref, len(got)]
engine.shutdown()
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's")
@pytest.mark.timeout(120)
def test_engine_thread_owns_the_only_openmp_pool() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["libgomp"]:
        pytest.skip("torch here does not use libgomp")
    built, released, freed = out["helper"]
    assert released and freed == built - 1, out  # OMP_NUM_THREADS=2: one worker thread, gone
    assert out["rebuilt"] == built, out
    before, after_start, after_request, same, n = out["engine"]
    assert after_start == before - 1, out  # the constructing thread's worker exited
    assert after_request == before, out  # the engine thread built its own pool: one pool in all
    assert same and n == 6, out
