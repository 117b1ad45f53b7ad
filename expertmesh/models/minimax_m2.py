"""MiniMax-M2 / M2.1 / M2.5 / M2.7 (MiniMaxM2ForCausalLM): q/k RMSNorm over the whole projection
width (qk_norm_type "per_layer"; under TP its squares are summed over the group), partial rotary
(the config's legacy rotary_dim 64 of head_dim 128, NeoX halves), sigmoid routing with a
selection-only e_score_correction_bias in one group, renormalised, no shared expert; experts named
w1 (gate), w3 (up), w2 (down) under block_sparse_moe as Mixtral's. The num_mtp_modules
multi-token-prediction layers after the last decoder layer are skipped by the loader's named rule."""

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class MiniMaxM2ForCausalLM(CausalLM):
    family = Family(
        qk_norm="projection",
        sliding_window=False,
        router="sigmoid_grouped",
        mlp_name="block_sparse_moe",
        names=CheckpointNames(
            gate="w1",
            up="w3",
            down="w2",
            # The hub keeps the correction bias beside the gate, not in it.
            renames=(
                (
                    ".block_sparse_moe.e_score_correction_bias",
                    ".block_sparse_moe.gate.e_score_correction_bias",
                ),
            ),
        ),
    )
