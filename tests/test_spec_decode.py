"""Speculative decoding (n-gram drafts): the config is checked when built; the proposer equals a
brute-force search written here; greedy output is token-identical to decoding without
speculation (several families, MLA included, uneven batches, requests that never draft, EOS,
stop ids, stop strings and max_tokens landing inside a draft, the request's logits processors,
prefix caching and preemption), with the KV accounting intact after every call; rejection sampling
draws each verified position from the target's processed distribution (chi-square against the
distribution computed in plain torch here), and seeded runs reproduce."""

import json
import math

import numpy as np
import pytest
import torch
from checkpoints import prompts_of_lengths
from expect import assert_tokens_equal
from real_checkpoints import published
from test_deepseek import deepseek

from expertmesh import LLM, SamplingParams
from expertmesh.engine.sequence import Sequence
from expertmesh.spec_decode.config import SpeculativeConfig
from expertmesh.spec_decode.ngram import propose_ngram
from expertmesh.spec_decode.verify import verify_one

# Drafting at every batch width (the default stops beyond DEFAULT_MAX_BATCH decoding sequences).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}  # fmt: skip
ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=1 << 22, warmup=False)
KEEP_STOP = dict(include_stop_str_in_output=True)


def _repeating_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random token runs, each repeated (twice and a bit): copy-heavy prompts that give drafts."""
    return [(r * 3)[: 2 * len(r) + 3] for r in prompts_of_lengths(lengths, seed=seed)]


def _generate(llm: LLM, prompts: list[list[int]], params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert llm.llm_engine.blocks.num_free == llm.llm_engine.blocks.num_blocks  # every block returned
    return outs


def _assert_same(spec_outs, plain_outs, what: str, logprobs: bool = False) -> None:
    assert len(spec_outs) == len(plain_outs)
    for i, (a, b) in enumerate(zip(spec_outs, plain_outs, strict=True)):
        x, y = a.outputs[0], b.outputs[0]
        assert_tokens_equal(x.token_ids, y.token_ids, f"{what} request {i}")
        assert (x.finish_reason, x.stop_reason, x.text) == (y.finish_reason, y.stop_reason, y.text), i
        if logprobs:
            for u, v in zip(x.logprobs, y.logprobs, strict=True):
                assert u.keys() == v.keys()
                assert all(abs(u[t].logprob - v[t].logprob) < 1e-4 for t in u)


def _assert_drafted(llm: LLM) -> dict:
    """Speculation really ran: drafts, accepted tokens, and rejected ones (the rollback path)."""
    s = llm.llm_engine.stats()
    assert s["spec_decode_num_drafts"] > 0, s
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]
    return s


# ---- the config ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle9", "num_speculative_tokens": 2}, "method='eagle9' is unknown"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens=True"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "prompt_lookup_min=4 is greater than prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max=0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "unknown speculative_config"),
        ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "batch_size=0"),
        ({"method": "deepseek_mtp", "num_speculative_tokens": 1, "prompt_lookup_max": 3}, "ngram' only"),
        ("ngram", "must be a dict"),
    ],
)  # fmt: skip
def test_bad_config_names_the_value(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SpeculativeConfig.of(value)


def test_config_defaults_and_aliases():
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    for alias in ("deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "mimo_mtp", "mtp"):
        assert SpeculativeConfig.of({"method": alias, "num_speculative_tokens": 1}).method == "mtp"


def test_mtp_on_a_model_without_mtp_layers_names_both():
    with pytest.raises(ValueError, match="method='mtp'.*PhimoeForCausalLM model has none"):
        LLM(speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 1}, warmup=False)


def test_mtp_on_a_family_it_is_not_built_for_says_so(tmp_path):
    """The published MiniMax-M2.7 config (3 MTP modules; only DeepSeek-V3's and GLM-4.5's MTP layer
    is built, see tests/test_spec_mtp.py): refused before any weight is read."""
    config = {k: v for k, v in published("2026/minimax-m2.7").items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="3 MTP layer.*MiniMaxM2ForCausalLM.*not implemented"):
        LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


# ---- the proposer -------------------------------------------------------------------------------
def _brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n :]
        hits = [i for i in range(len(tokens) - n) if tokens[i : i + n] == suffix]
        if hits:
            full = [i for i in hits if i + n + k <= len(tokens)]
            start = (full[-1] if full else hits[0]) + n
            return tokens[start : start + k]
    return []


def test_ngram_proposer_equals_a_brute_force_search():
    g = torch.Generator().manual_seed(0)
    for trial in range(400):
        length = int(torch.randint(1, 40, (1,), generator=g))
        alphabet = int(torch.randint(2, 6, (1,), generator=g))
        tokens = torch.randint(0, alphabet, (length,), generator=g).tolist()
        lo = int(torch.randint(1, 4, (1,), generator=g))
        hi, k = lo + int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        got = propose_ngram(torch.tensor(tokens).numpy(), k, lo, hi)
        assert got == _brute_force(tokens, k, lo, hi), (trial, tokens, k, lo, hi)
    # The engine's int32 buffers, token ids whose bytes repeat across token boundaries (the search
    # runs over bytes: a match straddling two tokens must not count).
    ids = [0, 1, 256, 65536, 1 << 24, 257, 65537, (1 << 24) + 1]
    for trial in range(400):
        length = int(torch.randint(1, 40, (1,), generator=g))
        picks = torch.randint(0, len(ids), (length,), generator=g).tolist()
        tokens = [ids[i] for i in picks]
        lo = int(torch.randint(1, 4, (1,), generator=g))
        hi, k = lo + int(torch.randint(0, 3, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        got = propose_ngram(np.array(tokens, dtype=np.int32), k, lo, hi)
        assert got == _brute_force(tokens, k, lo, hi), (trial, tokens, k, lo, hi)
    assert propose_ngram(np.array([256, 0, 5, 1], dtype=np.int32), 2, 1, 1) == []  # 1 only straddles 256, 0
    assert propose_ngram(torch.tensor([5, 6, 7, 5, 6]).numpy(), 3, 2, 2) == [7, 5, 6]
    assert propose_ngram(torch.tensor([1, 2, 3]).numpy(), 3, 1, 2) == []  # no repeat: no draft


# ---- greedy: token-identical ----------------------------------------------------------------------
FAMILY_CASES = ["mixtral", "qwen2_moe", "llama", "deepseek-v2-lite"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_greedy_equals_plain_decoding(family, checkpoint, real_checkpoint):
    """An uneven batch: copy-heavy prompts (long drafts), plain random ones (no draft until the
    output repeats), max_tokens 1 (nothing to verify) up to 40; logprobs too."""
    path = deepseek(real_checkpoint, "v2-lite") if family.startswith("deepseek") else checkpoint(family)
    prompts = _repeating_prompts([5, 9, 3, 14], seed=3) + prompts_of_lengths([7, 2], seed=4)
    lens = [40, 17, 1, 30, 25, 9]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lens]
    plain = _generate(LLM(path, **ENGINE), prompts, params)
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    _assert_same(_generate(spec, prompts, params), plain, family, logprobs=True)
    _assert_drafted(spec)


@pytest.mark.timeout(240)
def test_eos_stop_ids_stop_strings_and_max_tokens_inside_drafts(checkpoint):
    """Each stop lands at a different step of one long greedy output (many of them inside an
    accepted draft): the output ends exactly where decoding without speculation ends it."""
    path = checkpoint("mixtral")
    prompt = _repeating_prompts([6], seed=21)[0]
    plain_llm, spec = LLM(path, **ENGINE), LLM(path, **ENGINE, speculative_config=NGRAM)
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    whole = _generate(plain_llm, [prompt], free)[0].outputs[0]
    assert len(whole.token_ids) == 48
    text = whole.text
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in range(1, 48, 5)]
    params += [SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[whole.token_ids[j]]) for j in
               range(2, 48, 4)]  # fmt: skip
    starts = range(4, len(text) - 3, max(1, len(text) // 9))
    stops = [text[i : i + 3] for i in starts if text[i : i + 3].strip()]
    params += [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[s]) for s in stops]
    params += [
        SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop=[s], **KEEP_STOP)
        for s in stops[:3]
    ]
    prompts = [prompt] * len(params)
    _assert_same(_generate(spec, prompts, params), _generate(plain_llm, prompts, params), "stops")
    _assert_drafted(spec)
    # EOS itself: the same weights with a token of the output as the model's EOS.
    for j in (5, 17, 30):
        eos = whole.token_ids[j]
        eos_path = checkpoint("mixtral", eos_token_id=eos)
        sp = SamplingParams(temperature=0, max_tokens=48)
        a = _generate(LLM(eos_path, **ENGINE), [prompt], sp)
        b = _generate(LLM(eos_path, **ENGINE, speculative_config=NGRAM), [prompt], sp)
        _assert_same(b, a, f"eos={eos}")
        assert a[0].outputs[0].token_ids[-1] == eos and a[0].outputs[0].finish_reason == "stop"


@pytest.mark.timeout(240)
def test_logits_processors_apply_at_every_verified_position(checkpoint):
    """Penalties, logit_bias, min_tokens and bad words read the output so far: at draft position j
    they must see the first j drafted tokens as output, as a plain step would."""
    path = checkpoint("qwen3_moe")
    prompts = _repeating_prompts([5, 8, 4, 6, 7], seed=8)
    tok = prompts[0][1]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, presence_penalty=0.7,
                       frequency_penalty=0.4),
        SamplingParams(temperature=0, max_tokens=30, logit_bias={tok: 3.0, prompts[2][0]: -2.0}),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=12, stop_token_ids=[prompts[3][2]]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=0.8),
    ]  # fmt: skip
    plain = _generate(LLM(path, **ENGINE), prompts, params)
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    _assert_same(_generate(spec, prompts, params), plain, "processors")
    _assert_drafted(spec)


@pytest.mark.timeout(240)
def test_prefix_cache_and_preemption_stay_consistent(checkpoint):
    """A small KV cache: sequences are preempted mid-draft and recomputed; later prompts extend
    earlier prompts + outputs, so they hit blocks filled while drafts were verified (a rejected
    token in a keyed block would change their output)."""
    path = checkpoint("phimoe")
    tight = dict(ENGINE, kv_cache_memory_bytes=20 * 16 * 512, max_num_seqs=8)  # 20 blocks of 16 tokens
    prompts = _repeating_prompts([6, 11, 4, 9, 7, 5], seed=30)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(path, **ENGINE, enable_prefix_caching=False)
    spec = LLM(path, **tight, speculative_config=NGRAM)
    first = _generate(spec, prompts, sp)
    _assert_same(first, _generate(ref, prompts, sp), "preempted")
    assert spec.llm_engine.stats()["preemptions"] > 0
    longer = [p + o.outputs[0].token_ids[:m] for p, o, m in zip(prompts, first, [33, 20, 36, 17, 40, 25],
                                                                  strict=True)]  # fmt: skip
    drafts = spec.llm_engine.stats()["spec_decode_num_drafts"]
    again = _generate(spec, longer, sp)
    _assert_same(again, _generate(ref, longer, sp), "cached")
    assert sum(o.num_cached_tokens for o in again) >= 16 * 6
    assert spec.llm_engine.stats()["spec_decode_num_drafts"] > drafts  # sequences that hit the cache draft
    _assert_drafted(spec)


# ---- sampled: the rejection sampler ------------------------------------------------------------
def chi2_bound(df: int, z: float = 4.265) -> float:
    """The chi-square quantile at 1 - 1e-5 (Wilson and Hilferty's cube-root approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _target(row: torch.Tensor, output: list[int], p: SamplingParams) -> torch.Tensor:
    """The distribution a plain step samples from, in plain torch: presence penalty over the
    output, temperature, then top-k."""
    x = row.clone()
    for t in set(output):
        x[t] -= p.presence_penalty
    x = x / p.temperature
    if p.top_k > 0:
        x[x < x.topk(p.top_k).values[-1]] = float("-inf")
    return x.softmax(-1)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    expected = n * probs[keep]
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def test_rejection_sampling_follows_the_target_at_each_position():
    """Fixed logits over 6 tokens for 3 verified positions and a likely two-token draft: the first token
    follows position 0's processed distribution; given the draft's first token was accepted, the
    second follows position 1's (with that token as output: the presence penalty sees it); given
    both, the third follows position 2's."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 6, generator=g) * 1.5
    p = SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.9, seed=1)
    prompt, draws = [0, 3], 3000
    first = int(_target(logits[0], [], p).argmax())  # likely drafts: every position is reached often
    draft = [first, int(_target(logits[1], [first], p).argmax())]
    seq = Sequence("r", 0, prompt, p, 64)
    gen = torch.Generator().manual_seed(123)
    counts = [torch.zeros(6), torch.zeros(6), torch.zeros(6)]
    for _ in range(draws):
        new = verify_one(logits.clone(), seq, draft, frozenset(), gen)
        assert seq.output_token_ids == []  # the draft is never left behind as output
        counts[0][new[0]] += 1
        if new[0] == draft[0]:
            counts[1][new[1]] += 1
            if new[1] == draft[1]:
                counts[2][new[2]] += 1
    for j in range(3):
        want = _target(logits[j], draft[:j], p)
        chi2, df = _chi2(counts[j], want)
        assert counts[j].sum() > 300, (j, counts[j])
        assert chi2 < chi2_bound(df), (j, chi2, counts[j], want)


@pytest.mark.timeout(240)
def test_seeded_sampling_reproduces_and_unseeded_greedy_neighbours_stay_exact(checkpoint):
    path = checkpoint("mixtral")
    prompts = _repeating_prompts([5, 7, 6], seed=40)
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=30, ignore_eos=True, seed=11),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=4, max_tokens=30, ignore_eos=True, seed=12, n=2),
    ]
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    a, b = _generate(spec, prompts, params), _generate(spec, prompts, params)
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x.outputs, y.outputs, strict=True):
            assert_tokens_equal(u.token_ids, v.token_ids, "seeded", length=30)
    plain = _generate(LLM(path, **ENGINE), prompts[1:2], params[1])
    assert_tokens_equal(a[1].outputs[0].token_ids, plain[0].outputs[0].token_ids, "greedy neighbour")
    _assert_drafted(spec)


# ---- hybrids: the recurrent state rolled back -------------------------------------------------
HYBRIDS = ["qwen3-next", "qwen3.5-moe", "nemotron-h", "granite-4.0-h"]


class KnownDrafts:
    """A proposer (in the n-gram proposer's place) that knows the plain run's greedy outputs and
    drafts them with one token made wrong at a position that cycles through 0..k (k: the whole
    draft right), so every accepted length, full acceptance included, is verified and rolled
    back. Tiny random checkpoints rarely repeat themselves, so n-gram drafts alone would mostly be
    rejected at their first token."""

    def __init__(self, prompts: list[list[int]], outs: list[list[int]], k: int) -> None:
        self.known = [(list(p), list(o)) for p, o in zip(prompts, outs, strict=True)]
        self.k, self.calls = k, 0

    def propose(self, tokens, limit: int) -> list[int]:
        tokens = tokens.tolist()
        # the request whose prompt and known output so far these tokens are (a prompt with only its
        # last token to compute, after a prefix-cache hit, drafts too)
        mine = [
            (p, o)
            for p, o in self.known
            if tokens[: len(p)] == p and tokens[len(p) :] == o[: len(tokens) - len(p)]
        ]
        assert mine, "verification accepted a token plain decoding did not give"
        prompt, out = max(mine, key=lambda m: len(m[0]))
        done = len(tokens) - len(prompt)
        draft = out[done : done + min(self.k, limit)]
        wrong = self.calls % (self.k + 1)
        self.calls += 1
        if wrong < len(draft):
            draft[wrong] = (draft[wrong] + 1) % 500
        return draft


def known_drafts(llm: LLM, prompts: list[list[int]], plain_outs: list[list[int]]) -> KnownDrafts:
    """`llm`'s drafter proposing KnownDrafts (of the plain run's token ids) every step, its
    adaptive gate off."""
    drafter = llm.llm_engine.drafter
    drafter.proposer = KnownDrafts(prompts, plain_outs, drafter.config.num_speculative_tokens)
    drafter.gate = None
    return drafter.proposer


def assert_every_length_accepted(llm: LLM, k: int) -> None:
    """Drafts were accepted at every position and rejected (the stats of the verify steps)."""
    s = llm.llm_engine.stats()
    per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == k and all(n > 0 for n in per_pos), s
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"], s


def _torch_recurrence(llm: LLM) -> None:
    """The recurrent mixers on their torch path (no compiled kernels), for this engine's life."""
    from expertmesh.layers.recurrent_mixer import RecurrentMixer

    mixers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, RecurrentMixer)]
    assert mixers
    for m in mixers:
        m.recurrent_steps = None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", HYBRIDS)
def test_hybrid_greedy_equals_plain_decoding(family, real_checkpoint):
    """Gated DeltaNet and Mamba2 layers keep the state after every draft position and the slot
    takes the one at the accepted length: greedy tokens and logprobs equal decoding without
    speculation, on the compiled recurrent kernels and on the torch path, with drafts accepted and
    rejected (an uneven batch: copy-heavy prompts, a plain one, max_tokens 1)."""
    from test_hybrid_families import _source

    path = real_checkpoint(_source(family))
    prompts = _repeating_prompts([5, 9, 3, 14], seed=3) + prompts_of_lengths([7], seed=4)
    lens = [30, 17, 1, 25, 12]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in lens]
    plain = _generate(LLM(path, **ENGINE), prompts, params)
    spec = LLM(path, **ENGINE, speculative_config=NGRAM)
    assert spec.llm_engine.runner.draft_states is not None
    # n-gram drafts (mostly rejected on a random model), then drafts of known acceptance lengths
    _assert_same(_generate(spec, prompts, params), plain, f"{family} (n-gram)", logprobs=True)
    known_drafts(spec, prompts, [o.outputs[0].token_ids for o in plain])
    _assert_same(_generate(spec, prompts, params), plain, family, logprobs=True)
    assert_every_length_accepted(spec, NGRAM["num_speculative_tokens"])
    _torch_recurrence(spec)
    _assert_same(_generate(spec, prompts, params), plain, f"{family} (torch path)", logprobs=True)


def test_hybrid_preemption_and_prefix_hits_with_drafts(real_checkpoint):
    """Qwen3.5-MoE in a small cache, drafts of every acceptance length: sequences are preempted
    (their state slot recomputed from position 0) and equal the plain run; later prompts extend
    earlier prompts + outputs, so they start from state snapshots taken after verify steps and
    still equal the plain run."""
    from test_hybrid_families import _source

    path = real_checkpoint(_source("qwen3.5-moe"))
    tight = dict(ENGINE, max_model_len=128, kv_cache_memory_bytes=960_000, max_num_seqs=8)  # ~18 blocks
    prompts = _repeating_prompts([6, 11, 4, 9, 7, 5], seed=30)
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    ref = LLM(path, **ENGINE, enable_prefix_caching=False)
    plain = _generate(ref, prompts, sp)
    spec = LLM(path, **tight, speculative_config=NGRAM)
    known_drafts(spec, prompts, [o.outputs[0].token_ids for o in plain])
    first = _generate(spec, prompts, sp)
    _assert_same(first, plain, "preempted", logprobs=True)
    assert spec.llm_engine.stats()["preemptions"] > 0
    longer = [p + o.outputs[0].token_ids[:m] for p, o, m in zip(prompts, first, [33, 20, 36, 17, 40, 25],
                                                                  strict=True)]  # fmt: skip
    plain_longer = _generate(ref, longer, sp)
    known_drafts(spec, longer, [o.outputs[0].token_ids for o in plain_longer])
    again = _generate(spec, longer, sp)
    _assert_same(again, plain_longer, "cached", logprobs=True)
    assert sum(o.num_cached_tokens for o in again) >= 16 * 6
    assert_every_length_accepted(spec, NGRAM["num_speculative_tokens"])


@pytest.mark.parametrize("family", ["qwen3.5-moe", "nemotron-h"])
def test_verify_rows_step_like_plain_decodes(family, real_checkpoint):
    """A recurrent mixer (Gated DeltaNet, Mamba2) over a verify step's rows (3, 1 and 4 rows of
    sequences in scattered slots) gives each row the output of a plain one-token decode of that
    sequence alone, and keeps in its draft rows the state after each row but the last (the slot
    ends at the last), on the compiled kernels and on the torch path. Within float32 rounding, not
    bit for bit: torch's vectorised softplus rounds an element by the tensor's length, as a
    plain decode's bits follow its batch."""
    from types import SimpleNamespace

    from test_hybrid_families import _source

    llm = LLM(real_checkpoint(_source(family)), **ENGINE)
    mixer = llm.llm_engine.runner.state_layers[0]
    counts, slots = [3, 1, 4], [4, 0, 2]
    g = torch.Generator().manual_seed(7)
    hidden = llm.llm_engine.runner.config.model_config.hidden_size
    x = torch.randn(sum(counts), hidden, generator=g)
    start = [torch.randn(6, *t.shape[1:], generator=g) * 0.5 for t in (mixer.conv_state, mixer.rec_state)]

    def ctx(rows: int, sl: list[int], state_rows=None):
        attn = SimpleNamespace(num_decodes=rows, prefills=[])
        return SimpleNamespace(attn=attn, state_slots=torch.tensor(sl), state_rows=state_rows)

    # The projections' bits may follow the number of rows (a GEMM's blocking): computed once over
    # every row, each one-row reference takes its own; out_proj left out (the recurrence is the point).
    proj = "in_proj" if hasattr(mixer, "in_proj") else "_split"
    with torch.inference_mode():
        projected = getattr(mixer, proj)(x)
    whole = projected if isinstance(projected, tuple) else (projected,)
    picked = {}  # the rows the next call takes: all, or one reference row

    class Rows(torch.nn.Module):
        def forward(self, _):
            part = tuple(t[picked["rows"]] for t in whole)
            return part if isinstance(projected, tuple) else part[0]

    setattr(mixer, proj, Rows())
    mixer.out_proj = torch.nn.Identity()
    assert mixer.recurrent_steps is not None or llm.llm_engine.runner.model.cpu_kernels is None
    for kernels in (mixer.recurrent_steps, None):
        mixer.recurrent_steps = kernels
        picked["rows"] = slice(None)
        live = [t.clone() for t in start]
        kept = [torch.zeros(6, 3, *t.shape[1:]) for t in start]
        mixer.bind_state(tuple(live))
        mixer.bind_draft_states(tuple(kept))
        with torch.inference_mode():
            got = mixer(None, x, ctx(len(x), slots, counts))
        ref_live = [t.clone() for t in start]
        mixer.bind_state(tuple(ref_live))
        row = 0
        for n, slot in zip(counts, slots, strict=True):
            for j in range(n):
                picked["rows"] = slice(row, row + 1)
                with torch.inference_mode():
                    want = mixer(None, x[row : row + 1], ctx(1, [slot]))
                what = f"{family} kernels={kernels is not None} slot {slot} row {j}"
                torch.testing.assert_close(got[row], want[0], rtol=1e-5, atol=1e-6, msg=what)
                if j < n - 1:
                    for k, t in zip(kept, ref_live, strict=True):
                        torch.testing.assert_close(k[slot, j], t[slot], rtol=1e-5, atol=1e-6, msg=what)
                row += 1
        for a, b in zip(live, ref_live, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=family)
        assert not kept[0][slots[1]].any()  # a sequence without a draft keeps nothing


# ---- metrics and the CLI ----------------------------------------------------------------------
def test_metrics_carry_vllms_spec_decode_names(checkpoint):
    from prometheus_client.parser import text_string_to_metric_families

    from expertmesh.engine.client import EngineStepper
    from expertmesh.entrypoints.metrics import RequestMetrics

    spec = LLM(checkpoint("mixtral"), **ENGINE, speculative_config=NGRAM)
    _generate(spec, _repeating_prompts([5, 8], seed=3), SamplingParams(temperature=0, max_tokens=30))
    stats = _assert_drafted(spec)
    snap = EngineStepper(spec.llm_engine).stats()
    snap["kv_blocks_used"] = [0]
    body, _ = RequestMetrics(lambda: snap).exposition()
    got = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            got[(s.name, s.labels.get("position"))] = s.value
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert got[(f"vllm:spec_decode_{name}_total", None)] == stats[f"spec_decode_{name}"]
    per_pos = [got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)]
    assert per_pos == stats["spec_decode_num_accepted_tokens_per_pos"]


def test_generate_cli_prints_the_acceptance_rate(capsys):
    from expertmesh.entrypoints.cli import main

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    argv = ["generate", "--prompt", "1 2 3 1 2 3 1 2 3 1 2", "--max-tokens", "16", "--no-warmup"]
    assert main([*argv, "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    assert "speculative decoding (ngram, k=3): acceptance rate" in out, out
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        main([*argv, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'])


def test_default_batch_rule_and_adaptive_gate(checkpoint):
    """Without disable_by_batch_size nothing is drafted while more than DEFAULT_MAX_BATCH sequences
    decode (and the output is unchanged); the gate pauses a sequence whose drafts are rejected,
    longer after each failed retry, and resumes at once after an accepted one."""
    from expertmesh.spec_decode.adaptive import AdaptiveGate, SpecState
    from expertmesh.spec_decode.config import DEFAULT_MAX_BATCH

    path = checkpoint("mixtral")
    prompts = _repeating_prompts([5, 6, 7, 8, 9, 4], seed=61)
    assert len(prompts) > DEFAULT_MAX_BATCH
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = {k: v for k, v in NGRAM.items() if k != "disable_by_batch_size"}
    spec = LLM(path, **ENGINE, speculative_config=config)
    _assert_same(_generate(spec, prompts, sp), _generate(LLM(path, **ENGINE), prompts, sp), "wide batch")
    assert spec.llm_engine.stats()["spec_decode_num_drafts"] == 0
    _generate(spec, prompts[:1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert spec.llm_engine.stats()["spec_decode_num_drafts"] > 0  # one sequence alone drafts

    gate, state = AdaptiveGate(min_acceptance=0.3, min_backoff=2, max_backoff=8), SpecState()
    pauses = []
    for _ in range(4):
        assert gate.may_draft(state)
        gate.observe(state, 4, 0)  # all rejected
        skipped = 0
        while not gate.may_draft(state):
            skipped += 1
        pauses.append(skipped)
    assert pauses == [2, 4, 8, 8]
    gate.observe(state, 4, 3)  # accepted: no pause
    assert gate.may_draft(state) and state.backoff == 0


def test_serve_takes_the_same_flag():
    from expertmesh.entrypoints.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    assert _engine_kwargs(args, None)["speculative_config"] == NGRAM


def test_draft_length_has_the_most_expected_tokens_per_step_cost():
    """best_length against the acceptance-length distribution written out here: with per-token
    acceptance q, a draft of d tokens accepts exactly a < d of them with probability q^a (1 - q) and
    all d with q^d, giving a + 1 tokens, for a step costing 1 + ROW_COST * d."""
    from expertmesh.spec_decode.adaptive import ROW_COST, best_length

    lengths = set()
    for q64 in range(65):
        q = q64 / 64
        for k in (1, 2, 3, 5, 8, 16, 32):
            values = []
            for d in range(1, k + 1):
                probs = [q**a * (1 - q) for a in range(d)] + [q**d]
                values.append(sum(p * (a + 1) for a, p in enumerate(probs)) / (1 + ROW_COST * d))
            got = best_length(q64, k)
            assert 1 <= got <= k and values[got - 1] >= max(values) - 1e-12, (q, k, got, values)
            lengths.add(got)
    assert {1, 2, 5, 16, 32} <= lengths  # short drafts at low acceptance, k at full acceptance


class _ScriptedDrafts(KnownDrafts):
    """KnownDrafts drafting the plain output right throughout (`right`) or wrong at its first
    token, recording the draft length it is asked for each time."""

    def __init__(self, prompts, outs, k: int, right: bool) -> None:
        super().__init__(prompts, outs, k)
        self.right, self.limits = right, []

    def propose(self, tokens, limit: int) -> list[int]:
        self.limits.append(limit)
        self.calls = self.k if self.right else 0  # KnownDrafts makes token `calls % (k + 1)` wrong
        return super().propose(tokens, limit)


@pytest.mark.timeout(240)
def test_draft_length_grows_with_acceptance_and_shrinks_without(checkpoint):
    """With the adaptive gate on: drafts that are always accepted are asked longer until k, drafts
    rejected at their first token shorter down to one token, with pauses; outputs equal plain
    decoding either way."""
    path, k = checkpoint("mixtral"), 8
    prompts = prompts_of_lengths([6], seed=77)
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = _generate(LLM(path, **ENGINE), prompts, sp)
    outs = [list(o.outputs[0].token_ids) for o in plain]
    spec = LLM(path, **ENGINE, speculative_config={**NGRAM, "num_speculative_tokens": k})
    drafter = spec.llm_engine.drafter
    assert drafter.gate is not None
    drafter.proposer = right = _ScriptedDrafts(prompts, outs, k, right=True)
    _assert_same(_generate(spec, prompts, sp), plain, "right drafts")
    assert 1 < right.limits[0] < k and k in right.limits, right.limits
    assert right.limits.index(k) < 4, right.limits  # a few accepted drafts reach k
    steps = spec.llm_engine.stats()["steps"]
    drafter.proposer = wrong = _ScriptedDrafts(prompts, outs, k, right=False)
    _assert_same(_generate(spec, prompts, sp), plain, "wrong drafts")
    assert wrong.limits[0] < k and wrong.limits[-1] == 1, wrong.limits
    assert wrong.limits == sorted(wrong.limits, reverse=True), wrong.limits
    assert len(wrong.limits) < spec.llm_engine.stats()["steps"] - steps - 1  # paused in between
