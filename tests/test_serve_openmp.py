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
import asyncio, json, os, threading, time
import torch
from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.async_engine import AsyncEngine
from expertmesh.entrypoints.openmp_pool import loaded_libgomp, release_thread_pool

def unmanaged():  # OS threads that are not Python threads: OpenMP workers (and other runtimes')
    return len(os.listdir("/proc/self/task")) - threading.active_count()

def after_exit(count):  # a freed worker leaves its barrier, then exits: give it up to 5 s to go
    deadline = time.monotonic() + 5
    while unmanaged() >= count and time.monotonic() < deadline:
        time.sleep(0.01)
    return unmanaged()

out = {"libgomp": loaded_libgomp() is not None}
torch.ones(1 << 22).add_(1)  # a parallel region on this thread: its pool is built
built = unmanaged()
out["helper"] = [built, release_thread_pool(), after_exit(built)]
torch.ones(1 << 22).add_(1)  # and rebuilt by the next region
out["rebuilt"] = unmanaged()

llm = LLM(None, max_model_len=256, kv_cache_memory_bytes=1 << 22)
params = SamplingParams(temperature=0, max_tokens=6)
ref = llm.generate(["The engine thread"], params)[0].outputs[0].token_ids  # this thread computes
before = unmanaged()
engine = AsyncEngine(llm)
after_start = after_exit(before)

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


BUNDLED = r"""
import ctypes, json, os, shutil, tempfile, threading, time
import torch
from expertmesh.entrypoints.openmp_pool import loaded_libgomp, loaded_libgomps, release_thread_pool

def unmanaged():
    return len(os.listdir("/proc/self/task")) - threading.active_count()

def after_exit(count):
    deadline = time.monotonic() + 5
    while unmanaged() >= count and time.monotonic() < deadline:
        time.sleep(0.01)
    return unmanaged()

torch.ones(1).add_(1)
torch_gomp = loaded_libgomp()
copy = os.path.join(tempfile.mkdtemp(), "libgomp-bundled.so.1")
shutil.copy(torch_gomp, copy)
ctypes.CDLL(copy)  # another wheel's own copy, loaded after torch's, as sentencepiece's is
torch.ones(1 << 22).add_(1)  # torch's pool on this thread
built = unmanaged()
out = {"torch": torch_gomp, "paths": loaded_libgomps(), "found": loaded_libgomp()}
out["helper"] = [built, release_thread_pool(), after_exit(built)]
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp and /proc are Linux's")
@pytest.mark.timeout(60)
def test_a_bundled_libgomp_beside_torchs_does_not_hide_torchs_pool() -> None:
    """sentencepiece's wheel bundles its own libgomp, loaded (and mapped before torch's) when a
    tokenizer imports it: the pool release then paused that copy and left torch's pool, and the
    served steps ran throttled again. Torch's is found and its pool freed with a copy loaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-c", BUNDLED], env=env, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if out["torch"] is None:
        pytest.skip("torch here does not use libgomp")
    assert len(out["paths"]) == 2 and out["found"] == out["torch"], out
    built, released, freed = out["helper"]
    assert released and freed == built - 1, out  # torch's one worker thread exited
