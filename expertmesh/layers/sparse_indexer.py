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
(`kv_layers`). The indexer is replicated over TP (every rank selects the same tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.layers.attention import AttentionMetadata, prefill_mask
from expertmesh.layers.cache_spec import KVCacheSpec
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.norm import LayerNorm
from expertmesh.layers.rotary import RotaryTables

INDEX_NORM_EPS = 1e-6  # the reference's LayerNorm epsilon, whatever the config's
SCORE_VALUES = 1 << 24  # float32 index scores held at once while selecting (64 MiB)


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
        rope_interleaved: bool = False,
    ) -> None:
        super().__init__()
        if rope_dim > head_dim or topk < 1:
            raise ValueError(
                f"indexer: index_head_dim={head_dim} < qk_rope_head_dim={rope_dim} or index_topk={topk}"
            )
        self.heads, self.head_dim, self.rope_dim, self.topk = heads, head_dim, rope_dim, topk
        self.rope_interleaved = rope_interleaved
        self.wq_b = ReplicatedLinear(q_lora_rank, heads * head_dim, False, dtype)
        self.wk = ReplicatedLinear(hidden, head_dim, False, dtype)
        self.k_norm = LayerNorm(head_dim, INDEX_NORM_EPS, dtype)
        self.weights_proj = ReplicatedLinear(hidden, heads, False, dtype)
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
        q = self.wq_b(q_resid).view(t, self.heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(t, 1, self.head_dim)
        rope = rope.laid_out(self.rope_interleaved)
        q, k = rope.rotate(q), rope.rotate(k)
        k = k.view(t, self.head_dim)
        if self.cache.numel():
            self.cache.view(-1, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        weights = self.weights_proj(x).float() * self.heads**-0.5
        return IndexerStep(self, q, k, weights)


@dataclass
class IndexerStep:
    """One step's index queries [T, H, D], new keys [T, D] and head weights [T, H] float32."""

    indexer: LightningIndexer
    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor

    def keep(self, rows: slice, keys: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [L, S]: the keys (a sequence's index keys [S, D] at k_pos) each query of `rows`
        (at q_pos) attends to: its top index_topk visible keys, or every visible key."""
        visible = prefill_mask(q_pos, k_pos, None, None)
        topk = self.indexer.topk
        if keys.shape[0] <= topk:
            return visible
        q, weights, keys_t = (
            self.q[rows].float(),
            self.weights[rows],
            keys.float().t(),
        )  # [L, H, D], [L, H], [D, S]
        keep = torch.zeros_like(visible)
        # Queries in slices, so the [slice, H, S] scores stay near SCORE_VALUES (a long prefill).
        step = max(1, SCORE_VALUES // (q.shape[1] * keys.shape[0]))
        for a in range(0, q.shape[0], step):
            b = min(a + step, q.shape[0])
            scores = F.relu(torch.matmul(q[a:b], keys_t) * self.indexer.scale)  # [l, H, S]
            index = torch.matmul(weights[a:b].unsqueeze(-2), scores).squeeze(-2)  # [l, S]
            index = index.masked_fill(~visible[a:b], float("-inf"))
            keep[a:b].scatter_(-1, index.topk(topk, dim=-1).indices, True)
        return keep & visible
