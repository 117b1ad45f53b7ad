"""The layout matrix: every (DP, PP, TP) x EP x backend valid at world size 4 (and 2) gives, on
every rank, the tokens of the one-process run, with different prompts and uneven DP loads."""

import itertools

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from sweeps import sweep

from expertmesh import LLM, SamplingParams

P = prompts_of_lengths([4, 9, 15, 2, 21, 7, 12, 5], seed=31)
LENS = [3, 12, 5, 3, 8, 3, 6, 4]  # max_tokens per prompt: some finish many steps after others
LAYOUTS_4 = [(4, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 1, 4), (1, 4, 1)]
LAYOUTS_2 = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]


def backends(dp: int, ep: bool) -> list[str]:
    """Backends valid for a layout: token exchange exists only with DP > 1; alltoall needs EP."""
    if dp == 1:
        return ["allgather_reducescatter"]
    return ["naive", "allgather_reducescatter"] + (["alltoall"] if ep else [])


def cases(layouts):
    return [
        (dp, pp, tp, ep, b)
        for (dp, pp, tp), ep in itertools.product(layouts, (False, True))
        for b in backends(dp, ep)
    ]


def prompts_for(dp_rank: int, dp_size: int) -> list[int]:
    """Uneven: DP rank r takes prompts i with i % (dp+1) == r (the last DP rank may get fewer)."""
    idx = [i for i in range(len(P)) if i % (dp_size + 1) == dp_rank]
    if dp_size > 1 and dp_rank == dp_size - 1:
        idx = []  # one DP rank with nothing at all
    return idx


def run_case(path: str, case: tuple, kv_cache_memory_bytes: int = 1 << 21):
    """One layout case on this rank: (the LLM, this DP rank's prompt indices, their outputs)."""
    dp, pp, tp, ep, backend = case
    llm = LLM(
        path,
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        all2all_backend=backend,
        distributed_executor_backend="external_launcher",
        max_model_len=64,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        debug_nan_recv_buffers=True,
    )
    dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
    idx = prompts_for(dp_rank, dp)
    outs = llm.generate(
        [{"prompt_token_ids": P[i]} for i in idx],
        [SamplingParams(temperature=0, max_tokens=LENS[i], ignore_eos=True) for i in idx],
        use_tqdm=False,
    )
    return llm, idx, outs


def _rank_main(rank, world, path, case_list):
    results = []
    for case in case_list:
        _, idx, outs = run_case(path, case)
        results.append((case, idx, [o.outputs[0].token_ids for o in outs]))
    return results


def one_process(path: str, kv_cache_memory_bytes: int = 1 << 21):
    """Every prompt in one process: (the LLM, the token ids of each prompt's output)."""
    llm = LLM(path, max_model_len=64, kv_cache_memory_bytes=kv_cache_memory_bytes)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in P],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in LENS],
        use_tqdm=False,
    )
    return llm, [o.outputs[0].token_ids for o in outs]


def _check(path, world, case_list):
    _, expected = one_process(path)
    results = run_distributed(_rank_main, world, path, case_list, timeout=170 if world <= 4 else 880)
    for rank, per_rank in enumerate(results):
        for case, idx, tokens in per_rank:
            assert tokens == [expected[i] for i in idx], f"rank {rank}, (DP,PP,TP,EP,backend)={case}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", sweep(["mixtral", "phimoe", "qwen3_moe"], ["mixtral"]))
def test_world4_matrix(family, checkpoint):
    _check(checkpoint(family, num_hidden_layers=4), 4, cases(LAYOUTS_4))


@pytest.mark.timeout(120)
def test_world2_matrix_experts_not_divisible_by_ep(checkpoint):
    # 7 experts over EP 2: ranks own 4 and 3.
    _check(checkpoint("mixtral", num_local_experts=7), 2, cases(LAYOUTS_2))


LAYOUTS_8 = [(2, 2, 2), (8, 1, 1), (4, 1, 2), (2, 1, 4), (1, 2, 4), (4, 2, 1), (1, 8, 1)]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["mixtral", "phimoe", "qwen3_moe", "qwen2_moe"])
def test_world8_matrix(family, checkpoint):
    """On demand (pytest -m slow): the world-8 sweep, 8 layers so PP 8 has one each."""
    _check(checkpoint(family, num_hidden_layers=8), 8, cases(LAYOUTS_8))
