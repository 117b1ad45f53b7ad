"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5): per query, the top
`index_topk` past tokens that multi-head latent attention then attends over, alone.

Per layer: index queries from the MLA's q LoRA output (wq_b: index_n_heads x index_head_dim), one
index key per token (wk, then a LayerNorm), both rotated on their first qk_rope_head_dim dims (in
halves for DeepSeek-V3.2 although its MLA rotates pairs; in pairs where the config says
indexer_rope_interleave, GLM-5), and per-head weights from the hidden state
(weights_proj, times index_n_heads^-0.5). A key's score for a query is
sum_h w_h * relu(q_h . k * index_head_dim^-0.5); the top index_topk scores among the visible
keys are kept (torch.topk over the same [queries, keys] rows as transformers builds, so ties
resolve alike for an unchunked prefill and every decode step). A context no longer than
index_topk keeps every key: dense attention.

The index keys have their own cache slot (KV-cache kind "index_key", one row of index_head_dim a
token, engine/kv_cache.py), in the same blocks as the layer's latent rows: the layer offers both
(`kv_layers`).

Tensor parallel: the heads are split over the TP group (wq_b's and weights_proj's rows); the key
projection wk and its norm serve every head, so they are replicated, as is the key cache. Each
rank scores its heads, and the per-key scores are summed over the group before top-k, so every
rank selects the same keys. The partial scores of one step's requests travel together (one
collective a layer for a decode batch). Deterministic mode (the group's fixed_chunks): the heads
are cut into fixed chunks whatever the layout, each chunk scored by the same products on the same
shapes, the chunks added by the fixed tree and the ranks' subtree sums by `Group.ordered_sum`
(distributed/fixed_sum.py), so one process and every TP degree select from the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import chunk_count, tree_sum
from expertmesh.layers.attention import AttentionMetadata, prefill_mask
from expertmesh.layers.cache_spec import KVCacheSpec
from expertmesh.layers.linear import ColumnParallelLinear, ReplicatedLinear
from expertmesh.layers.norm import LayerNorm
from expertmesh.layers.rotary import RotaryTables

INDEX_NORM_EPS = 1e-6  # the reference's LayerNorm epsilon, whatever the config's
SCORE_VALUES = 1 << 24  # float32 index scores held at once while selecting (64 MiB)
SUM_VALUES = 1 << 22  # per-key partial scores (float32) sent over TP in one collective, at most


def split_heads(heads: int, group: Any) -> tuple[int, int]:
    """A lightning indexer's heads on this TP rank, and in deterministic mode (the group's
    fixed_chunks) the fixed chunks it scores them in (0: one product over its heads). DeepSeek-V4's
    indexer (layers/compressor.py) splits its heads the same way."""
    if heads % group.world_size:
        raise ValueError(f"index_n_heads={heads} is not divisible by tensor_parallel_size={group.world_size}")
    chunks = 0
    if getattr(group, "fixed_chunks", 0):
        chunks = chunk_count(heads, group.world_size, "the indexer's heads", even=False) // group.world_size
    return heads // group.world_size, chunks


def sum_over_group(partial: torch.Tensor, group: Any, chunks: int) -> torch.Tensor:
    """The whole per-key scores from every rank's share, float32 whatever the group's reduce dtype:
    in deterministic mode (or a group reducing in another dtype) an all-gather added in group order
    (`Group.ordered_sum`), else an all-reduce."""
    if group.world_size == 1:
        return partial
    if chunks or group.reduce_dtype != torch.float32:
        return group.ordered_sum(partial)
    return group.all_reduce(partial)


class LightningIndexer(nn.Module):
    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
        dtype,
        group: Any,
        rope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        if rope_dim > head_dim or topk < 1:
            raise ValueError(
                f"indexer: index_head_dim={head_dim} < qk_rope_head_dim={rope_dim} or index_topk={topk}"
            )
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.local_heads, self.chunks = split_heads(heads, group)
        self.group = group
        self.rope_interleaved = rope_interleaved
        self.wq_b = ColumnParallelLinear(q_lora_rank, heads * head_dim, False, group, dtype)
        self.wk = ReplicatedLinear(hidden, head_dim, False, dtype)
        self.k_norm = LayerNorm(head_dim, INDEX_NORM_EPS, dtype)
        self.weights_proj = ColumnParallelLinear(hidden, heads, False, group, dtype)
        self.scale = head_dim**-0.5
        self.cache = torch.empty(0)  # [num_blocks, block_size, 1, head_dim], set by the runner

    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec("index_key", 1, self.head_dim)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """cache: [1, blocks, block_size, 1, head_dim] (engine/kv_cache.py)."""
        self.cache = cache[0]

    def step(
        self, x: torch.Tensor, q_resid: torch.Tensor, rope: RotaryTables, meta: AttentionMetadata
    ) -> IndexerStep:
        """This step's index queries and weights; the new tokens' index keys go into the cache."""
        t = x.shape[0]
        q = self.wq_b(q_resid).view(t, self.local_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(t, 1, self.head_dim)
        rope = rope.laid_out(self.rope_interleaved)
        q, k = rope.rotate(q), rope.rotate(k)
        k = k.view(t, self.head_dim)
        if self.cache.numel():
            self.cache.view(-1, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        return IndexerStep(self, q, k, weights)

    def partial_scores(self, q: torch.Tensor, weights: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
        """q [l, h, D] and weights [l, h] of this rank's heads, keys_t [D, S] (float32) -> this rank's
        share of the scores, [l, S] float32."""
        if not self.chunks:
            scores = F.relu(torch.matmul(q, keys_t) * self.scale)  # [l, h, S]
            return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        parts = []
        for qc, wc in zip(q.chunk(self.chunks, 1), weights.chunk(self.chunks, 1), strict=True):
            scores = F.relu(torch.matmul(qc, keys_t) * self.scale)  # the same shape in every layout
            parts.append(torch.matmul(wc.unsqueeze(-2), scores).squeeze(-2))
        return tree_sum(parts)

    def sum_over_ranks(self, partial: torch.Tensor) -> torch.Tensor:
        """The whole scores from every rank's share (float32 whatever the group's reduce dtype)."""
        return sum_over_group(partial, self.group, self.chunks)


Request = tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]  # (rows, keys [S, D], q_pos, k_pos)


@dataclass
class IndexerStep:
    """One step's index queries [T, h, D] and head weights [T, h] float32 (this rank's heads), and
    the new keys [T, D]."""

    indexer: LightningIndexer
    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor

    def keep(self, rows: slice, keys: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """One request's `select`."""
        return self.select([(rows, keys, q_pos, k_pos)])[0]

    def select(self, requests: list[Request]) -> list[torch.Tensor]:
        """Per request, boolean [L, S]: the keys (a sequence's index keys [S, D] at k_pos) each
        query of `rows` (at q_pos) attends to: its top index_topk visible keys, or every visible
        key. Every TP rank passes the same requests (shapes): their partial scores are summed
        over the group in batches of up to SUM_VALUES."""
        ix = self.indexer
        keeps, pending, size = [], [], 0
        for i, (rows, keys, q_pos, k_pos) in enumerate(requests):
            visible = prefill_mask(q_pos, k_pos, None, None)
            keeps.append(visible)
            if keys.shape[0] <= ix.topk:
                continue
            q, weights, keys_t = self.q[rows].float(), self.weights[rows], keys.float().t()
            # Queries in slices, so the [slice, h, S] scores stay near SCORE_VALUES (a long prefill);
            # the slices follow the whole head count, so every layout cuts them alike.
            step = max(1, SCORE_VALUES // (ix.heads * keys.shape[0]))
            for a in range(0, q.shape[0], step):
                b = min(a + step, q.shape[0])
                pending.append((i, a, b, ix.partial_scores(q[a:b], weights[a:b], keys_t)))
                size += pending[-1][3].numel()
                if size >= SUM_VALUES:
                    self._pick(pending, keeps)
                    pending, size = [], 0
        if pending:
            self._pick(pending, keeps)
        return keeps

    def _pick(self, pending: list, keeps: list[torch.Tensor]) -> None:
        """Sum the pending partial scores over the group (one collective), then each query's top-k
        among its visible keys (torch.topk over the rows transformers builds: ties alike)."""
        flat = self.indexer.sum_over_ranks(torch.cat([p.reshape(-1) for *_, p in pending]))
        topk, at = self.indexer.topk, 0
        for i, a, b, part in pending:
            index = flat[at : at + part.numel()].view(part.shape)
            at += part.numel()
            visible = keeps[i][a:b]
            index = index.masked_fill(~visible, float("-inf"))
            chosen = torch.zeros_like(visible).scatter_(-1, index.topk(topk, dim=-1).indices, True)
            keeps[i][a:b] = chosen & visible
