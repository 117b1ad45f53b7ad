"""vLLM's `speculative_config`, typed, frozen and checked when it is built.

Keys (vLLM's names): method ("ngram", "mtp", or one of vLLM's per-family MTP aliases, which mean
"mtp"), num_speculative_tokens (k >= 1), prompt_lookup_min / prompt_lookup_max (n-gram only: the
suffix lengths tried, longest first; one given sets the other, none gives vLLM's 5 / 5),
disable_by_batch_size (no drafting while more sequences than this decode).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# vLLM's method names for the MTP layers a family ships; all of them draft with those layers.
MTP_ALIASES = (
    "mtp",
    "deepseek_mtp",
    "glm4_moe_mtp",
    "qwen3_next_mtp",
    "mimo_mtp",
    "ernie_mtp",
    "longcat_flash_mtp",
    "minimax_m2_mtp",
)
METHODS = ("ngram", *MTP_ALIASES)
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given
DEFAULT_MAX_BATCH = 4  # sequences decoding at once beyond which nothing is drafted (when not given)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # vLLM's key: no drafting while more than this many sequences decode. None: our default
    # (DEFAULT_MAX_BATCH), since a fixed batch is as slow as its least-accepting sequence and
    # the wider forward costs every step.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is unknown; valid: {list(METHODS)}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens={k!r} must be an int >= 1")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config disable_by_batch_size={b!r} must be an int >= 1")
        if self.method != "ngram":
            object.__setattr__(self, "method", "mtp")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} applies to method='ngram' only, not mtp")
            return
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config {name}={value!r} must be an int >= 1")
        lo, hi = (lo or hi or DEFAULT_LOOKUP), (hi or lo or DEFAULT_LOOKUP)
        if lo > hi:
            raise ValueError(
                f"speculative_config prompt_lookup_min={lo} is greater than prompt_lookup_max={hi}"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @property
    def max_batch(self) -> int:
        """Drafting stops while more sequences than this decode in a step."""
        return self.disable_by_batch_size or DEFAULT_MAX_BATCH

    @staticmethod
    def of(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From vLLM's dict (or one of these, or None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; supported: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in value:
                raise ValueError(f"speculative_config needs {name!r} (got keys {sorted(value)})")
        return SpeculativeConfig(**value)

    def check_model(self, architecture: str, num_mtp_layers: int) -> None:
        """An MTP method needs a model that ships MTP layers, of a family whose MTP layer is built
        (spec_decode/mtp.py); every layout runs it."""
        if self.method != "mtp":
            return
        if num_mtp_layers < 1:
            raise ValueError(
                f"speculative_config method='mtp' needs multi-token-prediction layers, and this "
                f"{architecture} model has none (num_nextn_predict_layers=0); use method='ngram'"
            )
        from expertmesh.spec_decode.mtp_families import MTP_ARCHITECTURES, MTP_NOT_BUILT

        if architecture not in MTP_ARCHITECTURES:
            why = MTP_NOT_BUILT.get(architecture, "not built")
            raise ValueError(
                f"speculative_config method='mtp': drafting with the {num_mtp_layers} MTP layer(s) of this "
                f"{architecture} model is not implemented yet: {why} (built for {list(MTP_ARCHITECTURES)}); "
                "use method='ngram'"
            )
