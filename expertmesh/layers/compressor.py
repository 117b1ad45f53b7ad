"""DeepSeek-V4 attention's key compression (layers/compressed_attention.py uses them): the compressor
that sums each window of tokens' projections into one softmax-gated entry, and the lightning indexer
of a compressed sparse layer, which keeps each query's top index_topk entries.

Under TP the indexer's heads are split over the group (wq_b's and weights_proj's rows), its
compressor replicated: each rank scores its heads and the per-entry scores are summed over the
group before top-k (float32; deterministic mode: fixed chunks of heads added by the fixed tree and
`Group.ordered_sum`, as layers/sparse_indexer.py does)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import tree_sum
from expertmesh.layers.linear import ColumnParallelLinear, ReplicatedLinear
from expertmesh.layers.norm import Float32RMSNorm
from expertmesh.layers.sparse_indexer import split_heads, sum_over_group
from expertmesh.layers.weights import default_loader, set_loader


class Compressor(nn.Module):
    """wkv and wgate [c * dim, H] (c = 2 with overlapping windows), ape [rate, c * dim] float32,
    norm: a token's projections [kv | gate] go to the cache; `compress` sums windows of them."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, dtype) -> None:
        super().__init__()
        c = 2 if overlap else 1
        self.dim, self.rate, self.overlap, self.cd = dim, rate, overlap, c * dim
        self.wkv = ReplicatedLinear(hidden, c * dim, False, dtype)
        self.wgate = ReplicatedLinear(hidden, c * dim, False, dtype)
        self.ape = nn.Parameter(torch.zeros(rate, c * dim, dtype=torch.float32), requires_grad=False)
        set_loader(self.ape, default_loader)
        self.norm = Float32RMSNorm(dim, eps, torch.float32)

    @property
    def width(self) -> int:
        return 2 * self.cd

    def project(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.wkv(x), self.wgate(x)), dim=-1)

    def compress(self, cur: torch.Tensor, prev: torch.Tensor | None, first: torch.Tensor) -> torch.Tensor:
        """cur [n, rate, width]: each window's tokens' projections; prev: the previous window's
        (overlap; ignored where `first` [n] marks window 0) -> entries [n, dim] (not rotated)."""
        cd, d = self.cd, self.dim
        kv, gate = cur[..., :cd], cur[..., cd:] + self.ape
        if self.overlap:
            pkv, pgate = prev[..., :d], prev[..., cd : cd + d] + self.ape[:, :d]
            pkv = pkv.masked_fill(first[:, None, None], 0.0)
            pgate = pgate.masked_fill(first[:, None, None], float("-inf"))
            kv, gate = torch.cat((pkv, kv[..., d:]), dim=1), torch.cat((pgate, gate[..., d:]), dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        return self.norm((kv * weights).sum(dim=1))


class Indexer(nn.Module):
    """The lightning indexer of a compressed sparse layer: its own overlapping compressor at
    index_head_dim, queries wq_b(q LoRA output), per-head weights from the hidden state."""

    def __init__(
        self, hidden: int, q_lora: int, heads: int, dim: int, topk: int, rate: int, eps, dtype, group: Any
    ) -> None:
        super().__init__()
        if topk < 1 or heads < 1 or dim < 1:
            raise ValueError(
                f"indexer: index_n_heads={heads}, index_head_dim={dim}, index_topk={topk} must be >= 1"
            )
        self.heads, self.dim, self.topk = heads, dim, topk
        self.local_heads, self.chunks = split_heads(heads, group)  # chunks: deterministic mode's
        self.group = group
        self.compressor = Compressor(hidden, dim, rate, True, eps, dtype)
        self.wq_b = ColumnParallelLinear(q_lora, heads * dim, False, group, dtype)
        self.weights_proj = ColumnParallelLinear(hidden, heads, False, group, dtype)

    def select(
        self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [L, h, dim], w [L, h] float32 (this rank's heads), keys [S, dim] (or each query's
        [L, S, dim]), visible [L, S] -> kept [L, S]; every TP rank calls it with the same shapes."""
        keys_t = keys.float().transpose(-1, -2)
        parts = (
            [(q, w)]
            if not self.chunks
            else list(zip(q.chunk(self.chunks, 1), w.chunk(self.chunks, 1), strict=True))
        )
        sums = []
        for qc, wc in parts:  # deterministic mode: each chunk the same shape in every layout
            scores = F.relu(torch.matmul(qc.float(), keys_t)) * self.dim**-0.5  # [L, h, S]
            sums.append((scores * wc.unsqueeze(-1)).sum(dim=1))  # [L, S]
        index = sum_over_group(tree_sum(sums), self.group, self.chunks)
        index = index.masked_fill(~visible, float("-inf"))
        top = index.topk(min(self.topk, keys.shape[-2]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(-1, top, True) & visible
