"""Quantized checkpoints held compressed across parallel layouts (issue 14): gpt-oss's MXFP4
experts held as fp4 under TP 2 and EP 2 equal one process; a TP size whose down-projection slice
cuts a 32-block dequantizes those experts at load and still equals one process. GPTQ desc_act held
with per-rank input orders under TP 2 and EP 2, and dequantized where a rank's slice cuts a group."""

import pytest
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from quantized_checkpoints import to_int4_packed, to_mxfp4
from real_checkpoints import Sizes
from test_quantization import _greedy, _held_weights

from expertmesh import LLM
from expertmesh.cpu.expert_forms import PanelStacks, QuantizedStacks
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.quantization.permuted import PermutedInputs

LAYOUTS = [(2, False), (2, True)]  # (TP, expert parallel) over 2 ranks


def _held_count(llm: LLM) -> int:
    held = llm.llm_engine.runner.model.held_weights
    return 0 if held is None else len(held.params)


def _fused_count(llm: LLM) -> int:
    """Expert blocks in one kernel call (gpt-oss's biased, clamped experts: moe_q_ex held, else
    moe_f32_ex / moe_bf16_ex)."""
    modules = llm.llm_engine.runner.model.modules()
    return sum(
        isinstance(m, FusedExperts) and isinstance(m.experts_form, (QuantizedStacks, PanelStacks))
        for m in modules
    )


def _layouts_main(rank, world, paths, prompts, probe):
    """Every checkpoint at every (TP, EP) layout: (checkpoint, TP, EP), probe(llm), greedy tokens."""
    out = []
    for path in paths:
        for tp, ep in LAYOUTS:
            llm = LLM(
                path, tensor_parallel_size=tp, enable_expert_parallel=ep,
                distributed_executor_backend="external_launcher", max_model_len=64,
                kv_cache_memory_bytes=1 << 21,
            )  # fmt: skip
            out.append(((path, tp, ep), probe(llm), _greedy(llm, prompts)))
    return out


def _held_and_fused(llm: LLM) -> tuple[int, int]:
    return _held_count(llm), _fused_count(llm)


def _held_and_permuted(llm: LLM) -> tuple[int, int]:
    modules = llm.llm_engine.runner.model.modules()
    return _held_count(llm), sum(isinstance(w, PermutedInputs) for m in modules for w in _held_weights(m))


@pytest.mark.timeout(120)
def test_mxfp4_tp2_and_ep2_equal_one_process(real_checkpoint, tmp_path):
    """Intermediate 64: TP 2 gives each rank 32 of the down projection's inputs (one whole block),
    held; 96: TP 2 gives each 48, which cuts a block, so TP 2 dequantizes the experts at load (EP
    keeps them whole and held)."""
    paths, expected, held_tp = [], {}, {}
    prompts = prompts_of_lengths([3, 17, 1], seed=6)
    for inter in (64, 96):
        src = real_checkpoint("gpt-oss-20b", sizes=Sizes(layers=2, expert_inter=inter))
        path = to_mxfp4(src, str(tmp_path / f"mxfp4-{inter}"))
        one = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 21)
        assert _held_count(one) == 4 and _fused_count(one) == 2
        paths.append(path)
        expected[path], held_tp[path] = _greedy(one, prompts), inter == 64
    results = run_distributed(_layouts_main, 2, paths, prompts, _held_and_fused, timeout=100)
    for rank, ranks_results in enumerate(results):
        for (path, tp, ep), held, tokens in ranks_results:
            where = f"rank {rank}, {path}, (TP, EP)=({tp}, {ep})"
            # held or dequantized at load (TP cutting a block), the experts run in one call
            assert held == (4 if ep or held_tp[path] else 0, 2), where
            assert tokens == expected[path], where


@pytest.mark.timeout(120)
def test_gptq_desc_act_tp2_and_ep2_equal_one_process(real_checkpoint, tmp_path):
    """desc_act held under TP 2: column-parallel layers take every input (one order); a row-parallel
    layer's rank holds its half of the inputs, sorted within it. Orders over all the inputs
    ("shared") scatter groups over both halves, so o_proj and the experts' down projection (TP 2
    splits its 32 inputs) are dequantized at load; orders within each half ("per-rank") keep every
    rank's groups whole (groups of 8: two in a rank's 16 inputs, scattered) and all is held."""
    src = real_checkpoint("qwen3-30b-a3b", sizes=Sizes(layers=2))
    prompts = prompts_of_lengths([3, 17, 1], seed=6)
    paths, expected = [], {}
    for desc_act in ("shared", "per-rank"):
        path = to_int4_packed(
            src, str(tmp_path / desc_act), str(tmp_path / f"ref-{desc_act}"), "gptq", 8, desc_act
        )
        one = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 21)
        assert _held_count(one) == 8
        paths.append(path)
        expected[path] = _greedy(one, prompts)
    experts = 8  # Sizes' default
    # (TP, EP) -> held parameters, permuted weights a rank; qkv + o per layer, a pair per local expert
    held = {
        (paths[0], 2, False): (2, 2),  # qkv only: o_proj and the experts' w2 cut groups, w13 follows w2
        (paths[0], 2, True): (6, 2 * (1 + experts)),  # qkv, and experts EP 2 whole: 4 a rank
        (paths[1], 2, False): (8, 2 * (2 + 2 * experts)),
        (paths[1], 2, True): (8, 2 * (2 + experts)),
    }
    results = run_distributed(_layouts_main, 2, paths, prompts, _held_and_permuted, timeout=100)
    for rank, ranks_results in enumerate(results):
        for layout, counts, tokens in ranks_results:
            where = f"rank {rank}, {layout}"
            assert counts == held[layout], where
            assert tokens == expected[layout[0]], where
