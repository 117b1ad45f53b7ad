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
        return cls(
            kv_lora_rank=int(hf.kv_lora_rank),
            qk_nope_head_dim=int(hf.qk_nope_head_dim),
            qk_rope_head_dim=int(hf.qk_rope_head_dim),
            v_head_dim=int(hf.v_head_dim),
            q_lora_rank=int(q_lora) if q_lora else None,
        )
