"""The request-failure invariant, offline: a request that fails anywhere (validation, tokenization,
a step) comes back with `.error`, its KV blocks are freed, the other requests of the call complete,
and the next call works; Ctrl-C takes a call's requests out of the engine. Each case below broke
the LLM for good, or left requests behind, before."""

import math

import pytest

from expertmesh import LLM, SamplingParams
from expertmesh.engine.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
GOOD = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [40, 41]}]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("mixtral"), max_model_len=64, kv_cache_memory_bytes=1 << 22)


@pytest.fixture(scope="module")
def expected(llm):
    return [o.outputs[0].token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)]


def _still_healthy(llm, expected) -> None:
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.requests == {} and not engine.scheduler.has_work()
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert [o.outputs[0].token_ids for o in llm.generate(GOOD, GREEDY, use_tqdm=False)] == expected


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "prompt,params,message",
    [
        (
            GOOD[0],
            SamplingParams(logprobs=5000, max_tokens=2),
            "logprobs=5000 exceeds the vocabulary size 512",
        ),
        ({"prompt_token_ids": [5.0, 7.9]}, GREEDY, r"must be integers; got [5.0, 7.9] (float)"),
        ({"prompt_token_ids": [True, 3]}, GREEDY, "must be integers; got [True] (bool)"),
        ({"prompt_token_ids": "5 6 7"}, GREEDY, "must be a list of integers, got str"),
        ({"prompt_token_ids": 7}, GREEDY, "must be a list of integers, got int"),
        ({"prompt_token_ids": [5, -1, 2**40]}, GREEDY, "[-1, 1099511627776] are outside the vocabulary"),
        ({"prompt_token_ids": []}, GREEDY, "the prompt is empty"),
        ({"text": "no key"}, GREEDY, "needs 'prompt' or 'prompt_token_ids'"),
        (12345, GREEDY, "a prompt must be a str or a dict, got int"),
        (GOOD[0], "not params", "sampling params must be a SamplingParams, got str"),
    ],
)
def test_a_bad_request_fails_alone_and_the_engine_stays_usable(llm, expected, prompt, params, message):
    outs = llm.generate([GOOD[0], prompt, GOOD[1]], [GREEDY, params, GREEDY], use_tqdm=False)
    assert outs[1].error is not None and message in outs[1].error, outs[1].error
    assert outs[1].outputs == []
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    _still_healthy(llm, expected)


@pytest.mark.timeout(60)
def test_a_failing_step_fails_its_requests_frees_blocks_and_the_next_call_works(llm, expected, monkeypatch):
    forward, calls = ModelRunner.forward, [0]

    def fails_once(self, *args):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a kernel failed")
        return forward(self, *args)

    monkeypatch.setattr(ModelRunner, "forward", fails_once)
    outs = llm.generate(GOOD, GREEDY, use_tqdm=False)
    assert all("the engine step failed: RuntimeError('a kernel failed')" in o.error for o in outs)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]  # what they had before the step
    _still_healthy(llm, expected)


@pytest.mark.timeout(60)
def test_ctrl_c_during_generate_aborts_its_requests(llm, expected, monkeypatch):
    engine = llm.llm_engine
    step, steps = type(engine).step, [0]

    def interrupted(self):
        steps[0] += 1
        if steps[0] == 5:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(type(engine), "step", interrupted)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(GOOD * 4, long, use_tqdm=False)
    monkeypatch.setattr(type(engine), "step", step)
    assert engine.requests == {}, "the interrupted call left its requests in the engine"
    before = engine.num_steps
    _still_healthy(llm, expected)
    assert engine.num_steps - before == GREEDY.max_tokens  # the next call ran only its own requests


def test_sampling_values_are_rejected_naming_the_field():
    for kwargs, kind, field in [
        ({"temperature": math.nan}, ValueError, "temperature"),
        ({"temperature": math.inf}, ValueError, "temperature"),
        ({"temperature": "hot"}, TypeError, "temperature"),
        ({"top_p": math.nan}, ValueError, "top_p"),
        ({"seed": "x"}, TypeError, "seed"),
        ({"seed": 2**70}, ValueError, "seed"),
        ({"seed": -1}, ValueError, "seed"),
        ({"stop": ""}, ValueError, "stop"),
        ({"stop": [3]}, TypeError, "stop"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens"),
        ({"n": True}, TypeError, "n"),
        ({"ignore_eos": "yes"}, TypeError, "ignore_eos"),
        ({"stop_token_ids": [1.5]}, TypeError, "stop_token_ids"),
    ]:
        with pytest.raises(kind, match=f"^SamplingParams.{field}="):
            SamplingParams(**kwargs)


@pytest.mark.timeout(60)
def test_tiny_temperatures_are_greedy_not_token_zero(llm, expected):
    for t in (1e-300, 5e-324, 1e-6):
        sp = SamplingParams(temperature=t, max_tokens=4, ignore_eos=True)
        assert sp.greedy
        outs = llm.generate(GOOD, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    # Just above the threshold it samples, and never yields NaN (token 0 on every step).
    outs = llm.generate(GOOD, SamplingParams(temperature=2e-5, max_tokens=4, seed=1, ignore_eos=True))
    assert all(o.outputs[0].token_ids != [0, 0, 0, 0] for o in outs)
