"""Weight formats as plain dicts: a checkpoint's `quantization_config` -> the format that reads
it, and `LLM(quantization=...)` -> the online scheme that quantizes an unquantized checkpoint.

A quantized checkpoint's codes are held compressed as stored wherever they map exactly onto the
kernels' codes (every format's `holds_compressed`; the rest dequantized at load, logged), as vLLM
runs them. `quantization="dequantize"` dequantizes all of it to the model dtype at load instead
(`Dequantized`: the reference, or bf16 prefill speed over memory). Every lookup fails with the
unknown name and the known ones. An online request over a quantized checkpoint must name the
checkpoint's own method (otherwise an error naming both): the weights are then dequantized at load
and re-quantized to that scheme, held compressed (one more rounding: `Requantized`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from expertmesh.layers.quantization.awq import AwqFormat
from expertmesh.layers.quantization.compressed import CompressedTensorsFormat
from expertmesh.layers.quantization.fp8 import Fp8Format
from expertmesh.layers.quantization.gguf import GGUFFormat
from expertmesh.layers.quantization.gptq import GptqFormat
from expertmesh.layers.quantization.modelopt import ModelOptFormat
from expertmesh.layers.quantization.mxfp4 import Mxfp4Format
from expertmesh.layers.quantization.online import OnlineScheme

# quant_method -> the format (its `from_config` parses the rest of quantization_config)
CHECKPOINT_FORMATS: dict[str, Any] = {
    "awq": AwqFormat,
    "compressed-tensors": CompressedTensorsFormat,
    "fp8": Fp8Format,
    "gptq": GptqFormat,
    "modelopt": ModelOptFormat,
    "mxfp4": Mxfp4Format,
}
# written by models/gguf into a GGUF model's config for the block types it holds, never by users
# (so not listed as supported)
INTERNAL_FORMATS: dict[str, Any] = {"gguf": GGUFFormat}


@dataclass(frozen=True)
class Requantized:
    """A quantized checkpoint read through its format, then re-quantized online (LLM(quantization=
    its method)): e.g. DeepSeek-V3's fp8 blocks held as fp8 with a scale per 128 inputs of a row."""

    checkpoint: Any
    scheme: OnlineScheme
    online: bool = True

    @property
    def method(self) -> str:
        return self.checkpoint.method

    @property
    def kind(self) -> str:
        return self.scheme.kind

    @property
    def group_size(self) -> int:
        return self.scheme.group_size

    @property
    def lm_head(self) -> bool:
        return self.scheme.lm_head

    @property
    def holds_compressed(self) -> bool:
        """An fp8 checkpoint asked as fp8 with its blocks' input width as the group: its e4m3
        bytes and block scales are held as stored (layers/quantization/held.py), not re-rounded."""
        block = getattr(self.checkpoint, "block", ())
        return self.checkpoint.method == "fp8" == self.scheme.kind and (
            block is None or self.scheme.group_size == block[1]
        )

    def view(self, handles: dict[str, Any]) -> Any:
        return self.checkpoint.view(handles)

    def check_split(self, what: str, local_in: int, shards: int) -> None:
        self.scheme.check_split(what, local_in, shards)

    def describe(self) -> str:
        if self.holds_compressed:
            return f"{self.checkpoint.name()}, held as fp8: e4m3 codes and block scales as stored"
        return f"{self.checkpoint.describe()}, then re-quantized: {self.scheme.describe()}"


DEQUANTIZE = "dequantize"  # LLM(quantization=...): a quantized checkpoint dequantized at load


@dataclass(frozen=True)
class Dequantized:
    """A quantized checkpoint asked as LLM(quantization="dequantize"): read through its format and
    dequantized to the model dtype at load, nothing held compressed."""

    checkpoint: Any
    online: bool = False
    holds_compressed: bool = False

    @property
    def method(self) -> str:
        return self.checkpoint.method

    def view(self, handles: dict[str, Any]) -> Any:
        return self.checkpoint.view(handles)

    def describe(self) -> str:
        name = getattr(self.checkpoint, "name", None)  # fp8 / mxfp4 describe what they hold; the rest name it
        what = name() if name is not None else self.checkpoint.describe()
        return f"{what}, dequantized to the model dtype at load (quantization='dequantize')"


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
    if method in INTERNAL_FORMATS:
        return INTERNAL_FORMATS[method].from_config(cfg)
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(
            f"config.json has a quantization_config with quant_method={method!r}, which expertmesh does "
            f"not load; supported: {sorted(CHECKPOINT_FORMATS)}; use an "
            "unquantized copy of the checkpoint, optionally with LLM(quantization=...) "
            f"({sorted(OnlineScheme.METHODS)})"
        )
    return CHECKPOINT_FORMATS[method].from_config(cfg)


def resolve(quant: Any, online: str | None) -> Any:
    """What ModelConfig.quantization holds: the checkpoint's format, an online scheme, or None."""
    fmt = checkpoint_format(quant) if quant else None
    if online is None:
        return fmt
    if online == DEQUANTIZE:
        if fmt is None:
            raise ValueError(
                "quantization='dequantize' dequantizes a quantized checkpoint at load, but this "
                "checkpoint's config.json has no quantization_config; pass quantization=None, or an online "
                f"scheme: {list(OnlineScheme.METHODS)}"
            )
        return Dequantized(fmt)
    if fmt is not None:
        if OnlineScheme.parse(online).method == fmt.method:
            return Requantized(fmt, OnlineScheme.parse(online))
        raise ValueError(
            f"quantization={online!r} was asked for, but the checkpoint is already quantized "
            f"(quant_method={fmt.method!r}); pass quantization=None (its codes held as stored), "
            f"{DEQUANTIZE!r} (dequantized at load) or {fmt.method!r} if online quantization knows it "
            f"(held compressed: {list(OnlineScheme.METHODS)})"
        )
    return OnlineScheme.parse(online)
