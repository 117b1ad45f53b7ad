"""Gated activations over a fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def get_act(name: str):
    if name not in _ACTS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {sorted(_ACTS)}")
    return _ACTS[name]


def gated(x: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up for x = [gate | up] along the last dim."""
    half = x.shape[-1] // 2
    return act(x[..., :half]) * x[..., half:]
