"""Speculative decoding in every layout: DP replicas verify different numbers of draft tokens each
step (lockstep agrees on the token counts, as for chunked prefill), TP ranks and PP stages take the
accepted tokens from the sampling rank; greedy output on every rank equals one process without
speculation, and every rank of a replica counts the same drafts.

MTP cells (DeepSeek-V3's MTP layer, k = 2; slow: GLM-4.5, Qwen3.5, LongCat-Flash, DeepSeek-V4):
the layer runs on the last pipeline stage, its MoE block dispatches over the EP group, DP replicas
run their MTP forwards in lockstep (a replica with fewer drafts runs dummies); every draft token of
every request equals the one-process MTP draft.

Hybrid cells (Qwen3.5-MoE, the same three layouts: Gated DeltaNet layers split over TP): drafts of
known acceptance lengths (test_spec_decode.KnownDrafts), the recurrent state rolled back on every
rank that holds a share of it."""

import functools

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from layout_cases import rank_main
from real_checkpoints import Sizes
from test_deepseek import MODELS
from test_hybrid_families import _source
from test_spec_decode import known_drafts

from expertmesh import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}  # fmt: skip
MTP = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}
COPY = [(r * 3)[: 2 * len(r) + 2] for r in prompts_of_lengths([5, 9, 4], seed=51)]  # drafts at once
PLAIN = prompts_of_lengths([6, 13, 3], seed=52)  # drafts only once the output repeats
P = COPY + PLAIN
LENS = [20, 14, 25, 9, 18, 12]
ENGINE = dict(max_model_len=96, kv_cache_memory_bytes=1 << 21, warmup=False)
CASES = [(2, 1, 2, False, "naive"), (2, 1, 2, True, "alltoall"), (1, 2, 2, True, "allgather_reducescatter")]
SLOW_CASES = [(4, 1, 1, True, "alltoall"), (1, 4, 1, False, "allgather_reducescatter"),
              (1, 1, 4, False, "allgather_reducescatter"), (2, 2, 1, True, "naive")]  # fmt: skip
V3 = Sizes(layers=5, experts=32, max_top_k=8)  # test_spec_mtp's DeepSeek-V3, MTP layer included


def _by_dp_rank(dp_rank: int, dp_size: int) -> list[int]:
    """Uneven: replica 0 the copy-heavy prompts and one plain, the others the rest (or nothing)."""
    if dp_size == 1:
        return list(range(len(P)))
    return [0, 1, 2, 3] if dp_rank == 0 else ([4, 5] if dp_rank == 1 else [])


def _sp(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=LENS[i], ignore_eos=True)


def record_drafts(llm: LLM) -> dict[tuple, list[list[int]]]:
    """{prompt: the MTP drafts its sequence got, step by step}, filled as `llm` generates."""
    mtp, seen = llm.llm_engine.drafter.mtp, {}
    run = mtp.run

    def recording(planned):
        drafts = run(planned)
        for (seq, _), draft in zip(planned, drafts, strict=True):
            seen.setdefault(tuple(seq.prompt_token_ids), []).append(list(draft))
        return drafts

    mtp.run = recording
    return seen


def _run(llm: LLM, idx: list[int]):
    drafts = record_drafts(llm) if llm.llm_engine.drafter.mtp is not None else None
    outs = llm.generate([{"prompt_token_ids": P[i]} for i in idx], [_sp(i) for i in idx], use_tqdm=False)
    stats = {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("spec_decode")}
    return [o.outputs[0].token_ids for o in outs], stats, drafts


def _run_known(expected: list[list[int]], llm: LLM, idx: list[int]):
    """_run with drafts of known acceptance lengths (every rank of a replica drafts alike) made
    from the one-process outputs `expected` (bound by _check: the ranks get it pickled)."""
    known_drafts(llm, P, expected)
    return _run(llm, idx)


def _check(
    path: str, case_list: list, spec: dict, run=_run, known: bool = False, base: dict = ENGINE
) -> None:
    """`known`: `run` (_run_known) takes the one-process outputs first. `base`: the engine
    arguments of every run."""
    ref = LLM(path, **base)
    outs = ref.generate([{"prompt_token_ids": p} for p in P], [_sp(i) for i in range(len(P))], use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in expected] == LENS
    if known:
        run = functools.partial(run, [list(t) for t in expected])
    ref_drafts = None
    if spec["method"] == "mtp":  # one process's MTP drafts, request by request
        ref_drafts = _run(LLM(path, **base, speculative_config=spec), list(range(len(P))))[2]
        assert all(ref_drafts[tuple(p)] for p in P), ref_drafts
    engine = dict(base, speculative_config=spec, debug_nan_recv_buffers=True)
    per_rank = run_distributed(rank_main, 4, path, case_list, engine, _by_dp_rank, run, timeout=240)
    for c, case in enumerate(case_list):
        dp, pp, tp = case[:3]
        for rank, results in enumerate(per_rank):
            got_case, idx, (tokens, stats, drafts) = results[c]
            assert got_case == case
            assert len(tokens) == len(idx)
            assert tokens == [expected[i] for i in idx], f"rank {rank}, (DP,PP,TP,EP,backend)={case}"
            if ref_drafts is not None:
                for i in idx:
                    assert drafts[tuple(P[i])] == ref_drafts[tuple(P[i])], f"rank {rank}, {case}, request {i}"
            if 0 in idx and spec["method"] == "ngram":  # the copy-heavy replica drafted, some failed
                assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
            if idx:
                assert stats["spec_decode_num_drafts"] > 0, (rank, case, stats)
            replica = rank // (pp * tp)  # ranks of one replica are consecutive (dp outermost)
            first = per_rank[replica * pp * tp][c][2][1]
            assert stats == first, f"rank {rank} of replica {replica} counted other drafts: {case}"


@pytest.mark.timeout(300)
def test_greedy_speculation_equals_one_process_across_layouts(checkpoint):
    _check(checkpoint("mixtral", num_hidden_layers=4), CASES, NGRAM)


@pytest.mark.timeout(300)
def test_hybrid_speculation_equals_one_process_across_layouts(real_checkpoint):
    """Qwen3.5-MoE in DP2 x TP2 (naive: replicas verify different drafts), DP2 x TP2 + EP
    (alltoall) and PP2 x TP2 + EP (allgather_reducescatter)."""
    _check(real_checkpoint(_source("qwen3.5-moe")), CASES, NGRAM, _run_known, known=True)


@pytest.mark.timeout(300)
def test_mtp_drafts_and_tokens_equal_one_process_across_layouts(real_checkpoint):
    """DP2 x TP2 (naive), DP2 x TP2 + EP (alltoall), PP2 x TP2 + EP (allgather_reducescatter)."""
    _check(real_checkpoint("deepseek-v3", sizes=V3), CASES, MTP)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_more_layouts_and_mla(checkpoint, real_checkpoint):
    _check(checkpoint("qwen2_moe", num_hidden_layers=4), SLOW_CASES, NGRAM)
    source, sizes = MODELS["v2-lite"]
    _check(real_checkpoint(source, sizes=sizes), [(2, 1, 2, True, "alltoall")], NGRAM)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_mtp_more_layouts(real_checkpoint):
    """DP4 + EP, PP4, TP4, DP2 x PP2 + EP; GLM-4.5-Air's MTP layer at DP2 x TP2 + EP."""
    _check(real_checkpoint("deepseek-v3", sizes=V3), SLOW_CASES, MTP)
    _check(real_checkpoint("glm-4.5-air"), [(2, 1, 2, True, "alltoall")], MTP)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_qwen_mtp_across_layouts(real_checkpoint, tmp_path):
    """Qwen3.5-MoE's MTP layer (mtp.*: the target's lm_head; on the last PP stage it loads the
    target's embedding) at DP2 x TP2, DP2 x TP2 + EP and PP2 x TP2 + EP: tokens and every draft
    equal one process. A cache that holds every request at once in every layout (8 state slots,
    the rest KV blocks): drafts are compared step by step, and a draft is cut to the free blocks,
    so a layout whose ranks afford more blocks would draft otherwise."""
    from test_spec_mtp import with_qwen_mtp

    path = with_qwen_mtp(real_checkpoint(_source("qwen3.5-moe")), str(tmp_path / "qwen3.5-mtp"))
    _check(path, CASES, MTP, base=dict(ENGINE, kv_cache_memory_bytes=1 << 23, max_num_seqs=8))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["longcat-flash", "deepseek-v4"])
def test_2026_mtp_across_layouts(real_checkpoint, tmp_path, family):
    """LongCat-Flash's MTP layer (model.mtp.*: its own embedding, the target's lm_head) and
    DeepSeek-V4's (mtp.0.*: over the target's hc streams; on the last PP stage it loads the target's
    embedding) at DP2 x TP2 + EP (alltoall) and PP2 x TP2 + EP: tokens and every draft equal one
    process (the cache holds every request at once, as in test_qwen_mtp_across_layouts)."""
    from test_spec_mtp_2026 import _longcat_path, _v4_path

    path = (_longcat_path if family == "longcat-flash" else _v4_path)(real_checkpoint, tmp_path)
    cases = [(2, 1, 2, True, "alltoall"), (1, 2, 2, True, "allgather_reducescatter")]
    _check(path, cases, MTP, base=dict(ENGINE, kv_cache_memory_bytes=1 << 23, max_num_seqs=8))
