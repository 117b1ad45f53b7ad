"""The sampler on fixed logits (issue 41, point 6): which tokens top_k / top_p / min_p keep, alone
and combined, and that the draws follow the renormalised distribution over them (chi-square with
fixed seeds); min_tokens holding back an EOS that comes early.

The reference is written here in plain Python from vLLM's documented semantics: top-k keeps the k
largest logits; top-p keeps, in descending order, each token whose preceding mass (renormalised
over what top-k kept) is below top_p; min-p keeps tokens whose probability is at least min_p times
the largest; the draw is from softmax(logits / temperature) renormalised over the kept tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
from checkpoints import prompts_of_lengths

from expertmesh import LLM, SamplingParams
from expertmesh.engine.sampler import Sampler
from expertmesh.engine.sequence import Sequence

# Probabilities with no two equal and no cumulative sum near the top_p values below; placed at
# shuffled ids so that "the first k ids" and "the k largest" differ.
PROBS = [0.30, 0.20, 0.15, 0.10, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005]
IDS = [7, 2, 9, 0, 5, 3, 8, 1, 6, 4]
LOGITS = torch.full((10,), 0.0)
for _p, _i in zip(PROBS, IDS, strict=True):
    LOGITS[_i] = math.log(_p) + 1.5  # an offset: the sampler must not assume normalised logits
DRAWS = 4000


def reference(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> dict[int, float]:
    """token id -> probability of being drawn, from the definitions above."""
    z = [v / temperature for v in logits]
    top = max(z)
    p = [math.exp(v - top) for v in z]
    order = sorted(range(len(z)), key=lambda i: -z[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(p[i] for i in kept)
    before, after_p = 0.0, []
    for i in kept:
        if before < top_p:
            after_p.append(i)
        before += p[i] / mass
    largest = max(p[i] for i in after_p)
    final = [i for i in after_p if p[i] >= min_p * largest]
    total = sum(p[i] for i in final)
    return {i: p[i] / total for i in final}


def chi2_bound(df: int, z: float = 4.265) -> float:
    """The chi-square quantile at 1 - 1e-5 (z), by Wilson and Hilferty's cube-root approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def draw(params: SamplingParams, n: int = DRAWS, seed: int = 11) -> list[int]:
    seqs = [Sequence(f"r{i}", 0, [1], params, 64) for i in range(n)]
    return Sampler(seed)(LOGITS.expand(n, -1).clone(), seqs)


CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),  # the whole distribution
    (1.3, 0, 1.0, 0.0),  # temperature alone
    (1.0, 3, 1.0, 0.0),
    (1.0, 0, 0.6, 0.0),
    (1.0, 0, 1.0, 0.3),
    (1.0, 5, 0.8, 0.0),  # top_p over the mass top_k left
    (0.7, 0, 0.9, 0.1),
    (1.5, 6, 0.95, 0.2),  # all three
    (1.0, 4, 1.0, 0.6),  # min_p past top_k
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", CASES)
def test_kept_set_and_frequencies(temperature, top_k, top_p, min_p):
    want = reference(LOGITS.tolist(), temperature, top_k, top_p, min_p)
    assert len(want) >= 2 and min(want.values()) * DRAWS >= 15  # every kept token is expected often
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=1)
    tokens = draw(params)
    assert len(tokens) == DRAWS
    counts = {t: tokens.count(t) for t in set(tokens)}
    assert set(counts) == set(want), f"kept {sorted(counts)}, expected {sorted(want)}"
    chi2 = sum((counts[t] - DRAWS * q) ** 2 / (DRAWS * q) for t, q in want.items())
    assert chi2 < chi2_bound(len(want) - 1), (chi2, counts, want)


def test_top_k_one_of_many_seeds_is_the_argmax_and_top_k_two_is_not():
    """A limit check (k=1) next to the case that tells top-k applied from top-k ignored."""
    for seed in range(3):
        assert set(draw(SamplingParams(temperature=1.0, top_k=1), 200, seed)) == {IDS[0]}
    assert set(draw(SamplingParams(temperature=1.0, top_k=2), 400)) == {IDS[0], IDS[1]}


def test_seeded_rows_repeat_and_differ_by_seed():
    a = draw(SamplingParams(temperature=1.0, seed=5), 50, seed=1)
    b = draw(SamplingParams(temperature=1.0, seed=5), 50, seed=2)  # another engine seed
    c = draw(SamplingParams(temperature=1.0, seed=6), 50, seed=1)
    assert a == b  # per-request generator: the engine's generator plays no part
    assert a != c


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("mixtral"), max_model_len=128, kv_cache_memory_bytes=1 << 23, seed=7)


def test_min_tokens_holds_back_an_early_eos(llm, monkeypatch):
    """EOS forced to be the first token greedy decoding makes: without min_tokens the request
    stops after it; with min_tokens=m it runs on to the first EOS at or after m tokens."""
    prompt = [{"prompt_token_ids": prompts_of_lengths([9], seed=4)[0]}]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    ids = free[0].outputs[0].token_ids
    assert len(ids) == 16
    eos = ids[0]
    monkeypatch.setattr(llm.llm_engine.detok, "eos_ids", frozenset({eos}))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    for m in (2, 6):
        later = [i for i in range(m - 1, 16) if ids[i] == eos]
        length = later[0] + 1 if later else 16
        params = SamplingParams(temperature=0, max_tokens=16, min_tokens=m)
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ids[:length], m
        assert out.finish_reason == ("stop" if later else "length"), m
        assert len(out.token_ids) >= m
