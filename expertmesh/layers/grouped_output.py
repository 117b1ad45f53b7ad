"""DeepSeek-V4's grouped low-rank output projection `wo_a`: o_groups blocks [o_lora_rank,
heads * head_dim / o_groups], group g mapping its heads' outputs to its o_lora_rank values.

Under TP a rank holds whole groups (its heads'), so the inputs of a group are never split. The
weight is dense (one batched product over the groups), or compressed: a checkpoint's codes held as
stored (DeepSeek-V4's block FP8, quantization/held.py) or online quantization, the same
`QuantizedWeight` the linear layers run, one product per group on a view of its panels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh.layers.linear_weight import DenseWeight, LinearWeight, release
from expertmesh.layers.ops import Ops
from expertmesh.layers.quantization.packed import QuantizedWeight
from expertmesh.layers.weights import copy_into, read, set_loader


class GroupedWeights:
    """One compressed weight per group: views of the panels of the whole [groups * rank, in]."""

    def __init__(self, whole: QuantizedWeight, groups: int) -> None:
        self.whole, rows = whole, whole.out_features // groups
        panels = rows // whole.lanes
        self.parts = [
            QuantizedWeight(
                whole.kind,
                *(t[g * panels : (g + 1) * panels] for t in (whole.codes, whole.scales, whole.offsets)),
                rows,
                whole.in_features,
                whole.group,
                whole.lanes,
                whole.ops,
                whole.shared_offsets,
            )  # fmt: skip
            for g in range(groups)
        ]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return self.whole.resident()


class GroupedOutput(nn.Module):
    """wo_a: o_groups blocks [o_lora_rank, heads * head_dim / o_groups], this rank's groups."""

    def __init__(self, groups: int, rank: int, per_group: int, tp: Any, dtype) -> None:
        super().__init__()
        if groups % tp.world_size:
            raise ValueError(f"o_groups={groups} is not divisible by tensor_parallel_size={tp.world_size}")
        self.groups, self.rank, self.per_group = groups // tp.world_size, rank, per_group
        self.start = tp.rank_in_group * self.groups * rank
        self.weight = nn.Parameter(
            torch.empty(self.groups * rank, per_group, dtype=dtype), requires_grad=False
        )
        set_loader(self.weight, self._load)
        self.weight_form: DenseWeight | GroupedWeights = DenseWeight(self.weight)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src, 0, self.start, param.shape[0]), "grouped output projection")

    quantizable = True  # online quantization and held checkpoint codes (quantization/held.py)

    def use_quantized(self, scheme: Any, ops: Ops) -> None:
        scheme.check_split(f"wo_a [{self.groups * self.rank}, {self.per_group}]", self.per_group, 1)
        self.hold_quantized(ops.quantized_form(self.weight, scheme.kind, scheme.group_size))

    def hold_quantized(self, weight: LinearWeight) -> None:
        """Each group's product on its rows of the codes: whole panels when o_lora_rank is a
        multiple of the panel width, else the weight dequantized once (the float32 values the
        codes stand for, rounded to the model dtype as a load that dequantizes does)."""
        if isinstance(weight, QuantizedWeight) and self.rank % weight.lanes == 0:
            self.weight_form = GroupedWeights(weight, self.groups)
            release(self.weight)
            return
        self.weight.data = weight.dequantize().to(self.weight.dtype)
        self.weight_form = DenseWeight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups * per_group] -> [T, groups * rank]."""
        t = x.shape[0]
        xg = x.view(t, self.groups, self.per_group)
        if isinstance(self.weight_form, GroupedWeights):
            return torch.cat([w.apply(xg[:, g]) for g, w in enumerate(self.weight_form.parts)], dim=-1)
        w = self.weight.view(self.groups, self.rank, self.per_group).transpose(1, 2)
        y = torch.bmm(xg.transpose(0, 1), w)  # [g, T, rank]
        return y.transpose(0, 1).reshape(t, -1)
