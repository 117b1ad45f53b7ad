"""DeepSeek-V4's attention: one shared K=V head over a sliding window, plus compressed entries.

Every layer: queries through a q LoRA (wq_a -> q_norm -> wq_b, then each head RMS-normed without a
weight), one K=V row a token (wkv -> norm) read as both key and value by every head, RoPE on the
trailing qk_rope_head_dim dims of each head in pairs, a learned per-head sink in the softmax, the
output's rotary dims turned back by the query's position, and a grouped low-rank output
projection (wo_a: each of o_groups groups of heads to o_lora_rank values; wo_b mixes them).
The layer kind (config layer_types, from the published compress_ratios) adds keys:
- sliding_attention: the last sliding_window tokens only (RoPE theta rope_theta, unscaled);
- heavily_compressed_attention (rate m): one compressed entry per m tokens, a softmax-gated sum
  of the window's wkv rows (wkv, wgate, a per-slot bias `ape`, then norm), rotated at the
  window's first position; a query sees every window it has completed;
- compressed_sparse_attention (rate m, overlapping windows): each entry gates the previous
  window's first-half projections with its own second-half ones (2m slots), and a lightning
  indexer (its own compressor at index_head_dim, index_n_heads queries from the q LoRA output,
  per-head weights from the hidden state; score sum_h w_h relu(q_h . k)) keeps each query's
  top index_topk completed entries.
Compressed layers rotate by compress_rope_theta with the config's YaRN block (cos/sin unscaled).

The cache (KV-cache kinds "shared_kv" and "compressed_kv", one row per token): the K=V row, and on
compressed layers the token's compressor projections ([kv | gate], twice as wide with overlap)
and those of the indexer, plus the entry of the window the token completes (written in that
token's row when it is computed). An entry depends only on the tokens of its windows, so it is
the same whether the window was seen in one prefill, in chunks or across a prefix-cache hit; the
projections are kept for every token (a compact ring of the last windows is future work).

A step's decodes attend together (each its window and its completed entries, padded to the
most entries); each prefill chunk attends by itself, QUERY_BLOCK queries at a time.

Tensor parallel: query heads, sinks and output groups split over TP (o_groups a multiple of
the TP size), and the indexer's heads (their scores summed over TP before top-k); the K=V row
and the compressors are replicated.

The compressor and the indexer are in layers/compressor.py, wo_a in layers/grouped_output.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.config.compressed_attention_config import CSA, SLIDING
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.attention import QUERY_BLOCK, AttentionMetadata
from expertmesh.layers.cache_spec import KVCacheSpec
from expertmesh.layers.compressor import Compressor, Indexer
from expertmesh.layers.grouped_output import GroupedOutput
from expertmesh.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from expertmesh.layers.norm import Float32RMSNorm
from expertmesh.layers.rotary import RotaryEmbedding, RotaryTables
from expertmesh.layers.weights import copy_into, read, set_loader


def rotate_tail(x: torch.Tensor, rope: RotaryTables) -> torch.Tensor:
    """x [T, H, D] with its last rotary_dim dims rotated (in pairs), the rest passed through."""
    r = rope.rotary_dim
    return torch.cat((x[..., :-r], rope.rotate(x[..., -r:])), dim=-1)


def inverse(rope: RotaryTables) -> RotaryTables:
    return RotaryTables(rope.cos, -rope.sin, rope.interleaved)


def _unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _table_slots(tables: torch.Tensor, block_size: int):
    """(positions [B, X], rows of `tables` [B] or all) -> cache slots [B, X] of those positions."""

    def slot(pos: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        t = tables if rows is None else tables[rows]
        return t.gather(1, pos // block_size) * block_size + pos % block_size

    return slot


@dataclass
class _Segment:
    """One sequence's tokens in a step: rows of the batch, positions [start, end), block table."""

    rows: slice
    start: int
    end: int
    table: torch.Tensor | None  # None: a prefill without context (its slots are the step's)


class CompressedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, family: Any, tp: Any) -> None:
        super().__init__()
        c = cfg.compressed
        if c is None:
            raise ValueError(f"{cfg.architecture}: compressed attention needs hc_mult and compress_rates")
        if cfg.num_heads % tp.world_size:
            raise ValueError(
                f"num_attention_heads={cfg.num_heads} is not divisible by tensor_parallel_size="
                f"{tp.world_size}"
            )
        if (cfg.num_heads * cfg.head_dim) % c.o_groups:
            raise ValueError(f"o_groups={c.o_groups} does not divide heads x head_dim")
        hidden, d, dt, eps = cfg.hidden_size, cfg.head_dim, cfg.dtype, cfg.norm_eps
        self.kind = cfg.layer_type(index)
        self.heads, self.head_dim, self.eps = cfg.num_heads // tp.world_size, d, eps
        self.window = cfg.sliding_window
        if self.window is None:
            raise ValueError(f"{cfg.architecture}: compressed attention needs sliding_window")
        self.wq_a = ReplicatedLinear(hidden, c.q_lora_rank, False, dt)
        self.q_norm = Float32RMSNorm(c.q_lora_rank, eps, torch.float32)
        self.wq_b = ColumnParallelLinear(c.q_lora_rank, cfg.num_heads * d, False, tp, dt)
        self.wkv = ReplicatedLinear(hidden, d, False, dt)
        self.norm = Float32RMSNorm(d, eps, torch.float32)
        self.wo_a = GroupedOutput(c.o_groups, c.o_lora_rank, cfg.num_heads * d // c.o_groups, tp, dt)
        self.wo_b = RowParallelLinear(c.o_groups * c.o_lora_rank, hidden, False, tp, dtype=dt)
        self.attn_sink = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32), requires_grad=False)
        self.head_start = tp.rank_in_group * self.heads
        set_loader(self.attn_sink, self._load_sinks)
        self.rate = c.rate(self.kind)
        self.rotary = RotaryEmbedding(c.main_rope if self.kind == SLIDING else c.compress_rope)
        self.compressor = self.indexer = None
        if self.rate:
            self.compressor = Compressor(hidden, d, self.rate, self.kind == CSA, eps, dt)
        if self.kind == CSA:
            self.indexer = Indexer(
                hidden, c.q_lora_rank, c.index_heads, c.index_head_dim, c.index_topk, self.rate, eps, dt, tp
            )
        # The cache row: [K=V | compressor projections | entry | indexer projections | index entry]
        self.offsets, width = {}, d
        for name, part in (("compressor", self.compressor), ("indexer", self.indexer)):
            if part is not None:
                dim = part.compressor.dim if name == "indexer" else part.dim
                width_in = part.compressor.width if name == "indexer" else part.width
                self.offsets[name] = (width, width + width_in, width + width_in + dim)
                width += width_in + dim
        self.width = width
        self.scale = d**-0.5
        self.cache = torch.empty(0)  # [num_blocks, block_size, 1, width], set by the runner

    def _load_sinks(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src, 0, self.head_start, self.heads), "attention sinks")

    @property
    def kv_spec(self) -> KVCacheSpec:
        per_head = 2 * self.heads * self.head_dim
        kind = "shared_kv" if self.compressor is None else "compressed_kv"
        return KVCacheSpec(kind, 1, self.width, expanded=per_head)

    def bind_kv_cache(self, cache: torch.Tensor) -> None:
        """cache: [1, blocks, block_size, 1, width] (engine/kv_cache.py)."""
        self.cache = cache[0]

    def kv_layers(self) -> list[Any]:
        return [self]

    # ---- the step ------------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        meta, t, h, d = ctx.attn, x.shape[0], self.heads, self.head_dim
        rope = self.rotary.lookup(positions, x.dtype)
        q_resid = self.q_norm(self.wq_a(x))
        q = rotate_tail(_unweighted_rms(self.wq_b(q_resid).view(t, h, d), self.eps), rope)
        kv = rotate_tail(self.norm(self.wkv(x)).unsqueeze(1), rope).squeeze(1)
        parts = [kv]
        for part in (self.compressor, None if self.indexer is None else self.indexer.compressor):
            if part is not None:
                parts += [part.project(x), kv.new_zeros(t, part.dim)]
        rows = torch.cat(parts, dim=-1) if len(parts) > 1 else kv
        cached = bool(self.cache.numel())
        flat = self.cache.view(-1, self.width) if cached else rows.clone()
        if cached:
            flat.index_copy_(0, meta.slot_mapping, rows)
        index_q = index_w = None
        if self.indexer is not None:
            ix = self.indexer
            index_q = rotate_tail(ix.wq_b(q_resid).view(t, ix.local_heads, ix.dim), rope)
            index_w = ix.weights_proj(x).float() * ix.heads**-0.5
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:  # every decode at once: padded to the longest context's entries
            tables, lens = self._decode_tables(meta)
            slot = _table_slots(tables, self.cache.shape[1])
            positions = lens.to(tables.device) - 1
            if self.compressor is not None:
                self._compress_decodes(positions, flat, slot, x.dtype)
            iq, iw = (None, None) if index_q is None else (index_q[:nd], index_w[:nd])
            out[:nd] = self._attend_decodes(q[:nd], positions, flat, slot, iq, iw)
        for chunk in meta.prefills:
            table = chunk.block_table if chunk.context else None  # without context: the step's slots
            seg = _Segment(chunk.rows, chunk.context, chunk.context + chunk.length, table)
            slots = self._slot_fn(seg, meta, cached)
            if self.compressor is not None:
                self._compress(seg, flat, slots, x.dtype)
            out[seg.rows] = self._attend(q[seg.rows], seg, flat, slots, index_q, index_w)
        out = rotate_tail(out, inverse(rope))
        return self.wo_b(self.wo_a(out.reshape(t, h * d)))

    @staticmethod
    def _decode_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' block tables [B, width] (long, zero-padded) and context lengths [B]."""
        if meta.decode_block_tables is not None:
            return meta.decode_block_tables.long(), meta.decode_context_lens.long()
        width = max(g.block_tables.shape[1] for g in meta.decode_groups)
        tables = [
            F.pad(g.block_tables.long(), (0, width - g.block_tables.shape[1])) for g in meta.decode_groups
        ]
        return torch.cat(tables), torch.cat([g.context_lens.long() for g in meta.decode_groups])

    def _compress_decodes(
        self, positions: torch.Tensor, flat: torch.Tensor, slot, dtype: torch.dtype
    ) -> None:
        """The entries of the windows the decodes complete (position + 1 a multiple of the rate)."""
        m = self.rate
        done = ((positions + 1) % m == 0).nonzero().squeeze(1)
        if not done.numel():
            return
        w = (positions[done] + 1) // m - 1
        tok = w[:, None] * m + torch.arange(m, device=flat.device)  # [b, m]
        cur_rows = flat.index_select(0, slot(tok, done).flatten()).view(done.numel(), m, -1)
        prev_rows = None
        if self.kind == CSA:
            prev_rows = flat.index_select(0, slot((tok - m).clamp(min=0), done).flatten()).view(
                done.numel(), m, -1
            )
        self._write_entries(w, cur_rows, prev_rows, slot(positions[done, None], done).squeeze(1), flat, dtype)

    def _attend_decodes(self, q, positions, flat, slot, index_q, index_w) -> torch.Tensor:
        """q [B, h, d] at `positions` [B] -> [B, h, d]: each over its window and completed entries."""
        dev, d, m, b = q.device, self.head_dim, self.rate, q.shape[0]
        k_pos = positions[:, None] - self.window + 1 + torch.arange(self.window, device=dev)  # [B, W]
        mask = k_pos >= 0
        keys = flat.index_select(0, slot(k_pos.clamp(min=0)).flatten())[:, :d].view(b, self.window, d)
        count = (positions + 1) // m if m else None
        n = int(count.max()) if m else 0
        if n:
            w = torch.arange(n, device=dev)[None, :]
            visible = w < count[:, None]
            last = torch.minimum(w * m + m - 1, positions[:, None])  # padding: a row of its own
            entry_rows = flat.index_select(0, slot(last).flatten()).view(b, n, -1)
            if self.indexer is not None:
                _, ib, ie = self.offsets["indexer"]
                visible = self.indexer.select(index_q, index_w, entry_rows[..., ib:ie], visible)
            _, eb, ee = self.offsets["compressor"]
            keys = torch.cat((keys, entry_rows[..., eb:ee]), dim=1)
            mask = torch.cat((mask, visible), dim=1)
        k32 = keys.float()
        scores = torch.matmul(q.float(), k32.transpose(1, 2)) * self.scale  # [B, h, S]
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        sink = self.attn_sink.float().view(1, -1, 1).expand(b, -1, 1)
        logits = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.matmul(probs, k32).to(q.dtype)

    def _slot_fn(self, seg: _Segment, meta: AttentionMetadata, cached: bool):
        """positions of this sequence -> rows of `flat` (the cache's slots, or the step's rows)."""
        if not cached:  # no cache bound: only a prefill without context can run
            return lambda p: p - seg.start + seg.rows.start
        if seg.table is None:
            mapping = meta.slot_mapping[seg.rows]
            return lambda p: mapping[p - seg.start]
        bs, table = self.cache.shape[1], seg.table.long()
        return lambda p: table[p // bs] * bs + p % bs

    def _compress(self, seg: _Segment, flat: torch.Tensor, slots, dtype: torch.dtype) -> None:
        """The entries of the windows this segment's tokens complete, into their last tokens' rows."""
        m = self.rate
        w = torch.arange(seg.start // m, seg.end // m, device=flat.device)
        if not w.numel():
            return
        pos = w[:, None] * m + torch.arange(m, device=flat.device)  # [n, m]
        cur_rows = flat.index_select(0, slots(pos.flatten())).view(w.numel(), m, -1)
        prev_rows = None
        if self.kind == CSA:
            prev_rows = flat.index_select(0, slots((pos - m).clamp(min=0).flatten())).view(w.numel(), m, -1)
        self._write_entries(w, cur_rows, prev_rows, slots(w * m + m - 1), flat, dtype)

    def _write_entries(self, w, cur_rows, prev_rows, last, flat: torch.Tensor, dtype: torch.dtype) -> None:
        """Windows `w` [n] from their tokens' rows [n, rate, width] (and the previous windows'):
        the entries (and index keys), rotated at each window's first position, into rows `last`."""
        rope = self.rotary.lookup(w * self.rate, dtype)
        parts = [("compressor", self.compressor)]
        if self.indexer is not None:
            parts.append(("indexer", self.indexer.compressor))
        for name, comp in parts:
            a, b, e = self.offsets[name]
            prev = None if prev_rows is None else prev_rows[..., a:b]
            entry = comp.compress(cur_rows[..., a:b], prev, w == 0)
            flat[last, b:e] = rotate_tail(entry.unsqueeze(1), rope).squeeze(1).to(flat.dtype)

    def _attend(
        self, q: torch.Tensor, seg: _Segment, flat: torch.Tensor, slots, index_q, index_w
    ) -> torch.Tensor:
        """q [L, h, d] of positions [start, end) -> [L, h, d] over the window and the entries,
        QUERY_BLOCK queries at a time (a long prefill's scores stay [block, h, window + entries])."""
        dev, d, m = q.device, self.head_dim, self.rate
        entries = index_keys = None
        if m and seg.end // m:  # the entries (and index keys) of every window completed by the end
            w = torch.arange(seg.end // m, device=dev)
            entry_rows = flat.index_select(0, slots(w * m + m - 1))
            entries = entry_rows[:, self.offsets["compressor"][1] : self.offsets["compressor"][2]]
            if self.indexer is not None:
                index_keys = entry_rows[:, self.offsets["indexer"][1] : self.offsets["indexer"][2]]
        out = torch.empty_like(q)
        for a in range(seg.start, seg.end, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, seg.end)
            q_pos = torch.arange(a, b, device=dev)
            k_pos = torch.arange(max(0, a - self.window + 1), b, device=dev)
            keys = flat.index_select(0, slots(k_pos))[:, :d]
            mask = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < self.window)
            n = 0 if entries is None else b // m  # the entries these queries may see
            if n:
                visible = torch.arange(n, device=dev)[None, :] < ((q_pos + 1) // m)[:, None]
                if index_keys is not None:
                    rows = slice(seg.rows.start + a - seg.start, seg.rows.start + b - seg.start)
                    visible = self.indexer.select(index_q[rows], index_w[rows], index_keys[:n], visible)
                keys = torch.cat((keys, entries[:n]), dim=0)
                mask = torch.cat((mask, visible), dim=1)
            out[a - seg.start : b - seg.start] = self._softmax_attend(
                q[a - seg.start : b - seg.start], keys, mask
            )
        return out

    def _softmax_attend(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [l, h, d], keys (= values) [S, d], mask [l, S]: float32 softmax with the sinks."""
        k32 = keys.float()
        scores = torch.einsum("lhd,sd->lhs", q.float(), k32) * self.scale
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        sink = self.attn_sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
        logits = torch.cat((scores, sink), dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        return torch.matmul(probs, k32).to(q.dtype)
