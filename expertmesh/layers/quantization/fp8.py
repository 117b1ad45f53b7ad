"""FP8 checkpoints (`quant_method: fp8`): e4m3 weights with float32 `weight_scale_inv` per
`weight_block_size` block (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8), activations dynamic.

The stored weight W8 [O, I] and its scales S [ceil(O / bo), ceil(I / bi)] give the real weight
W[o, i] = W8[o, i] * S[o // bo, i // bi]: the last block of a dimension that `bo` or `bi` does not
divide covers the remainder (the format's rule; transformers' dequantizer reads such a block
wrongly, see /work/shared/PEERS.md). Per-tensor FP8 (no `weight_block_size`) has one scale.

A rank's slice reads the rows and columns it keeps and the scale of every block they touch, so
a tensor-parallel size that cuts a block is handled: both ranks use the block's one scale for
their part (nothing is padded). The e4m3 bytes are held as stored, as codes with each row's block
scale per `bi` inputs (layers/quantization/held.py; one scale per row for per-tensor FP8), where the
kernels take them; a weight a module lays out anew (MLA's kv_b_proj) is dequantized to the model
dtype at load, and `LLM(quantization="dequantize")` dequantizes every one (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.view import CheckpointView, LogicalTensor

log = logging.getLogger("expertmesh")
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = ("F8_E4M3",)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


E4M3_MAX = 448.0


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's writer (checkpoints made by tests and benchmarks): [O, I] float -> (e4m3 weight,
    float32 `weight_scale_inv` [ceil(O / bo), ceil(I / bi)]), each block scaled by its largest |w|."""
    (o, i), (bo, bi) = w.shape, block
    go, gi = _cdiv(o, bo), _cdiv(i, bi)
    padded = torch.zeros(go * bo, gi * bi)
    padded[:o, :i] = w.float()
    scale = (padded.view(go, bo, gi, bi).abs().amax((1, 3)) / E4M3_MAX).clamp(min=1e-12)
    full = scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


@dataclass(frozen=True)
class Fp8Format:
    """The parsed `quantization_config` of an FP8 checkpoint."""

    block: tuple[int, int] | None = (128, 128)  # (output rows, input columns) per scale
    method: str = "fp8"
    online: bool = False
    holds_compressed = True  # e4m3 bytes and block scales held as stored (quantization/held.py)
    scale_suffix = SCALE_SUFFIX  # a weight's scale tensor is its key plus this (ModelOpt: `_scale`)

    @classmethod
    def from_config(cls, cfg: dict) -> Fp8Format:
        fmt = cfg.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"fp8 quantization_config fmt={fmt!r} is not supported; supported: ['e4m3']")
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"fp8 quantization_config activation_scheme={scheme!r} is not supported; supported: "
                "['dynamic'] (weights are dequantized; activations stay in the model dtype)"
            )
        block = cfg.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"fp8 weight_block_size={block!r} must be two positive sizes [rows, columns]")
        return cls(tuple(int(b) for b in block) if block is not None else None)

    def name(self) -> str:
        block = "per tensor" if self.block is None else f"{self.block[0]}x{self.block[1]} blocks"
        return f"fp8 e4m3 ({block})"

    def describe(self) -> str:
        return f"{self.name()}, held as fp8: e4m3 codes and block scales as stored"

    def view(self, handles: dict[str, Any]) -> CheckpointView:
        return Fp8View(handles, self)


class Fp8Tensor(LogicalTensor):
    def __init__(
        self, key: str, weight: Any, scale: Any, block: tuple[int, int] | None, suffix: str = SCALE_SUFFIX
    ) -> None:
        self.key, self.weight, self.scale = key, weight, scale
        self.shape = tuple(weight.get_shape())
        scale_shape = tuple(scale.get_shape())
        if len(self.shape) != 2:
            raise ValueError(f"fp8 weight {key!r} has shape {self.shape}; only 2-D weights are supported")
        if block is None:
            if scale_shape not in ((), (1,)):
                raise ValueError(f"{key}{suffix} has shape {scale_shape}; per-tensor fp8 needs one scale")
        else:
            want = (_cdiv(self.shape[0], block[0]), _cdiv(self.shape[1], block[1]))
            if scale_shape != want:
                raise ValueError(
                    f"{key}{suffix} has shape {scale_shape}; weight {self.shape} in blocks of "
                    f"{list(block)} needs {want}"
                )
        self.block = block
        self.base = key
        self.held_kind = ("fp8", block[1] if block is not None else 0)

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """The stored e4m3 bytes as codes; each row's scale per `group` inputs is its block's."""
        (o0, o1), (i0, i1) = rows, cols
        codes = self.weight[o0:o1, i0:i1].view(torch.uint8)
        n, g = o1 - o0, _cdiv(i1 - i0, group)
        if self.block is None:
            s = self.scale[:].to(torch.float32).reshape(1, 1).expand(n, g)
        else:
            bo, bi = self.block
            s = self.scale[o0 // bo : _cdiv(o1, bo), i0 // bi : i0 // bi + g].to(torch.float32)
            s = s[torch.arange(o0, o1) // bo - o0 // bo]
        return codes, s, torch.zeros_like(s)

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (r0, r1), (c0, c1) = bounds
        w = self.weight[r0:r1, c0:c1].to(torch.float32)
        if self.block is None:
            return w * self.scale[:].to(torch.float32).reshape(())
        bo, bi = self.block
        s = self.scale[r0 // bo : _cdiv(r1, bo), c0 // bi : _cdiv(c1, bi)].to(torch.float32)
        rows = torch.arange(r0, r1) // bo - r0 // bo
        cols = torch.arange(c0, c1) // bi - c0 // bi
        return w * s[rows][:, cols]


class Fp8View(CheckpointView):
    """FP8 weights served dequantized; their `weight_scale_inv` tensors consumed with them."""

    def __init__(self, handles: dict[str, Any], fmt: Fp8Format) -> None:
        super().__init__(handles)
        self.fmt, self.suffix = fmt, fmt.scale_suffix
        for key in self.file_of:
            if self.static_scale(key):
                continue
            if key.endswith((".input_scale", ".activation_scale")):
                raise ValueError(
                    f"checkpoint tensor {key!r} is a static activation scale; fp8 activation_scheme "
                    "'dynamic' checkpoints have none"
                )
            if key.endswith(self.suffix) and key[: -len(self.suffix)] not in self.file_of:
                raise ValueError(
                    f"checkpoint tensor {key!r} scales {key[: -len(self.suffix)]!r}, which is absent"
                )
        if not any(k.endswith(self.suffix) and not self.static_scale(k) for k in self.file_of):
            # e.g. DeepSeek's fp8_cast_bf16.py output, which keeps the config's quantization_config
            log.warning(
                "quantization_config says fp8, but no checkpoint tensor is e4m3: loading them as stored"
            )

    def static_scale(self, key: str) -> bool:
        """A tensor the format carries but the engine does not apply (ModelOpt's static activation
        and KV scales); none in this format."""
        return False

    def keys(self) -> list[tuple[str, str]]:
        return [(k, p) for k, p in super().keys() if not k.endswith(self.suffix) and not self.static_scale(k)]

    def get_slice(self, key: str) -> Any:
        stored = self.stored(key)
        if stored.get_dtype() not in FP8_DTYPES:
            return stored  # norms, embeddings, the router, lm_head: stored in bf16
        if key + self.suffix not in self.file_of:
            raise ValueError(f"fp8 weight {key!r} has no {key + self.suffix!r} in the checkpoint")
        scale = self.stored(key + self.suffix)
        return self.serve(key, Fp8Tensor(key, stored, scale, self.fmt.block, self.suffix))
