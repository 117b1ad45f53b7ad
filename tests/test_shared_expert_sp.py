"""Qwen2-MoE under EP + sequence parallel (DP2 TP2): the shared expert runs on the full local
batch, the routed experts on each TP rank's slice. Tokens equal one process on every rank."""

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed

from expertmesh import LLM, SamplingParams

P = prompts_of_lengths([5, 13, 2, 9, 17], seed=41)
N = [6, 3, 9, 4, 5]
SPLIT = [[0, 1, 2], [3, 4]]  # prompts per DP rank: odd token counts make uneven SP slices


def _rank_main(rank, world, path, settings):
    results = []
    for ep, backend in settings:
        llm = LLM(
            path,
            data_parallel_size=2,
            tensor_parallel_size=2,
            enable_expert_parallel=ep,
            all2all_backend=backend,
            distributed_executor_backend="external_launcher",
            max_model_len=64,
            kv_cache_memory_bytes=1 << 21,
            debug_nan_recv_buffers=True,
        )
        plan = llm.model_env.moe_plan
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        idx = SPLIT[dp_rank]
        outs = llm.generate(
            [{"prompt_token_ids": P[i]} for i in idx],
            [SamplingParams(temperature=0, max_tokens=N[i], ignore_eos=True) for i in idx],
            use_tqdm=False,
        )
        results.append((plan.mode, idx, [o.outputs[0].token_ids for o in outs]))
    return results


@pytest.mark.timeout(120)
def test_qwen2_moe_ep_sequence_parallel_equals_one_process(checkpoint):
    path = checkpoint("qwen2_moe")
    ref = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 21).generate(
        [{"prompt_token_ids": p} for p in P],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in N],
        use_tqdm=False,
    )
    expected = [o.outputs[0].token_ids for o in ref]
    settings = [(True, "naive"), (True, "allgather_reducescatter"), (False, "allgather_reducescatter")]
    results = run_distributed(_rank_main, 4, path, settings, timeout=110)
    for rank, per_rank in enumerate(results):
        modes = [mode for mode, _, _ in per_rank]
        assert modes == ["ep_sp", "ep_sp", "dp_tp"]
        for (mode, idx, tokens), (_, backend) in zip(per_rank, settings, strict=True):
            assert tokens == [expected[i] for i in idx], f"rank {rank} {mode} {backend}"
