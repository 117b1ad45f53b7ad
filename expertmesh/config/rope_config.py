"""The rope block of a config.json, typed: RopeConfig (the rotary code is layers/rotary.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The rope types layers/rotary.py computes (its ROPE_TYPES has one frequency function for each; a
# test checks that the two agree). Named here so the config checks a type without importing layers.
ROPE_TYPE_NAMES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
_ROPE_REQUIRED = {  # rope_type -> RopeConfig fields a published rope block must set
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("original_max_position_embeddings",),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding of one checkpoint: its rope block, typed (layers/rotary.py)."""

    rope_type: str = "default"
    theta: float = 10000.0
    head_dim: int = 64
    partial_rotary_factor: float = 1.0
    interleaved: bool = False  # GPT-J pairs (Llama 4, DeepSeek) instead of NeoX halves
    max_position_embeddings: int = 2048
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    short_mscale: float | None = None
    long_mscale: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPE_NAMES:
            known = sorted(ROPE_TYPE_NAMES)
            raise ValueError(f"rope_type={self.rope_type!r} is not supported; supported: {known}")
        missing = [k for k in _ROPE_REQUIRED.get(self.rope_type, ()) if getattr(self, k) is None]
        if missing:
            raise ValueError(f"rope_type={self.rope_type!r} needs {missing} in the config's rope block")
        for name in ("short_factor", "long_factor"):
            values = getattr(self, name)
            if values is not None and len(values) != self.rotary_dim // 2:
                raise ValueError(
                    f"rope {name} has {len(values)} entries; rotary_dim={self.rotary_dim} needs "
                    f"{self.rotary_dim // 2}"
                )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary_dim={self.rotary_dim} "
                f"for head_dim={self.head_dim}; it must be even and in [2, head_dim]"
            )

    @property
    def rotary_dim(self) -> int:
        """Dims rotated per head; `proportional` rotates all of them (some at frequency 0)."""
        if self.rope_type == "proportional":
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, hf: Any, head_dim: int) -> RopeConfig:
        params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        original = params.get("original_max_position_embeddings") or getattr(
            hf, "original_max_position_embeddings", None
        )
        partial = params.get("partial_rotary_factor") or getattr(hf, "partial_rotary_factor", None) or 1.0
        lists = ("short_factor", "long_factor")
        factors = {k: tuple(float(v) for v in params[k]) for k in lists if k in params}
        floats = ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        floats += ("short_mscale", "long_mscale", "low_freq_factor", "high_freq_factor")
        return cls(
            rope_type=str(params.get("rope_type", params.get("type", "default"))),
            theta=float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0)),
            head_dim=head_dim,
            partial_rotary_factor=float(partial),
            interleaved=bool(getattr(hf, "rope_interleave", False)),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 2048)),
            original_max_position_embeddings=int(original) if original else None,
            truncate=bool(params.get("truncate", True)),
            **{k: opt_float(params.get(k)) for k in floats},
            **factors,
        )
