"""The batched logits processors equal the per-row definition bit for bit, on random batches that mix
every processor (and rows with none), including the edge cases each step special-cases."""

from __future__ import annotations

import random

import pytest
import torch

from expertmesh.engine.sampler import apply_logits_processors, apply_logits_processors_per_row
from expertmesh.engine.sequence import Sequence
from expertmesh.sampling_params import SamplingParams

VOCAB = 97
EOS = frozenset({2, 5})


def random_seq(rng: random.Random, i: int) -> Sequence:
    kw: dict = {}
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.7, 1.3, 2.0])
    if rng.random() < 0.4:
        kw["frequency_penalty"] = rng.uniform(-1.5, 1.5)
    if rng.random() < 0.4:
        kw["presence_penalty"] = rng.uniform(-1.5, 1.5)
    if rng.random() < 0.3:  # ids past the vocabulary are ignored, as in the per-row version
        kw["logit_bias"] = {rng.randrange(VOCAB + 5): rng.uniform(-50, 50) for _ in range(rng.randint(1, 6))}
    if rng.random() < 0.25:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 8))
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(1, 6)
        kw["stop_token_ids"] = rng.sample(range(VOCAB), 2)
        kw["ignore_eos"] = rng.random() < 0.5
    params = SamplingParams(max_tokens=16, **kw)
    if rng.random() < 0.3:
        params.bad_words_token_ids = [rng.sample(range(VOCAB), rng.randint(1, 3)) for _ in range(3)]
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 150))]  # long lists take the buffer path
    seq = Sequence(f"r{i}", 0, prompt, params, max_len=200)
    seq.output_token_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 90))]
    if params.bad_words_token_ids and rng.random() < 0.5:  # end the output with a word's prefix
        seq.output_token_ids += params.bad_words_token_ids[0][:-1]
    return seq


@pytest.mark.parametrize("seed", range(12))
def test_batched_equals_per_row(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    seqs = [random_seq(rng, i) for i in range(rng.randint(1, 24))]
    logits = torch.randn(len(seqs), VOCAB) * 5
    if seed % 3 == 0:  # a grammar-like row with only banned ids finite: the bans must give way
        row = rng.randrange(len(seqs))
        s = seqs[row]
        s.params.min_tokens, s.params.ignore_eos = 10**6, False
        logits[row] = float("-inf")
        logits[row, sorted(EOS)] = torch.tensor([1.5, -0.5])
    logits[:, rng.randrange(VOCAB)] = float("-inf")  # an id a grammar already masked
    before = logits.clone()
    want = apply_logits_processors_per_row(logits, seqs, EOS)
    got = apply_logits_processors(logits, seqs, EOS)
    assert torch.equal(logits, before), "the input logits must not change"
    # Bit for bit: the same float32 operations in the same order (inf positions included).
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    untouched = [i for i, s in enumerate(seqs) if not s.params.uses_logits_processors]
    assert torch.equal(got[untouched], before[untouched])


def test_no_processed_rows_returns_the_input() -> None:
    seqs = [Sequence("a", 0, [1, 2], SamplingParams(max_tokens=4), max_len=50)]
    logits = torch.randn(1, VOCAB)
    assert apply_logits_processors(logits, seqs) is logits
