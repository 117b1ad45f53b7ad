"""The attention blocks of a decoder layer: GQA/MHA (optional q/k norm of the family's kind, QKV
clipping, Llama 4's temperature tuning, sliding / chunked windows, sinks) and the output-gated GQA
of Qwen3-Next / Qwen3.5. Each owns its projections and its KV cache slot (`.attn`); the decoder
picks one by name (decoder.ATTENTION_KINDS).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.attention import Attention
from expertmesh.layers.linear import QKVParallelLinear, RowParallelLinear
from expertmesh.layers.norm import NORMS, QK_NORMS, L2Norm, ProjectionRMSNorm, RMSNorm
from expertmesh.models.family import Family
from expertmesh.registries import lookup


def qk_norms(cfg: ModelConfig, family: Family, qkv: QKVParallelLinear, tp: Any, use_rope: bool):
    """(q norm, k norm, after_rope) of one layer, or (None, None, False)."""
    if family.qk_norm is None or not cfg.use_qk_norm:
        return None, None, False
    kind = lookup(QK_NORMS, family.qk_norm, "q/k norm")
    if kind.rope_layers_only and not use_rope:
        return None, None, False
    d, eps = cfg.head_dim, cfg.norm_eps
    if family.qk_norm == "l2":
        norm = L2Norm(eps)
        return norm, norm, kind.after_rope
    if family.qk_norm == "per_head":
        return RMSNorm(d, eps, cfg.dtype), RMSNorm(d, eps, cfg.dtype), kind.after_rope
    if qkv.kv_head_start is not None:
        raise ValueError(
            f"a q/k norm over the whole projection needs num_key_value_heads={cfg.num_kv_heads} >= "
            f"tensor_parallel_size={tp.world_size} (it cannot be computed on replicated KV heads)"
        )
    h, hk, r = qkv.num_heads, qkv.num_kv_heads, tp.rank_in_group
    q = ProjectionRMSNorm(h * d, cfg.num_heads * d, eps, tp, r * h * d, cfg.dtype)
    k = ProjectionRMSNorm(hk * d, cfg.num_kv_heads * d, eps, tp, r * hk * d, cfg.dtype)
    return q, k, kind.after_rope


class DecoderAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, family: Family, tp: Any) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, cfg.dtype
        )
        o_bias = cfg.o_bias if family.o_proj_bias is None else family.o_proj_bias
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, o_bias, tp, dtype=cfg.dtype
        )
        h, hk, d = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, cfg.head_dim
        self.sizes, self.heads = (h * d, hk * d, hk * d), (h, hk, d)
        self.use_rope = cfg.uses_rope(index) and family.rope
        self.q_norm, self.k_norm, self.norm_after_rope = qk_norms(
            cfg, family, self.qkv_proj, tp, self.use_rope
        )
        self.clip = cfg.clip_qkv
        # Attention temperature tuning (Llama 4) scales queries of the layers without RoPE.
        self.temperature = cfg.attn_temperature if not self.use_rope else None
        kind = cfg.layer_type(index)
        window = cfg.sliding_window if kind == "sliding_attention" and family.sliding_window else None
        chunk = cfg.attention_chunk_size if kind == "chunked_attention" else None
        scale = cfg.attention_multiplier if cfg.attention_multiplier is not None else d**-0.5
        self.attn = Attention(h, hk, d, scale, window, chunk=chunk, sinks=family.attention_sinks, group=tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, hk, d = self.heads
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k, v = q.view(-1, h, d), k.view(-1, hk, d), v.view(-1, hk, d)
        if self.q_norm is not None and not self.norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        rope = ctx.rope if self.use_rope else None
        if self.norm_after_rope or self.temperature is not None:
            if rope is not None:
                q, k = rope.apply(q, k)
                rope = None
            if self.norm_after_rope:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.temperature is not None:
                floor_scale, attn_scale = self.temperature
                scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
                q = (q * scales[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, ctx.attn, rope=rope))

    def native_form(self, keep: list) -> dict | None:
        """This block's part of a native decode layer, or None where it has no native form."""
        per_head = self.q_norm is None or (type(self.q_norm) is RMSNorm and not self.norm_after_rope)
        if not per_head or self.clip is not None or self.temperature is not None:
            return None
        qkv, o, attn = self.qkv_proj.native_form(keep), self.o_proj.native_form(keep), self.attn.native_form()
        if qkv is None or o is None or attn is None:
            return None
        h, hk, d = self.heads
        form = dict(qkv_fn=qkv[0], qkv_w=qkv[1], qkv_bias=qkv[2], heads=h, kv_heads=hk, head_dim=d,
                    use_rope=int(self.use_rope), o_fn=o[0], o_w=o[1], o_bias=o[2], **attn)  # fmt: skip
        if self.q_norm is not None:
            q, k = self.q_norm.native_form(), self.k_norm.native_form()
            if q is None or k is None:
                return None
            form.update(q_norm=q[0], k_norm=k[0], qk_eps=q[1])
        return form


class GatedDecoderAttention(nn.Module):
    """GQA whose output is gated per channel by sigmoid(gate), the gate projected with the query
    (q_proj holds [query, gate] per head: Qwen3-Next, Qwen3.5), per-head q/k norm of the family's
    norm kind before RoPE, partial RoPE from the config."""

    def __init__(self, cfg: ModelConfig, index: int, family: Family, tp: Any) -> None:
        super().__init__()
        d = cfg.head_dim
        # The query and its gate as 2 x num_heads "heads" of head_dim: a TP shard keeps pairs whole.
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, d, 2 * cfg.num_heads, cfg.num_kv_heads, cfg.qkv_bias, tp, cfg.dtype
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.o_bias, tp, dtype=cfg.dtype)
        h, hk = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.sizes, self.heads = (2 * h * d, hk * d, hk * d), (h, hk, d)
        norm = lookup(NORMS, family.norm, "norm")
        self.q_norm, self.k_norm = norm(d, cfg.norm_eps, cfg.dtype), norm(d, cfg.norm_eps, cfg.dtype)
        self.attn = Attention(h, hk, d, d**-0.5, None, group=tp)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h, hk, d = self.heads
        qg, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, gate = qg.view(-1, h, 2 * d).chunk(2, dim=-1)
        q, k, v = self.q_norm(q.contiguous()), self.k_norm(k.view(-1, hk, d)), v.view(-1, hk, d)
        y = self.attn(q, k, v, ctx.attn, rope=ctx.rope)
        return self.o_proj(y * torch.sigmoid(gate.reshape(y.shape)))
