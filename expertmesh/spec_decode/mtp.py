"""Multi-token-prediction (MTP) drafts: the MTP layer DeepSeek-V3 / R1 and GLM-4.5 ship after their last
decoder layer (checkpoint `model.layers.{num_hidden_layers}.*`), as vLLM's and SGLang's MTP run it:

    h = eh_proj(cat(enorm(embed(t[i+1])), hnorm(h_target[i])))     # embedding first, then hidden
    h = decoder_layer(h)                                             # the target's layer kind
    logits = shared_head.head(shared_head.norm(h))                   # predicts t[i+2]

h_target[i] is the target model's final-normed hidden state at position i (what its lm_head reads).
The embedding is the target's (`model.embed_tokens`; the checkpoint's copy under the MTP layer is
the same tensor and is not loaded). A draft of k > 1 chains the one layer: the layer's own output h
at the last position and the drafted token extend its input, as vLLM does.

KV cache: each sequence keeps the MTP layer's K/V rows in a small cache of its own (`seq.mtp_kv`,
grown by doubling, freed with the sequence) rather than a slot in the paged cache. MTP position i's
row depends only on t[i+1] and h[i], both final once t[i+1] is accepted, so each draft step computes
only the positions added since the last one (a prefill chunk over the cached context); rows of
chained drafts are past `seq.mtp_done` and are overwritten later.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.engine import kv_cache
from expertmesh.engine.sequence import Sequence
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.attention import AttentionMetadata, PrefillChunk
from expertmesh.layers.embedding import ParallelLMHead
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.norm import NORMS
from expertmesh.registries import lookup


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, norm: Any, tp: Any) -> None:
        super().__init__()
        self.norm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, False, tp, cfg.dtype)


class MTPLayer(nn.Module):
    """One MTP layer (parameters `mtp.*`; the loader maps `model.layers.{n}.*` onto them)."""

    def __init__(self, cfg: ModelConfig, family: Any, env: Any) -> None:
        super().__init__()
        from expertmesh.models.decoder import DecoderLayer  # models import spec_decode's config

        norm = lookup(NORMS, family.norm, "norm")
        h = cfg.hidden_size
        self.enorm, self.hnorm = norm(h, cfg.norm_eps, cfg.dtype), norm(h, cfg.norm_eps, cfg.dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, cfg.dtype)
        self.layer = DecoderLayer(cfg, cfg.num_layers, family, env)
        self.shared_head = SharedHead(cfg, norm, env.groups.tp)
        self.index = cfg.num_layers

    def kv_layer(self) -> Any:
        (attn,) = self.layer.kv_layers()
        return attn

    def cache_for(self, seq: Sequence, tokens: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """`seq`'s MTP cache, grown (doubling, rows kept) to hold `tokens` positions."""
        cache: torch.Tensor | None = getattr(seq, "mtp_kv", None)
        have = 0 if cache is None else cache.shape[1] - 1  # allocate adds one scratch block
        need = -(-tokens // block_size)
        if need > have:
            blocks = max(need, 2 * have)
            spec, device = self.kv_layer().kv_spec, str(self.enorm.weight.device)
            (grown,) = kv_cache.allocate([spec], blocks, block_size, dtype, device)
            if cache is not None:
                grown[:, :have] = cache[:, :have]
            cache = seq.mtp_kv = grown
        return cache

    @torch.inference_mode()
    def forward(
        self,
        embed: nn.Module,
        rotary: Any,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        context: int,
        cache: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        """The layer's output h [m, H] at MTP positions context..context+m-1 (ids[j] = t[context+j+1],
        hidden[j] = h[context+j]), each attending to the cached positions before `context` and to the
        new ones up to its own; their K/V rows are stored in `cache` (slot = position)."""
        m = ids.shape[0]
        self.kv_layer().bind_kv_cache(cache)
        x = self.eh_proj(torch.cat([self.enorm(embed(ids)), self.hnorm(hidden)], dim=-1))
        dev = x.device
        pos = torch.arange(context, context + m, device=dev)
        table = torch.arange(-(-(context + m) // block_size), device=dev) if context else None
        meta = AttentionMetadata(pos.clone(), 0, [], [PrefillChunk(0, m, context, table)])
        meta.seq_lens = torch.full((m,), context + m, device=dev)
        ctx = ForwardContext(meta, [m], count_load=False)
        ctx.rope = rotary.lookup(pos, x.dtype, meta.seq_lens if rotary.length_dependent else None)
        return self.layer(pos, x, ctx)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(self.shared_head.norm(h)).float()


class HiddenHistory:
    """Per sequence, the target's hidden state at each computed position (what the MTP layer reads).
    Rows are written by position as the model runner computes them; rows at or past a sequence's
    computed tokens (rejected draft rows) are stale and rewritten when recomputed."""

    @staticmethod
    def write(seq: Sequence, first_pos: int, rows: torch.Tensor) -> None:
        buf: torch.Tensor | None = getattr(seq, "mtp_hidden", None)
        end = first_pos + rows.shape[0]
        if buf is None or buf.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if buf is None else buf.shape[0]), 16), rows.shape[1],
                                dtype=rows.dtype, device=rows.device)  # fmt: skip
            if buf is not None:
                grown[: buf.shape[0]] = buf
            buf = seq.mtp_hidden = grown
        buf[first_pos:end] = rows
        known = getattr(seq, "mtp_known", 0)
        if first_pos <= known:  # contiguous from position 0 (a prefix-cache hit leaves a gap)
            seq.mtp_known = max(known, end)

    @staticmethod
    def read(seq: Sequence, upto: int) -> torch.Tensor | None:
        """Rows 0..upto-1, or None where some were never computed for this sequence."""
        if min(getattr(seq, "mtp_known", 0), seq.num_computed_tokens) < upto:
            return None
        return seq.mtp_hidden[:upto]


class MTPProposer:
    """Drafts by the MTP layer of `model` (a CausalLM holding `.mtp`): greedy, k tokens chained."""

    def __init__(self, model: nn.Module, k: int, block_size: int, tp: Any = None) -> None:
        self.model, self.k, self.block_size = model, k, block_size
        # TP ranks hold the same sequences and call this in the same order (the layer's collectives
        # run in lockstep); the draft is taken from rank 0, so ranks cannot disagree on it.
        self.tp = tp if tp is not None and tp.world_size > 1 else None

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        n = seq.num_tokens
        if seq.num_computed_tokens != n - 1 or n < 2:
            return []
        hidden = HiddenHistory.read(seq, n - 1)
        if hidden is None:
            return []
        mtp, inner = self.model.mtp, self.model.model
        k = min(self.k, limit)
        cache = mtp.cache_for(seq, n - 1 + k, self.block_size, hidden.dtype)
        # MTP positions done (their K/V cached) up to n - 2, the last one run again for its output.
        done = min(getattr(seq, "mtp_done", 0), n - 2)
        ids, h_in = torch.tensor(seq.tokens(done + 1, n), device=hidden.device), hidden[done : n - 1]
        draft: list[int] = []
        for j in range(k):
            h = mtp(inner.embed_tokens, inner.rotary, ids, h_in, done if j == 0 else n - 2 + j, cache,
                    self.block_size)  # fmt: skip
            if j == 0:
                seq.mtp_done = n - 1  # rows past it (chained drafts) are overwritten later
            token = int(mtp.logits(h[-1:]).argmax(dim=-1))
            draft.append(token)
            ids, h_in = torch.tensor([token], device=h.device), h[-1:]
        return draft if self.tp is None else self.tp.broadcast_object(draft, 0)
