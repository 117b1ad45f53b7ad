"""Checkpoint-name translation as data: which checkpoint tensor fills which parameter shard.

A key is first made canonical (a family's prefix stripped, its renames applied), then mapped to
targets: (parameter, shard id, function giving the source for that shard). Keys no parameter
takes on purpose are consumed by named skip rules, which the loader logs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# (checkpoint piece, fused parameter piece, shard id) for dense projections.
GATE_UP = ((".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1))
STACKED = ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"))
STACKED += GATE_UP
# Renames every family shares: the attention sinks live on the attention layer.
COMMON_RENAMES = ((".self_attn.sinks", ".self_attn.attn.sinks"),)
IGNORED = re.compile(r"rotary_emb\.inv_freq$")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Fused 3-D expert tensors: [E, 2I, H] gate rows then up rows ("split"), [E, H, 2I] ("transposed",
# Llama 4), [E, H, 2I] with gate and up in alternating columns ("transposed_interleaved", GPT-OSS).
FUSED_LAYOUTS = ("split", "transposed", "transposed_interleaved")
FUSED = re.compile(r"^(.*)\.experts\.(gate_up_proj|down_proj)(_bias)?$")


@dataclass(frozen=True)
class CheckpointNames:
    """How a family names its tensors: per-expert (gate, up, down) or fused 3-D expert tensors,
    plus renames (checkpoint piece -> ours), a prefix to strip and named skip rules."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    fused_experts: str = "split"
    renames: tuple[tuple[str, str], ...] = ()
    prefix: str = ""  # e.g. "language_model." for the text tower of a multimodal checkpoint
    skip: tuple[tuple[str, str], ...] = ()  # (rule name, regex on the original key)
    # Projections fused into one parameter: q/k/v and gate/up; GATE_UP where attention keeps its
    # own projections (multi-head latent attention has a q_proj of its own).
    stacked: tuple[tuple[str, str, Any], ...] = STACKED

    def __post_init__(self) -> None:
        if self.fused_experts not in FUSED_LAYOUTS:
            raise ValueError(f"fused_experts={self.fused_experts!r}; known: {list(FUSED_LAYOUTS)}")

    def expert_pattern(self) -> re.Pattern:
        names = "|".join((self.gate, self.up, self.down))
        return re.compile(rf"^(.*)\.experts\.(\d+)\.({names})\.weight$")

    def canonical(self, key: str) -> str:
        if self.prefix and key.startswith(self.prefix):
            key = key[len(self.prefix) :]
        for old, new in (*self.renames, *COMMON_RENAMES):
            key = key.replace(old, new)
        return key

    def skip_rule(self, key: str) -> str | None:
        return next((name for name, pattern in self.skip if re.search(pattern, key)), None)


# A target: (parameter name, shard id, function giving the source for that shard).
Target = tuple[str, Any, Callable[[Any], Any]]


def _identity(src: Any) -> Any:
    return src


# The pick that reads a checkpoint tensor unchanged: the loader may hold such a target's codes as
# stored (a picked part of a fused tensor is sliced, so it is not held).
READ_AS_IS = _identity


def _expert_of(e: int, half: int | None, inter: int | None, layout: str = "split") -> Callable[[Any], Any]:
    """Source for expert e of a fused [E, ...] tensor: its gate (half 0) or up (half 1) part as
    [I, ...] rows, or (half None) its down projection as [H, I] (biases: [I] and [H])."""

    def pick(src: Any) -> Any:
        t = src[e] if isinstance(src, torch.Tensor) else src[e : e + 1][0]  # safetensors slice: read one
        if layout != "split" and t.dim() == 2:
            t = t.t()  # stored [in, out]: ours are [out, in]
        if half is None:
            return t
        if layout == "transposed_interleaved":
            return t[half::2]
        return t[half * inter : (half + 1) * inter]

    return pick


def checkpoint_targets(key: str, names: CheckpointNames, experts: Any, tie: bool) -> list[Target] | None:
    """Targets for one canonical key; [] means consumed without a local target."""
    if IGNORED.search(key):
        return []
    m = names.expert_pattern().match(key)
    if m:
        prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
        if which == names.down:
            return [(f"{prefix}.experts.w2", (e, None), _identity)]
        return [(f"{prefix}.experts.w13", (e, 0 if which == names.gate else 1), _identity)]
    m = FUSED.match(key)
    if m and experts is not None:
        return _fused_targets(m, names, experts)
    if tie and key == "model.embed_tokens.weight":
        return [(key, None, _identity), ("lm_head.weight", None, _identity)]
    if tie and key == "lm_head.weight":
        return []
    if key.endswith(".gate_up_proj.weight") and ".experts." not in key:  # a fused [gate; up] weight
        return [(key, h, _fused_half(h)) for h in (0, 1)]
    for piece, fused, shard in names.stacked:
        if piece in key and ".experts." not in key:
            return [(key.replace(piece, fused), shard, _identity)]
    return [(key, None, _identity)]


def _fused_half(h: int) -> Callable[[Any], Any]:
    def pick(src: Any) -> Any:
        rows = (src.shape if isinstance(src, torch.Tensor) else src.get_shape())[0] // 2
        return src[h * rows : (h + 1) * rows]

    return pick


def _fused_targets(m: re.Match, names: CheckpointNames, experts: Any) -> list[Target]:
    prefix, which, bias = m.groups()
    lib = experts(prefix)
    if lib is None:
        return []
    suffix = "_bias" if bias else ""
    layout = names.fused_experts
    if which == "down_proj":
        return [
            (f"{prefix}.experts.w2{suffix}", (e, None), _expert_of(e, None, None, layout))
            for e in lib.expert_ids
        ]
    return [
        (f"{prefix}.experts.w13{suffix}", (e, h), _expert_of(e, h, lib.full_inter, layout))
        for e in lib.expert_ids
        for h in (0, 1)
    ]


def layer_index(key: str) -> int | None:
    m = LAYER.match(key)
    return int(m.group(1)) if m else None
