"""Attention over a paged KV cache.

A batch is laid out decodes first (one token each, batched over the cache through block
tables), then prefills: a whole prompt (attended causally in place), or a chunk of one whose
earlier tokens are in the cache already (chunked prefill, prefix cache hits): the chunk's
queries attend to the sequence's cached keys and its own, read back from the cache.

A layer sees its keys as transformers masks them: all earlier tokens, or the last
`sliding_window` of them (the token itself included), or those of its own `chunk` (chunked local
attention: positions p // chunk equal); with `sinks`, a learned per-head logit joins every
softmax's denominator (and its value is zero).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.layers.cache_spec import KVCacheSpec
from expertmesh.layers.ops import Ops
from expertmesh.layers.rotary import RotaryTables
from expertmesh.layers.torch_ops import TORCH_OPS
from expertmesh.layers.weights import copy_into, read, set_loader

QUERY_BLOCK = 256  # rows of queries per block in the sink attention, to bound its score matrix


@dataclass
class DecodeGroup:
    """Decodes [start, end) of a step, attended together: their block tables padded to one width."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, width]
    context_lens: torch.Tensor  # [end - start]
    block_size: int
    masks: dict = field(default_factory=dict)  # (window, chunk) -> key mask, built once per step

    def key_mask(self, window: int | None, chunk: int | None) -> torch.Tensor:
        """[B, 1, 1, width * block_size] boolean, True = attend; shared by the layers alike."""
        if (window, chunk) not in self.masks:
            width = self.block_tables.shape[1] * self.block_size
            self.masks[window, chunk] = decode_key_mask(self.context_lens, width, window, chunk)
        return self.masks[window, chunk]


@dataclass
class PrefillChunk:
    """Tokens [start, start + length) of a step: positions [context, context + length) of one
    sequence, whose first `context` tokens' K/V are in the cache (blocks `block_table`)."""

    start: int
    length: int
    context: int = 0
    block_table: torch.Tensor | None = None  # long [blocks covering context + length], if context
    _table32: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)

    def positions(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's query positions and the positions of every key it sees."""
        end = self.context + self.length
        return torch.arange(self.context, end, device=device), torch.arange(end, device=device)

    def table32(self) -> torch.Tensor:
        """block_table as int32 for the prefill kernel, converted once and shared by every layer."""
        if self._table32 is None:
            self._table32 = self.block_table.to(torch.int32)
        return self._table32

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """cache [blocks, block_size, ...] -> this sequence's rows [context + length, ...]."""
        rows = torch.index_select(cache, 0, self.block_table)
        return rows.flatten(0, 1)[: self.context + self.length]


@dataclass
class AttentionMetadata:
    """One step's attention layout, built once by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decodes: int  # tokens [0, num_decodes) are single-token decodes
    # Decodes sorted by context length and grouped so that short contexts are not padded to the
    # longest one (the gather and attention cost grow with the padded width).
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]  # each prefilled sequence's tokens this step
    # Reused buffers the decode gathers cache blocks into, per KV-cache spec: its planes, each
    # [blocks, block_size, heads, width] (K and V, or the latent). A fresh multi-MB tensor per layer
    # costs more in page faults than the copy itself.
    decode_kv_buffers: dict[KVCacheSpec, tuple[torch.Tensor, ...]] | None = None
    # For the CPU paged-decode kernel, which reads blocks in place instead of grouping and
    # gathering: every decode's block table (int32 [num_decodes, W], zero-padded) and length.
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    # [T]: the length of each token's sequence this step (a decode: its position + 1; a prefill,
    # every chunk of it: the length the whole prefill reaches), for length-dependent RoPE.
    seq_lens: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> AttentionMetadata:
        """Moves the step's index tensors (built on the CPU) to the device the model runs on."""
        if torch.device(device).type == "cpu":
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        self.slot_mapping = move(self.slot_mapping)
        for group in self.decode_groups:
            group.block_tables, group.context_lens = move(group.block_tables), move(group.context_lens)
        for chunk in self.prefills:
            chunk.block_table = move(chunk.block_table)
        self.decode_block_tables = move(self.decode_block_tables)
        self.decode_context_lens = move(self.decode_context_lens)
        self.seq_lens = move(self.seq_lens)
        return self

    def token_context_lens(self, positions: torch.Tensor) -> torch.Tensor:
        if self.seq_lens is not None:
            return self.seq_lens
        lens = positions + 1
        for chunk in self.prefills:
            lens[chunk.rows] = chunk.context + chunk.length
        return lens


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None,
        chunk: int | None = None,
        sinks: bool = False,
        group: Any = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.chunk = scale, sliding_window, chunk
        self.k_cache = torch.empty(0)  # [num_blocks, block_size, kv_heads, head_dim], set by the runner
        self.v_cache = torch.empty(0)
        self.ops: Ops = TORCH_OPS  # the model's, set by use_ops()
        self.sinks = None
        if sinks:  # [this rank's heads], float32 like the reference's softmax
            self.sinks = nn.Parameter(torch.empty(num_heads, dtype=torch.float32), requires_grad=False)
            self.head_start = (group.rank_in_group if group is not None else 0) * num_heads
            set_loader(self.sinks, self._load_sinks)

    @property
    def kv_spec(self) -> KVCacheSpec:
        return KVCacheSpec("per_head", self.num_kv_heads, self.head_dim)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """cache: [2, blocks, block_size, kv_heads, head_dim] (engine/kv_cache.py)."""
        self.k_cache, self.v_cache = cache[0], cache[1]

    def _load_sinks(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src, 0, self.head_start, self.num_heads), "attention sinks")

    def use_ops(self, ops: Ops) -> None:
        """On our kernels: rotary + cache store in one call, attention over the blocks in place."""
        self.ops = ops

    def native_form(self) -> dict | None:
        """The cache and masking fields of a native decode layer (cpu/native_decode.py): our
        kernels serve this layer's decode and its cache is bound; else None."""
        if not self.ops.native_decode or not self.k_cache.numel():
            return None
        sinks = None if self.sinks is None else self.sinks.data_ptr()  # float32 [H] already
        return dict(
            k_cache=self.k_cache.data_ptr(), v_cache=self.v_cache.data_ptr(),
            block_size=self.k_cache.shape[1], scale=self.scale, window=self.sliding_window or 0,
            chunk=self.chunk or 0, sinks=sinks,
        )  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: RotaryTables | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hk, D] (views allowed), rotated by `rope` when given
        -> [T, H*D]. The new k and v are stored in the cache first."""
        q, k, v = self.ops.store_kv(q, k, v, rope, meta.slot_mapping, self.k_cache, self.v_cache)
        if not meta.prefills:  # decode-only step: no copy into a fresh buffer
            return self._decode(q, meta).view(q.shape[0], -1)
        if not meta.num_decodes and len(meta.prefills) == 1 and not meta.prefills[0].context:
            return self._prefill_rows(q, k, v, meta.prefills[0]).reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], meta)
        for chunk in meta.prefills:
            out[chunk.rows] = self._prefill_rows(q, k, v, chunk)
        return out.view(q.shape[0], -1)

    def _prefill_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk
    ) -> torch.Tensor:
        """One prefill chunk's attention: our kernel reads a cached context from the blocks in place
        (the torch path gathers it) and masks windows, chunks and sinks per row (torch: an [L, S]
        mask, and sinks on the plain-matmul path: much slower at 2,000 tokens; docs/benchmarks.md,
        "Dispatch figures"). A fresh prompt seen whole and unmasked goes to whichever of ours and
        torch's flash kernel is faster on this build (CpuKernels.prefill_fresh;
        docs/benchmarks.md)."""
        rows = chunk.rows
        n = chunk.context + chunk.length
        cut = (self.sliding_window is not None and n > self.sliding_window) or (
            self.chunk is not None and n > self.chunk
        )
        masked = bool(chunk.context) or cut or self.sinks is not None
        if self.ops.serves_prefill(q.dtype, masked):
            cached = bool(chunk.context)
            return self.ops.paged_prefill(
                q[rows], self.k_cache if cached else k[rows], self.v_cache if cached else v[rows],
                self.scale, self.sliding_window, self.chunk, self.sinks,
                chunk.table32() if cached else None, chunk.context,
            )  # fmt: skip
        if chunk.context:
            k_all, v_all = chunk.gather(self.k_cache), chunk.gather(self.v_cache)
            return self._prefill(q[rows], k_all, v_all, chunk)
        return self._prefill(q[rows], k[rows], v[rows])

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk | None = None
    ) -> torch.Tensor:
        """q [L, H, D] of new tokens, k/v [S, Hk, D] of every key they see (S = L without a cached
        context, else the context too, read from the cache) -> [L, H, D]."""
        q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, L or S, D]
        n = k.shape[0]
        limited = (self.sliding_window is not None and n > self.sliding_window) or (
            self.chunk is not None and n > self.chunk
        )
        if chunk is not None and chunk.context:
            q_pos, k_pos = chunk.positions(q.device)
        else:
            q_pos = k_pos = torch.arange(n, device=q.device)
        if self.sinks is not None:
            mask = prefill_mask(q_pos, k_pos, self.sliding_window, self.chunk)  # [L, S]
            y = self._sink_attention(q_, k_, v_, mask)
        elif limited or (chunk is not None and chunk.context):
            mask = prefill_mask(q_pos, k_pos, self.sliding_window, self.chunk)
            y = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=self.scale, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=self.scale, enable_gqa=True)
        return y.squeeze(0).transpose(0, 1)

    def _sink_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [B, H, L, D], k/v [B, Hk, S, D], mask broadcastable to [B, H, L, S] -> [B, H, L, D].
        softmax over [scores, sink] with the sink column dropped: the sink takes probability mass
        and gives nothing back. Float32, query rows in blocks."""
        group = self.num_heads // self.num_kv_heads
        k32 = k.float().repeat_interleave(group, dim=1)
        v32 = v.float().repeat_interleave(group, dim=1)
        sink = self.sinks.float().view(1, -1, 1, 1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for i in range(0, q.shape[2], QUERY_BLOCK):
            rows = slice(i, i + QUERY_BLOCK)
            scores = (q[:, :, rows].float() @ k32.transpose(-1, -2)) * self.scale  # [B, H, l, S]
            m = mask[..., rows, :] if mask.dim() == 2 else mask
            scores = scores.masked_fill(~m, float("-inf"))
            logits = torch.cat((scores, sink.expand(*scores.shape[:-1], 1)), dim=-1)
            probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
            out[:, :, rows] = (probs @ v32).to(q.dtype)
        return out

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.decode_block_tables is not None:
            return self.ops.paged_decode(
                q.contiguous(),
                self.k_cache,
                self.v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                self.sliding_window,
                self.chunk,
                self.sinks,
            )
        buffers = meta.decode_kv_buffers.get(self.kv_spec) if meta.decode_kv_buffers else None
        if len(meta.decode_groups) == 1:
            return self._decode_group(q, meta.decode_groups[0], buffers)
        return torch.cat([self._decode_group(q[g.start : g.end], g, buffers) for g in meta.decode_groups])

    def _decode_group(self, q: torch.Tensor, group: DecodeGroup, buffers) -> torch.Tensor:
        """q: [B, H, D] for the group's sequences -> [B, H, D]."""
        b, hk, d = q.shape[0], self.num_kv_heads, self.head_dim
        # index_select over flat block ids is several times faster than advanced indexing here.
        blocks = group.block_tables.flatten()
        k_buf, v_buf = (
            (buffers[0][: blocks.numel()], buffers[1][: blocks.numel()]) if buffers else (None, None)
        )
        k = torch.index_select(self.k_cache, 0, blocks, out=k_buf).view(b, -1, hk, d).transpose(1, 2)
        v = torch.index_select(self.v_cache, 0, blocks, out=v_buf).view(b, -1, hk, d).transpose(1, 2)
        mask = group.key_mask(self.sliding_window, self.chunk)
        if self.sinks is not None:
            return self._sink_attention(q.unsqueeze(2), k, v, mask).view(b, self.num_heads, self.head_dim)
        y = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [B, H, 1, D]
        return y.view(b, self.num_heads, self.head_dim)


def decode_key_mask(
    context_lens: torch.Tensor, max_len: int, sliding_window: int | None, chunk: int | None = None
) -> torch.Tensor:
    """[B, 1, 1, max_len] boolean: key j is visible to the newest token of a sequence."""
    j = torch.arange(max_len, device=context_lens.device)[None, :]
    last = (context_lens - 1)[:, None]
    return prefill_mask(last, j, sliding_window, chunk)[:, None, None, :]


def prefill_mask(
    q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None, chunk: int | None
) -> torch.Tensor:
    """Boolean [.., Lq, Lk] (broadcast of q_pos [Lq, 1] or [Lq] and k_pos): key visible to query."""
    q = q_pos[:, None] if q_pos.dim() == 1 else q_pos
    k = k_pos[None, :] if k_pos.dim() == 1 else k_pos
    mask = k <= q
    if sliding_window is not None:
        mask &= q - k < sliding_window
    if chunk is not None:
        mask &= q // chunk == k // chunk
    return mask
