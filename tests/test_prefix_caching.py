"""Automatic prefix caching: the same tokens with and without it; a repeated prefix is found
(num_cached_tokens, the hit and query counters); freed cached blocks are reused in LRU order and
evicted on demand; shared blocks are reference counted, and under preemption and aborts no block
leaks (LLMEngine.check_invariants after every step)."""

import logging

import pytest
from checkpoints import prompts_of_lengths
from real_checkpoints import Sizes
from test_real_families import FAMILIES

from expertmesh import LLM, SamplingParams
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _run(llm, ps, sp=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    return outs


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _shared_prefix_prompts(prefix_len: int, suffixes: list[int], seed: int = 5) -> list[list[int]]:
    prefix, *tails = prompts_of_lengths([prefix_len, *suffixes], seed=seed)
    return [prefix + t for t in tails]


@pytest.mark.timeout(120)
def test_repeated_1000_token_prefix_is_found_and_gives_the_same_tokens(checkpoint):
    path = checkpoint("phimoe", max_position_embeddings=1100)
    ps = _shared_prefix_prompts(1000, [9, 30, 1])
    off = LLM(path, max_model_len=1100, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 24)
    on = LLM(path, max_model_len=1100, kv_cache_memory_bytes=1 << 24)
    expected = _tokens(_run(off, ps))
    first = _run(on, ps[:1])  # computes (and caches) the prefix
    rest = _run(on, ps[1:])  # find it, one request after another in one batch
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 992 for o in rest), [o.num_cached_tokens for o in rest]
    assert _tokens(first + rest) == expected
    for a, b in zip(first + rest, _run(off, ps), strict=True):  # logprobs too (fp32)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(lp.logprob - y[t].logprob) < 1e-4 for t, lp in x.items())
    stats = on.llm_engine.stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for p in ps)
    assert stats["prefix_cache_hits"] == sum(o.num_cached_tokens for o in rest) >= 2 * 992
    assert off.llm_engine.stats()["prefix_cache_hits"] == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "family",
    [
        "gpt-oss",
        "llama4-text",
        "phi-3.5-moe",
        "glm-4.5",
        "minimax-m2.7",
        "kimi-k2.5",
        "longcat-flash",
        "deepseek-v3.2",
    ],
)
def test_same_tokens_with_and_without_for_window_chunk_and_sink_families(family, real_checkpoint):
    """Sliding windows, attention chunks, sinks, NoPE layers: the cache keeps every block of a
    prefix, so a hit is exactly what recomputing gives. Phi-3.5-MoE under max_model_len 128 (its
    shrunk LongRoPE switch) stays in the short regime: caching is on. The 2026 families (MiniMax's
    whole-projection q/k norm, Kimi-K2.5's MLA, LongCat-Flash's two latent caches a layer,
    DeepSeek-V3.2's index keys) take the same check."""
    source, overrides = FAMILIES[family]
    path = real_checkpoint(source, sizes=Sizes(), **overrides)
    ps = _shared_prefix_prompts(70, [3, 20, 1, 40])
    kw = dict(max_model_len=128, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=64, max_num_seqs=8)
    off = LLM(path, enable_prefix_caching=False, **kw)
    on = LLM(path, **kw)
    expected = _tokens(_run(off, ps))
    assert _tokens(_run(on, ps[:1]) + _run(on, ps[1:])) == expected
    assert on.llm_engine.stats()["prefix_cache_hits"] == 3 * 64  # the 70-token prefix: 4 full blocks


@pytest.mark.timeout(60)
def test_length_dependent_rope_past_its_switch_turns_caching_off_with_a_reason(real_checkpoint, caplog):
    source, overrides = FAMILIES["phi-3.5-moe"]
    path = real_checkpoint(source, **overrides)
    log = logging.getLogger("expertmesh")
    log.addHandler(caplog.handler)
    try:
        llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=1 << 22)
    finally:
        log.removeHandler(caplog.handler)
    assert not llm.llm_engine.blocks.enable_prefix_caching
    assert "prefix caching is off: rope_type='longrope'" in caplog.text


@pytest.mark.timeout(120)
def test_deepseek_latent_cache_is_shared_too(real_checkpoint):
    from test_deepseek import MODELS

    source, sizes = MODELS["v2-lite"]
    path = real_checkpoint(source, sizes=sizes)
    ps = _shared_prefix_prompts(50, [2, 17])
    off = LLM(path, max_model_len=128, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 24)
    on = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 24)
    assert _tokens(_run(on, ps[:1]) + _run(on, ps[1:])) == _tokens(_run(off, ps))
    assert on.llm_engine.stats()["prefix_cache_hits"] == 48


@pytest.mark.timeout(120)
def test_preemption_and_aborts_leak_no_block(checkpoint):
    """Shared prefixes in a KV cache far too small: sequences share blocks, are preempted and
    recomputed (from what the cache still holds), some are aborted part way through their prefill
    or decode; the accounting holds after every step and every block comes back."""
    path = checkpoint("phimoe")
    ps = _shared_prefix_prompts(40, [5, 17, 30, 9, 41, 2])
    roomy = LLM(path, max_model_len=128, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 24)
    expected = _tokens(_run(roomy, ps, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)))
    per_block = roomy.llm_engine.runner.block_bytes()
    tight = LLM(
        path,
        max_model_len=128,
        kv_cache_memory_bytes=per_block * 9,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    engine = tight.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, sp)
    engine.add_request("abort-prefilling", ps[4] + [7] * 30, sp)
    engine.add_request("abort-decoding", ps[0], sp)
    done, step = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
        engine.check_invariants()
        step += 1
        if step == 2:
            engine.abort_request("abort-prefilling")
        if step == 12:
            engine.abort_request("abort-decoding")
            engine.check_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert [done[str(i)].outputs[0].token_ids for i in range(len(ps))] == expected
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert not any(engine.blocks.ref_counts)
    assert engine.stats()["prefix_cache_hits"] > 0


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(), 1 << 20)


def _admit(bm: BlockManager, tokens: list[int]) -> Sequence:
    seq = _seq(tokens)
    hits = bm.cached_prefix(seq)
    assert bm.can_allocate(seq, hits, len(tokens))
    bm.allocate(seq, hits, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(seq)
    return seq


def test_freed_cached_blocks_are_reused_lru_and_evicted_on_demand():
    bm = BlockManager(7, 4)
    a = _admit(bm, list(range(8)) + [99])  # 2 full blocks + 1 partial
    b = _admit(bm, list(range(8)) + [50])  # shares a's two full blocks
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.ref_counts[a.block_table[0]] == 2 and bm.problems([a.block_table, b.block_table]) == []
    c = _admit(bm, list(range(100, 109)))  # 2 more cached blocks + 1 partial: every block used
    shared, c_blocks = a.block_table[:2], c.block_table[:2]
    for s in (a, b, c):
        bm.free(s)
    assert bm.num_free == 7 and bm.problems([]) == []
    # Keyless (partial) blocks are handed out first, then cached ones least recently freed first:
    # the shared prefix (freed with b) before c's.
    d = _admit(bm, list(range(200, 220)))  # 5 blocks: 3 keyless + 2 evicted
    assert set(shared) <= set(d.block_table) and not set(c_blocks) & set(d.block_table)
    assert bm.cached_prefix(_seq(list(range(8)) + [1])) == []  # evicted
    e = _seq(list(range(100, 109)))
    assert bm.cached_prefix(e) == c_blocks  # still cached, on the free list
    assert not bm.can_allocate(e, c_blocks, 9)  # reviving both leaves no block for its third
    bm.free(d)
    assert bm.can_allocate(e, c_blocks, 9)
    bm.allocate(e, c_blocks, 9)
    assert e.block_table[:2] == c_blocks and e.num_computed_tokens == 8
    assert bm.num_free == 4 and bm.problems([e.block_table]) == []


def test_a_hit_leaves_the_last_token_to_compute_and_duplicates_stay_keyless():
    bm = BlockManager(8, 4)
    a = _admit(bm, list(range(8)))
    assert bm.cached_prefix(_seq(list(range(8)))) == a.block_table[:1]  # 8 tokens: 7 may hit -> 1 block
    twin = _seq(list(range(8)))
    bm.allocate(twin, [], 8)  # computed at the same time as `a` would be: its own blocks
    twin.num_computed_tokens = 8
    bm.cache_full_blocks(twin)
    assert all(bm.block_keys[b] is None for b in twin.block_table)
    assert bm.problems([a.block_table, twin.block_table]) == []
    bm.free(a)
    bm.free(twin)
    assert bm.problems([]) == [] and bm.num_free == 8


def test_check_invariants_catches_a_shared_block_with_a_wrong_count(checkpoint):
    llm = LLM(checkpoint("phimoe"), max_model_len=64, kv_cache_memory_bytes=1 << 22)
    engine = llm.llm_engine
    for i, p in enumerate(_shared_prefix_prompts(32, [3, 4])):
        engine.add_request(str(i), p, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()
    engine.check_invariants()
    block = engine.scheduler.running[0].block_table[0]
    engine.blocks.ref_counts[block] += 1
    with pytest.raises(AssertionError, match=f"block {block} has reference count"):
        engine.check_invariants()


@pytest.mark.timeout(120)
def test_samples_of_one_request_compute_its_prompt_once(checkpoint):
    """n > 1: samples 1..n-1 wait for sample 0's prompt and start from its cached full blocks (a
    70-token prompt: 4 full blocks of 16 each), with the tokens and logprobs of recomputing; with
    one output token, sample 0 is finished when the others start (its blocks still cached); an
    abort while sample 0 prefills in chunks takes the waiting samples too, leaking nothing."""
    path = checkpoint("phimoe")
    (prompt,) = prompts_of_lengths([70], seed=9)
    kw = dict(max_model_len=128, kv_cache_memory_bytes=1 << 24)
    off = LLM(path, enable_prefix_caching=False, **kw)
    for sp in (
        SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(n=3, temperature=0.8, seed=12, max_tokens=1, ignore_eos=True),
    ):
        on = LLM(path, **kw)  # a fresh cache: the prompt's blocks come from sample 0 only
        (want,) = _run(off, [prompt], sp)
        (got,) = _run(on, [prompt], sp)
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], sp
        for a, b in zip(got.outputs, want.outputs, strict=True):
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert all(abs(lp.logprob - y[t].logprob) < 1e-4 for t, lp in x.items())
        assert on.llm_engine.stats()["prefix_cache_hits"] == (sp.n - 1) * 64, sp
    chunked = LLM(path, max_num_batched_tokens=32, max_num_seqs=8, **kw)
    engine = chunked.llm_engine
    engine.add_request("aborted", prompt, SamplingParams(n=3, max_tokens=4))
    engine.add_request("kept", prompt[:40], SamplingParams(n=2, temperature=0.0, max_tokens=4))
    engine.step()  # sample 0 of "aborted" computes its first chunk; its other samples wait
    assert [s.index for s in engine.scheduler.waiting if s.request_id == "aborted"] == [1, 2]
    engine.abort_request("aborted")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
        engine.check_invariants()
    assert "aborted" not in done and [len(c.token_ids) for c in done["kept"].outputs] == [4, 4]
    assert engine.scheduler.first_samples == {} and engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.timeout(60)
def test_a_poisoned_cached_block_changes_the_output_only_where_it_is_reused(checkpoint):
    """Reuse proven by the cache's contents, not its counters: after a prompt ran, its cached
    blocks' K/V are overwritten with garbage. The same prompt again must read them (its first-token
    logprobs change), a prompt sharing no block must not (it equals the run without caching), and
    a prompt sharing the poisoned blocks must change too."""
    import torch

    path = checkpoint("mixtral")
    kw = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, block_size=4)
    off = LLM(path, enable_prefix_caching=False, **kw)
    on = LLM(path, **kw)
    a, b = prompts_of_lengths([18, 18], seed=21)
    b[0] = (a[0] + 1) % 100  # no shared first block
    shared = a[:16] + b[16:]  # four full blocks of a, then its own
    want = {name: _run(off, [p])[0].outputs[0] for name, p in (("a", a), ("b", b), ("shared", shared))}
    first = _run(on, [a])[0].outputs[0]
    assert first.token_ids == want["a"].token_ids and len(first.token_ids) == GREEDY.max_tokens
    engine = on.llm_engine
    cached = sorted(engine.blocks.cached.values())
    assert len(cached) >= 4, cached
    with torch.no_grad():
        for t in engine.runner.kv:
            t[:, cached] = 50.0  # garbage keys and values in every plane of every layer

    def lp0(out):  # the first generated token's logprob under its own distribution
        return out.logprobs[0][out.token_ids[0]].logprob

    again = _run(on, [a])[0]
    assert again.num_cached_tokens >= 16
    assert lp0(again.outputs[0]) != pytest.approx(lp0(want["a"]), abs=1e-4)  # read the poisoned blocks
    other = _run(on, [b])[0]
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == want["b"].token_ids  # nothing reused: unaffected
    assert lp0(other.outputs[0]) == pytest.approx(lp0(want["b"]), abs=1e-5)
    mixed = _run(on, [shared])[0]
    assert mixed.num_cached_tokens >= 16
    assert lp0(mixed.outputs[0]) != pytest.approx(lp0(want["shared"]), abs=1e-4)
