"""Recurrent layers' sizes, typed from config.json, part of ModelConfig: Gated DeltaNet (Qwen3-Next,
Qwen3.5) and Mamba2 (Granite-4.0-H). The layers of kind "linear_attention" in `layer_types` (as
transformers names them; Granite's published "mamba") use them."""

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
        if getattr(hf, "linear_num_key_heads", None) is None:  # Mamba2 layers: Mamba2Config
            return None
        return cls(
            num_key_heads=int(hf.linear_num_key_heads),
            num_value_heads=int(hf.linear_num_value_heads),
            key_head_dim=int(hf.linear_key_head_dim),
            value_head_dim=int(hf.linear_value_head_dim),
            conv_kernel=int(hf.linear_conv_kernel_dim),
        )


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 layers' sizes (Granite-4.0-H; Nemotron-H under its own key names): `num_heads` heads
    of `head_dim` channels, B and C of `state_size` per group of heads (`n_groups`), a causal conv
    of `conv_kernel` taps."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(f"mamba heads={self.num_heads} is not a multiple of n_groups={self.n_groups}")

    @classmethod
    def from_hf(cls, hf: Any) -> Mamba2Config | None:
        if "linear_attention" not in (getattr(hf, "layer_types", None) or ()):
            return None
        limit = tuple(float(v) for v in (getattr(hf, "time_step_limit", None) or (0.0, float("inf"))))
        if getattr(hf, "mamba_num_heads", None) is not None:  # Nemotron-H's names
            return cls(
                num_heads=int(hf.mamba_num_heads),
                head_dim=int(hf.mamba_head_dim),
                state_size=int(hf.ssm_state_size),
                n_groups=int(hf.n_groups),
                conv_kernel=int(hf.conv_kernel),
                conv_bias=bool(getattr(hf, "use_conv_bias", True)),
                proj_bias=bool(getattr(hf, "use_bias", False)),  # what its in/out projections read
                time_step_limit=limit,
            )
        if getattr(hf, "mamba_n_heads", None) is None:
            return None
        return cls(
            num_heads=int(hf.mamba_n_heads),
            head_dim=int(hf.mamba_d_head),
            state_size=int(hf.mamba_d_state),
            n_groups=int(hf.mamba_n_groups),
            conv_kernel=int(hf.mamba_d_conv),
            conv_bias=bool(getattr(hf, "mamba_conv_bias", True)),
            proj_bias=bool(getattr(hf, "mamba_proj_bias", False)),
            time_step_limit=limit,
        )
