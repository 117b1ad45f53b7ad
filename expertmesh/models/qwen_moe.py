"""Qwen2-MoE (shared expert with a sigmoid gate, qkv bias) and Qwen3-MoE (q/k RMSNorm).

Both route with softmax top-k, renormalised when the config's norm_topk_prob says so; the
differences live in ModelConfig (shared expert size, qk_norm, biases).
"""

from expertmesh.models.decoder import CausalLM


class Qwen2MoeForCausalLM(CausalLM):
    router = "softmax_topk"


class Qwen3MoeForCausalLM(CausalLM):
    router = "softmax_topk"
