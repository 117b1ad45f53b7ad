"""Dense MLPs, tensor parallel: gated (Llama, Qwen2-MoE's shared expert and dense layers) and
ungated (Nemotron-H: act(up) then down)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh.layers.activation import gated, get_act
from expertmesh.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: str,
        group: Any,
        reduce: bool = True,
        dtype=torch.float32,
        limit: float | None = None,
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, False, group, dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, group, reduce=reduce, dtype=dtype)
        self.act = get_act(act)
        # DeepSeek-V4's shared expert: gate clamped above at `limit`, up to [-limit, limit]
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if self.limit is not None:
            half = h.shape[-1] // 2
            h = torch.cat(
                (h[..., :half].clamp(max=self.limit), h[..., half:].clamp(-self.limit, self.limit)), -1
            )
        return self.down_proj(gated(h, self.act))


class UngatedMLP(nn.Module):
    """down(act(up(x))) with no gate projection (Nemotron-H's MLP layers and shared expert)."""

    def __init__(
        self, hidden: int, intermediate: int, act: str, group: Any, reduce: bool = True, dtype=torch.float32
    ) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden, intermediate, False, group, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, False, group, reduce=reduce, dtype=dtype)
        self.act = get_act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
