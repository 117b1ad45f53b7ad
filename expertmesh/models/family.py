"""What a family declares: which shared building blocks it uses, each chosen by its registry name.

The published config.json decides the rest (ModelConfig): sizes, biases, windows, rope block,
multipliers. A family is a class attribute `family = Family(...)` on a CausalLM subclass, plus
its checkpoint names; no layer asks which architecture it serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from expertmesh.models.checkpoint import CheckpointNames
from expertmesh.registries import lookup


@dataclass(frozen=True)
class Family:
    attention: str = "gqa"  # models/decoder.py ATTENTION_KINDS: "gqa" (per-head KV), "mla" (latent KV)
    # models/decoder.py LINEAR_MIXERS: the mixer of the config's "linear_attention" layers (hybrids)
    linear_attention: str | None = None
    # models/decoder.py LAYER_KINDS: "decoder" (a token mixer then an MLP / MoE per layer),
    # "block" (one block a layer, its kind from the config's layer_types: Nemotron-H) or
    # "shortcut_moe" (LongCat-Flash: two attention blocks and two dense MLPs beside one MoE branch)
    layer: str = "decoder"
    norm: str = (
        "rms"  # layers/norm.py NORMS: "rms", "layer" (with bias), "rms_offset" ((1 + w)), "rms_float32"
    )
    rope: bool = True  # False: no layer rotates (attention without positional encoding)
    dense_mlp: str = "gated"  # "gated" (act(gate) * up) or "ungated" (act(up)): dense layers' MLP
    qk_norm: str | None = None  # layers/norm.py QK_NORMS: "per_head", "projection", "l2"
    rope_interleaved: bool = False  # GPT-J pairs instead of NeoX halves
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator
    o_proj_bias: bool | None = None  # None: the config's attention_bias (GLM: never)
    sliding_window: bool = True  # False where transformers ignores the config's window
    router: str = "softmax_topk"  # layers/routing.py ROUTERS
    # The config's `topk_method` -> router, where a family's config picks its rule (DeepSeek-V2:
    # greedy or group_limited_greedy); () means `router` whatever the config says.
    router_by_method: tuple[tuple[str, str], ...] = ()
    router_bias: bool = False  # the router linear has a bias (GPT-OSS)
    expert_activation: str = "gated"  # layers/activation.py EXPERT_ACTIVATIONS
    expert_bias: bool = False  # gate/up and down biases on every expert (GPT-OSS)
    router_weights_input: bool = False  # the routing weight scales the expert's input (Llama 4)
    shared_expert: str | None = None  # layers/moe.py SHARED_EXPERTS: "sigmoid_gated", "plain"
    shared_expert_width: str = "config"  # "config", or "routed": as wide as a routed expert
    mlp_name: str = "mlp"  # where the MLP / MoE block lives in the checkpoint
    names: CheckpointNames = field(default_factory=CheckpointNames)

    def router_for(self, topk_method: str | None) -> str:
        if not self.router_by_method:
            return self.router
        return lookup(dict(self.router_by_method), topk_method, "topk_method")
