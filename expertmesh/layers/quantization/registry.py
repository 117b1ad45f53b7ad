"""Weight formats as plain dicts: a checkpoint's `quantization_config` -> the format that reads
it, and `LLM(quantization=...)` -> the online scheme that quantizes an unquantized checkpoint.

Every lookup fails with the unknown name and the known ones. A checkpoint's own format wins
over an online request only when they name the same method (vLLM's rule); otherwise it is an
error naming both.
"""

from __future__ import annotations

from typing import Any

from expertmesh.layers.quantization.fp8 import Fp8Format
from expertmesh.layers.quantization.mxfp4 import Mxfp4Format
from expertmesh.layers.quantization.online import OnlineScheme

# quant_method -> the format (its `from_config` parses the rest of quantization_config)
CHECKPOINT_FORMATS: dict[str, Any] = {"fp8": Fp8Format, "mxfp4": Mxfp4Format}
# Not read yet (issue 14's later items); named in the error so a user sees where they stand.
PLANNED = ("awq", "compressed-tensors", "gptq")


def _as_dict(quant: Any) -> dict:
    if isinstance(quant, dict):
        return quant
    if hasattr(quant, "to_dict"):
        return quant.to_dict()
    return dict(vars(quant))


def checkpoint_format(quant: Any) -> Any:
    """The format of a config.json `quantization_config` (dict or transformers object)."""
    cfg = _as_dict(quant)
    method = cfg.get("quant_method")
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"config.json has a quantization_config with quant_method={method!r}, which expertmesh does "
            f"not load; supported: {sorted(CHECKPOINT_FORMATS)} (not yet: {list(PLANNED)}); use an "
            "unquantized copy of the checkpoint, optionally with LLM(quantization=...) "
            f"({sorted(OnlineScheme.METHODS)})"
        )
    return CHECKPOINT_FORMATS[method].from_config(cfg)


def resolve(quant: Any, online: str | None) -> Any:
    """What ModelConfig.quantization holds: the checkpoint's format, an online scheme, or None."""
    fmt = checkpoint_format(quant) if quant else None
    if online is None:
        return fmt
    if fmt is not None:
        if online == fmt.method:
            return fmt
        raise ValueError(
            f"quantization={online!r} was asked for, but the checkpoint is already quantized "
            f"(quant_method={fmt.method!r}); pass quantization=None or {fmt.method!r}"
        )
    return OnlineScheme.parse(online)
