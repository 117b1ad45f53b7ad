"""The decoder-only transformer every registered family is built from.

A family class sets a few class attributes (norm type, router, where the MLP lives in the
checkpoint, how expert tensors are named); the parallel layers do the sharding.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.attention import Attention
from expertmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from expertmesh.layers.linear import QKVParallelLinear, RowParallelLinear
from expertmesh.layers.mlp import GatedMLP
from expertmesh.layers.moe import MoE
from expertmesh.layers.norm import LayerNorm, RMSNorm
from expertmesh.layers.rotary import RotaryEmbedding
from expertmesh.models.checkpoint import CheckpointNames


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: Any, norm_cls: type) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, cfg.dtype
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp, dtype=cfg.dtype
        )
        h, hk, d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        self.sizes = (h * d, hk * d, hk * d)
        self.heads = (h, hk, d)
        self.q_norm = norm_cls(d, cfg.norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.k_norm = norm_cls(d, cfg.norm_eps, cfg.dtype) if cfg.qk_norm else None
        self.attn = Attention(h, hk, d, d**-0.5, cfg.sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, hk, d = self.heads
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k, v = q.view(-1, h, d), k.view(-1, hk, d), v.view(-1, hk, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.o_proj(self.attn(q, k, v, ctx.attn, rope=ctx.rope))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, family: type, env: Any) -> None:
        super().__init__()
        norm = family.norm_cls
        self.input_layernorm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.self_attn = DecoderAttention(cfg, env.groups.tp, norm)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            mlp = MoE(
                cfg,
                family.router,
                env.moe_plan,
                env.groups,
                env.make_dispatcher(cfg.num_experts),
                env.expert_placement,
            )
        else:
            mlp = GatedMLP(
                cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, env.groups.tp, dtype=cfg.dtype
            )
        setattr(self, family.mlp_name, mlp)
        self.mlp_name = family.mlp_name

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        mlp = getattr(self, self.mlp_name)
        h = self.post_attention_layernorm(x)
        return x + (mlp(h, ctx) if self.is_moe else mlp(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, family: type, env: Any) -> None:
        super().__init__()
        tp = env.groups.tp
        self.layer_range = env.layer_range
        self.first, self.last = env.is_first_stage, env.is_last_stage
        self.rotary = RotaryEmbedding(cfg.rope)
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype) if self.first else None
        )
        # Layers of other pipeline stages are absent; a ModuleDict keeps checkpoint indices.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, family, env) for i in self.layer_range})
        self.norm = family.norm_cls(cfg.hidden_size, cfg.norm_eps, cfg.dtype) if self.last else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None, ctx
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if self.first else hidden
        lens = ctx.attn.token_context_lens(positions) if self.rotary.length_dependent else None
        ctx.rope = self.rotary.lookup(positions, x.dtype, lens)
        for layer in self.layers.values():
            x = layer(positions, x, ctx)
        return self.norm(x) if self.last else x


class CausalLM(nn.Module):
    """Base of every family: `model` (embed, layers, norm) and `lm_head`, HF parameter names."""

    norm_cls: ClassVar[type] = RMSNorm
    router: ClassVar[str] = "softmax_topk"
    mlp_name: ClassVar[str] = "mlp"
    names: ClassVar[CheckpointNames] = CheckpointNames()

    def __init__(self, cfg: ModelConfig, env: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, type(self), env)
        self.lm_head = None
        if env.is_last_stage:
            self.lm_head = ParallelLMHead(
                cfg.vocab_size, cfg.hidden_size, cfg.lm_head_bias, env.groups.tp, cfg.dtype
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, hidden, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers.values()]


class LayerNormCausalLM(CausalLM):
    norm_cls = LayerNorm
