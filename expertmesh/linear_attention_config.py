"""Gated DeltaNet linear attention's sizes (Qwen3-Next, Qwen3.5), typed from config.json: part of
ModelConfig. The layers of kind "linear_attention" in `layer_types` use them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LinearAttentionConfig:
    """`num_key_heads` query/key heads of `key_head_dim`, `num_value_heads` value heads of
    `value_head_dim` (each key head serves num_value_heads / num_key_heads consecutive value
    heads), a causal depthwise convolution of `conv_kernel` taps over q, k and v."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"linear attention {name}={getattr(self, name)} must be >= 1")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 2")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_key_heads}"
            )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> LinearAttentionConfig | None:
        if "linear_attention" not in (getattr(hf, "layer_types", None) or ()):
            return None
        return cls(
            num_key_heads=int(hf.linear_num_key_heads),
            num_value_heads=int(hf.linear_num_value_heads),
            key_head_dim=int(hf.linear_key_head_dim),
            value_head_dim=int(hf.linear_value_head_dim),
            conv_kernel=int(hf.linear_conv_kernel_dim),
        )
