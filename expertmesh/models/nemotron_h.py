"""Nemotron-H (NVIDIA-Nemotron-3-Nano-30B-A3B; NemotronHForCausalLM): one block a layer, its kind
from the config's hybrid_override_pattern (M: Mamba2, E: MoE, *: attention without positional
encoding, -: dense MLP), each behind an RMSNorm (weight product in float32) with a residual.
Experts, shared expert and MLP layers are ungated: down(relu^2(up(x))). Routing is DeepSeek-V3's
(sigmoid scores, a selection-only correction bias, groups, renormalised top-k times
routed_scaling_factor). Checkpoint: `backbone.` names, `embeddings`, `norm_f`, every block at
`mixer`, per-expert tensors, the Mamba conv as conv1d [channels, 1, K]; the multi-token-prediction
weights (`mtp.*`), where a checkpoint ships them, skipped by a named rule."""

from expertmesh.models.checkpoint import STACKED, CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family

NEMOTRON_H = Family(
    layer="block",
    linear_attention="mamba2",
    norm="rms_float32",
    rope=False,
    sliding_window=False,
    router="sigmoid_grouped",
    expert_activation="ungated",
    shared_expert="ungated",
    dense_mlp="ungated",
    names=CheckpointNames(
        renames=(
            ("backbone.embeddings.", "model.embed_tokens."),
            ("backbone.norm_f.", "model.norm."),
            ("backbone.", "model."),
            (".mixer.conv1d.weight", ".mixer.conv_weight"),
            (".mixer.conv1d.bias", ".mixer.conv_bias"),
            (".mixer.shared_experts.", ".mixer.shared_expert."),
        ),
        skip=(("multi-token prediction layers (mtp.*: not used for one-token decoding)", r"^mtp\."),),
        stacked=STACKED[:3],  # q/k/v fused; up_proj stays its own (there is no gate to fuse it with)
    ),
)


class NemotronHForCausalLM(CausalLM):
    family = NEMOTRON_H
