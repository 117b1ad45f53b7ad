"""Sampling: validation, seeded reproducibility independent of the batch, stops, n, logprobs."""

import math

import pytest
from checkpoints import prompts_of_lengths

from expertmesh import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("mixtral"), max_model_len=128, kv_cache_memory_bytes=1 << 23, seed=7)


def _tok(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("min_p", 2.0),
        ("max_tokens", 0),
        ("n", 0),
        ("logprobs", -1),
        ("stop", [""]),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


@pytest.mark.timeout(60)
def test_seeded_sampling_same_alone_or_in_a_batch(llm):
    prompts = prompts_of_lengths([6, 11, 3, 19], seed=8)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    alone = llm.generate(_tok(prompts[:1]), seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(_tok(prompts), [seeded, other, other, other], use_tqdm=False)
    again = llm.generate(_tok(prompts[1:] + prompts[:1]), [other, other, other, seeded], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert again[3].outputs[0].token_ids == alone
    different = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True)
    assert llm.generate(_tok(prompts[:1]), different, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.timeout(60)
def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    prompts = prompts_of_lengths([4, 9], seed=9)
    greedy = llm.generate(
        _tok(prompts), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    for sp in (
        SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10, ignore_eos=True),
    ):
        outs = llm.generate(_tok(prompts), sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in greedy]


@pytest.mark.timeout(60)
def test_stop_token_ids_stop_strings_and_eos(llm):
    prompt = _tok(prompts_of_lengths([7], seed=10))
    full = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0]
    ids = full.outputs[0].token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id

    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        out = llm.generate(
            prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True), use_tqdm=False
        )[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text[: text.find(stop)]


@pytest.mark.timeout(60)
def test_n_samples_and_logprobs(llm):
    prompt = _tok(prompts_of_lengths([5], seed=11))
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, logprobs=2)
    out = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == 8
        for token, step in zip(c.token_ids, c.logprobs, strict=True):
            assert token in step and len(step) in (2, 3)
            assert all(lp.logprob <= 0 for lp in step.values())
        assert math.isclose(
            c.cumulative_logprob,
            sum(s[t].logprob for t, s in zip(c.token_ids, c.logprobs, strict=True)),
            rel_tol=1e-5,
        )
