"""What a layer caches: per token in the paged KV cache (`KVCacheSpec`, one of KV_CACHE_KINDS) and
per sequence beside it (`StateSpec`, recurrent layers). The layers declare these; the engine
(engine/kv_cache.py, engine/state_cache.py) sizes and allocates from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from expertmesh.registries import lookup


@dataclass(frozen=True)
class CacheKind:
    planes: int  # tensors per layer: K and V, or one latent row both are read from
    what: str


KV_CACHE_KINDS = {
    "per_head": CacheKind(2, "per-head K and V"),
    "latent": CacheKind(1, "one latent row shared by all heads (MLA)"),
    "index_key": CacheKind(1, "one indexer key per token (DeepSeek Sparse Attention)"),
    # DeepSeek-V4 (layers/compressed_attention.py): one K=V row a token shared by all heads, and on
    # compressed layers beside it the compressor's (and indexer's) projections of the token and the
    # compressed entry of the window the token closes (its window's last token's row holds it)
    "shared_kv": CacheKind(1, "one K=V row per token shared by all heads (DeepSeek-V4 sliding layers)"),
    "compressed_kv": CacheKind(1, "K=V row, compressor inputs and compressed entries (DeepSeek-V4)"),
}


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer caches per token: `planes` rows of `heads` x `width` values.
    `expanded` is what per-head K and V of this layer's query heads would take instead (a latent
    kind reports it next to its own size)."""

    kind: str
    heads: int
    width: int
    expanded: int = 0

    def __post_init__(self) -> None:
        lookup(KV_CACHE_KINDS, self.kind, "KV-cache kind")
        if self.heads < 1 or self.width < 1:
            raise ValueError(f"KV-cache spec {self}: heads and width must be >= 1")

    @property
    def planes(self) -> int:
        return KV_CACHE_KINDS[self.kind].planes

    @property
    def values_per_token(self) -> int:
        return self.planes * self.heads * self.width

    def layer_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (self.planes, num_blocks, block_size, self.heads, self.width)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass(frozen=True)
class StateSpec:
    """What one recurrent layer keeps per sequence: tensors of `shapes`, in `dtype`."""

    kind: str  # e.g. "gated_deltanet": the layer kind, for the start-up line
    shapes: tuple[tuple[int, ...], ...]  # e.g. ((conv channels, kernel - 1), (heads, d_k, d_v))
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if not self.shapes or any(not s or min(s) < 1 for s in self.shapes):
            raise ValueError(f"state spec {self}: every tensor needs a non-empty shape of sizes >= 1")

    @property
    def bytes_per_seq(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * element_size(self.dtype)
