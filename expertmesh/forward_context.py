"""Per-step metadata passed down the model in one typed object."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.layers.attention import AttentionMetadata
from expertmesh.layers.rotary import RotaryTables


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    # Tokens in this step on every DP rank (agreed each step); MoE dispatch sizes derive from it.
    dp_token_counts: list[int]
    # Rotary cos/sin of this step's positions, looked up once and shared by every layer.
    rope: RotaryTables | None = None
    # False for a lockstep dummy forward: its token is not counted in the expert load.
    count_load: bool = True
    # Hybrid models: each sequence's recurrent-state slot (engine/state_cache.py), decodes then
    # prefill chunks in AttentionMetadata order; None (a dummy forward): zero state, not kept.
    state_slots: torch.Tensor | None = None
    # A step verifying speculative drafts on a hybrid model: each decode sequence's row count (its
    # last token and its draft), in decode order; the recurrent layers then step position by
    # position and keep the state after each draft position (engine/state_cache.py DraftStates).
    state_rows: list[int] | None = None
    # This step's token ids [T] (set by a model whose MoE routes by them: DeepSeek-V4's hash layers)
    input_ids: torch.Tensor | None = None
