"""Rotary position embedding: every RoPE type transformers knows, NeoX halves or GPT-J pairs, partial.

A type is a function RopeConfig, context length -> (inverse frequencies [rotary_dim / 2], the
factor cos and sin are multiplied by), registered by name. The frequencies are computed in the
reference's float32 order of operations, so that positions in the hundred thousands rotate by
the same angles. cos/sin are computed per step for the step's positions (the reference's recipe:
position * inv_freq in float32), so no table sized by max_position_embeddings is kept.

Two types depend on the sequence's length (its context, the newest token included):
- `dynamic` (NTK): past max_position_embeddings the base grows with the length;
- `longrope`: the short factors (and short_mscale) while the length is at most
  original_max_position_embeddings, the long ones past it.
Each token uses its own sequence's length this step: a prefill of a long prompt is rotated
entirely with the long values, as transformers does. Keys cached before a sequence crossed the
switch keep their old rotation; transformers instead recomputes the whole cache once at the
crossing (docs/architectures.md).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from expertmesh.config.rope_config import RopeConfig

Frequencies = tuple[torch.Tensor, float]


def _exponents(rope: RopeConfig) -> torch.Tensor:
    """[0, 2, 4, ...] / rotary_dim, float32 (the exponent of theta for each frequency)."""
    dim = rope.rotary_dim
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _default(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    return 1.0 / (rope.theta ** _exponents(rope)), 1.0


def _linear(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    inv, _ = _default(rope)
    return inv / rope.factor, 1.0


def _dynamic(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    """NTK-aware: theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2)) for L > max_pos."""
    max_pos = rope.max_position_embeddings
    if seq_len is None or seq_len <= max_pos:
        return _default(rope)
    dim = rope.rotary_dim
    length = torch.tensor(seq_len, dtype=torch.int64)  # the reference's tensor arithmetic (float32)
    base = rope.theta * ((rope.factor * length / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** _exponents(rope)), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    """YaRN: frequencies below the beta_slow..beta_fast band interpolated by `factor`, above kept,
    a linear ramp between; cos/sin scaled by attention_factor (or the mscale rule)."""
    dim, base, original = rope.rotary_dim, rope.theta, rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else rope.max_position_embeddings / original
    scale = rope.attention_factor
    if scale is None:
        if rope.mscale and rope.mscale_all_dim:
            scale = float(yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim))
        else:
            scale = yarn_mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(rope.beta_fast or 32), dim_of(rope.beta_slow or 1)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    powers = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    return inv, scale


def _longrope(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    """Phi-3 LongRoPE: per-frequency factors, short up to original_max_position_embeddings, long past."""
    original = rope.original_max_position_embeddings
    long = seq_len is not None and seq_len > original
    factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    inv = 1.0 / (factors * rope.theta ** _exponents(rope))
    explicit = rope.long_mscale if long else rope.short_mscale
    if explicit is not None:  # Phi-3.5-MoE publishes its own scale for each regime
        return inv, float(explicit)
    if rope.attention_factor is not None:
        return inv, rope.attention_factor
    factor = rope.factor if rope.factor is not None else rope.max_position_embeddings / original
    return inv, 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _llama3(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, a smooth blend between."""
    inv, _ = _default(rope)
    factor, low_f, high_f = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low_f, inv / factor, inv)
    smooth = (old / wavelen - low_f) / (high_f - low_f)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high_f) * ~(wavelen > old / low_f)
    return torch.where(medium, blended, scaled), 1.0


def _proportional(rope: RopeConfig, seq_len: int | None = None) -> Frequencies:
    """Rotate the first partial_rotary_factor of the angles (exponents over the whole head), the
    rest at frequency 0 (cos 1, sin 0); then divide by `factor`."""
    angles = int(rope.partial_rotary_factor * rope.head_dim // 2)
    inv = 1.0 / (rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / rope.head_dim))
    inv = torch.cat((inv, torch.zeros(rope.head_dim // 2 - angles)))
    return inv / (rope.factor or 1.0), 1.0


# One frequency function per name of rope_config.ROPE_TYPE_NAMES (tests/test_rotary.py checks it).
ROPE_TYPES: dict[str, Callable[[RopeConfig, int | None], Frequencies]] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "longrope": _longrope,
    "llama3": _llama3,
    "proportional": _proportional,
}
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass
class RotaryTables:
    """cos and sin [T, 1, rotary_dim] of one step's positions, in the layout `apply` rotates."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[-1]

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hk, D]: the first rotary_dim dims rotated, the rest passed through."""
        return self.rotate(q), self.rotate(k)

    def laid_out(self, interleaved: bool) -> RotaryTables:
        """These tables in the pairs (interleaved) or NeoX halves layout: the same frequencies for a
        block that rotates its own way (DeepSeek-V3.2's indexer rotates halves beside an MLA that
        rotates pairs)."""
        if interleaved == self.interleaved:
            return self
        if self.interleaved:  # pairs -> halves
            cos, sin = self.cos[..., 0::2], self.sin[..., 0::2]
            return RotaryTables(torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1), False)
        half = self.rotary_dim // 2  # halves -> pairs
        cos, sin = self.cos[..., :half], self.sin[..., :half]
        return RotaryTables(cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1), True)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        part = x[..., :r]
        turned = _rotate_pairs(part) if self.interleaved else _rotate_half(part)
        out = part * self.cos + turned * self.sin
        return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        self.rope = rope
        self.kind = ROPE_TYPES[rope.rope_type]
        device = torch.get_default_device()
        # on meta (the loader's twin), computed on the CPU and moved: elementwise math on meta runs
        # torch's Python decompositions, whose first use imports torch._dynamo (a second a load)
        with torch.device("cpu") if device.type == "meta" else contextlib.nullcontext():
            inv, self.scale = self.kind(rope, None)
        self.register_buffer("inv_freq", inv.to(device), persistent=False)
        self.length_dependent = rope.rope_type in LENGTH_DEPENDENT
        self._table: dict[torch.dtype, RotaryTables] = {}  # positions [0, n), grown by doubling

    def frequencies(self, seq_len: int) -> Frequencies:
        """Inverse frequencies and scale for a sequence of `seq_len` tokens."""
        return self.kind(self.rope, seq_len) if self.length_dependent else (self.inv_freq, self.scale)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype, context_lens: torch.Tensor | None = None
    ) -> RotaryTables:
        """cos/sin for positions [T]; `context_lens` [T] (each token's sequence length this step)
        picks the frequencies of the length-dependent types (default: position + 1)."""
        if not self.length_dependent:
            return self._rows(positions, dtype)
        lens = positions + 1 if context_lens is None else context_lens
        # Lengths that share frequencies share one computation: longrope has two regimes, dynamic
        # one below max_position_embeddings and one per length above it.
        limit = self.rope.original_max_position_embeddings or 0
        if self.rope.rope_type == "dynamic":
            limit = self.rope.max_position_embeddings
        regimes = (
            torch.where(lens > limit, lens, 0) if self.rope.rope_type == "dynamic" else (lens > limit).long()
        )
        cos = torch.empty(positions.shape[0], 1, self.rope.rotary_dim, dtype=dtype, device=positions.device)
        sin = torch.empty_like(cos)
        for regime in torch.unique(regimes).tolist():
            rows = (regimes == regime).nonzero().flatten()
            inv, scale = self.frequencies(int(lens[rows[0]]))
            part = self._tables(positions[rows], inv, scale, dtype)
            cos[rows], sin[rows] = part.cos, part.sin
        return RotaryTables(cos, sin, self.rope.interleaved)

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryTables:
        """Rows of a table over positions [0, n) computed once: a decode step's cos/sin cost one
        index instead of ~8 ops (host time at batch 1), and a position's values never depend on
        which positions share its step (vectorised and scalar tails of cos can differ by an ulp)."""
        table = self.table(int(positions.max()) + 1 if positions.numel() else 0, dtype, positions.device)
        return RotaryTables(table.cos[positions], table.sin[positions], self.rope.interleaved)

    def table(self, need: int, dtype: torch.dtype, device: torch.device) -> RotaryTables:
        """cos/sin [n, 1, R] of positions [0, n), n >= need (not for the length-dependent types):
        the table decode steps index (native decode reads its rows by position)."""
        table = self._table.get(dtype)
        if table is None or table.cos.shape[0] < need or table.cos.device != device:
            have = table.cos.shape[0] if table is not None else 0
            # doubling, but not past the model's positions (a 128K-token model's table is 64 MB in fp32)
            grown = min(max(2 * have, 256), self.rope.max_position_embeddings)
            every = torch.arange(max(need, grown), device=device)
            table = self._table[dtype] = self._tables(every, self.inv_freq, self.scale, dtype)
        return table

    def _tables(self, positions: torch.Tensor, inv: torch.Tensor, scale: float, dtype) -> RotaryTables:
        freqs = positions[:, None].float() * inv.to(positions.device)[None, :]  # [T, rotary_dim / 2]
        if self.rope.interleaved:
            freqs = freqs.repeat_interleave(2, dim=-1)
        else:
            freqs = torch.cat((freqs, freqs), dim=-1)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        return RotaryTables(cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype), self.rope.interleaved)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): GPT-J / complex-pair rotation."""
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
