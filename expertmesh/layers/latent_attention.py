"""Attention over a paged latent KV cache: the cache half of multi-head latent attention (MLA).

A token's cache row is [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], one row for every head
(KV-cache kind "latent", engine/kv_cache.py). Keys and values are linear in the latent; with
W_UK_h [nope, r] and W_UV_h [v, r] head h's rows of kv_b_proj:

    k_h = [W_UK_h c ; k_pe],   v_h = W_UV_h c,
    q_h . k_h = (W_UK_h^T q_nope_h) . c + q_pe_h . k_pe,   o_h = W_UV_h (sum_t p_t c_t).

Decode attends in the latent space with these absorbed projections: per head one query of
kv_lora_rank + qk_rope_head_dim values against the cached rows themselves (in the CPU kernel,
one shared K/V "head" whose values are the first kv_lora_rank entries of the row), then W_UV.
Prefill expands the new tokens' latents into per-head K and V and attends causally, as the
reference does; a chunk whose sequence has cached tokens (chunked prefill, prefix cache hits)
expands the cached rows of the context with them. Both are exact: the same sums in another
order. `absorbed = False` makes decode expand the whole cached context instead (the reference's
way; benchmarks/mla_decode.py compares).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.layers.attention import AttentionMetadata, PrefillChunk, prefill_mask
from expertmesh.layers.cache_spec import KVCacheSpec
from expertmesh.layers.ops import Ops
from expertmesh.layers.torch_ops import TORCH_OPS


class LatentAttention(nn.Module):
    def __init__(
        self, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int, v_dim: int, scale: float
    ) -> None:
        super().__init__()
        self.num_heads, self.rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.nope_dim, self.v_dim, self.scale = nope_dim, v_dim, scale
        self.width = kv_lora_rank + rope_dim
        self.cache = torch.empty(0)  # [num_blocks, block_size, 1, width], set by the runner
        self.ops: Ops = TORCH_OPS  # the model's, set by use_ops()
        self.absorbed = True
        # Deterministic mode (MLAAttention sets it from the TP group's fixed_chunks): the expansion's
        # products go through our packed panels (expand_forms, set by use_ops), whose bits
        # per output do not follow the thread count or this rank's share of the heads, as torch's
        # BLAS product's do (its blocking of the reduction follows both).
        self.fixed_order = False
        self.expand_forms: tuple | None = None
        # kv_b_proj split per head (set_projections): W_UK [H, nope, r] and W_UV [H, v, r].
        self.register_buffer("w_uk", torch.empty(0), persistent=False)
        self.register_buffer("w_uv", torch.empty(0), persistent=False)

    @property
    def kv_spec(self) -> KVCacheSpec:
        per_head = self.num_heads * (self.nope_dim + self.rope_dim + self.v_dim)
        return KVCacheSpec("latent", 1, self.width, expanded=per_head)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """cache: [1, blocks, block_size, 1, width] (engine/kv_cache.py)."""
        self.cache = cache[0]

    def use_ops(self, ops: Ops) -> None:
        self.ops = ops
        self.expand_forms = None
        if self.fixed_order and self.w_uk.numel():
            self.expand_forms = ops.latent_expand_forms(self.w_uk, self.w_uv, self.rank)

    def set_projections(self, kv_b: torch.Tensor) -> None:
        """kv_b: this rank's kv_b_proj weight [H * (nope + v), r], head by head [k_nope rows; v rows]."""
        w = kv_b.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        self.w_uk = w[:, : self.nope_dim].contiguous()
        self.w_uv = w[:, self.nope_dim :].contiguous()

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        c: torch.Tensor,
        k_pe: torch.Tensor,
        meta: AttentionMetadata,
        sparse: Any = None,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), c [T, r] (normed latent), k_pe [T, rope]
        (rotated) -> [T, H * v]. The new rows are stored in the cache first. `sparse`: this step's
        indexer (layers/sparse_indexer.IndexerStep), each query attending to the keys it keeps."""
        t = q_nope.shape[0]
        if self.cache.numel():
            self.cache.view(-1, self.width).index_copy_(0, meta.slot_mapping, torch.cat((c, k_pe), dim=-1))
        if sparse is not None:
            return self._sparse(q_nope, q_pe, c, k_pe, meta, sparse).reshape(t, -1)
        if not meta.prefills:
            return self._decode(q_nope, q_pe, meta).reshape(t, -1)
        out = q_nope.new_empty(t, self.num_heads, self.v_dim)
        n = meta.num_decodes
        if n:
            out[:n] = self._decode(q_nope[:n], q_pe[:n], meta)
        for chunk in meta.prefills:
            rows = chunk.rows
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], c[rows], k_pe[rows], chunk)
        return out.view(t, -1)

    # ---- sparse: each query over the keys its indexer keeps ----------------------------------------
    def _sparse(self, q_nope, q_pe, c, k_pe, meta: AttentionMetadata, sparse: Any) -> torch.Tensor:
        """Decodes attend in the latent space (absorbed) over the kept rows alone, gathered by slot;
        prefill chunks expand their context and mask it (or, absorbed = False, decodes too)."""
        q = torch.cat((q_nope, q_pe), dim=-1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        index_cache, nd = sparse.indexer.cache, meta.num_decodes
        tables = list(self._decode_tables(meta))
        # Every decode keeps all its keys: dense. Not in deterministic mode: whether a request takes
        # this path would follow the other requests of the step, and the two paths round apart.
        if nd and not self.fixed_order and max(n for _, n in tables) <= sparse.indexer.topk:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], meta)
            nd, tables = 0, []
        # Every request's selection first: their partial index scores cross TP together.
        requests = []
        for i, (table, n) in enumerate(tables):
            positions = torch.arange(n, device=q.device)
            requests.append((slice(i, i + 1), self._rows(index_cache, table, n), positions[-1:], positions))
        for chunk in meta.prefills:
            r = chunk.rows
            keys = chunk.gather(index_cache).view(-1, index_cache.shape[-1]) if chunk.context else sparse.k[r]
            requests.append((r, keys, *chunk.positions(q.device)))
        keeps = sparse.select(requests)
        if self.absorbed and nd:
            q_abs = torch.cat((self._per_head(q_nope[:nd], self.w_uk), q_pe[:nd]), dim=-1)  # [B, H, r + rope]
            latent = q.new_empty(nd, self.num_heads, self.rank)
        for i, (table, n) in enumerate(tables):
            keep = keeps[i]
            if self.absorbed:
                kept = keep[0].nonzero().squeeze(1)  # at most index_topk positions
                bs = self.cache.shape[1]
                slots = table[kept // bs] * bs + kept % bs
                rows = self.cache.view(-1, self.width).index_select(0, slots)  # [m, width]
                scores = torch.matmul(q_abs[i], rows.t()).float() * self.scale  # [H, m]
                latent[i] = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), rows[:, : self.rank])
                continue
            rows = self._rows(self.cache, table, n)
            k, v = self.expand(rows[:, : self.rank], rows[:, self.rank :])
            out[i] = self._attend(q[i : i + 1], k, v, causal=False, mask=keep)[0]
        if self.absorbed and nd:
            out[:nd] = self._per_head(latent, self.w_uv, transposed=True)
        for chunk, keep in zip(meta.prefills, keeps[len(tables) :], strict=True):
            r = chunk.rows
            if chunk.context:
                rows = chunk.gather(self.cache).view(-1, self.width)
            else:
                rows = torch.cat((c[r], k_pe[r]), dim=-1)
            k, v = self.expand(rows[:, : self.rank], rows[:, self.rank :])
            out[r] = self._attend(q[r], k, v, causal=False, mask=keep)
        return out

    def _decode_tables(self, meta: AttentionMetadata) -> Iterator[tuple[torch.Tensor, int]]:
        """Each decode's block table and context length, in batch order."""
        if meta.decode_block_tables is not None:
            yield from zip(meta.decode_block_tables.long(), meta.decode_context_lens.tolist(), strict=True)
            return
        for g in meta.decode_groups:
            yield from zip(g.block_tables, g.context_lens.tolist(), strict=True)

    @staticmethod
    def _rows(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
        """A sequence's first n cached rows [n, width] of `cache` [blocks, block_size, 1, width]."""
        return cache[table[: -(-n // cache.shape[1])]].flatten(0, 2)[:n]

    # ---- expanded: per-head K and V from latents ---------------------------------------------------
    def expand(self, c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [S, r], k_pe [S, rope] -> k [S, H, nope + rope], v [S, H, v]."""
        s, h = c.shape[0], self.num_heads
        if self.expand_forms is not None:  # deterministic mode: our panels (use_ops)
            uk, uv = self.expand_forms
            c = c.contiguous()
            k_nope, v = uk.apply(c).view(s, h, self.nope_dim), uv.apply(c).view(s, h, self.v_dim)
        else:
            k_nope = F.linear(c, self.w_uk.view(-1, self.rank)).view(s, h, self.nope_dim)
            v = F.linear(c, self.w_uv.view(-1, self.rank)).view(s, h, self.v_dim)
        return torch.cat((k_nope, k_pe[:, None, :].expand(s, h, self.rope_dim)), dim=-1), v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask=None
    ) -> torch.Tensor:
        """q [L, H, qk], k [S, H, qk], v [S, H, v] -> [L, H, v]."""
        q_, k_, v_ = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        y = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=causal, scale=self.scale)
        return y.squeeze(0).transpose(0, 1)

    def _prefill(self, q_nope, q_pe, c, k_pe, chunk: PrefillChunk | None = None) -> torch.Tensor:
        q = torch.cat((q_nope, q_pe), dim=-1)
        if chunk is None or not chunk.context:
            k, v = self.expand(c, k_pe)
            return self._attend(q, k, v, causal=True)
        rows = chunk.gather(self.cache).view(-1, self.width)  # the context's rows and the chunk's
        k, v = self.expand(rows[:, : self.rank], rows[:, self.rank :])
        mask = prefill_mask(*chunk.positions(q.device), None, None)
        return self._attend(q, k, v, causal=False, mask=mask)

    def _decode_expanded(self, q_nope, q_pe, meta: AttentionMetadata) -> torch.Tensor:
        q = torch.cat((q_nope, q_pe), dim=-1)  # [B, H, qk]
        out = q.new_empty(q.shape[0], self.num_heads, self.v_dim)
        for i, rows in enumerate(self._contexts(meta)):
            k, v = self.expand(rows[:, : self.rank], rows[:, self.rank :])
            out[i] = self._attend(q[i : i + 1], k, v, causal=False)[0]
        return out

    def _contexts(self, meta: AttentionMetadata) -> Iterator[torch.Tensor]:
        """Each decode's cached rows [len, width], in batch order."""
        if meta.decode_block_tables is not None:
            pairs = zip(meta.decode_block_tables.long(), meta.decode_context_lens.tolist(), strict=True)
        else:
            pairs = (
                (t, n)
                for g in meta.decode_groups
                for t, n in zip(g.block_tables, g.context_lens.tolist(), strict=True)
            )
        bs = self.cache.shape[1]
        for table, n in pairs:
            yield self.cache[table[: -(-n // bs)]].view(-1, self.width)[:n]

    # ---- absorbed: attention in the latent space ---------------------------------------------------
    def _decode(self, q_nope, q_pe, meta: AttentionMetadata) -> torch.Tensor:
        """-> [B, H, v]."""
        if not self.absorbed:
            return self._decode_expanded(q_nope, q_pe, meta)
        q = torch.cat((self._per_head(q_nope, self.w_uk), q_pe), dim=-1)  # [B, H, r + rope]
        if meta.decode_block_tables is not None:
            o = self.ops.paged_decode(
                q, self.cache, self.cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale, None, value_dim=self.rank,
            )  # fmt: skip
        else:
            o = torch.cat([self._latent_group(q[g.start : g.end], g, meta) for g in meta.decode_groups])
        return self._per_head(o, self.w_uv, transposed=True)  # [B, H, v]

    def _per_head(self, x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        """x [B, H, K] times each head's w[h] ([K, N], or [N, K] transposed) -> [B, H, N]. torch's
        CPU bmm is many times slower here than a plain matmul of the same size (DeepSeek-V2-Lite's
        16 heads at one token; docs/benchmarks.md, "Dispatch figures"): our kernel reads each
        weight row once instead."""
        return self.ops.head_matmul(x, w, transposed)

    def _latent_group(self, q: torch.Tensor, group, meta: AttentionMetadata) -> torch.Tensor:
        """q [b, H, width] against the group's cached rows (one head shared by all) -> [b, H, r]."""
        blocks = group.block_tables.flatten()
        buffers = meta.decode_kv_buffers.get(self.kv_spec) if meta.decode_kv_buffers else None
        buf = buffers[0][: blocks.numel()] if buffers else None
        rows = torch.index_select(self.cache, 0, blocks, out=buf).view(q.shape[0], -1, self.width)
        scores = torch.bmm(q, rows.transpose(1, 2)).float() * self.scale  # [b, H, S]
        mask = group.key_mask(None, None).view(q.shape[0], 1, -1)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
        return torch.bmm(probs, rows[..., : self.rank])
