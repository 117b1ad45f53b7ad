"""Speculative decoding in every layout: DP replicas verify different numbers of draft tokens each
step (lockstep agrees on the token counts, as for chunked prefill), TP ranks and PP stages take the
accepted tokens from the sampling rank; greedy output on every rank equals one process without
speculation, and every rank of a replica counts the same drafts."""

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from test_deepseek import MODELS

from expertmesh import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": 64}  # fmt: skip
COPY = [(r * 3)[: 2 * len(r) + 2] for r in prompts_of_lengths([5, 9, 4], seed=51)]  # drafts at once
PLAIN = prompts_of_lengths([6, 13, 3], seed=52)  # drafts only once the output repeats
P = COPY + PLAIN
LENS = [20, 14, 25, 9, 18, 12]
ENGINE = dict(max_model_len=96, kv_cache_memory_bytes=1 << 21, warmup=False)
CASES = [(2, 1, 2, False, "naive"), (2, 1, 2, True, "alltoall"), (1, 2, 2, True, "allgather_reducescatter")]
SLOW_CASES = [(4, 1, 1, True, "alltoall"), (1, 4, 1, False, "allgather_reducescatter"),
              (1, 1, 4, False, "allgather_reducescatter"), (2, 2, 1, True, "naive")]  # fmt: skip


def _by_dp_rank(dp_rank: int, dp_size: int) -> list[int]:
    """Uneven: replica 0 the copy-heavy prompts and one plain, the others the rest (or nothing)."""
    if dp_size == 1:
        return list(range(len(P)))
    return [0, 1, 2, 3] if dp_rank == 0 else ([4, 5] if dp_rank == 1 else [])


def _sp(i: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=LENS[i], ignore_eos=True)


def _rank_main(rank, world, path, case_list):
    results = []
    for dp, pp, tp, ep, backend in case_list:
        llm = LLM(
            path, data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
            enable_expert_parallel=ep, all2all_backend=backend,
            distributed_executor_backend="external_launcher", speculative_config=NGRAM,
            debug_nan_recv_buffers=True, **ENGINE,
        )  # fmt: skip
        engine = llm.llm_engine
        idx = _by_dp_rank(engine.vllm_config.parallel_config.data_parallel_rank, dp)
        outs = llm.generate([{"prompt_token_ids": P[i]} for i in idx], [_sp(i) for i in idx], use_tqdm=False)
        engine.check_invariants()
        stats = {k: v for k, v in engine.stats().items() if k.startswith("spec_decode")}
        results.append(((dp, pp, tp, ep, backend), idx, [o.outputs[0].token_ids for o in outs], stats))
    return results


def _check(path: str, case_list: list) -> None:
    ref = LLM(path, **ENGINE)
    outs = ref.generate([{"prompt_token_ids": p} for p in P], [_sp(i) for i in range(len(P))], use_tqdm=False)
    expected = [o.outputs[0].token_ids for o in outs]
    assert [len(t) for t in expected] == LENS
    per_rank = run_distributed(_rank_main, 4, path, case_list, timeout=240)
    for c, case in enumerate(case_list):
        dp, pp, tp = case[:3]
        for rank, results in enumerate(per_rank):
            got_case, idx, tokens, stats = results[c]
            assert got_case == case
            assert len(tokens) == len(idx)
            assert tokens == [expected[i] for i in idx], f"rank {rank}, (DP,PP,TP,EP,backend)={case}"
            if 0 in idx:  # the replica with the copy-heavy prompts drafted, and some drafts failed
                assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
            replica = rank // (pp * tp)  # ranks of one replica are consecutive (dp outermost)
            first = per_rank[replica * pp * tp][c][3]
            assert stats == first, f"rank {rank} of replica {replica} counted other drafts: {case}"


@pytest.mark.timeout(300)
def test_greedy_speculation_equals_one_process_across_layouts(checkpoint):
    _check(checkpoint("mixtral", num_hidden_layers=4), CASES)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_more_layouts_and_mla(checkpoint, real_checkpoint):
    _check(checkpoint("qwen2_moe", num_hidden_layers=4), SLOW_CASES)
    source, sizes = MODELS["v2-lite"]
    _check(real_checkpoint(source, sizes=sizes), [(2, 1, 2, True, "alltoall")])
