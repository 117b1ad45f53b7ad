"""Multi-token-prediction (MTP) drafts: the MTP layer DeepSeek-V3 / R1 and GLM-4.5 ship after their last
decoder layer (checkpoint `model.layers.{num_hidden_layers}.*`; Qwen3-Next's / Qwen3.5's `mtp.*`, read
under those names: spec_decode/mtp_families.py), as vLLM's and SGLang's MTP run it:

    h = eh_proj(cat(enorm(embed(t[i+1])), hnorm(h_target[i])))     # embedding first, then hidden
    h = decoder_layer(h)                                             # the target's layer kind
    logits = shared_head.head(shared_head.norm(h))                   # predicts t[i+2]

h_target[i] is the target model's final-normed hidden state at position i (what its lm_head reads).
The embedding is the target's (`model.embed_tokens`; the checkpoint's copy under the MTP layer is
the same tensor); on a last pipeline stage, which holds no embedding, the MTP layer loads that copy
as its own (Qwen's checkpoints have none: the target's). Qwen's layer has no head of its own (the
target's lm_head) and applies its norm inside the layer, so a chained step reads the normed output.
A draft of k > 1 chains the one layer: the layer's own output h at the last position and
the drafted token extend its input, as vLLM does.

Hidden states: the model runner writes every computed position's h_target row into a paged store
beside the KV cache (`ModelRunner.hidden`, one row per KV slot, budgeted with the KV blocks), so a
block found in the prefix cache brings the hidden states of its tokens: a sequence that hits the
cache drafts like any other (its first draft computes the MTP rows of the cached positions).

KV cache: each sequence keeps the MTP layer's K/V rows in a small cache of its own (`seq.mtp_kv`,
grown by doubling, freed with the sequence) rather than a slot in the paged cache. MTP position i's
row depends only on t[i+1] and h[i], both final once t[i+1] is accepted, so each draft step computes
only the positions added since the last one (a prefill chunk over the cached context); rows of
chained drafts are past `seq.mtp_done` and are overwritten later.

Layouts: the layer lives on the last pipeline stage (with the final hidden states and the head),
sliced per TP rank like the target's layers; its MoE block dispatches over the same EP group. Each
step the scheduler first plans every draft's length (`plan`: known before the layer runs), then
`run` computes them all: under DP the replicas' last-stage ranks agree on the number and token count
of their MTP forwards (one all_gather_object a step), a replica with fewer runs one-token dummies;
the drafts are taken from TP rank 0 and broadcast from the last stage to the other stages.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.engine import kv_cache
from expertmesh.engine.sequence import Sequence
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.attention import AttentionMetadata, PrefillChunk
from expertmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.norm import NORMS
from expertmesh.registries import lookup


def _with_mtp_layer(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the MTP layer's index num_layers in its per-layer lists: the last layer's kind
    (DeepSeek-V3.2's indexed attention), full attention after a recurrent last layer."""
    if not cfg.layer_types and not cfg.rope_layers:
        return cfg
    kind = cfg.layer_types[-1] if cfg.layer_types else None
    if kind == "linear_attention":
        kind = "full_attention"
    return replace(
        cfg,
        num_layers=cfg.num_layers + 1,
        layer_types=(*cfg.layer_types, kind) if kind else (),
        rope_layers=(*cfg.rope_layers, cfg.rope_layers[-1]) if cfg.rope_layers else (),
    )


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, norm: Any, tp: Any, head: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.head = (
            head
            if head is not None
            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, False, tp, cfg.dtype)
        )


class MTPLayer(nn.Module):
    """One MTP layer (parameters `mtp.*`; the loader maps `model.layers.{n}.*` onto them)."""

    def __init__(self, cfg: ModelConfig, family: Any, env: Any, lm_head: nn.Module | None = None) -> None:
        """`lm_head`: the target's head, which Qwen3-Next's / Qwen3.5's MTP layer predicts with (it
        has none of its own; DeepSeek's and GLM's carry shared_head.head)."""
        super().__init__()
        from expertmesh.models.decoder import DecoderLayer  # models import spec_decode's config
        from expertmesh.spec_decode.mtp_families import mtp_family

        norm = lookup(NORMS, family.norm, "norm")
        h, tp = cfg.hidden_size, env.groups.tp
        self.enorm, self.hnorm = norm(h, cfg.norm_eps, cfg.dtype), norm(h, cfg.norm_eps, cfg.dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, cfg.dtype)
        layer_cfg = _with_mtp_layer(cfg)
        declared = mtp_family(cfg.architecture)
        # LongCat-Flash's MTP layer (vLLM's longcat_flash_mtp.py) is a plain decoder layer of the
        # family's attention (MLA) and one dense MLP, not the target's shortcut-MoE layer.
        self.own_embedding = declared.dense_layer
        if self.own_embedding:
            layer_cfg = replace(layer_cfg, moe_layers=())
        self.layer = DecoderLayer(layer_cfg, cfg.num_layers, family, env)
        # Qwen's and LongCat's layers (vLLM's qwen3_next_mtp.py, longcat_flash_mtp.py): the target's
        # head, and the final norm inside the layer, so a chained draft step reads the normed output
        # (DeepSeek's reads it before the norm).
        self.normed_output = declared.target_head
        self.shared_head = SharedHead(cfg, norm, tp, lm_head if self.normed_output else None)
        # A later pipeline stage has no target embedding: it loads the MTP layer's copy; LongCat's
        # layer always embeds with its own copy (model.mtp.embed_tokens), as vLLM loads it.
        self.embed_tokens = (
            None
            if env.is_first_stage and not self.own_embedding
            else VocabParallelEmbedding(cfg.vocab_size, h, tp, cfg.dtype)
        )
        self.index = cfg.num_layers
        self.row_width, self.dtype = h, cfg.dtype  # a hidden row the runner keeps per position
        self._scratch: list[torch.Tensor] | None = None  # the K/V rows of lockstep dummies

    def attach(self, model: nn.Module) -> None:
        """Called once the target is built (a family whose MTP layer reads more than its final
        hidden states asks the target to keep them)."""

    def rows(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """What the runner keeps per computed position: the target's final hidden states."""
        return hidden

    def cache_for(self, seq: Any, tokens: int, block_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """`seq`'s MTP cache, one tensor per cache slot of the layer (MLA's latent, DSA's index keys
        too), grown (doubling, rows kept) to hold `tokens` positions."""
        cache: list[torch.Tensor] | None = getattr(seq, "mtp_kv", None)
        have = 0 if cache is None else cache[0].shape[1] - 1  # allocate adds one scratch block
        need = -(-tokens // block_size)
        if need > have:
            blocks = max(need, 2 * have)
            specs = [layer.kv_spec for layer in self.layer.kv_layers()]
            grown = kv_cache.allocate(specs, blocks, block_size, dtype, str(self.enorm.weight.device))
            for new, old in zip(grown, cache or [], strict=False):
                new[:, :have] = old[:, :have]
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
        cache: list[torch.Tensor],
        block_size: int,
        counts: list[int] | None = None,
    ) -> torch.Tensor:
        """The layer's output h [m, H] at MTP positions context..context+m-1 (ids[j] = t[context+j+1],
        hidden[j] = h[context+j]), each attending to the cached positions before `context` and to the
        new ones up to its own; their K/V rows are stored in `cache` (slot = position). `counts`: the
        tokens of this forward on every DP rank (their MoE dispatch sizes), [m] in one replica."""
        x = self.eh_proj(torch.cat([self.enorm(embed(ids)), self.hnorm(hidden)], dim=-1))
        pos, ctx = self._context(cache, x, context, block_size, counts, rotary)
        h = self.layer(pos, x, ctx)
        return self.shared_head.norm(h) if self.normed_output else h

    def _context(
        self, cache: list[torch.Tensor], x: torch.Tensor, context: int, block_size: int,
        counts: list[int] | None, rotary: Any,
    ) -> tuple[torch.Tensor, ForwardContext]:  # fmt: skip
        """The positions and forward context of m = len(x) new MTP positions from `context` on, over
        `cache` (bound to the layer; slot = position)."""
        m, dev = x.shape[0], x.device
        for layer, tensor in zip(self.layer.kv_layers(), cache, strict=True):
            layer.bind_kv_cache(tensor)
        pos = torch.arange(context, context + m, device=dev)
        table = torch.arange(-(-(context + m) // block_size), device=dev) if context else None
        meta = AttentionMetadata(pos.clone(), 0, [], [PrefillChunk(0, m, context, table)])
        meta.seq_lens = torch.full((m,), context + m, device=dev)
        ctx = ForwardContext(meta, list(counts) if counts is not None else [m], count_load=False)
        if rotary is not None:  # None: the layer rotates by itself (DeepSeek-V4)
            ctx.rope = rotary.lookup(pos, x.dtype, meta.seq_lens if rotary.length_dependent else None)
        return pos, ctx

    def dummy(self, embed: nn.Module, rotary: Any, block_size: int, counts: list[int]) -> None:
        """A one-token forward that keeps a DP replica with no draft to compute in lockstep."""
        dtype = self.dtype
        if self._scratch is None:
            self._scratch = self.cache_for(nn.Module(), 1, block_size, dtype)
        dev = self.enorm.weight.device
        hidden = torch.zeros(1, self.row_width, dtype=dtype, device=dev)
        token = torch.zeros(1, dtype=torch.long, device=dev)
        self(embed, rotary, token, hidden, 0, self._scratch, block_size, counts)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(h if self.normed_output else self.shared_head.norm(h)).float()


class HiddenStore:
    """The target's final hidden state at every KV slot ([slots, H], one row per cache slot plus the
    scratch block's): written by the model runner where the step's KV rows go, so rows follow the
    blocks (rolled back with them, shared through the prefix cache); a slot's row is current for as
    long as its KV row is."""

    def __init__(self, num_blocks: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: Any) -> None:  # fmt: skip
        self.rows = torch.zeros((num_blocks + 1) * block_size, hidden_size, dtype=dtype, device=device)
        self.block_size = block_size

    def write(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        self.rows[slots] = hidden

    def read(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Rows of `seq`'s positions start..end-1 (all computed)."""
        pos = torch.arange(start, end, device=self.rows.device)
        table = torch.tensor(seq.block_table, dtype=torch.long, device=self.rows.device)
        return self.rows[table[pos // self.block_size] * self.block_size + pos % self.block_size]


class MTPProposer:
    """Drafts by the MTP layer of `model` (a CausalLM holding `.mtp` on the last pipeline stage):
    greedy, k tokens chained. `runner`: the model runner (its hidden store and groups)."""

    def __init__(self, runner: Any, k: int, block_size: int) -> None:
        self.runner, self.model, self.k, self.block_size = runner, runner.model, k, block_size
        groups = runner.groups
        self.tp, self.pp, self.dp = groups.tp, groups.pp, groups.dp
        self.last_stage = self.pp.rank_in_group == self.pp.world_size - 1

    def plan(self, seq: Sequence, limit: int) -> int:
        """How many tokens `seq` drafts this step (known before the layer runs, alike on every rank
        of the replica): min(k, limit) once its hidden states are computed up to its last token."""
        n = seq.num_tokens
        if seq.num_computed_tokens != n - 1 or n < 2:
            return 0
        return max(0, min(self.k, limit))

    def run(self, planned: list[tuple[Sequence, int]]) -> list[list[int]]:
        """The drafts of `planned` ((sequence, length) each), on every rank of the replica. Every
        rank calls this each step (under DP even with nothing planned: the lockstep)."""
        drafts: list[list[int]] | None = None
        if self.last_stage:
            drafts = self._compute(planned)
            if self.tp.world_size > 1 and planned:
                drafts = self.tp.broadcast_object(drafts, 0)  # rank 0's: ranks cannot disagree
        if self.pp.world_size > 1 and planned:
            drafts = self.pp.broadcast_object(drafts, self.pp.world_size - 1)
        return drafts if drafts is not None else []

    def _compute(self, planned: list[tuple[Sequence, int]]) -> list[list[int]]:
        """The drafts on a last-stage rank; under DP, in lockstep with the other replicas."""
        mtp, inner = self.model.mtp, self.model.model
        embed = mtp.embed_tokens if mtp.embed_tokens is not None else inner.embed_tokens
        rotary = getattr(inner, "rotary", None)  # DeepSeek-V4's attention rotates by itself
        # MTP positions done (their K/V cached) up to n - 2, the last one run again for its output.
        starts = [min(getattr(seq, "mtp_done", 0), seq.num_tokens - 2) for seq, _ in planned]
        sizes = [  # catch-up positions, then one per chained token
            s
            for (seq, k), d in zip(planned, starts, strict=True)
            for s in [seq.num_tokens - 1 - d] + [1] * (k - 1)
        ]
        table = None
        if self.dp.world_size > 1:
            table = self.dp.all_gather_object(sizes)  # every replica's forwards, in its order
        call = 0

        def counts() -> list[int] | None:
            if table is None:
                return None
            return [row[call] if call < len(row) else 1 for row in table]  # 1: a dummy's token

        drafts = []
        for (seq, k), done in zip(planned, starts, strict=True):
            n = seq.num_tokens
            cache = mtp.cache_for(seq, n - 1 + k, self.block_size, self.model.cfg.dtype)
            ids = torch.tensor(seq.tokens(done + 1, n), device=self.runner.hidden.rows.device)
            h_in = self.runner.hidden.read(seq, done, n - 1)
            draft: list[int] = []
            for j in range(k):
                context = done if j == 0 else n - 2 + j
                h = mtp(embed, rotary, ids, h_in, context, cache, self.block_size, counts())
                call += 1
                if j == 0:
                    seq.mtp_done = n - 1  # rows past it (chained drafts) are overwritten later
                token = int(mtp.logits(h[-1:]).argmax(dim=-1))
                draft.append(token)
                ids, h_in = torch.tensor([token], device=h.device), h[-1:]
            drafts.append(draft)
        while table is not None and call < max(len(row) for row in table):
            mtp.dummy(embed, rotary, self.block_size, counts())
            call += 1
        return drafts
