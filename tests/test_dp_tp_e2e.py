"""Data x tensor parallel under an external launcher (gloo ranks): every rank's tokens equal the
one-process run of its own prompts, for each all2all backend, with uneven and empty DP loads."""

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from expect import assert_within
from sweeps import sweep

from expertmesh import LLM, SamplingParams

P = prompts_of_lengths([4, 9, 15, 2, 21, 7, 12], seed=21)
SHORT = dict(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = dict(temperature=0.0, max_tokens=28, ignore_eos=True)
# Per DP rank: (prompts, max_tokens per prompt). Rank 1 of the first load has nothing at all;
# in the second, one rank finishes many steps after the other, and both share a prompt.
LOADS = {
    "one_rank_idle": [[(P[0], SHORT), (P[1], LONG), (P[2], SHORT), (P[3], SHORT)], []],
    "uneven": [[(P[4], LONG)], [(P[4], SHORT), (P[5], SHORT), (P[6], SHORT), (P[1], SHORT)]],
}


def _engine(path, dp, tp, backend):
    return LLM(
        path,
        tensor_parallel_size=tp,
        data_parallel_size=dp,
        all2all_backend=backend,
        distributed_executor_backend="external_launcher",
        max_model_len=128,
        kv_cache_memory_bytes=1 << 22,
        debug_nan_recv_buffers=True,
    )


def _rank_main(rank, world, path, layouts):
    results = []
    for dp, tp, backend in layouts:
        llm = _engine(path, dp, tp, backend)
        pc = llm.llm_engine.vllm_config.parallel_config
        for name, load in LOADS.items():
            mine = load[pc.data_parallel_rank] if dp > 1 else load[0] + load[1]
            outs = llm.generate(
                [{"prompt_token_ids": p} for p, _ in mine],
                [SamplingParams(**sp) for _, sp in mine],
                use_tqdm=False,
            )
            results.append(
                ((dp, tp, backend, name), pc.data_parallel_rank, [o.outputs[0].token_ids for o in outs])
            )
        assert llm.llm_engine.blocks.num_free == llm.llm_engine.blocks.num_blocks
    return results


def _reference(path):
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    cache = {}
    for load in LOADS.values():
        for p, sp in load[0] + load[1]:
            key = (tuple(p), sp["max_tokens"])
            if key not in cache:
                out = llm.generate({"prompt_token_ids": p}, SamplingParams(**sp), use_tqdm=False)[0]
                cache[key] = out.outputs[0].token_ids
    return cache


def _check(results, reference, dp_size_of):
    for per_rank in results:
        for layout, dp_rank, tokens in per_rank:
            dp, tp, backend, name = layout
            load = LOADS[name]
            mine = load[dp_rank] if dp > 1 else load[0] + load[1]
            expected = [reference[(tuple(p), sp["max_tokens"])] for p, sp in mine]
            assert tokens == expected, (
                f"layout DP{dp} TP{tp} {backend} load {name}: DP rank {dp_rank} differs"
            )


@pytest.mark.timeout(150)
@pytest.mark.parametrize("family", ["phimoe", "mixtral"])
def test_tp2_and_dp2_on_two_ranks(family, checkpoint):
    path = checkpoint(family)
    layouts = [(1, 2, "allgather_reducescatter"), (2, 1, "naive"), (2, 1, "allgather_reducescatter")]
    results = run_distributed(_rank_main, 2, path, layouts, timeout=140)
    _check(results, _reference(path), None)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("family", sweep(["phimoe", "mixtral"], ["mixtral"]))
def test_dp2_tp2_on_four_ranks(family, checkpoint):
    path = checkpoint(family)
    layouts = [(2, 2, "naive"), (2, 2, "allgather_reducescatter")]
    results = run_distributed(_rank_main, 4, path, layouts, timeout=140)
    _check(results, _reference(path), None)
    # The same prompt on both DP ranks gives the same tokens on both ("uneven" shares P[4]).
    by_rank = {(r[0], r[1]): r[2] for per in results for r in per}
    for backend in ("naive", "allgather_reducescatter"):
        a = by_rank[((2, 2, backend, "uneven"), 0)][0]
        b = by_rank[((2, 2, backend, "uneven"), 1)][0]
        assert a[:4] == b


def _one_rank_fails(rank, world, path):
    llm = _engine(path, 2, 1, "allgather_reducescatter")
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    # Rank 0 would wait for rank 1 in the lockstep forever without the harness' failure handling.
    llm.generate([{"prompt_token_ids": P[0]}], SamplingParams(**LONG), use_tqdm=False)


@pytest.mark.time_bound
@pytest.mark.timeout(60)
def test_a_failing_rank_fails_the_run_quickly(checkpoint):
    import time

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose"):
        run_distributed(_one_rank_fails, 2, checkpoint("mixtral"), timeout=50)
    assert_within(time.monotonic() - start, 45, "the failing rank's report")  # not the harness' 50 s timeout


def _mismatched_configs(rank, world, path):
    # Rank 1 was started with another max_model_len: start-up must say so instead of hanging later.
    LLM(
        path,
        tensor_parallel_size=2,
        distributed_executor_backend="external_launcher",
        max_model_len=128 if rank == 0 else 64,
        kv_cache_memory_bytes=1 << 22,
    )


@pytest.mark.timeout(60)
def test_ranks_with_different_configs_fail_naming_the_rank(checkpoint):
    # The rank, and the setting that differs with both values (it used to name only the rank).
    with pytest.raises(
        RuntimeError, match=r"rank 1 differs from rank 0 in max_model_len \(rank 0: 128, rank 1: 64\)"
    ):
        run_distributed(_mismatched_configs, 2, checkpoint("mixtral"), timeout=50)


def _wrong_world(rank, world, path):
    LLM(path, tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="external_launcher")


@pytest.mark.timeout(60)
def test_world_size_mismatch_names_all_four_numbers(checkpoint):
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2.*DP=2.*PP=1.*TP=2"):
        run_distributed(_wrong_world, 2, checkpoint("mixtral"), timeout=50)
