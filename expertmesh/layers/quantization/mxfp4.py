"""MXFP4 checkpoints (`quant_method: mxfp4`, gpt-oss): the routed experts' weights as FP4 e2m1
values packed two a byte (`*_blocks`, the low nibble first) with one e8m0 scale (2^(s - 127))
per 32 consecutive input values (`*_scales`); `modules_to_not_convert` names what stays bf16
(attention, router, embeddings, head).

gpt-oss stores `experts.gate_up_proj_blocks` [E, 2I, H / 32, 16] and `_scales` [E, 2I, H / 32]
(likewise down [E, H, I / 32, 16]); the logical tensor is the unquantized checkpoint's
`experts.gate_up_proj` [E, H, 2I] (input dim first), so the family's loader reads both alike. A
slice (one expert, a TP range of the intermediate dim) decodes only the blocks it touches.

Held as FP4 (layers/quantization/held.py): the kernels' fp4 kind (e2m1, decoded by a vector permute)
with groups of 32 and the e8m0 scale as a float32 scale (2^(s - 127) is exact), offset 0: 0.5 + 4 /
32 = 0.625 bytes a weight. The family's loader picks experts, gate / up columns and TP ranges with
tensor ops, so a held slice is an int16 tensor carrying each weight's code (bits 0-3) with its
block's exponent (bits 4-11): every pick moves both alike, and after loading held.py splits them
into codes and per-group scales. A rank whose inputs cut a 32-block (TP over a down projection whose
intermediate a rank does not hold in whole blocks) is dequantized at load (logged).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.view import CheckpointView, LogicalTensor

BLOCK = 32  # values per e8m0 scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Mxfp4Format:
    modules_to_not_convert: tuple[str, ...] = ()
    method: str = "mxfp4"
    online: bool = False
    holds_compressed = True  # experts held as fp4 codes and block scales (quantization/held.py)

    @classmethod
    def from_config(cls, cfg: dict) -> Mxfp4Format:
        return cls(tuple(cfg.get("modules_to_not_convert") or ()))

    def name(self) -> str:
        return "mxfp4 (e2m1, e8m0 scale per 32)"

    def describe(self) -> str:
        return f"{self.name()}, experts held as fp4 codes with a float32 scale per 32 inputs"

    def view(self, handles: dict[str, Any]) -> CheckpointView:
        return Mxfp4View(handles, self)

    def not_converted(self, module: str) -> bool:
        return any(
            fnmatch.fnmatchcase(module, p) or module.startswith(p + ".") for p in self.modules_to_not_convert
        )


def decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., G, 16] uint8 and [..., G] uint8 -> [..., G * 32] float32."""
    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2)


class Mxfp4Experts(LogicalTensor):
    """[E, in, out] from blocks [E, out, in / 32, 16] and scales [E, out, in / 32]."""

    held_kind = ("fp4", BLOCK)
    held_through_picks = True  # held slices carry their scales (see the module doc)
    held_storage = torch.int16

    def __init__(self, key: str, blocks: Any, scales: Any) -> None:
        self.key, self.blocks, self.scales = key, blocks, scales
        b, s = tuple(blocks.get_shape()), tuple(scales.get_shape())
        if len(b) != 4 or b[3] != BLOCK // 2 or b[:3] != s:
            raise ValueError(
                f"mxfp4 {key}_blocks {b} and {key}_scales {s} do not fit: "
                "want [E, out, G, 16] and [E, out, G]"
            )
        self.shape = (b[0], b[2] * BLOCK, b[1])

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (e0, e1), (i0, i1), (o0, o1) = bounds
        g0, g1 = i0 // BLOCK, _cdiv(i1, BLOCK)
        w = decode(self.blocks[e0:e1, o0:o1, g0:g1], self.scales[e0:e1, o0:o1, g0:g1])  # [e, out, in]
        return w[:, :, i0 - g0 * BLOCK : i1 - g0 * BLOCK].transpose(1, 2)

    @property
    def held_in(self) -> int:
        return self.shape[1]

    def held_region(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The region as int16: code | exponent << 4 per weight ([e, in, out], as materialize)."""
        (e0, e1), (i0, i1), (o0, o1) = bounds
        g0, g1 = i0 // BLOCK, _cdiv(i1, BLOCK)
        s = self.scales[e0:e1, o0:o1, g0:g1]
        if bool((s == 255).any()):
            raise ValueError(f"mxfp4 {self.key}_scales holds 255 (e8m0 NaN)")
        b = self.blocks[e0:e1, o0:o1, g0:g1].to(torch.int16)
        codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)  # [e, out, G, 32]
        v = (codes | (s.to(torch.int16) << 4).unsqueeze(-1)).flatten(-2)
        return v[:, :, i0 - g0 * BLOCK : i1 - g0 * BLOCK].transpose(1, 2)


class Mxfp4View(CheckpointView):
    def __init__(self, handles: dict[str, Any], fmt: Mxfp4Format) -> None:
        super().__init__(handles)
        for key in self.file_of:
            if not key.endswith(("_blocks", "_scales")):
                continue
            base = key.rsplit("_", 1)[0]
            if not base.endswith(FUSED_EXPERTS):
                raise ValueError(
                    f"mxfp4 tensor {key!r}: only gpt-oss's fused expert tensors "
                    f"{list(FUSED_EXPERTS)} are supported"
                )
            if fmt.not_converted(base.rsplit(".", 1)[0]):
                raise ValueError(f"mxfp4 tensor {key!r} is in a module that modules_to_not_convert lists")
            other = base + ("_scales" if key.endswith("_blocks") else "_blocks")
            if other not in self.file_of:
                raise ValueError(f"mxfp4 tensor {key!r} has no {other!r} in the checkpoint")

    def keys(self) -> list[tuple[str, str]]:
        out = []
        for key, path in super().keys():
            if key.endswith("_blocks"):
                out.append((key[: -len("_blocks")], path))
            elif not key.endswith("_scales"):
                out.append((key, path))
        return out

    def get_slice(self, key: str) -> Any:
        if key in self.file_of:
            return self.stored(key)
        return self.serve(key, Mxfp4Experts(key, self.stored(key + "_blocks"), self.stored(key + "_scales")))
