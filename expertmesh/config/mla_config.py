"""Multi-head latent attention's sizes (DeepSeek-V2/V3), typed from config.json: part of ModelConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3; layers/mla.py): queries through a
    low-rank `q_lora_rank` bottleneck or a plain projection; keys and values from one latent of
    `kv_lora_rank` values plus a rotary key of `qk_rope_head_dim` shared by every head."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    # LongCat-Flash: queries times sqrt(hidden / q_lora_rank), the normed latent times
    # sqrt(hidden / kv_lora_rank) (mla_scale_q_lora / mla_scale_kv_lora); 1.0: no scaling
    q_lora_scale: float = 1.0
    kv_lora_scale: float = 1.0
    # DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): heads, head width and
    # the past tokens each query keeps; index_topk 0: dense attention, no indexer
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    index_rope_interleaved: bool = False  # the indexer rotates pairs (GLM-5), not halves (V3.2)

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLA {name}={getattr(self, name)} must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (rotated in pairs)")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank={self.q_lora_rank} must be >= 1 or null")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Values a token keeps in the latent cache: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> MLAConfig | None:
        if not getattr(hf, "kv_lora_rank", None):
            return None
        q_lora = getattr(hf, "q_lora_rank", None)
        hidden = int(hf.hidden_size)
        q_scale = (hidden / int(q_lora)) ** 0.5 if q_lora and getattr(hf, "mla_scale_q_lora", False) else 1.0
        kv_scale = (hidden / int(hf.kv_lora_rank)) ** 0.5 if getattr(hf, "mla_scale_kv_lora", False) else 1.0
        shared = sorted({t for t in getattr(hf, "indexer_types", None) or () if t != "full"})
        if shared:  # GLM's cross-layer top-k sharing: no published config turns it on
            raise ValueError(f"indexer_types {shared} are not supported; supported: ['full']")
        return cls(
            index_rope_interleaved=bool(getattr(hf, "indexer_rope_interleave", False)),
            index_heads=int(getattr(hf, "index_n_heads", 0) or 0),
            index_head_dim=int(getattr(hf, "index_head_dim", 0) or 0),
            index_topk=int(getattr(hf, "index_topk", 0) or 0),
            q_lora_scale=q_scale,
            kv_lora_scale=kv_scale,
            kv_lora_rank=int(hf.kv_lora_rank),
            qk_nope_head_dim=int(hf.qk_nope_head_dim),
            qk_rope_head_dim=int(hf.qk_rope_head_dim),
            v_head_dim=int(hf.v_head_dim),
            q_lora_rank=int(q_lora) if q_lora else None,
        )
