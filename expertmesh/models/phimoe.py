"""PhiMoE: LayerNorm with bias, attention and lm_head biases per config, sparsemixer top-2."""

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import LayerNormCausalLM


class PhimoeForCausalLM(LayerNormCausalLM):
    router = "sparsemixer"
    mlp_name = "block_sparse_moe"
    names = CheckpointNames(gate="w1", up="w3", down="w2")
