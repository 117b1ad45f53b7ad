"""deterministic=True with preemption and prefix hits: a request preempted (its KV blocks and
recurrent state freed, the sequence computed again later) gives the logprobs it gives when the
cache has room for every request, bit for bit, bf16, top-8 at every one of 32 generated positions.

A cache too small for the batch preempts requests mid-decode; their tokens so far were prefilled
again, and a prefill rounds apart from decode steps: a recurrent layer's (Gated DeltaNet, Mamba2)
convolution sums in another order, an attention layer's prefill path apart from its paged decode;
layers downstream then cache other K/V. The engine recomputes a preempted sequence the way it
first computed it (its prompt in the chunks it was prefilled in, its decoded positions as decode
rows: one at a time in the recurrent layers).

The roomy run is the reference (nothing preempted: asserted); the small cache must preempt
(asserted), so `==` can fail. And a chat's next turn (a prompt holding the previous answer) gives
on the engine that cached the first turn what it gives on a fresh engine: only prompt blocks are
cached in deterministic mode (decoded blocks were computed by decode steps).
"""

from __future__ import annotations

import pytest
from distributed_utils import run_distributed
from test_bitwise_families import BF16, WIDE, engine
from test_bitwise_layouts import ASKED, prompts
from test_bitwise_sweep import _path as sweep_path

from expertmesh import SamplingParams

NEW_TOKENS = 32
REQUESTS = 6
TIGHT = dict(dtype=BF16, max_model_len=128, max_num_seqs=6)
ROOM = 1 << 26  # bytes: room for every request's KV and state
# Bytes that preempt in one process (checked: the test asserts it preempts), per family.
SMALL = {"olmoe": 1 << 21, "granite-4.0-h": 1_800_000, "qwen3.5-moe": 800_000}


def _generate(llm, batch: list[list[int]]) -> list[list[dict[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=ASKED, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs]


def _run(path: str, cache: int, batch: list[list[int]], **kw) -> tuple[list, int]:
    llm = engine(path, kv_cache_memory_bytes=cache, **TIGHT, **kw)
    got = _generate(llm, batch)
    return got, llm.llm_engine.stats()["preemptions"]


def _off(ref: list[list[dict]], got: list[list[dict]]) -> list[str]:
    """Per request: '(request, positions off, largest difference)' where not bit-equal."""
    out = []
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        off = [j for j, (a, b) in enumerate(zip(r, g, strict=True)) if a != b]
        if off:
            worst = max(abs(g[j].get(t, float("-inf")) - v) for j in off for t, v in r[j].items())
            out.append(f"request {i}: {len(off)} positions off from {off[0]}, max |diff| {worst:.3g}")
    return out


def _path(real_checkpoint, family: str) -> str:
    if family == "olmoe":  # attention only (with its whole-projection q/k norm)
        from test_real_families import FAMILIES

        source, overrides = FAMILIES[family]
        return real_checkpoint(source, sizes=WIDE, **overrides)
    return sweep_path(real_checkpoint, family)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family", ["olmoe", "granite-4.0-h", "qwen3.5-moe"])
def test_preempted_requests_bit_equal(family, real_checkpoint):
    """One process, bf16: a cache that preempts gives the roomy cache's logprobs bit for bit."""
    path = _path(real_checkpoint, family)
    batch = prompts(REQUESTS, seed=7)
    ref, none = _run(path, ROOM, batch)
    assert none == 0, "the roomy cache preempted: it is no reference"
    got, preempted = _run(path, SMALL[family], batch)
    assert preempted > 0, "the small cache did not preempt: the test shows nothing"
    bad = _off(ref, got)
    assert not bad, f"{family}, {preempted} preemptions:\n" + "\n".join(bad)


def _simulate(exact: bool, budget: int = 12, num_blocks: int = 9) -> tuple[dict, int]:
    """Three 10-token prompts, 12 tokens each, chunked by a 12-token budget in a cache of 9 blocks
    of 4: the scheduler alone, stepped as the engine steps it. Returns {seq: [(start, end, kind)]}
    (kind: prefill, decode or replay) and the preemptions."""
    from expertmesh.config import SchedulerConfig
    from expertmesh.engine.block_manager import BlockManager
    from expertmesh.engine.scheduler import Scheduler
    from expertmesh.engine.sequence import Sequence

    config = SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=budget)
    sched = Scheduler(config, BlockManager(num_blocks, 4, enable_prefix_caching=False), exact_recompute=exact)
    params = SamplingParams(max_tokens=12)
    seqs = [Sequence(f"r{i}", 0, list(range(1, 11)), params, 64) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    log: dict[int, list] = {i: [] for i in range(3)}
    for _ in range(500):
        if not sched.has_work():
            break
        batch = sched.schedule()
        assert batch, "the scheduler stalled with work left"
        sampled = batch.sampled  # before the update, as the engine takes it
        for seq in batch.seqs:
            start, n = seq.num_computed_tokens, batch.num_new[seq.seq_id]
            kind = (
                "prefill" if seq in batch.prefills else "replay" if seq.seq_id in batch.replays else "decode"
            )
            log[seqs.index(seq)].append((start, start + n, kind))
            seq.num_computed_tokens += n
        for seq in sampled:
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) >= 12:
                seq.finish("length")
                sched.finish(seq)
    assert not sched.has_work()
    return log, sched.num_preemptions


def _attempts(entries: list[tuple]) -> list[list[tuple]]:
    """A sequence's log cut where it starts over (preempted, recomputed from 0)."""
    out: list[list[tuple]] = []
    for e in entries:
        if e[0] == 0:
            out.append([])
        out[-1].append(e)
    return out


def test_recompute_repeats_prompt_chunks_and_replays_decodes():
    """deterministic mode's scheduler: a preempted sequence's recompute cuts its prompt where its
    first computation did and computes its decoded positions as decode rows; without the option
    it prefills them (the test can fail)."""
    log, preempted = _simulate(exact=True)
    assert preempted > 0
    replays = []
    for entries in log.values():
        attempts = _attempts(entries)
        chunks = [[(s, e) for s, e, kind in attempt if kind == "prefill"] for attempt in attempts]
        longest = max(chunks, key=len)  # every attempt cuts the prompt alike, as far as it got
        assert all(c == longest[: len(c)] for c in chunks), attempts
        for attempt in attempts:
            assert all(kind != "prefill" for s, _, kind in attempt if s >= 10), attempt
            replays += [e - s for s, e, kind in attempt if kind == "replay"]
    assert max(replays, default=0) > 1  # several decoded positions recomputed in one step
    plain, preempted = _simulate(exact=False)
    assert preempted > 0
    assert any(kind == "prefill" and e > 10 for entries in plain.values() for _, e, kind in entries)


# (DP, PP, TP, EP, backend, cache bytes a rank that preempts there: asserted): TP4, DP2 x TP2 + EP
WORLD4 = [(1, 1, 4, False, "allgather_reducescatter", 500_000), (2, 1, 2, True, "alltoall", 620_000)]


def _small_cache_rank(rank, world, path, batch):
    out = []
    for dp, pp, tp, ep, backend, cache in WORLD4:
        llm = engine(path, dp, pp, tp, ep, backend, kv_cache_memory_bytes=cache, **TIGHT)
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        mine = list(range(len(batch)))[dp_rank::dp]
        got = _generate(llm, [batch[i] for i in mine])
        out.append((mine, got, llm.llm_engine.stats()["preemptions"], llm.llm_engine.blocks.num_blocks))
        del llm
    return out


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_preempting_layouts_bit_equal_one_roomy_process(real_checkpoint):
    """Granite-4.0-H (Mamba2 + attention): TP4 and DP2 x TP2 + EP with a cache that preempts, on
    every rank, give one process's logprobs (with room for every request) bit for bit. Each rank
    of TP4 affords other blocks than one process, so they preempt at other steps."""
    family = "granite-4.0-h"
    path = _path(real_checkpoint, family)
    batch = prompts(REQUESTS, seed=7)
    ref, none = _run(path, ROOM, batch)
    assert none == 0
    results = run_distributed(_small_cache_rank, 4, path, batch, timeout=450, gloo_timeout=200)
    bad, quiet = [], []
    for rank, per_rank in enumerate(results):
        for layout, (mine, got, preempted, blocks) in zip(WORLD4, per_rank, strict=True):
            print(f"{family} {layout} rank {rank}: {blocks} blocks, {preempted} preemptions")
            quiet += [] if preempted else [f"{layout} rank {rank}"]
            bad += [f"{layout} rank {rank} {line}" for line in _off([ref[i] for i in mine], got)]
    assert not quiet, f"no preemption (the test shows nothing there): {quiet}"
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["olmoe", pytest.param("qwen3.5-moe", marks=pytest.mark.slow)])
def test_next_turn_hits_only_prompt_blocks(family, real_checkpoint):
    """The first turn's prompt + answer + 3 tokens as the next prompt: bit-equal on the engine
    that ran the first turn (a prefix hit) and on a fresh one. Blocks of decoded positions offered
    to the cache made OLMoE 32 of 32 positions off."""
    path = _path(real_checkpoint, family)
    first = prompts(1, seed=7)[0][:20]
    llm = engine(path, kv_cache_memory_bytes=ROOM, **TIGHT)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    answer = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0].token_ids
    turn = first + list(answer) + [5, 6, 7]
    hit = _generate(llm, [turn])
    fresh = _generate(engine(path, kv_cache_memory_bytes=ROOM, **TIGHT), [turn])
    bad = _off(fresh, hit)
    assert not bad, "\n".join(bad)
    assert llm.llm_engine.stats()["prefix_cache_hits"] == 16  # the first prompt's one full block


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3.5-moe", "granite-4.0-h"])
def test_prompt_split_keeps_recurrent_bits(family, real_checkpoint):
    """A 100-token prompt prefilled whole and split by a 7- and a 37-token budget: bit-equal (the
    recurrent layers step a prefill chunk token by token on our kernels)."""
    path = _path(real_checkpoint, family)
    prompt = prompts(1, seed=1)[0] * 4
    prompt = (prompt * (100 // len(prompt) + 1))[:100]
    whole = _generate(engine(path, kv_cache_memory_bytes=ROOM, **TIGHT), [prompt])
    for budget in (7, 37):
        llm = engine(
            path, kv_cache_memory_bytes=ROOM, max_num_batched_tokens=budget, **{**TIGHT, "max_num_seqs": 1}
        )
        bad = _off(whole, _generate(llm, [prompt]))
        assert llm.llm_engine.stats()["steps"] > len(whole[0]) + 1  # the prompt took several steps
        assert not bad, f"split by {budget}: " + "\n".join(bad)
