"""The rank main of the layout-matrix tests (test_chunked_layouts, test_spec_layouts,
test_real_layouts, test_deepseek_v4): on each of the gloo ranks, one external-launcher engine per
(DP, PP, TP, EP, all2all backend) case, each DP replica given its own share of the requests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from expertmesh import LLM

Case = tuple[int, int, int, bool, str]  # (DP, PP, TP, enable_expert_parallel, all2all_backend)


def layout_llm(path: str, case: Case, **engine: Any) -> LLM:
    dp, pp, tp, ep, backend = case
    return LLM(
        path, data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
        enable_expert_parallel=ep, all2all_backend=backend,
        distributed_executor_backend="external_launcher", **engine,
    )  # fmt: skip


def rank_main(
    rank: int,
    world: int,
    path: str,
    cases: list[Case],
    engine: dict,
    share: Callable[[int, int], list[int]],
    run: Callable[[LLM, list[int]], Any],
) -> list[tuple[Case, list[int], Any]]:
    """Per case: (case, the request indices `share(dp_rank, dp_size)` gave this replica, what
    `run(llm, indices)` returned), after checking the engine's KV accounting. `share` and `run` are
    module-level functions of the test (the ranks import them by name)."""
    results = []
    for case in cases:
        llm = layout_llm(path, case, **engine)
        idx = share(llm.llm_engine.vllm_config.parallel_config.data_parallel_rank, case[0])
        out = run(llm, idx)
        llm.llm_engine.check_invariants()
        results.append((case, idx, out))
    return results
