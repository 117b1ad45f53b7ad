"""Linear layers that own their tensor-parallel sharding and their collective.

Column-parallel splits the output dimension over the TP group, row-parallel the input
dimension (its partial sums are all-reduced once, on the group it was given). A partial sum is
computed in float32 and never rounded on its own: the rounding to the model's dtype happens
once, after the sum over ranks, as one process rounds its whole product once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh import huge_pages
from expertmesh.distributed.fixed_sum import chunk_count
from expertmesh.layers.linear_weight import ChunkedWeight, DenseWeight, LinearWeight, bias_ptr, release
from expertmesh.layers.ops import Ops
from expertmesh.layers.weights import copy_into, default_loader, read, set_loader


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={parts}")
    return total // parts


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.model_dtype = dtype  # its activations' (a held checkpoint's weight becomes its codes' dtype)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(huge_pages.empty((out_features, in_features), dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        )
        # The one form its weight is held and multiplied in (layers/linear_weight.py): the dense
        # parameter until the model's ops choose another (use_ops / use_quantized / hold_quantized).
        self.weight_form: LinearWeight = DenseWeight(self.weight)

    partial_output = False  # its products are partial sums over ranks: asked for in float32

    def use_ops(self, ops: Ops) -> None:
        """Packed for our CPU kernels (or oneDNN) where one serves it; the dense weight then dropped."""
        self.weight_form = ops.linear_form(self.weight, float32_out=self.partial_output)

    quantizable = True  # online quantization compresses it (the router opts out)

    def use_quantized(self, scheme: Any, ops: Ops) -> None:
        """Online weight-only quantization: the weight held compressed (layers/quantization)."""
        if self.weight.numel() == 0:  # moved elsewhere after loading (MLA's kv_b_proj)
            return self.use_ops(ops)
        scheme.check_split(f"{type(self).__name__} [{self.weight.shape[0]}, {self.weight.shape[1]}]",
                           self.weight.shape[1], self.input_shards)  # fmt: skip
        self.hold_quantized(ops.quantized_form(self.weight, scheme.kind, scheme.group_size))

    def hold_quantized(self, weight: LinearWeight) -> None:
        """Serve matmuls from a compressed weight (online, or a checkpoint's codes as stored)."""
        self.weight_form = weight
        release(self.weight)

    input_shards = 1  # ranks the input dim is split over (row-parallel: the TP size)

    def matmul(
        self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x @ W.T (+ bias), accumulated in float32, rounded to ``out_dtype`` (default x's) once."""
        return self.weight_form.apply(x, bias, out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def native_form(self, keep: list) -> tuple[int, int, int | None] | None:
        """(GEMM entry, weight, float32 bias) pointers for a native decode layer, if our panel GEMM
        or gemm_q serves this weight and its product is the whole sum (no TP partial), else None."""
        form = None if self.partial_output else self.weight_form.native_form(self.model_dtype, keep)
        return None if form is None else (form["fn"], form["w"], bias_ptr(self.bias, keep))


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
    """y = sum over TP of x[:, shard] @ W[:, shard].T; the bias is added once, after the sum.

    With TP > 1 each rank's product is a float32 partial; the all-reduce sums them in float32
    (the group's ``reduce_dtype``) and the result is rounded to x's dtype once. Without the
    reduce (``reduce=False``) the float32 partial is returned for the caller to sum and round.

    Deterministic mode (the group's ``fixed_chunks``; distributed/fixed_sum.py): the whole K is cut
    into fixed chunks, whatever TP is; each chunk's product is its own float32 GEMM on the same
    shape, the chunks are added by a fixed tree, the ranks' subtree sums by ``Group.ordered_sum``.
    The result is then the whole sum on every rank, so ``reduce=False`` returns it (float32, bias
    added) and the caller adds nothing more over TP.
    """

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
        self.partial_output = self.tp_size > 1 or not reduce
        self.input_shards = self.tp_size
        # Deterministic mode: fixed chunks of the whole K, this rank's share of them.
        self.fixed_chunks = 0
        if getattr(group, "fixed_chunks", 0):
            self.fixed_chunks = chunk_count(in_features, self.tp_size, "a row-parallel input") // self.tp_size
            self.partial_output = True  # float32 chunk sums; never the native one-GEMM decode form
        super().__init__(_divide(in_features, self.tp_size, "input size"), out_features, bias, dtype)
        if self.fixed_chunks:  # never packed (e.g. not on the CPU): slices of the dense weight
            self.weight_form = ChunkedWeight(self.weight, self.fixed_chunks)
        set_loader(self.weight, self._load)
        if self.bias is not None:
            set_loader(self.bias, default_loader)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        cols = param.shape[1]
        copy_into(param.data, read(src, 1, self.tp_rank * cols, cols), "row-parallel weight")

    def hold_quantized(self, weight: LinearWeight) -> None:
        if self.fixed_chunks:
            raise ValueError("deterministic=True does not serve quantized weights yet (a row-parallel layer)")
        super().hold_quantized(weight)

    def use_ops(self, ops: Ops) -> None:
        if not self.fixed_chunks:
            return super().use_ops(ops)
        self.weight_form = ops.chunked_linear_form(self.weight, self.fixed_chunks)

    def _fixed_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight_form.apply(x)  # this rank's fixed chunks, added by the fixed tree (float32)
        y = self.group.ordered_sum(y)  # the whole sum, the same bits on every rank
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype) if self.reduce else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_chunks:
            return self._fixed_forward(x)
        if not self.partial_output:  # one rank holds the whole sum: one rounding, in the GEMM
            return self.matmul(x, self.bias)
        y = self.matmul(x, None, out_dtype=torch.float32)  # [n, out] this rank's partial, unrounded
        # Without the reduce, the caller sums the partials later: the bias joins on rank 0 only.
        bias = self.bias if (self.reduce or self.tp_rank == 0) else None
        if self.reduce:
            y = self.group.all_reduce(y)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype) if self.reduce else y
