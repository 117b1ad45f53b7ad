"""One rank's forward pass over a scheduled batch, and the sampling that follows it.

Serves every launcher: it only needs its groups, its model and a batch. Within one DP
replica the sampled tokens come from the last pipeline stage's TP rank 0 and are broadcast,
so TP and PP ranks can never disagree.
"""

from __future__ import annotations

import torch

from expertmesh.config import EngineConfig
from expertmesh.cpu.native_decode import decoders
from expertmesh.distributed.parallel_groups import ParallelGroups
from expertmesh.engine import kv_cache, state_cache
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.sampler import Sampler, prompt_logprobs, top_logprobs
from expertmesh.engine.scheduler import ScheduledBatch
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from expertmesh.spec_decode.verify import verify


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, groups: ParallelGroups) -> None:
        self.config, self.model, self.groups = config, model, groups
        self.block_size = config.cache_config.block_size
        self.sampler = Sampler(config.seed)
        self.attn_layers = model.attention_layers()
        self.kv: list[torch.Tensor] = []  # one cache tensor per attention layer (engine/kv_cache.py)
        self._workspace: dict | None = None  # decode gather buffers per KV-cache spec, see _gather_buffers
        self.num_blocks = 0
        # Our compiled CPU kernels, if the model builder chose them (models/build.py): decode
        # steps then carry int32 block tables for the in-place paged attention.
        self.kernels = getattr(model, "cpu_kernels", None)
        # Recurrent layers of hybrid models (engine/state_cache.py); [] for attention-only ones.
        self.state_layers = model.state_layers() if hasattr(model, "state_layers") else []
        self.states: list[tuple[torch.Tensor, ...]] = []
        self.num_state_slots = 0
        self.local_state_slots = 0  # what this rank's budget affords, set by local_block_budget
        self.snapshots: state_cache.StateSnapshots | None = None  # hybrid prefix caching
        self.draft_states: state_cache.DraftStates | None = None  # hybrid speculative decoding
        # MTP speculative decoding (the MTP layer sits on the last stage): each step's final hidden
        # states are kept at their KV slots (spec_decode/mtp.py HiddenStore), budgeted per block.
        self.keep_hidden = getattr(model, "mtp", None) is not None
        self.hidden = None

    # ---- KV cache -------------------------------------------------------------------------
    def kv_specs(self) -> list[kv_cache.KVCacheSpec]:
        """What each of this rank's attention layers caches per token (its KV-cache kind)."""
        return [layer.kv_spec for layer in self.attn_layers]

    def bytes_per_token(self) -> int:
        return kv_cache.bytes_per_token(self.kv_specs(), self.config.model_config.dtype)

    def block_bytes(self) -> int:
        mc = self.config.model_config
        kept = self.block_size * self.model.mtp.row_width * mc.dtype.itemsize if self.keep_hidden else 0
        return kv_cache.bytes_per_block(self.kv_specs(), self.block_size, mc.dtype) + kept

    def describe_kv(self) -> str:
        line = kv_cache.describe(self.kv_specs(), self.config.model_config.dtype)
        return state_cache.describe(line, self.state_specs())

    def state_specs(self) -> list[state_cache.StateSpec]:
        return [layer.state_spec for layer in self.state_layers]

    def local_block_budget(self) -> int:
        """KV blocks this rank affords; a hybrid model's state slots (`local_state_slots`) are
        taken from the same budget first."""
        sc, cc = self.config.scheduler_config, self.config.cache_config
        per_block = self.block_bytes()
        # With prefix caching, each sequence slot comes with one state snapshot (StateSnapshots);
        # with speculative decoding, with the states after k draft positions (DraftStates).
        copies = (2 if self.keeps_snapshots() else 1) + self.draft_positions()
        per_seq = state_cache.bytes_per_seq(self.state_specs()) * copies
        useful = sc.max_num_seqs * (-(-sc.max_model_len // self.block_size) * per_block + per_seq)
        budget = kv_cache.kv_budget_bytes(
            cc.kv_cache_memory_bytes, self.config.device, cc.gpu_memory_utilization, useful
        )
        reserve = -(-sc.max_model_len // self.block_size) * per_block  # one full-length sequence
        self.local_state_slots = state_cache.slots_for(
            self.state_specs(), budget, sc.max_num_seqs, reserve, copies
        )
        if not per_block:  # a pipeline stage of recurrent layers only: its blocks cost nothing
            return sc.max_num_seqs * -(-sc.max_model_len // self.block_size)
        return (budget - self.local_state_slots * per_seq) // per_block

    def keeps_snapshots(self) -> bool:
        """Whether a hybrid model's prefix caching keeps recurrent-state snapshots (decided from
        the whole model's config, so every pipeline stage agrees)."""
        cc, mc = self.config.cache_config, self.config.model_config
        return bool(cc.enable_prefix_caching) and "linear_attention" in mc.layer_types

    def draft_positions(self) -> int:
        """k of the speculative config: the draft positions a verify step keeps the recurrent
        state after (0 without speculation)."""
        spec = self.config.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    def rollback_state(self, slot: int, position: int) -> None:
        """A verified sequence's recurrent state set to the one after its verify row `position`
        (its last token and `position` accepted draft tokens; state_cache.DraftStates)."""
        if self.draft_states is not None:
            self.draft_states.rollback(self.states, slot, position)

    def allocate_states(self, num_slots: int, num_snapshots: int = 0) -> None:
        """`num_slots` sequences' recurrent state per recurrent layer, bound to its layer, and
        `num_snapshots` prefix-cache snapshot rows after them (`snapshots`)."""
        self.num_state_slots = num_slots
        self.states = state_cache.allocate(self.state_specs(), num_slots + num_snapshots, self.config.device)
        for layer, tensors in zip(self.state_layers, self.states, strict=True):
            layer.bind_state(tensors)
        self.snapshots = (
            state_cache.StateSnapshots(self.states, num_slots, num_snapshots) if num_snapshots else None
        )
        k = self.draft_positions()
        if k and self.state_layers:
            self.draft_states = state_cache.DraftStates(self.state_specs(), num_slots, k, self.config.device)
            for layer, tensors in zip(self.state_layers, self.draft_states.rows, strict=True):
                layer.bind_draft_states(tensors)

    def allocate_kv(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        specs = self.kv_specs()
        mc = self.config.model_config
        self.kv = kv_cache.allocate(specs, num_blocks, self.block_size, mc.dtype, self.config.device)
        for layer, tensor in zip(self.attn_layers, self.kv, strict=True):
            layer.bind_kv_cache(tensor)
        for native in decoders(self.model):  # their descriptors hold the cache's address
            native.reset()
        if self.keep_hidden:
            from expertmesh.spec_decode.mtp import HiddenStore

            self.hidden = HiddenStore(
                num_blocks, self.block_size, self.model.mtp.row_width, mc.dtype, self.config.device
            )

    # ---- inputs ---------------------------------------------------------------------------
    def prepare(
        self, batch: ScheduledBatch, blocks: BlockManager
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """Inputs of one step: each sequence's tokens from its `num_computed_tokens` on, and the
        rows whose logits are sampled (`last`: only sequences whose last token is computed, in
        `batch.sampled`'s order; a sequence verifying a draft has a row at each of its tokens)."""
        ids, pos, slots, lens, last = [], [], [], [], []
        rows = []  # (sequence, context length) of each decode row
        # Shortest context first, so decode attention can group similar lengths (see _decode_groups);
        # batch.seqs follows, keeping sampled rows aligned. Deterministic: every rank sorts alike.
        batch.decodes.sort(key=lambda s: len(s.block_table))
        for seq in batch.decodes:
            p = seq.num_computed_tokens
            draft = batch.drafts.get(seq.seq_id, [])
            # A draft's tokens (and the positions a preempted sequence replays: batch.replays) are
            # decode rows of the same sequence, each seeing the positions up to its own: every KV
            # row is stored before attention reads any, so they are causal.
            end = p + batch.num_new[seq.seq_id]
            ids.extend(seq.tokens(p, end - len(draft)) + draft)
            for q in range(p, end):
                pos.append(q)
                slots.append(blocks.slot(seq, q))
                lens.append(q + 1)
                rows.append((seq, q + 1))
                if draft or (q == end - 1 and batch.completes(seq)):
                    last.append(len(ids) - (end - q))
        prefills = []
        for seq in batch.prefills:
            c, n = seq.num_computed_tokens, batch.num_new[seq.seq_id]
            table = torch.tensor(seq.block_table[: -(-(c + n) // self.block_size)]) if c else None
            prefills.append(PrefillChunk(len(ids), n, c, table))
            ids.extend(seq.tokens(c, c + n))
            pos.extend(range(c, c + n))
            slots.extend(blocks.slot(seq, p) for p in range(c, c + n))
            # Every chunk rotates by the length the whole prefill reaches, as one unchunked prefill does.
            lens.extend([seq.num_tokens] * n)
            if batch.completes(seq):
                last.append(len(ids) - 1)
        meta = self._attention_metadata(rows, slots, prefills)
        meta.seq_lens = torch.tensor(lens)
        ctx = ForwardContext(meta, [len(ids)])
        if self.state_layers:
            ctx.state_slots = torch.tensor([s.state_slot for s in batch.decodes + batch.prefills])
            if batch.drafts or batch.replays:  # the recurrent layers step these rows position by position
                ctx.state_rows = [batch.num_new[s.seq_id] for s in batch.decodes]
        return self._on_device(ids, pos, ctx, last)

    def _on_device(
        self, ids: list[int], pos: list[int], ctx: ForwardContext, last: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """The step's inputs, built on the CPU, on the device the model runs on."""
        device = self.config.device
        ctx.attn.to(device)
        if ctx.state_slots is not None:
            ctx.state_slots = ctx.state_slots.to(device)
        return torch.tensor(ids, device=device), torch.tensor(pos, device=device), ctx, last

    def _attention_metadata(
        self, rows: list[tuple], slots: list[int], prefills: list[PrefillChunk]
    ) -> AttentionMetadata:
        slots_t = torch.tensor(slots, dtype=torch.long)
        if self.kernels is not None:
            tables, lens = self._decode_tables(rows)
            return AttentionMetadata(slots_t, len(rows), [], prefills, None, tables, lens)
        groups = self._decode_groups(rows)
        most = max((g.block_tables.numel() for g in groups), default=0)
        buffers = self._gather_buffers(most) if groups else None
        return AttentionMetadata(slots_t, len(rows), groups, prefills, buffers)

    @staticmethod
    def _tables_and_lengths(rows: list[tuple], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables [B, widest] (zero-padded) and context lengths [B] of decode `rows`
        ((sequence, its computed tokens and the row's own) each)."""
        width = max(len(s.block_table) for s, _ in rows)
        tables = torch.tensor(
            [s.block_table + [0] * (width - len(s.block_table)) for s, _ in rows], dtype=dtype
        )
        return tables, torch.tensor([n for _, n in rows], dtype=dtype)

    def _decode_tables(self, rows: list[tuple]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """int32 tables and lengths of every decode row, for the paged-decode kernel."""
        return self._tables_and_lengths(rows, torch.int32) if rows else (None, None)

    def _decode_groups(self, rows: list[tuple]) -> list[DecodeGroup]:
        """Consecutive decode rows (sorted by length in prepare) while the widest stays <= 2x the first."""
        groups, start = [], 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and len(rows[end][0].block_table) <= 2 * len(rows[start][0].block_table):
                end += 1
            tables, lens = self._tables_and_lengths(rows[start:end], torch.long)
            # Each layer takes its key mask (window, chunk) from the group, built once per kind.
            groups.append(DecodeGroup(start, end, tables, lens, self.block_size))
            start = end
        return groups

    def _gather_buffers(self, num_blocks: int) -> dict:
        """Per KV-cache spec, its planes' gather buffers for `num_blocks` blocks, grown (doubling)
        and then reused: {spec: (K buffer, V buffer) or (latent buffer,)}."""
        ws = self._workspace or {}
        out = {}
        for spec, cache in zip(self.kv_specs(), self.kv, strict=True):
            if spec in out:
                continue
            buf = ws.get(spec)
            if buf is None or buf.shape[1] < num_blocks:
                rows = max(num_blocks, 2 * (0 if buf is None else buf.shape[1]))
                buf = ws[spec] = torch.empty(
                    spec.layer_shape(rows, self.block_size), dtype=cache.dtype, device=cache.device
                )
            out[spec] = tuple(plane[:num_blocks] for plane in buf)
        self._workspace = ws
        return out

    def dummy_inputs(self) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, list[int]]:
        """One token written to the scratch block: keeps a rank with no work in lockstep."""
        scratch = self.num_blocks * self.block_size
        meta = AttentionMetadata(torch.tensor([scratch]), 0, [], [PrefillChunk(0, 1)])
        return self._on_device([0], [0], ForwardContext(meta, [1]), [0])

    # ---- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        ctx: ForwardContext,
        last: list[int],
        extra: list[int] = (),
    ) -> torch.Tensor | None:
        """Runs this rank's stage; returns float32 logits [B, V] on the last stage, else None: the
        rows `last` (sampled), then the rows `extra` (prompt logprobs)."""
        pp = self.groups.pp
        if (
            pp.world_size == 1
            and len(last) == ids.shape[0]
            and not extra
            and not ctx.attn.prefills
            and not self.keep_hidden
        ):  # every row sampled: a decode-only step (its native path returns no hidden states)
            logits = self.model.decode_logits(ids, pos, ctx)
            if logits is not None:
                return logits
        hidden = None
        if pp.rank_in_group > 0:
            mc = self.config.model_config
            # per token: the hidden state, or the model's whole residual (DeepSeek-V4: hc_mult streams)
            shape = self.model.stage_shape
            hidden = pp.recv(torch.empty(ids.shape[0], *shape, dtype=mc.dtype), pp.rank_in_group - 1)
        hidden = self.model(ids, pos, ctx, hidden)
        if self.keep_hidden:  # the last stage: what the MTP layer reads at these positions
            self.hidden.write(ctx.attn.slot_mapping, self.model.mtp.rows(self.model, hidden))
        if pp.rank_in_group < pp.world_size - 1:
            pp.send(hidden, pp.rank_in_group + 1)
            return None
        if not last and not extra:  # only partial prefill chunks: nothing to sample (alike on every rank)
            return None
        return self.model.compute_logits(hidden[list(last) + list(extra)]).float()

    @staticmethod
    def prompt_logprob_rows(batch, ctx: ForwardContext) -> list[tuple[object, list[int], int]]:
        """(sequence, rows, first prompt token index they score) for each prefill chunk of a
        sequence asking for prompt logprobs: a position's logits score the next prompt token."""
        out = []
        for seq, chunk in zip(batch.prefills, ctx.attn.prefills, strict=True):
            if seq.prompt_logprobs is None:
                continue
            end = min(
                chunk.context + chunk.length, len(seq.prompt_token_ids) - 1
            )  # last position scores none
            if end > chunk.context:
                rows = list(range(chunk.start, chunk.start + end - chunk.context))
                out.append((seq, rows, chunk.context + 1))
        return out

    def sample(
        self,
        logits: torch.Tensor | None,
        seqs: list,
        prompt: list = (),
        drafts: list[list[int]] | None = None,
    ) -> tuple[list, list, list]:
        """Tokens, their logprobs and the prompt logprobs `prompt` (prompt_logprob_rows) asked for,
        chosen on the last stage's TP rank 0, known to every rank of the replica. With `drafts`
        (per sequence, possibly empty: a step that verifies drafts), each sequence's tokens and
        logprobs are lists: the accepted draft tokens and the one after (spec_decode/verify.py)."""
        if not seqs and not prompt:  # every rank of the replica scheduled the same batch: all return here
            return [], [], []
        payload = None
        if logits is not None and drafts is not None:
            rows = len(seqs) + sum(len(d) for d in drafts)
            tokens, lps = verify(logits[:rows], seqs, drafts, self.sampler)
            payload = (tokens, lps, prompt_logprobs(logits[rows:], prompt))
        elif logits is not None:
            tokens = self.sampler(logits[: len(seqs)], seqs) if seqs else []
            payload = (
                tokens,
                top_logprobs(logits[: len(seqs)], seqs, tokens) if seqs else [],
                prompt_logprobs(logits[len(seqs) :], prompt),
            )
        if self.groups.tp.world_size > 1 and logits is not None:
            payload = self.groups.tp.broadcast_object(payload, 0)
        if self.groups.pp.world_size > 1:
            payload = self.groups.pp.broadcast_object(payload, self.groups.pp.world_size - 1)
        return payload
