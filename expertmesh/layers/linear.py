"""Linear layers that own their tensor-parallel sharding and their collective.

Column-parallel splits the output dimension over the TP group, row-parallel the input
dimension (its partial sums are all-reduced once, on the group it was given).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.layers import cpu_gemm
from expertmesh.layers.cpu_kernels import CpuKernels
from expertmesh.layers.weights import copy_into, default_loader, read, set_loader


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    packed: cpu_gemm.PackedWeight | None = None  # set by use_cpu_kernels(); the dense weight is then dropped

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        self.packed = cpu_gemm.pack(self.weight, kernels)
        if self.packed is not None:
            cpu_gemm.release(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.float32) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        set_loader(self.weight, default_loader)
        if self.bias is not None:
            set_loader(self.bias, default_loader)


class ColumnParallelLinear(LinearBase):
    """y[:, shard] = x @ W[shard].T; the output stays split over the TP group."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: Any, dtype=torch.float32
    ) -> None:
        self.tp_rank, self.tp_size = group.rank_in_group, group.world_size
        super().__init__(in_features, _divide(out_features, self.tp_size, "output size"), bias, dtype)
        set_loader(self.weight, self._load)
        if self.bias is not None:
            set_loader(self.bias, self._load)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        rows = param.shape[0]
        copy_into(param.data, read(src, 0, self.tp_rank * rows, rows), "column-parallel weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (gate and up projections)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, group: Any, dtype=torch.float32
    ) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, group, dtype)
        shards = set(range(len(output_sizes)))
        set_loader(self.weight, self._load_shard, shards)
        if self.bias is not None:
            set_loader(self.bias, self._load_shard, shards)

    def _load_shard(self, param: nn.Parameter, src: Any, shard_id: int) -> None:
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset = sum(sizes[:shard_id])
        value = read(src, 0, self.tp_rank * sizes[shard_id], sizes[shard_id])
        copy_into(param.data.narrow(0, offset, sizes[shard_id]), value, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v. Query heads split over TP; KV heads replicated when TP exceeds their number."""

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        group: Any,
        dtype=torch.float32,
    ) -> None:
        tp = group.world_size
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
        else:
            if tp % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size={tp} is not a multiple of num_key_value_heads={num_kv_heads}"
                )
            self.num_kv_heads = 1
        # Which KV head this rank holds: several ranks share one when KV heads are replicated.
        self.kv_head_start = group.rank_in_group * num_kv_heads // tp if num_kv_heads < tp else None
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias, group, dtype)
        set_loader(self.weight, self._load_qkv, {"q", "k", "v"})
        if self.bias is not None:
            set_loader(self.bias, self._load_qkv, {"q", "k", "v"})

    def _load_qkv(self, param: nn.Parameter, src: Any, shard_id: str) -> None:
        d, q, kv = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, start = 0, q, self.tp_rank * q
        else:
            offset = q if shard_id == "k" else q + kv
            size = kv
            start = self.kv_head_start * d if self.kv_head_start is not None else self.tp_rank * kv
        copy_into(param.data.narrow(0, offset, size), read(src, 0, start, size), f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """y = sum over TP of x[:, shard] @ W[:, shard].T; the bias is added once, after the sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group: Any,
        reduce: bool = True,
        dtype=torch.float32,
    ) -> None:
        self.group, self.reduce = group, reduce
        self.tp_rank, self.tp_size = group.rank_in_group, group.world_size
        super().__init__(_divide(in_features, self.tp_size, "input size"), out_features, bias, dtype)
        set_loader(self.weight, self._load)
        if self.bias is not None:
            set_loader(self.bias, default_loader)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        cols = param.shape[1]
        copy_into(param.data, read(src, 1, self.tp_rank * cols, cols), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        # Without the reduce, the caller sums the partials later: the bias joins on rank 0 only.
        bias = self.bias if (self.reduce or self.tp_rank == 0) else None
        y = self.matmul(x, None)
        if self.reduce:
            y = self.group.all_reduce(y)
        return y if bias is None else y + bias
