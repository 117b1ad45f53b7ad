"""vLLM's logits-processing fields (logit_bias, allowed_token_ids, bad_words, min_tokens, the
penalties, truncate_prompt_tokens) against transformers' logits processors or plain torch, run
on transformers' own model; requests that use none of them are unchanged bit for bit."""

import pytest
import torch
from checkpoints import one_thread, prompts_of_lengths
from transformers import (
    AutoModelForCausalLM,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from expertmesh import LLM, SamplingParams

N = 12


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("mixtral")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 23, seed=3)


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def hf_greedy(model, prompt, procs, stop=(), n=N):
    """Greedy decoding with transformers' model, each step's logits through `procs` in order."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), one_thread():
        for _ in range(n):
            scores = model(ids).logits[:, -1].float()
            for proc in procs:
                scores = proc(ids, scores)
            token = scores.argmax(-1, keepdim=True)
            ids = torch.cat([ids, token], dim=1)
            if int(token) in stop:
                break
    return ids[0, len(prompt) :].tolist()


class Penalties:
    """vLLM's frequency and presence penalties over the output tokens, in plain torch."""

    def __init__(self, prompt_len, frequency, presence):
        self.start, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, ids, scores):
        counts = torch.bincount(ids[0, self.start :], minlength=scores.shape[1]).float()
        return scores - self.frequency * counts - self.presence * (counts > 0).float()


class OutputOnly:
    """A transformers processor shown only the generated tokens (vLLM matches bad words there)."""

    def __init__(self, proc, prompt_len):
        self.proc, self.start = proc, prompt_len

    def __call__(self, ids, scores):
        return self.proc(ids[:, self.start :], scores)


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, **kw)


def test_each_field_equals_transformers_batched_with_plain_requests(llm, hf):
    prompts = prompts_of_lengths([9, 5, 14], seed=21)
    plain = _greedy(logprobs=3)
    base = _run(llm, prompts, plain)
    p0, first = prompts[0], base[0]
    tok = llm.get_tokenizer()
    word = tok.decode(first[2:4])
    bad_ids = [tok.encode(w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip())]
    single = tok.decode(first[1:2]).strip()
    cases = [
        (dict(repetition_penalty=1.8), [RepetitionPenaltyLogitsProcessor(1.8)]),
        (dict(repetition_penalty=0.5), [RepetitionPenaltyLogitsProcessor(0.5)]),
        (dict(frequency_penalty=1.5, presence_penalty=0.7), [Penalties(len(p0), 1.5, 0.7)]),
        (dict(presence_penalty=-2.0), [Penalties(len(p0), 0.0, -2.0)]),
        (
            dict(logit_bias={first[1]: -100, 7: 6.5}),
            [SequenceBiasLogitsProcessor(sequence_bias=[[[first[1]], -100.0], [[7], 6.5]])],
        ),
        (
            dict(bad_words=[word]),
            [OutputOnly(NoBadWordsLogitsProcessor([b for b in bad_ids if b], eos_token_id=None), len(p0))],
        ),
    ]
    for kw, procs in cases:
        ours = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], [_greedy(**kw), plain, plain], use_tqdm=False
        )
        assert ours[0].outputs[0].token_ids == hf_greedy(hf, p0, procs), kw
        # the requests that use nothing: same tokens and the same logprobs, bit for bit
        again = _run(llm, prompts[1:], plain)
        assert [o.outputs[0].token_ids for o in ours[1:]] == base[1:] == again
    # at least the bias and the bad word changed the greedy answer (the test can fail)
    assert _run(llm, [p0], _greedy(bad_words=[single]))[0] != first
    assert _run(llm, [p0], _greedy(logit_bias={first[0]: -100}))[0][0] != first[0]


def test_allowed_token_ids_and_min_tokens(llm, hf):
    prompts = prompts_of_lengths([8], seed=22)
    p0 = prompts[0]
    allowed = [5, 11, 40, 41, 97]
    mask = torch.full((1, hf.config.vocab_size), float("-inf"))
    mask[0, allowed] = 0
    ours = _run(llm, prompts, _greedy(allowed_token_ids=allowed))[0]
    assert ours == hf_greedy(hf, p0, [lambda ids, s: s + mask])
    assert set(ours) <= set(allowed)
    # min_tokens: the stop id (and EOS) cannot come before min_tokens tokens
    first = _run(llm, prompts, _greedy())[0]
    stop = first[1]
    sp = SamplingParams(temperature=0, max_tokens=N, min_tokens=6, stop_token_ids=[stop])
    out = llm.generate([{"prompt_token_ids": p0}], sp, use_tqdm=False)[0].outputs[0]
    eos = sorted(llm.llm_engine.detok.eos_ids)
    ref = hf_greedy(hf, p0, [MinNewTokensLengthLogitsProcessor(len(p0), 6, [stop, *eos])], stop={stop, *eos})
    assert out.token_ids == ref
    assert len(out.token_ids) >= 6 and stop not in out.token_ids[:5]


def test_seeded_penalties_same_alone_or_batched(llm):
    prompts = prompts_of_lengths([7, 10, 4], seed=23)
    sp = SamplingParams(
        temperature=0.9, seed=5, max_tokens=N, ignore_eos=True, repetition_penalty=1.3,
        frequency_penalty=0.5, logit_bias={9: 3.0},
    )  # fmt: skip
    other = SamplingParams(temperature=1.0, max_tokens=N, ignore_eos=True)
    alone = _run(llm, prompts[:1], sp)[0]
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts], [sp, other, other], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone
    assert (
        alone
        != _run(llm, prompts[:1], SamplingParams(temperature=0.9, seed=5, max_tokens=N, ignore_eos=True))[0]
    )


def test_truncate_prompt_tokens_keeps_the_last_n(llm):
    prompt = prompts_of_lengths([20], seed=24)[0]
    out = llm.generate([{"prompt_token_ids": prompt}], _greedy(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-6:]
    assert out.outputs[0].token_ids == _run(llm, [prompt[-6:]], _greedy())[0]


@pytest.mark.parametrize(
    "field,value,kind",
    [
        ("repetition_penalty", 0.0, ValueError),
        ("presence_penalty", 2.5, ValueError),
        ("frequency_penalty", -3, ValueError),
        ("frequency_penalty", "1", TypeError),
        ("logit_bias", {1: 101}, ValueError),
        ("logit_bias", {"x": 1}, TypeError),
        ("allowed_token_ids", [], ValueError),
        ("allowed_token_ids", [1.5], TypeError),
        ("bad_words", [""], ValueError),
        ("bad_words", "word", TypeError),
        ("truncate_prompt_tokens", 0, ValueError),
    ],
)
def test_invalid_values_name_the_field(field, value, kind):
    with pytest.raises(kind, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_ids_outside_the_vocabulary_fail_that_request_only(llm):
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts = prompts_of_lengths([5, 5], seed=25)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [_greedy(allowed_token_ids=[vocab]), _greedy()],
        use_tqdm=False,
    )
    assert (
        "allowed_token_ids" in outs[0].error
        and outs[1].error is None
        and len(outs[1].outputs[0].token_ids) == N
    )


@pytest.mark.parametrize("chunk", [None, 8])
def test_prompt_logprobs_equal_transformers_log_softmax(path, hf, chunk):
    """Every prompt token's logprob (the first None), chunked prefill or not, and again when the
    prompt's blocks sit in the prefix cache (a request for prompt logprobs recomputes them)."""
    kw = dict(max_num_batched_tokens=chunk, max_num_seqs=chunk) if chunk else {}
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 23, enable_prefix_caching=True, **kw)
    prompts = prompts_of_lengths([37, 6], seed=26)
    with torch.no_grad(), one_thread():
        refs = [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([{"prompt_token_ids": prompts[0]}], plain, use_tqdm=False)  # fills the prefix cache
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [sp, plain], use_tqdm=False)
    assert outs[1].prompt_logprobs is None and outs[0].num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": prompts[0]}], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the cache held the prompt: prompt logprobs skipped it
    got, ref, prompt = outs[0].prompt_logprobs, refs[0], prompts[0]
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        assert prompt[i] in entry and len(entry) in (3, 4)
        torch.testing.assert_close(
            entry[prompt[i]].logprob, float(ref[i - 1, prompt[i]]), atol=2e-4, rtol=1e-4
        )
        assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1
        top = ref[i - 1].topk(3)
        assert sorted(t for t, lp in entry.items() if lp.rank <= 3) == sorted(top.indices.tolist())


TP_PROMPTS = prompts_of_lengths([9, 5, 13], seed=27)
TP_PARAMS = [
    dict(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=1.6, logit_bias={7: 4.0}),
    dict(
        temperature=0.9, seed=11, max_tokens=N, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5
    ),
    dict(temperature=0, max_tokens=N, ignore_eos=True, prompt_logprobs=2),
]


def _tp_run(path, **kw):
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22, **kw)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in TP_PROMPTS],
        [SamplingParams(**p) for p in TP_PARAMS],
        use_tqdm=False,
    )
    lps = [(t, round(lp.logprob, 4)) for e in outs[2].prompt_logprobs[1:] for t, lp in sorted(e.items())]
    return [o.outputs[0].token_ids for o in outs], lps


def _tp2_rank(rank, world, path):
    return _tp_run(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher")


@pytest.mark.timeout(120)
def test_penalties_bias_and_prompt_logprobs_under_tp2_equal_one_process(path):
    from distributed_utils import run_distributed

    one_tokens, one_lps = _tp_run(path)
    for tokens, lps in run_distributed(_tp2_rank, 2, path, timeout=90):
        assert tokens == one_tokens
        assert [t for t, _ in lps] == [t for t, _ in one_lps]
        assert [v for _, v in lps] == pytest.approx([v for _, v in one_lps], abs=2e-3)
