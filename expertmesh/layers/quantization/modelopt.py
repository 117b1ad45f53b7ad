"""NVIDIA ModelOpt checkpoints (`quant_method: modelopt`), FP8 (`quant_algo: FP8`): e4m3 weights with
one float32 `weight_scale` per tensor (W = W8 * weight_scale, the same product as fp8.py's per-tensor
case, under another name) and a static per-tensor `input_scale` for the activations.

The format as vLLM reads it (vllm/model_executor/layers/quantization/modelopt.py, and its
features/quantization/modelopt.md in vLLM's docs folder): the config is either hf_quant_config.json's
`{"quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}` or config.json's flat
`quantization_config` `{"quant_method": "modelopt", "quant_algo", "kv_cache_scheme", "ignore"}`; a
quantized linear `X` stores `X.weight` (e4m3), `X.weight_scale` and `X.input_scale` (scalars);
modules in the exclusion list stay in the model dtype; with an FP8 KV cache, attention carries
`k_scale` / `v_scale`.

Here the e4m3 bytes are held as stored with their one scale (fp8.py's per-tensor path). The static
`input_scale`, `k_scale` and `v_scale` are read and checked (one positive number each) but not
applied: activations and the KV cache stay in the model dtype (logged), so the result is the
checkpoint's weights exactly, not vLLM's fp8 activations. NVFP4 and the other quant_algos are
refused by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.fp8 import Fp8Format, Fp8View
from expertmesh.layers.quantization.view import CheckpointView

log = logging.getLogger("expertmesh")
SUPPORTED_ALGOS = ("FP8",)
STATIC_SCALES = (".input_scale", ".k_scale", ".v_scale")


def modelopt_settings(cfg: dict) -> tuple[str, Any]:
    """(quant_algo upper-cased, the KV-cache scheme or None) from either of the config's forms."""
    quant = cfg["quantization"] if isinstance(cfg.get("quantization"), dict) else cfg
    algo = str(quant.get("quant_algo") or "").upper()
    kv = quant.get("kv_cache_quant_algo", quant.get("kv_cache_scheme"))
    return algo, kv


@dataclass(frozen=True)
class ModelOptFormat(Fp8Format):
    """The parsed `quantization_config` of a ModelOpt FP8 checkpoint (per-tensor scales)."""

    block: tuple[int, int] | None = None
    method: str = "modelopt"
    kv_cache: str | None = None
    scale_suffix = "_scale"

    @classmethod
    def from_config(cls, cfg: dict) -> ModelOptFormat:
        algo, kv = modelopt_settings(cfg)
        if algo not in SUPPORTED_ALGOS:
            raise ValueError(
                f"modelopt quant_algo={algo or None!r} is not supported; supported: {list(SUPPORTED_ALGOS)} "
                "(NVFP4, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, MXFP8 are not read yet)"
            )
        return cls(kv_cache=None if kv is None else str(kv))

    def name(self) -> str:
        return "modelopt fp8 e4m3 (per tensor)"

    def describe(self) -> str:
        return f"{self.name()}, held as fp8: e4m3 codes and their scale as stored"

    def view(self, handles: dict[str, Any]) -> CheckpointView:
        return ModelOptView(handles, self)


class ModelOptView(Fp8View):
    """fp8.py's view with ModelOpt's names; the static activation / KV scales checked and set aside."""

    def __init__(self, handles: dict[str, Any], fmt: ModelOptFormat) -> None:
        super().__init__(handles, fmt)
        static = [k for k in self.file_of if self.static_scale(k)]
        for key in static:
            value = self.stored(key)[:].to(torch.float32)
            if value.numel() != 1 or not bool(value.reshape(()) > 0):
                raise ValueError(
                    f"modelopt tensor {key!r} should be one positive scale; it has shape {tuple(value.shape)}"
                )
        if static or fmt.kv_cache:
            log.info(
                "modelopt fp8: %d static activation / KV scales read and not applied (activations and "
                "the KV cache stay in the model dtype; kv cache scheme in the config: %s)",
                len(static),
                fmt.kv_cache,
            )

    def static_scale(self, key: str) -> bool:
        return key.endswith(STATIC_SCALES)
