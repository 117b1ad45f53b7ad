"""Start-up warm-up (LLMEngine.warmup): it runs (a forward count and its log line, on every rank of
an mp layout, of `serve` under torchrun and with the mp executor, whose workers also start with the
command's OpenMP spin bound), it is opt-in for offline `LLM`,
and it leaves nothing a request can see: the same tokens and logprobs as an engine started
without it, an empty prefix cache, zeroed counters."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest
from serve_utils import ServeProcess, torchrun

from expertmesh import LLM, SamplingParams
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME
from expertmesh.entrypoints.cli import build_parser
from expertmesh.entrypoints.openmp_pool import DEFAULT_WAIT, WAIT_SETTINGS

ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, max_num_seqs=16, max_num_batched_tokens=256)
SHARED = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # more than a block: cacheable
PROMPTS = [{"prompt_token_ids": SHARED + [20 + i] * (i + 1)} for i in range(6)]
# Unseeded sampling draws from the engine's generator: a warm-up that drew from it would show here.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=10, logprobs=2, ignore_eos=True),
]


def _run(llm: LLM) -> list[tuple]:
    outs = []
    for params in PARAMS:  # two calls: the second hits the prefix cache the first filled
        for o in llm.generate(PROMPTS, params, use_tqdm=False):
            c = o.outputs[0]
            lps = [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs]
            outs.append((c.token_ids, lps, o.num_cached_tokens))
    return outs


def test_warmup_runs_logs_and_changes_no_result(checkpoint, engine_log):
    path = checkpoint("mixtral")
    cold = LLM(path, warmup=False, **ENGINE)
    assert cold.llm_engine.num_warmup_steps == 0
    assert "warm-up:" not in engine_log.text
    warm = LLM(path, warmup=True, **ENGINE)
    engine = warm.llm_engine
    n, prompt, sizes = engine.warmup_plan()
    assert (n, sizes) == (16, [16, 8, 4, 2, 1]) and n * prompt == 256  # one prefill at the budget
    # The prefill step, then one decode step per batch size.
    assert engine.num_warmup_steps == 1 + len(sizes)
    assert re.search(r"warm-up: 6 forwards \(16 requests of 16 prompt tokens.* in [0-9.]+ s", engine_log.text)
    fresh = engine.stats()
    assert fresh["steps"] == fresh["dummy_steps"] == fresh["preemptions"] == 0
    assert fresh["prefix_cache_queries"] == fresh["prefix_cache_hits"] == 0
    assert fresh["kv_blocks_free"] == fresh["kv_blocks_total"] and not engine.blocks.cached
    assert repr(warm.expert_load()) == repr(cold.expert_load())  # repr: NaN balancedness compares

    assert _run(warm) == _run(cold)
    assert warm.llm_engine.stats() == cold.llm_engine.stats()
    assert repr(warm.expert_load()) == repr(cold.expert_load())


def test_warmup_refuses_an_engine_with_requests(checkpoint):
    llm = LLM(checkpoint("mixtral"), warmup=False, **ENGINE)
    llm.llm_engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="before any request"):
        llm.llm_engine.warmup()
    outs = list(llm.llm_engine.step_until_none_left())  # the queued request is untouched and runs
    assert [(o.request_id, len(o.outputs[0].token_ids), o.error) for o in outs] == [("r", 2, None)]


def test_offline_llm_does_not_warm_by_default(checkpoint, engine_log):
    """Offline warm-up is opt-in (it gave the first generate no measured gain); serve keeps it."""
    assert LLM(checkpoint("mixtral"), **ENGINE).llm_engine.num_warmup_steps == 0
    assert "warm-up:" not in engine_log.text


def test_cli_flag_reaches_the_engine_keywords():
    from expertmesh.entrypoints.cli import _engine_kwargs

    parser = build_parser()
    assert _engine_kwargs(parser.parse_args(["serve", "m"]), "m")["warmup"] is True
    assert _engine_kwargs(parser.parse_args(["serve", "m", "--no-warmup"]), "m")["warmup"] is False


@pytest.mark.timeout(120)
def test_every_mp_rank_warms_in_lockstep(checkpoint):
    path = checkpoint("mixtral")
    llm = LLM(path, data_parallel_size=2, distributed_executor_backend="mp", warmup=True, **ENGINE)
    try:
        steps = {r: info["warmup_steps"] for r, info in llm._executor.ready_info.items()}
        one = LLM(path, warmup=True, **ENGINE).llm_engine.num_warmup_steps
        assert steps == {0: one, 1: one}  # both DP ranks ran the same forwards as one process
        ref = LLM(path, warmup=False, **ENGINE)
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
        assert got == [o.outputs[0].token_ids for o in ref.generate(PROMPTS, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_serve_under_torchrun_warms_every_rank_before_health(tmp_path):
    server = ServeProcess(["-dp", "2"], tmp_path / "serve.log", launcher=torchrun(2))
    try:
        server.wait_healthy(150)
        ranks = re.findall(r"\[?rank ?(\d)\]?.*warm-up: (\d+) forwards", server.output())
        assert sorted(r for r, _ in ranks) == ["0", "1"] and len({n for _, n in ranks}) == 1, server.output()
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_serve_with_the_mp_executor_warms_every_rank_before_health(tmp_path):
    """`serve -tp 2 --distributed-executor-backend mp`: both workers (each with half of every layer)
    log their warm-up before /health answers; the request after it works."""
    flags = ["-tp", "2", "--distributed-executor-backend", "mp"]
    server = ServeProcess(flags, tmp_path / "serve.log")
    try:
        server.wait_healthy(120)
        ranks = re.findall(r"\[?rank ?(\d)\]?.*warm-up: (\d+) forwards", server.output())
        assert sorted(r for r, _ in ranks) == ["0", "1"] and len({n for _, n in ranks}) == 1, server.output()
        if not any(k in os.environ for k in WAIT_SETTINGS):  # the command's OpenMP spin bound, inherited
            for pid in server.worker_pids().values():
                start_env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                assert all(f"{k}={v}".encode() in start_env for k, v in DEFAULT_WAIT.items()), pid
        body = {"model": DEFAULT_SERVED_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        got = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert got["usage"]["completion_tokens"] == 3, got
    finally:
        server.stop()
