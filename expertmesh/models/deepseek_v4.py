"""DeepSeek-V4-Flash / -Pro (DeepseekV4ForCausalLM), the blocks it is built from:

- attention (layers/compressed_attention.py): one shared K=V head of head_dim, sliding window in
  every layer, the layer kind from the config's layer_types (transformers' reading of the
  published compress_ratios): sliding only, compressed sparse (overlapping windows of 4 tokens and
  a lightning indexer keeping index_topk entries), heavily compressed (windows of 128); a per-head
  sink; the grouped low-rank output projection; sliding layers rotate by rope_theta, compressed
  ones by compress_rope_theta with YaRN;
- hyper-connections (layers/hyper_connections.py): hc_mult residual streams per token, collapsed
  before each block and the final norm, spread and mixed (Sinkhorn) after each;
- MoE every layer: the first num_hash_layers (mlp_layer_types "hash_moe") route by token id
  (layers/hash_routing.py), the rest by sqrt(softplus) scores with a correction bias
  (layers/routing.py "sqrtsoftplus"); experts and the shared expert clamp gate and up by
  swiglu_limit.
Checkpoint: DeepSeek's names (attn.wq_a, attn.compressor.ape, ffn.experts.<e>.w1/w3/w2,
hc_attn_fn, head.weight, ...), at the top level as published (embed.weight, layers.<i>.*,
hc_head_fn) or as transformers saves them (model.embed_tokens, model.layers.<i>.*,
model.hc_head.hc_fn); the MTP layer (mtp.0.* published) loads for speculative decoding
(spec_decode/mtp_v4.py) and is skipped by a named rule otherwise. Pipeline stages hand each other
the hc_mult streams (stage_shape).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.compressed_attention import CompressedAttention
from expertmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from expertmesh.layers.hyper_connections import HyperConnection, HyperHead
from expertmesh.layers.moe import MoE
from expertmesh.layers.norm import Float32RMSNorm
from expertmesh.models.checkpoint import GATE_UP, CheckpointNames
from expertmesh.models.decoder import CausalLM, moe_spec
from expertmesh.models.family import Family

# The published files name the top-level tensors without transformers' `model.` (embed.weight,
# layers.<i>.*, norm.weight, hc_head_fn, ...); transformers' save keeps `model.`, embed_tokens and
# hc_head.hc_fn. Both read.
PUBLISHED_TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


@dataclass(frozen=True)
class DeepseekV4Names(CheckpointNames):
    def canonical(self, key: str) -> str:
        if key.startswith("layers."):
            key = "model." + key
        return super().canonical(PUBLISHED_TOP.get(key, key))


NAMES = DeepseekV4Names(
    gate="w1",
    up="w3",
    down="w2",
    stacked=GATE_UP,
    renames=(
        (".ffn.shared_experts.w1.", ".ffn.shared_expert.gate_proj."),
        (".ffn.shared_experts.w3.", ".ffn.shared_expert.up_proj."),
        (".ffn.shared_experts.w2.", ".ffn.shared_expert.down_proj."),
        (".ffn.gate.bias", ".ffn.gate.e_score_correction_bias"),
        (".hc_attn_", ".hc_attn."),
        (".hc_ffn_", ".hc_ffn."),
    ),
    skip=(("mtp layer (published as mtp.*; loaded for speculative method mtp only)", r"^mtp\."),),
)


class DeepseekV4Layer(nn.Module):
    """hc_attn -> attn_norm -> attention -> merge; hc_ffn -> ffn_norm -> MoE -> merge."""

    def __init__(self, cfg: ModelConfig, index: int, family: Family, env: Any) -> None:
        super().__init__()
        c, hidden = cfg.compressed, cfg.hidden_size
        self.hc_attn = HyperConnection(c.hc_mult, hidden, c.hc_sinkhorn_iters, c.hc_eps, cfg.norm_eps)
        self.hc_ffn = HyperConnection(c.hc_mult, hidden, c.hc_sinkhorn_iters, c.hc_eps, cfg.norm_eps)
        fixed = bool(getattr(env.groups.tp, "fixed_chunks", 0))  # deterministic mode
        self.hc_attn.use_fixed_order(fixed)
        self.hc_ffn.use_fixed_order(fixed)
        self.attn_norm = Float32RMSNorm(hidden, cfg.norm_eps, torch.float32)
        self.ffn_norm = Float32RMSNorm(hidden, cfg.norm_eps, torch.float32)
        self.attn = CompressedAttention(cfg, index, family, env.groups.tp)
        spec = moe_spec(cfg, family)
        if c.mlp_layer_types[index] == "hash_moe":
            spec = replace(spec, router=f"hash_{c.scoring_func}")
        dispatcher = env.make_dispatcher(cfg.num_experts)
        placement = env.placement_for(index, cfg.num_experts)
        self.ffn = MoE(cfg, spec, env.moe_plan, env.groups, dispatcher, placement, index)

    is_linear, native_form = False, None

    def kv_layers(self) -> list[Any]:
        return [self.attn]

    def state_module(self) -> None:
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        post, comb, h = self.hc_attn(x)
        x = HyperConnection.merge(x, self.attn(positions, self.attn_norm(h), ctx), post, comb)
        post, comb, h = self.hc_ffn(x)
        return HyperConnection.merge(x, self.ffn(self.ffn_norm(h), ctx), post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: ModelConfig, family: Family, env: Any) -> None:
        super().__init__()
        if not cfg.is_moe:
            raise ValueError(f"{cfg.architecture}: the config has no routed experts")
        c, tp = cfg.compressed, env.groups.tp
        self.hc = c.hc_mult
        self.layer_range = env.layer_range
        # Pipeline stages hand each other the whole residual, [T, hc_mult, hidden] (stage_shape);
        # the embedding lives on the first stage, the final norm and the head on the last. hc_head
        # (hc x hc x hidden float32 values) is kept on every stage so that the loader finds it.
        self.first, self.last = env.is_first_stage, env.is_last_stage
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype) if self.first else None
        )
        self.layers = nn.ModuleDict({str(i): DeepseekV4Layer(cfg, i, family, env) for i in self.layer_range})
        self.hc_head = HyperHead(c.hc_mult, cfg.hidden_size, c.hc_eps, cfg.norm_eps)
        self.hc_head.use_fixed_order(bool(getattr(tp, "fixed_chunks", 0)))
        self.norm = Float32RMSNorm(cfg.hidden_size, cfg.norm_eps, torch.float32) if self.last else None
        self.native = None  # no native decode form
        # With the MTP layer (spec_decode/mtp_v4.py): the last stage keeps its streams before hc_head.
        self.keep_streams, self.streams = False, None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        ctx.input_ids = input_ids  # the hash-routed layers choose experts by token id (every stage)
        if self.first:
            x = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.hc, -1).contiguous()  # [T, hc, D]
        else:
            x = hidden  # the previous stage's streams
        for layer in self.layers.values():
            x = layer(positions, x, ctx)
        if self.last and self.keep_streams:
            self.streams = x
        return self.norm(self.hc_head(x)) if self.last else x


class DeepseekV4ForCausalLM(CausalLM):
    family = Family(
        attention="compressed",
        router="sqrtsoftplus",
        expert_activation="gated_clamped",
        shared_expert="clamped",
        mlp_name="ffn",
        names=NAMES,
    )

    def __init__(self, cfg: ModelConfig, env: Any) -> None:
        nn.Module.__init__(self)
        if cfg.compressed is None:
            raise ValueError(f"{cfg.architecture}: config.json has no hc_mult / compress_ratios")
        if cfg.compressed.scoring_func != "sqrtsoftplus":
            raise ValueError(
                f"scoring_func={cfg.compressed.scoring_func!r} is not supported for {cfg.architecture}; "
                "supported: 'sqrtsoftplus'"
            )
        self.cfg = cfg
        self.model = DeepseekV4Model(cfg, self.family, env)
        self.lm_head = None
        if env.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, False, env.groups.tp, cfg.dtype)

    @property
    def stage_shape(self) -> tuple[int, ...]:
        """A pipeline stage hands the next the whole residual: hc_mult streams of hidden a token."""
        return (self.cfg.compressed.hc_mult, self.cfg.hidden_size)
