"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1 (also Kimi-K2, Moonlight: the V3 class).

Both: multi-head latent attention with its latent KV cache (layers/mla.py), RMSNorm, a plain
shared expert of n_shared_experts x moe_intermediate_size, dense leading layers
(first_k_dense_replace) and moe_layer_freq from the config. Routing:
- V2: softmax scores, `topk_method` greedy or group_limited_greedy (n_group, topk_group), the
  weights times routed_scaling_factor (renormalised instead when norm_topk_prob);
- V3: sigmoid scores, e_score_correction_bias for the choice only, groups ranked by their two best
  biased scores, renormalised when norm_topk_prob, times routed_scaling_factor.
RoPE on the rope dims: V2 always in pairs (its complex-number rotation); V3 as `rope_interleave`
says (transformers' default: pairs). V3's multi-token-prediction layer (model.layers.<n>) is
skipped by the loader's named rule. Checkpoints name the shared expert `shared_experts`; expert
tensors load per expert (hub, transformers' save) or fused 3-D (transformers' in-memory layout).
"""

from expertmesh.models.checkpoint import GATE_UP, CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family

NAMES = CheckpointNames(renames=((".mlp.shared_experts.", ".mlp.shared_expert."),), stacked=GATE_UP)


class DeepseekV2ForCausalLM(CausalLM):
    family = Family(
        attention="mla",
        rope_interleaved=True,
        router_by_method=(("greedy", "softmax_greedy"), ("group_limited_greedy", "softmax_group_limited")),
        shared_expert="plain",
        names=NAMES,
    )


class DeepseekV3ForCausalLM(CausalLM):
    family = Family(attention="mla", router="sigmoid_grouped", shared_expert="plain", names=NAMES)


class DeepseekV32ForCausalLM(CausalLM):
    """DeepSeek-V3.2 / V3.2-Exp: V3 with DeepSeek Sparse Attention, a lightning indexer in every
    layer (layers/sparse_indexer.py, from the config's index_n_heads / index_head_dim /
    index_topk) choosing the past tokens each query's MLA attends to; RoPE in pairs for the MLA."""

    family = Family(
        attention="mla", rope_interleaved=True, router="sigmoid_grouped", shared_expert="plain", names=NAMES
    )
