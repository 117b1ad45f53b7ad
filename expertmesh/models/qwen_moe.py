"""Qwen2-MoE (shared expert with a sigmoid gate, qkv bias) and Qwen3-MoE (per-head q/k RMSNorm).

Both route with softmax top-k, renormalised when the config's norm_topk_prob says so; sizes,
biases, sliding windows and rope scaling (Qwen3's YaRN) come from the config.
"""

from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class Qwen2MoeForCausalLM(CausalLM):
    family = Family(router="softmax_topk", shared_expert="sigmoid_gated")


class Qwen3MoeForCausalLM(CausalLM):
    family = Family(router="softmax_topk", qk_norm="per_head")
