"""Llama 4 text (Llama4ForCausalLM) and the text tower of Llama4ForConditionalGeneration
checkpoints: top-1 sigmoid router whose score scales the expert input, a shared expert as wide
as a routed one, dense layers where moe_layers / interleave_moe_layer_step say, NoPE layers
(no_rope_layers) with global attention and temperature tuning, chunked local attention on the
RoPE layers (layer_types), weightless L2 q/k norm after RoPE, GPT-J-pair RoPE with llama3 scaling
from the config; experts stored fused [E, H, 2I] and [E, I, H]."""

from dataclasses import replace

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family

LLAMA4 = Family(
    qk_norm="l2",
    rope_interleaved=True,
    router="topk_sigmoid",
    router_weights_input=True,
    shared_expert="plain",
    shared_expert_width="routed",
    mlp_name="feed_forward",
    names=CheckpointNames(
        fused_experts="transposed", renames=((".feed_forward.router.", ".feed_forward.gate."),)
    ),
)


class Llama4ForCausalLM(CausalLM):
    family = LLAMA4


class Llama4ForConditionalGeneration(CausalLM):
    """Only the text tower: `language_model.` stripped, the vision tower skipped (a named rule)."""

    family = replace(
        LLAMA4,
        names=replace(
            LLAMA4.names,
            prefix="language_model.",
            skip=(
                (
                    "vision tower and projector (expertmesh serves text)",
                    r"^(vision_model|multi_modal_projector)\.",
                ),
            ),
        ),
    )
