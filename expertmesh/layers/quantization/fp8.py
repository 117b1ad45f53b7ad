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

`scale_fmt: ue8m0` (DeepSeek-V3.2, V4): every scale a power of two, stored as float32 (V3.2), as
e8m0 (`F8_E8M0`) or as its exponent byte (`U8`, 2^(b - 127)); all are read exactly. DeepSeek-V4's
files name a weight's scale `X.scale` beside `X.weight` (transformers' FP8 integration renames it
to `weight_scale_inv`) and hold its routed experts in FP4 (`expert_dtype: fp4`, as transformers'
FP8 integration reads them; the stored configs do not describe the layout): an `I8` / `U8` weight
[O, I / 2] of two e2m1 values a byte, the low nibble first, with an e8m0 scale per 32 inputs of a
row [O, I / 32]. Those are held as our fp4 kind with groups of 32 (the codes as stored, the scale
2^(e - 127) exact in float32), as gpt-oss's MXFP4 experts are.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.mxfp4 import E2M1
from expertmesh.layers.quantization.view import CheckpointView, LogicalTensor

log = logging.getLogger("expertmesh")
SCALE_SUFFIX = "_scale_inv"
V4_SCALE = ".scale"  # DeepSeek-V4's name for X.weight's scale: X.scale
FP8_DTYPES = ("F8_E4M3",)
FP4_DTYPES = ("I8", "U8")  # two e2m1 values a byte (DeepSeek-V4's experts)
FP4_GROUP = 32  # inputs per e8m0 scale of an FP4 weight


def scale_values(t: torch.Tensor) -> torch.Tensor:
    """Stored scales as float32: float32 / e8m0 as they are, exponent bytes (uint8) as 2^(b - 127)."""
    if t.dtype == torch.uint8:
        return torch.exp2(t.to(torch.float32) - 127)
    return t.to(torch.float32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


E4M3_MAX = 448.0
E4M3_NAMES = ("e4m3", "float8_e4m3fn")


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
        if fmt not in E4M3_NAMES:  # MiniMax-M2 spells it as torch does
            raise ValueError(
                f"fp8 quantization_config fmt={fmt!r} is not supported; supported: {list(E4M3_NAMES)}"
            )
        scale_fmt = cfg.get("scale_fmt")
        if scale_fmt not in (None, "ue8m0"):
            raise ValueError(
                f"fp8 quantization_config scale_fmt={scale_fmt!r} is not supported; supported: ['ue8m0'] "
                "(or none: float32 scales)"
            )
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
            s = scale_values(self.scale[:]).reshape(1, 1).expand(n, g)
        else:
            bo, bi = self.block
            s = scale_values(self.scale[o0 // bo : _cdiv(o1, bo), i0 // bi : i0 // bi + g])
            s = s[torch.arange(o0, o1) // bo - o0 // bo]
        return codes, s, torch.zeros_like(s)

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (r0, r1), (c0, c1) = bounds
        w = self.weight[r0:r1, c0:c1].to(torch.float32)
        if self.block is None:
            return w * scale_values(self.scale[:]).reshape(())
        bo, bi = self.block
        s = scale_values(self.scale[r0 // bo : _cdiv(r1, bo), c0 // bi : _cdiv(c1, bi)])
        rows = torch.arange(r0, r1) // bo - r0 // bo
        cols = torch.arange(c0, c1) // bi - c0 // bi
        return w * s[rows][:, cols]


class Fp4Tensor(LogicalTensor):
    """DeepSeek-V4's FP4 weight [O, I]: stored [O, I / 2] bytes of two e2m1 codes (the low nibble
    first) and an e8m0 scale per 32 inputs of a row [O, I / 32]; held as the fp4 kind as stored."""

    held_kind = ("fp4", FP4_GROUP)

    def __init__(self, key: str, weight: Any, scale: Any) -> None:
        self.key, self.weight, self.scale, self.base = key, weight, scale, key
        stored, scale_shape = tuple(weight.get_shape()), tuple(scale.get_shape())
        self.shape = (stored[0], 2 * stored[1]) if len(stored) == 2 else stored
        want = (self.shape[0], _cdiv(self.shape[1], FP4_GROUP)) if len(stored) == 2 else None
        if want is None or self.shape[1] % FP4_GROUP or scale_shape != want:
            raise ValueError(
                f"fp4 weight {key!r} {list(stored)} with scale {list(scale_shape)}: want [O, I / 2] "
                f"bytes (two e2m1 values each) and [O, I / {FP4_GROUP}] e8m0 scales"
            )

    def codes(self, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """The e2m1 codes (0-15) of a region, uint8 one a weight."""
        (o0, o1), (i0, i1) = rows, cols
        b = self.weight[o0:o1, i0 // 2 : _cdiv(i1, 2)].view(torch.uint8)
        codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)
        return codes[:, i0 % 2 : i0 % 2 + i1 - i0]

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        (o0, o1), (i0, i1) = rows, cols
        s = scale_values(self.scale[o0:o1, g0 : g0 + _cdiv(i1 - i0, group)])
        return self.codes(rows, cols).contiguous(), s, torch.zeros_like(s)

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (r0, r1), (c0, c1) = bounds
        values = torch.tensor(E2M1, dtype=torch.float32)[self.codes((r0, r1), (c0, c1)).long()]
        s = scale_values(self.scale[r0:r1, c0 // FP4_GROUP : _cdiv(c1, FP4_GROUP)])
        return values * s[:, torch.arange(c0, c1) // FP4_GROUP - c0 // FP4_GROUP]


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
            scaled = self.scaled_by(key)
            if scaled is not None and scaled not in self.file_of:
                raise ValueError(f"checkpoint tensor {key!r} scales {scaled!r}, which is absent")
        fp4 = sum(self.stored_dtype(k) in FP4_DTYPES and self.scale_of(k) is not None for k in self.file_of)
        if fp4:
            log.info(
                "fp8 checkpoint: %d weights in fp4 (e2m1 two a byte, an e8m0 scale per %d inputs: "
                "DeepSeek-V4's experts), held as fp4 codes as stored",
                fp4,
                FP4_GROUP,
            )
        if not any(self.scaled_by(k) and not self.static_scale(k) for k in self.file_of):
            # e.g. DeepSeek's fp8_cast_bf16.py output, which keeps the config's quantization_config
            log.warning(
                "quantization_config says fp8, but no checkpoint tensor is e4m3: loading them as stored"
            )

    def scaled_by(self, key: str) -> str | None:
        """The weight a scale tensor scales (X.weight_scale_inv, V4's X.scale -> X.weight), else None."""
        if key.endswith(self.suffix):
            return key[: -len(self.suffix)]
        if key.endswith(V4_SCALE) and key[: -len(V4_SCALE)] + ".weight" in self.file_of:
            return key[: -len(V4_SCALE)] + ".weight"
        return None

    def scale_of(self, key: str) -> str | None:
        """The scale tensor of a weight (X.weight_scale_inv, or V4's X.scale), None if it has none."""
        names = [key + self.suffix]
        if key.endswith(".weight"):
            names.append(key[: -len(".weight")] + V4_SCALE)
        return next((n for n in names if n in self.file_of), None)

    def static_scale(self, key: str) -> bool:
        """A tensor the format carries but the engine does not apply (ModelOpt's static activation
        and KV scales); none in this format."""
        return False

    def keys(self) -> list[tuple[str, str]]:
        return [(k, p) for k, p in super().keys() if self.scaled_by(k) is None and not self.static_scale(k)]

    def get_slice(self, key: str) -> Any:
        stored = self.stored(key)
        dtype, scale = stored.get_dtype(), self.scale_of(key)
        if dtype in FP4_DTYPES and key.endswith(".weight"):
            if scale is None:  # read as plain integers it would load as garbage
                raise ValueError(f"fp4 weight {key!r} ({dtype}) has no {key[: -len('weight')] + 'scale'!r}")
            return self.serve(key, Fp4Tensor(key, stored, self.stored(scale)))
        if dtype not in FP8_DTYPES:
            return stored  # norms, embeddings, the router, lm_head: stored in bf16
        if scale is None:
            raise ValueError(f"fp8 weight {key!r} has no {key + self.suffix!r} in the checkpoint")
        return self.serve(key, Fp8Tensor(key, stored, self.stored(scale), self.fmt.block, self.suffix))
