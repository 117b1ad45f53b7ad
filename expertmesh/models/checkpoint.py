"""Checkpoint-name translation as data: which checkpoint tensor fills which parameter shard."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (checkpoint piece, fused parameter piece, shard id) for dense projections.
STACKED = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
)
IGNORED = re.compile(r"rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointNames:
    """How a family names expert tensors: per-expert (gate, up, down) or fused 3-D tensors."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"

    def expert_pattern(self) -> re.Pattern:
        names = "|".join((self.gate, self.up, self.down))
        return re.compile(rf"^(.*)\.experts\.(\d+)\.({names})\.weight$")


# A target: (parameter name, shard id, function giving the source for that shard).
Target = tuple[str, Any, Callable[[Any], Any]]


def _identity(src: Any) -> Any:
    return src


def _expert_of(e: int, half: int | None, inter: int | None) -> Callable[[Any], Any]:
    """Source for expert e of a fused [E, ...] tensor; with half, rows [half*I, (half+1)*I)."""

    def pick(src: Any) -> Any:
        t = src[e] if isinstance(src, torch.Tensor) else src[e : e + 1][0]  # safetensors slice: read one
        return t if half is None else t[half * inter : (half + 1) * inter]

    return pick


def checkpoint_targets(key: str, names: CheckpointNames, experts: Any, tie: bool) -> list[Target] | None:
    """Targets for one checkpoint key; [] means consumed without a local target, None unknown."""
    if IGNORED.search(key):
        return []
    m = names.expert_pattern().match(key)
    if m:
        prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
        if which == names.down:
            return [(f"{prefix}.experts.w2", (e, None), _identity)]
        return [(f"{prefix}.experts.w13", (e, 0 if which == names.gate else 1), _identity)]
    m = re.match(r"^(.*)\.experts\.(gate_up_proj|down_proj)$", key)
    if m and experts is not None:
        prefix, which = m.groups()
        lib = experts(prefix)
        if lib is None:
            return []
        if which == "down_proj":
            return [(f"{prefix}.experts.w2", (e, None), _expert_of(e, None, None)) for e in lib.expert_ids]
        return [
            (f"{prefix}.experts.w13", (e, h), _expert_of(e, h, lib.full_inter))
            for e in lib.expert_ids
            for h in (0, 1)
        ]
    if tie and key == "model.embed_tokens.weight":
        return [(key, None, _identity), ("lm_head.weight", None, _identity)]
    if tie and key == "lm_head.weight":
        return []
    for piece, fused, shard in STACKED:
        if piece in key and ".experts." not in key:
            return [(key.replace(piece, fused), shard, _identity)]
    return [(key, None, _identity)]


def layer_index(key: str) -> int | None:
    m = LAYER.match(key)
    return int(m.group(1)) if m else None
