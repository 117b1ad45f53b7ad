"""Normalisation layers by name: RMSNorm (float32 like the reference), LayerNorm with bias
(PhiMoE); and the q/k norm kinds: per head, over the whole projection (TP-aware), weightless L2."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import chunk_count, tree_sum
from expertmesh.layers.ops import Ops
from expertmesh.layers.torch_ops import TORCH_OPS
from expertmesh.layers.weights import copy_into, default_loader, read, set_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)

    ops: Ops = TORCH_OPS  # the model's (use_ops): one compiled call per norm on our kernels

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops

    def native_form(self) -> tuple[int, float] | None:
        """(weight pointer, eps) for a native decode layer (cpu/native_decode.py)."""
        return (self.weight.data_ptr(), self.eps) if self.ops.native_decode else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w), w stored zero-centred (Qwen3-Next, Qwen3.5), in float32 with the
    product rounded once, as the reference does."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class Float32RMSNorm(nn.Module):
    """RMSNorm with the weight product in float32, rounded once (Nemotron-H, as its reference)."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)
        set_loader(self.bias, default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class L2Norm(nn.Module):
    """Weightless RMS normalisation over the last dim (Llama 4's q/k norm), in float32."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class ProjectionRMSNorm(nn.Module):
    """RMSNorm over a whole q or k projection (OLMoE), not per head. Under tensor parallelism each
    rank holds `local` of the `width` columns: the squares are summed over the TP group."""

    def __init__(
        self, local: int, width: int, eps: float, group: Any, start: int, dtype=torch.float32
    ) -> None:
        super().__init__()
        self.eps, self.group, self.width, self.start = eps, group, width, start
        self.weight = nn.Parameter(torch.ones(local, dtype=dtype), requires_grad=False)
        set_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src, 0, self.start, param.shape[0]), "q/k norm shard")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (this rank's heads) -> the same shape."""
        x32 = x.reshape(x.shape[0], -1).float()
        if self.group.fixed_chunks:
            squares = self._fixed_squares(x32)
        else:
            squares = x32.pow(2).sum(-1, keepdim=True)
            if self.group.world_size > 1:
                squares = self.group.all_reduce(squares)
        y = x32 * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * y.to(x.dtype)).view(x.shape)

    def _fixed_squares(self, x32: torch.Tensor) -> torch.Tensor:
        """Deterministic mode: the whole width's sum of squares over fixed chunks added by the fixed
        tree, the ranks' subtree sums by the group's ordered_sum (fixed_sum.py), so one process
        and every TP degree give the same bits (an all-reduce of per-rank sums does not)."""
        ranks = self.group.world_size
        chunks = chunk_count(self.width, ranks, "a whole-projection q/k norm", even=False)
        parts = x32.view(x32.shape[0], chunks // ranks, self.width // chunks).pow(2).sum(-1)
        return self.group.ordered_sum(tree_sum(list(parts.unbind(-1))))[:, None]


NORMS = {"rms": RMSNorm, "layer": LayerNorm, "rms_offset": OffsetRMSNorm, "rms_float32": Float32RMSNorm}


@dataclass(frozen=True)
class QKNorm:
    """A q/k norm kind: whether it runs after the rotation, and only on rotary layers."""

    after_rope: bool
    rope_layers_only: bool


QK_NORMS = {
    "per_head": QKNorm(after_rope=False, rope_layers_only=False),  # Qwen3-MoE, GLM-4.5 (RMSNorm(D))
    "projection": QKNorm(after_rope=False, rope_layers_only=False),  # OLMoE (ProjectionRMSNorm)
    "l2": QKNorm(after_rope=True, rope_layers_only=True),  # Llama 4 (L2Norm)
}
