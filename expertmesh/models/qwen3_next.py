"""Qwen3-Next (Qwen3NextForCausalLM): a hybrid of Gated DeltaNet layers and gated full attention
(three to one, the config's layer_types), RMSNorm scaling by (1 + w) everywhere (q/k norms
included) but the DeltaNet's gated output norm, partial RoPE, softmax top-k routing with a
sigmoid-gated shared expert. Checkpoint: fused in_proj_qkvz / in_proj_ba grouped per key head,
conv1d.weight [channels, 1, K], A_log, dt_bias; the multi-token-prediction weights (`mtp.*`) are
skipped by a named rule (expertmesh decodes one token a step)."""

from dataclasses import replace

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family

MTP_SKIP = ("multi-token prediction layers (mtp.*: not used for one-token decoding)", r"^mtp\.")

QWEN3_NEXT = Family(
    attention="gated_gqa",
    linear_attention="gated_deltanet",
    norm="rms_offset",
    sliding_window=False,
    router="softmax_topk",
    shared_expert="sigmoid_gated",
    names=CheckpointNames(
        renames=((".linear_attn.conv1d.weight", ".linear_attn.conv_weight"),), skip=(MTP_SKIP,)
    ),
)


class Qwen3NextForCausalLM(CausalLM):
    family = QWEN3_NEXT


# Qwen3.5-MoE: the same blocks with the DeltaNet's projections split (in_proj_qkv, in_proj_z,
# in_proj_b, in_proj_a). Its interleaved multimodal rotary sections rotate every section by the
# same position on text-only input, so it is plain partial RoPE here.
QWEN3_5_MOE = replace(QWEN3_NEXT, linear_attention="gated_deltanet_split")


class Qwen3_5MoeForCausalLM(CausalLM):
    family = QWEN3_5_MOE


class Qwen3_5MoeForConditionalGeneration(CausalLM):
    """Only the text model (`model.language_model.`), the vision tower skipped (a named rule)."""

    family = replace(
        QWEN3_5_MOE,
        names=replace(
            QWEN3_5_MOE.names,
            renames=(("model.language_model.", "model."), *QWEN3_5_MOE.names.renames),
            skip=(*QWEN3_5_MOE.names.skip, ("vision tower (expertmesh serves text)", r"^model\.visual\.")),
        ),
    )
