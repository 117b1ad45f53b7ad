"""Rotary position embedding (NeoX half-rotation), cos/sin tabulated once for all positions."""

from __future__ import annotations

import torch
from torch import nn


def inverse_frequencies(
    head_dim: int, theta: float, rope_type: str, params: dict
) -> tuple[torch.Tensor, float]:
    if rope_type == "default":
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "linear":
        inv, scale = inverse_frequencies(head_dim, theta, "default", params)
        return inv / float(params["factor"]), scale
    raise NotImplementedError(
        f"rope_type={rope_type!r} is not supported yet (supported: 'default', 'linear')"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_type: str, params: dict) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(head_dim, theta, rope_type, params)
        # Same float32 recipe as the reference: positions * inv_freq, duplicated halves.
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D] for positions [T]; looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def apply(
        cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]."""
        cos, sin = cos_sin
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
