"""Greedy speculative decoding equals decoding without it on every family that has a test
checkpoint: the synthetic ones (tests/checkpoints.py), the published 2024-25 and 2026 configs
shrunk (test_real_families.FAMILIES, DeepSeek-V2 / V3 of test_deepseek, Kimi-K2 read as
DeepSeek-V3, DeepSeek-V4), and the hybrids (Gated DeltaNet, Mamba2).

One engine per family drafts n-gram tokens from copy-heavy prompts (drafted only where the random
model's output reuses a context token), then (its proposer swapped for test_spec_decode.KnownDrafts)
drafts of every acceptance length, so tokens are both accepted and rejected whatever the model
writes; tokens and logprobs equal the plain engine's, and the
KV accounting is intact after each call. Every family runs by default (a second or two each). MTP
drafts: tests/test_spec_mtp.py."""

import pytest
from checkpoints import FAMILIES as SYNTHETIC
from checkpoints import prompts_of_lengths
from test_deepseek import MODELS as DEEPSEEK
from test_hybrid_families import FAMILIES as HYBRID
from test_hybrid_families import _source
from test_real_families import FAMILIES as REAL
from test_spec_decode import _assert_same, _generate, assert_every_length_accepted, known_drafts

from expertmesh import LLM, SamplingParams

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
         "disable_by_batch_size": 64}  # fmt: skip
ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 23, warmup=False)
# A prompt repeating itself (drafts from the first step) and one that does not; 14 and 9 new tokens.
PROMPTS = [(r * 3)[: 2 * len(r) + 2] for r in prompts_of_lengths([6], seed=61)] + prompts_of_lengths(
    [5], seed=62
)
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (14, 9)]


def _v4(real_checkpoint) -> str:
    from test_deepseek_v4 import OVERRIDES, SOURCE

    return real_checkpoint(SOURCE, **OVERRIDES)


def _paths() -> dict:
    """family -> fn(checkpoint, real_checkpoint) giving its checkpoint's directory."""
    out = {f"synthetic-{name}": (lambda c, r, n=name: c(n)) for name in SYNTHETIC}
    out |= {name: (lambda c, r, s=src, o=over: r(s, **o)) for name, (src, over) in REAL.items()}
    out |= {
        f"deepseek-{name}": (lambda c, r, s=src, z=sizes: r(s, sizes=z))
        for name, (src, sizes) in DEEPSEEK.items()
    }
    out["kimi-k2"] = lambda c, r: r("2026/kimi-k2-instruct", model_type="deepseek_v3")
    out["deepseek-v4"] = lambda c, r: _v4(r)
    out |= {name: (lambda c, r, n=name: r(_source(n))) for name in HYBRID}
    return out


PATHS = _paths()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(PATHS))
def test_ngram_and_known_drafts_equal_plain_decoding(family, checkpoint, real_checkpoint):
    path = PATHS[family](checkpoint, real_checkpoint)
    plain = _generate(LLM(path, **ENGINE), PROMPTS, PARAMS)
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    # n-gram drafts need the output to reuse the context's tokens: a random model does now and then
    _assert_same(_generate(spec, PROMPTS, PARAMS), plain, f"{family} (n-gram)", logprobs=True)
    known_drafts(spec, PROMPTS, [o.outputs[0].token_ids for o in plain])
    _assert_same(_generate(spec, PROMPTS, PARAMS), plain, f"{family} (known drafts)", logprobs=True)
    assert_every_length_accepted(spec, K)
