"""Chunked prefill and prefix caching over many ranks: at DP2 x TP2 (naive exchange), with EP and
sequence-parallel MoE (DP2 x TP2 + EP, alltoall), with PP x TP + EP, and a DeepSeek (MLA) at
DP2 x TP2 + EP, a budget of 24 tokens a step gives every rank the tokens of one unchunked process
without prefix caching. DP ranks get uneven loads (long prompts split over many steps on one,
short ones on the other: different token counts every step, lockstep), and each DP replica
keeps its own prefix cache."""

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from layout_cases import rank_main
from test_deepseek import MODELS

from expertmesh import LLM, SamplingParams

PREFIX = prompts_of_lengths([40], seed=11)[0]
TAILS = prompts_of_lengths([3, 60, 1, 9, 25, 5], seed=12)
P = [PREFIX + t for t in TAILS[:3]] + TAILS[3:] + [PREFIX + [4]]
LENS = [6, 3, 9, 4, 7, 5, 3]
ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=24, max_num_seqs=8)
CASES = [(2, 1, 2, False, "naive"), (2, 1, 2, True, "alltoall"), (1, 2, 2, True, "allgather_reducescatter")]


def _by_dp_rank(dp_rank: int, dp_size: int) -> list[int]:
    """DP rank 0: the long shared-prefix prompts; rank 1: the short ones."""
    if dp_size == 1:
        return list(range(len(P)))
    return [0, 1, 2, 6] if dp_rank == 0 else [3, 4, 5]


def _sp(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=LENS[i], ignore_eos=True)


def _run(llm, idx):
    """The first request alone (it fills the prefix cache), then the rest."""
    first = llm.generate(
        [{"prompt_token_ids": P[i]} for i in idx[:1]], [_sp(i) for i in idx[:1]], use_tqdm=False
    )
    rest = llm.generate(
        [{"prompt_token_ids": P[i]} for i in idx[1:]], [_sp(i) for i in idx[1:]], use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in first + rest], llm.llm_engine.stats()["prefix_cache_hits"]


def _reference(path):
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22, enable_chunked_prefill=False,
              enable_prefix_caching=False)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in P], [_sp(i) for i in range(len(P))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _check(path, case_list):
    expected = _reference(path)
    per_ranks = run_distributed(rank_main, 4, path, case_list, ENGINE, _by_dp_rank, _run, timeout=170)
    for rank, per_rank in enumerate(per_ranks):
        for case, idx, (tokens, hits) in per_rank:
            assert tokens == [expected[i] for i in idx], f"rank {rank}, (DP,PP,TP,EP,backend)={case}"
            if 0 in idx:  # the replica that saw the shared 40-token prefix found its 2 full blocks
                assert hits >= 3 * 32, f"rank {rank}, {case}: {hits} prefix-cache hits"
            else:  # its own cache: nothing shared with the other replica's prompts
                assert hits == 0, f"rank {rank}, {case}: {hits} prefix-cache hits"


@pytest.mark.timeout(180)
def test_chunked_prefill_and_prefix_caching_across_layouts(checkpoint):
    _check(checkpoint("phimoe", num_hidden_layers=4), CASES)


@pytest.mark.timeout(180)
def test_deepseek_chunks_at_dp2_tp2_with_ep(real_checkpoint):
    source, sizes = MODELS["v2-lite"]
    _check(real_checkpoint(source, sizes=sizes), [(2, 1, 2, True, "allgather_reducescatter")])
