"""Per-sequence recurrent state beside the paged KV cache (DESIGN.md section 14).

Hybrid families (Gated DeltaNet, Mamba2) keep, per sequence and per recurrent layer, a fixed-size
state instead of growing K/V: a causal convolution's last inputs and the recurrent (DeltaNet or
SSM) state. Each layer declares it (`StateSpec`: the shapes of its tensors, float32 by default);
the engine allocates `slots + 1` rows of each (the last is a scratch row that a lockstep dummy
forward may write), and the block manager hands one slot to each running sequence with its KV
blocks and takes it back with them (finish, abort, failure, preemption). A preempted sequence is
recomputed: its prefill restarts at position 0, which starts from a zero state, so a slot is never
cleared by hand. An attention-only model declares no state and pays nothing.

Speculative decoding verifies a draft of up to k tokens in one forward; the recurrent layers step
through its positions one at a time (as plain decoding would) and keep the state after each of the
first k positions in `DraftStates` (k more rows per slot, budgeted with it). After acceptance a
sequence's slot takes the state at its accepted length; when every draft token is accepted the
slot already holds it.
"""

from __future__ import annotations

import torch

from expertmesh.layers.cache_spec import StateSpec  # noqa: F401 -- the layers' declaration, re-exported


def bytes_per_seq(specs: list[StateSpec]) -> int:
    """State bytes one sequence takes over all of a rank's recurrent layers."""
    return sum(s.bytes_per_seq for s in specs)


def slots_for(specs: list[StateSpec], budget: int, max_num_seqs: int, reserve: int, copies: int = 1) -> int:
    """Sequences whose state fits in `budget` less `reserve` (the KV blocks of one full-length
    sequence), at most max_num_seqs; 0 when the model has no state. `copies` 2: each sequence
    slot comes with one prefix-cache snapshot (StateSnapshots)."""
    per_seq = bytes_per_seq(specs) * copies
    if not per_seq:
        return 0
    slots = min(max_num_seqs, (budget - reserve) // per_seq)
    if slots < 1:
        raise ValueError(
            f"the cache budget ({budget} bytes) holds no sequence's recurrent state ({per_seq} bytes "
            f"per sequence) beside one full-length sequence's KV ({reserve} bytes); raise "
            "kv_cache_memory_bytes or lower max_model_len"
        )
    return slots


def describe(kv_line: str, specs: list[StateSpec]) -> str:
    """The KV start-up line with the per-sequence state added: `KV cache: N bytes per token + M
    bytes per sequence (...)`; unchanged for a model without state."""
    if not specs:
        return kv_line
    kinds = []
    for kind in sorted({s.kind for s in specs}):
        mine = [s for s in specs if s.kind == kind]
        shapes = " + ".join("x".join(map(str, shape)) for shape in mine[0].shapes)
        kinds.append(f"{kind} ({len(mine)} layers, {shapes} {mine[0].dtype} values a layer)")
    added = f" + {bytes_per_seq(specs)} bytes per sequence"
    head, sep, tail = kv_line.partition(" bytes per token")
    return f"{head}{sep}{added}{tail}; state: " + "; ".join(kinds)


def allocate(specs: list[StateSpec], num_slots: int, device: str) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, one zeroed [num_slots + 1, *shape] tensor per state tensor (the extra row is the
    scratch slot of dummy forwards)."""
    return [
        tuple(torch.zeros((num_slots + 1, *shape), dtype=spec.dtype, device=device) for shape in spec.shapes)
        for spec in specs
    ]


class StateSnapshots:
    """Prefix caching for recurrent layers: `count` snapshot rows after the `slots` sequence rows
    of every state tensor. A snapshot holds a sequence's state right after the last token of a
    cached full KV block (the block manager keys it by that block's prefix key, and forgets it
    when the block is evicted); a request whose cached prefix ends at that block starts from a
    copy of it instead of position 0. Copies are this rank's own (a pipeline stage without
    recurrent layers copies nothing)."""

    def __init__(self, states: list[tuple[torch.Tensor, ...]], slots: int, count: int) -> None:
        self.states, self.slots, self.count = states, slots, count

    def save(self, slot: int, snapshot: int) -> None:
        for tensors in self.states:
            for t in tensors:
                t[self.slots + snapshot].copy_(t[slot])

    def restore(self, snapshot: int, slot: int) -> None:
        for tensors in self.states:
            for t in tensors:
                t[slot].copy_(t[self.slots + snapshot])


class DraftStates:
    """Per recurrent layer, per state tensor, [slots, k, *shape]: row (slot, j) is the state of the
    sequence in `slot` after the j-th row of a verify step (its last token and j draft tokens),
    written by the layers (RecurrentMixer.scan) and read back by `rollback`."""

    def __init__(self, specs: list[StateSpec], slots: int, k: int, device: str) -> None:
        self.k = k
        self.rows = [
            tuple(torch.zeros((slots, k, *shape), dtype=spec.dtype, device=device) for shape in spec.shapes)
            for spec in specs
        ]

    def rollback(self, states: list[tuple[torch.Tensor, ...]], slot: int, position: int) -> None:
        """The state of `slot` set to the one after verify row `position` (< k)."""
        for live, kept in zip(states, self.rows, strict=True):
            for t, rows in zip(live, kept, strict=True):
                t[slot].copy_(rows[slot, position])
