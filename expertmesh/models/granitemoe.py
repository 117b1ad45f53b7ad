"""Granite-MoE and Granite-MoE with a shared expert: embedding, attention (replacing
1/sqrt(head_dim)) and residual multipliers and logits scaling from the config, tied embeddings,
softmax over the top-k router logits, experts stored fused (input_linear [E, 2I, H] with the gate
first, output_linear), the shared MLP likewise fused (its input_linear [2I, H])."""

from dataclasses import replace

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family

_MOE = ".block_sparse_moe."
GRANITE = Family(
    router="topk_softmax",
    sliding_window=False,
    shared_expert="plain",  # only where the config gives it a width (shared_intermediate_size)
    mlp_name="block_sparse_moe",
    names=CheckpointNames(
        renames=(
            (_MOE + "input_linear.weight", _MOE + "experts.gate_up_proj"),
            (_MOE + "output_linear.weight", _MOE + "experts.down_proj"),
            (_MOE + "router.layer.", _MOE + "gate."),
            (".shared_mlp.input_linear.", _MOE + "shared_expert.gate_up_proj."),
            (".shared_mlp.output_linear.", _MOE + "shared_expert.down_proj."),
        )
    ),
)


class GraniteMoeForCausalLM(CausalLM):
    family = GRANITE


class GraniteMoeSharedForCausalLM(CausalLM):
    family = GRANITE


# The Mamba2 mixer lives where every recurrent mixer does (`linear_attn`), its conv as two tensors.
MAMBA_RENAMES = (
    (".mamba.conv1d.weight", ".linear_attn.conv_weight"),
    (".mamba.conv1d.bias", ".linear_attn.conv_bias"),
    (".mamba.", ".linear_attn."),
)


class GraniteMoeHybridForCausalLM(CausalLM):
    """Granite-4.0-H: Granite-MoE's blocks with Mamba2 mixers on the config's "mamba" layers and
    attention without positional encoding (`position_embedding_type: nope`) on the others; every
    layer with its MoE and the always-on shared MLP."""

    family = replace(
        GRANITE,
        linear_attention="mamba2",
        names=replace(GRANITE.names, renames=(*GRANITE.names.renames, *MAMBA_RENAMES)),
    )
