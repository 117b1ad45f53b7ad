"""PhiMoE (Phi-mini-MoE, Phi-3.5-MoE): LayerNorm with bias, attention and lm_head biases per
config, sparsemixer top-2, experts named like Mixtral's; LongRoPE comes from the config."""

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class PhimoeForCausalLM(CausalLM):
    family = Family(
        norm="layer",
        router="sparsemixer",
        mlp_name="block_sparse_moe",
        names=CheckpointNames(gate="w1", up="w3", down="w2"),
    )
