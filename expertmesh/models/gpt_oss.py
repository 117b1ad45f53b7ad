"""GPT-OSS (gpt-oss-20b/120b): attention sinks, alternating sliding/full layers (layer_types),
biases on q/k/v/o, a router with bias and softmax over the selected logits, experts with biases
and interleaved gate/up columns ([E, H, 2I] stored), clamped SwiGLU; YaRN from the config."""

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.models.decoder import CausalLM
from expertmesh.models.family import Family


class GptOssForCausalLM(CausalLM):
    family = Family(
        attention_sinks=True,
        router="topk_softmax",
        router_bias=True,
        expert_activation="swiglu_clamped",
        expert_bias=True,
        names=CheckpointNames(
            fused_experts="transposed_interleaved", renames=((".mlp.router.", ".mlp.gate."),)
        ),
    )
