"""Mixtral: RMSNorm, softmax top-k renormalised, experts named w1 (gate), w3 (up), w2 (down)."""

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class MixtralForCausalLM(CausalLM):
    family = Family(
        router="softmax_topk",
        mlp_name="block_sparse_moe",
        names=CheckpointNames(gate="w1", up="w3", down="w2"),
    )
