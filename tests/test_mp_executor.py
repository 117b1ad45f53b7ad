"""distributed_executor_backend="mp": LLM(..., tensor_parallel_size=2) in a plain process spawns
its own workers, gives the tokens of one process, spreads prompts over DP replicas, reports a
dead worker by rank within seconds, and leaves no process behind."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading
import time

import pytest
from expect import assert_within

from expertmesh import LLM, SamplingParams
from expertmesh.executor.mp_executor import WorkerError

PROMPTS = ["The cat", "Hello world and more words here", "a", "1 2 3 4 5 6 7 8 9", "x y"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)
ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22)


def _workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("expertmesh-rank")]


def _wait_no_workers(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _workers():
        assert time.monotonic() < deadline, f"workers left behind: {_workers()}"
        time.sleep(0.1)


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(checkpoint):
    path = checkpoint("phimoe")
    return path, _tokens(LLM(path, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.timeout(90)
def test_tp2_equals_one_process_and_shuts_down(reference):
    path, expected = reference
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    assert len(_workers()) == 2
    outs = llm.generate(PROMPTS, GREEDY)
    assert _tokens(outs) == expected
    assert [o.prompt for o in outs] == PROMPTS
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY)) == expected[:1]  # the workers keep serving
    llm.shutdown()
    _wait_no_workers()


@pytest.mark.timeout(90)
def test_dp2_spreads_prompts_keeps_order_and_exits_when_collected(reference):
    path, expected = reference
    llm = LLM(path, data_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm._executor.last_split == [[0, 2, 4], [1, 3]]
    assert _tokens(llm.generate(PROMPTS[:1], GREEDY)) == expected[:1]  # replica 1 idles in lockstep
    del llm
    gc.collect()
    _wait_no_workers()


@pytest.mark.time_bound
@pytest.mark.timeout(90)
def test_a_killed_worker_is_reported_by_rank_within_seconds(reference):
    path, _ = reference
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    victim = next(p for p in _workers() if p.name == "expertmesh-rank1")
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(victim.pid, signal.SIGKILL)

    threading.Timer(0.5, kill).start()
    with pytest.raises(WorkerError, match=r"worker rank 1 of 2 .* died") as err:
        while True:  # the kill lands during a call, or just before the next one
            llm.generate(PROMPTS * 4, long)
    assert_within(time.monotonic() - killed_at[0], 30, f"the report ({err.value})")
    _wait_no_workers()
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate(PROMPTS, GREEDY)


@pytest.mark.timeout(90)
def test_a_worker_that_raises_at_start_up_is_reported_with_its_traceback(reference):
    path, _ = reference
    with pytest.raises(WorkerError, match=r"(?s)worker rank [01] of 2 .* raised:.*holds no block"):
        LLM(
            path,
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
            max_model_len=128,
            kv_cache_memory_bytes=1,
        )
    _wait_no_workers()


@pytest.mark.time_bound
@pytest.mark.timeout(60)
def test_a_stopped_worker_is_named_and_every_worker_ended(reference):
    path, _ = reference
    llm = LLM(
        path,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        distributed_timeout_seconds=3,
        **ENGINE,
    )
    victim = next(p for p in _workers() if p.name == "expertmesh-rank1")
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    threading.Timer(0.5, os.kill, (victim.pid, signal.SIGSTOP)).start()
    start = time.monotonic()
    with pytest.raises(
        WorkerError,
        match=r"(?s)worker rank (1 of 2 .*stopped responding|0 of 2 .*ended the run:.*rank 1 stopped "
        r"responding)",
    ) as err:
        while True:
            llm.generate(PROMPTS * 4, long)
    assert_within(time.monotonic() - start, 3 + 12, f"the report ({err.value})")  # it hung in silence before
    _wait_no_workers()


@pytest.mark.timeout(60)
def test_bad_requests_and_ctrl_c_leave_the_workers_serving(reference, monkeypatch):
    from expertmesh.executor import mp_executor

    path, expected = reference
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE)
    # Bad requests fail alone: every worker stays up (they were all shut down before).
    bad = SamplingParams(logprobs=5000, max_tokens=2)
    outs = llm.generate([PROMPTS[0], {"prompt_token_ids": [5.0, 7.9]}, PROMPTS[1]], [bad, GREEDY, GREEDY])
    assert "logprobs=5000 exceeds the vocabulary" in outs[0].error and "integers" in outs[1].error
    assert outs[2].outputs[0].token_ids == expected[1] and len(_workers()) == 2
    # Ctrl-C while the driver waits on a long call: KeyboardInterrupt out of its wait, as Python
    # raises it from an interrupted poll. Raised from the wait itself, not by a signal: a timer's
    # interrupt_main landed after a fast call had ended, and runs the process's SIGINT handler,
    # which an earlier test in the same pytest process may have replaced.
    real_wait, waits = mp_executor.wait, []

    def interrupted_wait(*args, **kwargs):
        waits.append(1)
        if len(waits) == 2:  # the second second of the call (each wait times out after 1 s)
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(mp_executor, "wait", interrupted_wait)
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        while True:  # a call that ends within its first wait is followed by another
            llm.generate(PROMPTS * 24, long)
    monkeypatch.setattr(mp_executor, "wait", real_wait)
    # The interrupted requests are gone from every worker (counted, not timed: the next call used
    # to finish them first): one empty step round reports nothing running or waiting.
    idle = llm.engine_client().step().stats
    assert idle["num_requests_running"] == [0] and idle["num_requests_waiting"] == [0], idle
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    # Ctrl-C (a real SIGINT) after rank 0 was sent the call and before rank 1 was: held until
    # every rank has it, then the call is aborted as above; the workers stay in lockstep.
    real_send, sent = mp_executor.send, []

    def interrupted_send(conn, message):
        real_send(conn, message)
        sent.append(message[0])
        if len(sent) == 1:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(mp_executor, "send", interrupted_send)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS * 24, long)
    finally:
        signal.signal(signal.SIGINT, previous)
        monkeypatch.setattr(mp_executor, "send", real_send)
    assert sent == ["generate", "generate", "abort", "abort"]
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected
    # A second Ctrl-C while the workers abort (in the abort's own wait): every worker is ended and
    # the LLM says so, rather than waiting on an abort that may never come.
    waits.clear()

    def twice_interrupted_wait(*args, **kwargs):
        waits.append(1)
        if len(waits) in (2, 3):  # the call's second wait, then the abort's first
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(mp_executor, "wait", twice_interrupted_wait)
    with pytest.raises(KeyboardInterrupt):
        while True:
            llm.generate(PROMPTS * 24, long)
    monkeypatch.setattr(mp_executor, "wait", real_wait)
    _wait_no_workers()
    with pytest.raises(WorkerError, match="shut down; create a new LLM"):
        llm.generate(PROMPTS, GREEDY)
    llm.shutdown()
