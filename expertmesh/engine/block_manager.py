"""Fixed-size KV blocks, shared by reference count, with automatic prefix caching.

A block is free (reference count 0) or held by the sequences that share it. With prefix caching
on, a block full of computed tokens gets a key: sha256 of its parent block's key and its own
tokens, so one key names the whole prefix up to the block's end. A new sequence starts from the
longest run of its leading full blocks whose keys are cached (the hits), sharing those blocks;
its other blocks are new. A freed block keeps its key and stays reusable: free blocks without a
key are handed out first, then cached ones, least recently freed first (LRU), and a cached block
handed out is evicted (its key forgotten). A sequence frees its blocks last first, so the tail of
a prompt is evicted before the head others may share.

Hybrid models (engine/state_cache.py): with `state_slots`, each sequence also holds one slot of
recurrent state from its first blocks to its release; a sequence without a free slot waits.
With prefix caching they keep `snapshots` of the state: when a step leaves a sequence's computed
tokens at a block boundary, the state is copied to a snapshot under that block's key (the least
recently used snapshot gives way when none is free; an evicted block takes its snapshot with
it). A hit then ends at the last cached block that has a snapshot, and the sequence's slot starts
as a copy of it. So that a prompt's last full block gets one, a prefill chunk stops there
(`chunk_end`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict

from expertmesh.engine.sequence import Sequence
from expertmesh.engine.state_cache import StateSnapshots


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        state_slots: int = 0,
        snapshots: StateSnapshots | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache holds {num_blocks} blocks; at least 1 is needed")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> the block that holds it
        # Free blocks in the order they are handed out (keyless first, then cached ones by LRU).
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # tokens looked up / found
        self.state_slots = state_slots
        self.free_slots: list[int] = list(range(state_slots - 1, -1, -1))  # popped from the end
        # key -> snapshot index, least recently used first; free snapshot indices
        self.snapshots = snapshots if enable_prefix_caching else None
        self.snapshot_of: OrderedDict[bytes, int] = OrderedDict()
        self.free_snapshots: list[int] = list(range(snapshots.count - 1, -1, -1)) if self.snapshots else []
        # Deterministic mode: only blocks of prompt tokens are offered to the cache. A decoded
        # position's KV (and a recurrent state after it) came from decode steps, whose bits a
        # request prefilling the same tokens (a chat's next turn) would not compute.
        self.prompt_blocks_only = False

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks for `seq` to hold `num_tokens` tokens of K/V."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"sequence {seq.seq_id} needs {need} KV blocks, {self.num_free} are free")
        seq.block_table.extend(self._new_block() for _ in range(need))

    def _new_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        key = self.block_keys[block]
        if key is not None:  # evict: the cached prefix it held is gone, its state snapshot too
            del self.cached[key]
            self.block_keys[block] = None
            snap = self.snapshot_of.pop(key, None)
            if snap is not None:
                self.free_snapshots.append(snap)
        self.ref_counts[block] = 1
        return block

    # ---- prefix cache -----------------------------------------------------------------------
    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of `seq`'s first `num_blocks` full blocks (kept on the sequence: tokens of a
        full block never change, preemption included)."""
        bs = self.block_size
        for i in range(len(seq.block_keys), num_blocks):
            parent = seq.block_keys[i - 1] if i else b""
            tokens = array("q", seq.tokens(i * bs, (i + 1) * bs)).tobytes()
            seq.block_keys.append(hashlib.sha256(parent + tokens).digest())
        return seq.block_keys[:num_blocks]

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached run of a not yet scheduled `seq`'s leading full
        blocks, leaving at least its last token to compute (its logits are needed)."""
        if not self.enable_prefix_caching or seq.block_table:
            return []
        if seq.params.prompt_logprobs is not None:  # every prompt position's logits are needed
            return []
        hits, keys = [], self.keys(seq, (seq.num_tokens - 1) // self.block_size)
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            hits.append(block)
        if self.snapshots is not None:  # recurrent state: only up to the last block with a snapshot
            while hits and keys[len(hits) - 1] not in self.snapshot_of:
                hits.pop()
        return hits

    def chunk_end(self, seq: Sequence, start: int, n: int) -> int:
        """Tokens of a prefill chunk from `start`: `n`, or fewer so the chunk ends at the sequence's
        last full block (where its state snapshot is taken) when it would pass it."""
        if self.snapshots is None or n <= 1:
            return n
        boundary = (seq.num_tokens - 1) // self.block_size * self.block_size
        return boundary - start if start < boundary < start + n else n

    def can_allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Whether `seq` can start from `hits` and hold `num_tokens` tokens."""
        need = -(-num_tokens // self.block_size) - len(hits)
        reclaimed = sum(1 for b in hits if self.ref_counts[b] == 0)  # hits now on the free list
        if self.state_slots and not self.free_slots:
            return False
        return need <= self.num_free - reclaimed

    def allocate(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """First blocks of a waiting `seq`: the shared `hits`, then new ones up to `num_tokens`."""
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
        seq.block_table = list(hits)
        if self.state_slots:
            seq.state_slot = self.free_slots.pop()
            if hits and self.snapshots is not None:  # the state after the last hit block
                key = self.block_keys[hits[-1]]
                self.snapshot_of.move_to_end(key)
                self.snapshots.restore(self.snapshot_of[key], seq.state_slot)
        seq.num_keyed_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        self.grow(seq, num_tokens)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key `seq`'s blocks that are now full of computed tokens (called after each step). A
        block whose prefix another block already holds stays keyless (both were computed at once)."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if self.prompt_blocks_only:
            full = min(full, len(seq.prompt_token_ids) // self.block_size)
        if not self.enable_prefix_caching or full <= seq.num_keyed_blocks:
            return
        keys = self.keys(seq, full)
        for i in range(seq.num_keyed_blocks, full):
            block = seq.block_table[i]
            if self.block_keys[block] is None and keys[i] not in self.cached:
                self.block_keys[block] = keys[i]
                self.cached[keys[i]] = block
        seq.num_keyed_blocks = full
        if self.snapshots is not None and seq.state_slot is not None:
            if seq.num_computed_tokens == full * self.block_size:  # the state is at a block's end
                self._snapshot(seq.state_slot, keys[full - 1])

    def _snapshot(self, slot: int, key: bytes) -> None:
        if key in self.snapshot_of or key not in self.cached:
            return
        if not self.free_snapshots:  # the least recently used snapshot gives way
            if not self.snapshot_of:
                return
            _, snap = self.snapshot_of.popitem(last=False)
            self.free_snapshots.append(snap)
        snap = self.free_snapshots.pop()
        self.snapshots.save(slot, snap)
        self.snapshot_of[key] = snap

    # ---- release ----------------------------------------------------------------------------
    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Free `seq`'s blocks past the first `num_tokens` tokens (speculative decoding's rollback of
        rejected draft tokens). They are past its computed tokens, so none of them is keyed."""
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            assert self.block_keys[block] is None, f"block {block} past the accepted tokens is cached"
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
                self.free_blocks.move_to_end(block, last=False)  # nothing to keep: reused first
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None  # most recently used: evicted last
                if self.block_keys[block] is None:
                    self.free_blocks.move_to_end(block, last=False)  # nothing to keep: reused first
        seq.block_table = []
        seq.num_computed_tokens = seq.num_keyed_blocks = 0
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_problems(self, held: list[int]) -> list[str]:
        """What is wrong with the state slots, given the slots queued sequences hold."""
        if sorted(held + self.free_slots) != list(range(self.state_slots)):
            return [f"state slots held {sorted(held)} and free {sorted(self.free_slots)} do not partition "
                    f"the {self.state_slots} slots"]  # fmt: skip
        return []

    def problems(self, tables: list[list[int]]) -> list[str]:
        """What is wrong with the accounting, given the block tables of every queued sequence:
        reference counts equal holders, free means unreferenced, keys and the cache agree."""
        out = []
        if any(len(set(t)) != len(t) for t in tables):
            out.append("a sequence holds a block twice")
        holders = Counter(b for t in tables for b in t)
        wrong = [b for b in range(self.num_blocks) if self.ref_counts[b] != holders.get(b, 0)]
        if wrong:
            b = wrong[0]
            out.append(f"block {b} has reference count {self.ref_counts[b]} but {holders.get(b, 0)} holders")
        free = set(self.free_blocks)
        unreferenced = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        if free != unreferenced:
            out.append(f"free list != unreferenced blocks (differ: {sorted(free ^ unreferenced)[:5]})")
        if any(self.block_keys[b] != k for k, b in self.cached.items()) or len(self.cached) != sum(
            k is not None for k in self.block_keys
        ):
            out.append("the prefix cache's keys and the blocks' keys disagree")
        if any(k not in self.cached for k in self.snapshot_of):
            out.append("a state snapshot outlived its cached block")
        if self.snapshots is not None and sorted([*self.snapshot_of.values(), *self.free_snapshots]) != list(
            range(self.snapshots.count)
        ):
            out.append("state snapshots held and free do not partition the snapshots")
        return out
