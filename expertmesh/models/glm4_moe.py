"""GLM-4.5 / 4.6 / 4.5-Air (Glm4MoeForCausalLM): partial rotary (the config's 0.5), q/k/v biases
but none on o_proj, per-head q/k norm when use_qk_norm, sigmoid router with a selection-only
e_score_correction_bias (n_group / topk_group groups), routed_scaling_factor, a plain shared
expert, dense leading layers (first_k_dense_replace). The MTP layer after the last decoder layer
is skipped by the loader's named rule."""

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class Glm4MoeForCausalLM(CausalLM):
    family = Family(
        qk_norm="per_head",
        o_proj_bias=False,
        sliding_window=False,
        router="sigmoid_grouped",
        shared_expert="plain",
        names=CheckpointNames(renames=((".mlp.shared_experts.", ".mlp.shared_expert."),)),
    )
