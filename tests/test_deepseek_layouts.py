"""DeepSeek under the layouts it is served with: TP splitting the heads (every TP rank keeping the
whole latent cache), and the DeepSeek deployment layout, data_parallel_size=N with
enable_expert_parallel (attention per DP rank, experts over all ranks), at world 2 and 4 with every
valid backend; 64 routed experts over 4 EP ranks and counts that do not divide the EP size; one DP
rank idle (test_layout_matrix.prompts_for). Every rank's tokens equal one process."""

import pytest
from distributed_utils import run_distributed
from real_checkpoints import Sizes, deepseek_v2
from test_layout_matrix import backends, one_process, run_case

LITE = "deepseek-v2-lite"  # 64 experts top-6, 2 shared, first layer dense


def _rank_main(rank, world, path, case_list):
    results = []
    for case in case_list:
        llm, idx, outs = run_case(path, case, kv_cache_memory_bytes=1 << 20)
        runner = llm.llm_engine.runner
        moe = next(layer.mlp for layer in runner.model.model.layers.values() if layer.is_moe)
        placement = (
            len(moe.experts.expert_ids),
            sum(moe.shared_expert.gate_up_proj.output_sizes) // moe.shared_expert.gate_up_proj.tp_size,
            [layer.kv_spec.values_per_token for layer in runner.attn_layers],
        )
        results.append((case, idx, [o.outputs[0].token_ids for o in outs], placement))
    return results


def _check(path, world, case_list, timeout):
    llm, expected = one_process(path, kv_cache_memory_bytes=1 << 20)
    cfg = llm.llm_engine.config.model_config
    shared = 2 * cfg.shared_expert_intermediate_size  # gate and up rows of the whole shared expert
    latent = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    results = run_distributed(_rank_main, world, path, case_list, timeout=timeout)
    for rank, per_rank in enumerate(results):
        for case, idx, tokens, (experts, shared_rows, cache_rows) in per_rank:
            dp, pp, tp, ep, _ = case
            assert tokens == [expected[i] for i in idx], f"rank {rank}, (DP,PP,TP,EP,backend)={case}"
            # The shared expert is a dense MLP under plain TP: never split by EP, whole per TP group.
            assert shared_rows == shared // tp, case
            owners = dp * tp if ep else 1  # EP: whole experts over every rank of the stage
            base, extra = divmod(cfg.num_experts, owners)
            assert experts in (base, base + (1 if extra else 0)), case
            # Every TP rank keeps the whole latent row of every token.
            assert set(cache_rows) == {latent}, case


def _cases(layouts, ep_values=(True, False)):
    return [(dp, pp, tp, ep, b) for dp, pp, tp in layouts for ep in ep_values for b in backends(dp, ep)]


@pytest.mark.timeout(240)
def test_world4_v2_lite_64_experts_over_4_ep_ranks(real_checkpoint):
    """DP4 + EP (16 experts a rank), DP2 x TP2 + EP (EP with sequence parallel), TP4 (one head a
    rank), DP4 without EP, PP2 x TP2; every valid backend."""
    path = real_checkpoint(LITE, sizes=Sizes(experts=64, max_top_k=6))
    cases = _cases([(4, 1, 1), (2, 1, 2)]) + _cases([(1, 1, 4), (1, 2, 2)])
    _check(path, 4, cases, timeout=230)


@pytest.mark.timeout(150)
def test_world4_expert_counts_not_dividing_ep_and_v3_groups(real_checkpoint):
    """62 experts over 4 EP ranks (16, 16, 15, 15) under DP4 + EP; every backend."""
    uneven = real_checkpoint(LITE, sizes=Sizes(experts=62, max_top_k=6))
    _check(uneven, 4, _cases([(4, 1, 1)], (True,)), timeout=140)


@pytest.mark.timeout(150)
def test_world4_v3_dp_ep(real_checkpoint):
    """V3's grouped sigmoid routing with the correction bias, q LoRA, 3 dense layers and the MTP
    layer skipped, under DP4 + EP and DP2 x TP2 + EP; every backend."""
    v3 = real_checkpoint("deepseek-v3", sizes=Sizes(layers=5, experts=32, max_top_k=8))
    _check(v3, 4, _cases([(4, 1, 1), (2, 1, 2)], (True,)), timeout=140)


@pytest.mark.timeout(150)
def test_world2_dp_ep_tp_and_uneven_experts(real_checkpoint):
    """The V2 shape (q LoRA, group_limited_greedy): DP2 + EP with every backend, DP2 without EP, TP2
    with and without EP; then 63 experts (the V2-Lite shape) over EP 2, 32 and 31."""
    path = real_checkpoint(deepseek_v2(), sizes=Sizes(experts=32, max_top_k=6))
    _check(path, 2, _cases([(2, 1, 1), (1, 1, 2)]), timeout=100)
    uneven = real_checkpoint(LITE, sizes=Sizes(experts=63, max_top_k=6))
    _check(uneven, 2, _cases([(2, 1, 1)], (True,)), timeout=60)
