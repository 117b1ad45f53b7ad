"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): an attention kind
(models/decoder.py ATTENTION_KINDS), with the latent KV cache of layers/latent_attention.py.

Queries: q_proj, or with q LoRA (q_lora_rank set) q_a_proj -> RMSNorm -> q_b_proj; per head
qk_nope_head_dim values without position and qk_rope_head_dim rotated ones. Keys and values:
kv_a_proj_with_mqa -> the latent c_kv (kv_lora_rank values, RMSNorm'd by kv_a_layernorm) and one
rotary key k_pe (qk_rope_head_dim) shared by every head; kv_b_proj maps c_kv to each head's k_nope
and v. RoPE turns the rope dims only, in the checkpoint's layout (the rotary block's pairs or
halves). The softmax scale is qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under a
scaled rope (DeepSeek's YaRN correction).

Tensor parallel: the query heads (q_proj / q_b_proj, kv_b_proj, o_proj) are split over TP; the
latent projections are replicated, so every TP rank keeps the whole latent cache
(docs/deepseek.md says what that costs). A sparse-attention indexer splits its own heads over TP
(layers/sparse_indexer.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh.config import ModelConfig, RopeConfig
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.latent_attention import LatentAttention
from expertmesh.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from expertmesh.layers.norm import RMSNorm
from expertmesh.layers.rotary import yarn_mscale
from expertmesh.layers.sparse_indexer import LightningIndexer

# q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon in DeepSeek's code and in
# transformers' port, whatever the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 when the rope is scaled (YaRN)."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor if rope.factor is not None else 1.0, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, family: Any, tp: Any) -> None:
        super().__init__()
        m = cfg.mla
        if m is None:
            raise ValueError(
                f"{cfg.architecture}: multi-head latent attention needs kv_lora_rank, qk_nope_head_dim, "
                "qk_rope_head_dim and v_head_dim in config.json"
            )
        if cfg.num_heads % tp.world_size:
            raise ValueError(
                f"num_attention_heads={cfg.num_heads} is not divisible by "
                f"tensor_parallel_size={tp.world_size}"
            )
        self.m, self.heads = m, cfg.num_heads // tp.world_size
        hidden, heads, dt, bias = cfg.hidden_size, cfg.num_heads, cfg.dtype, cfg.o_bias
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if m.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * m.qk_head_dim, False, tp, dt)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, m.q_lora_rank, bias, dt)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, dt)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, heads * m.qk_head_dim, False, tp, dt)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, m.latent_width, bias, dt)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, dt)
        self.kv_b_proj = ColumnParallelLinear(
            m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), False, tp, dt
        )
        self.o_proj = RowParallelLinear(heads * m.v_head_dim, hidden, bias, tp, dtype=dt)
        self.indexer = None  # DeepSeek Sparse Attention (layers/sparse_indexer.py) when the config has one
        # Layers the config's layer_types calls indexed_attention (every layer when it has none).
        if m.index_topk and (not cfg.layer_types or cfg.layer_type(index) == "indexed_attention"):
            if m.q_lora_rank is None:
                raise ValueError(f"{cfg.architecture}: the sparse-attention indexer needs q_lora_rank")
            self.indexer = LightningIndexer(
                hidden, m.q_lora_rank, m.index_heads, m.index_head_dim, m.qk_rope_head_dim, m.index_topk, dt,
                tp, rope_interleaved=m.index_rope_interleaved,
            )  # fmt: skip
        scale = mla_softmax_scale(cfg.rope, m.qk_head_dim)
        self.attn = LatentAttention(
            self.heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim, scale
        )
        self.attn.fixed_order = bool(getattr(tp, "fixed_chunks", 0))

    relaid_after_loading = ("kv_b_proj",)  # the children it takes (quantization/held.py keeps them float)

    def process_weights_after_loading(self) -> None:
        """kv_b_proj moves into the attention as per-head W_UK / W_UV (used by both the absorbed
        decode and the prefill's expansion), so the model holds it once."""
        self.attn.set_projections(self.kv_b_proj.weight.data)
        self.kv_b_proj.weight.data = torch.empty(0, dtype=self.kv_b_proj.weight.dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, m = x.shape[0], self.m
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(t, self.heads, m.qk_head_dim).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], -1
        )
        c, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        if m.q_lora_scale != 1.0:
            q_nope, q_pe = q_nope * m.q_lora_scale, q_pe * m.q_lora_scale
        if m.kv_lora_scale != 1.0:
            c = c * m.kv_lora_scale
        q_pe, k_pe = ctx.rope.apply(q_pe, k_pe.unsqueeze(1))
        sparse = None if self.indexer is None else self.indexer.step(x, q_resid, ctx.rope, ctx.attn)
        return self.o_proj(self.attn(q_nope, q_pe, c, k_pe.squeeze(1), ctx.attn, sparse))

    def kv_layers(self) -> list[Any]:
        """The modules owning a KV cache slot: the latent rows, and the indexer's keys."""
        return [self.attn] if self.indexer is None else [self.attn, self.indexer]
