"""AWQ checkpoints (`quant_method: awq`, AutoAWQ's GEMM version): per linear `X`, `X.qweight`
int32 [in, out / 8] packing eight 4-bit output columns a word in AWQ's order (value j of word w
is column w * 8 + AWQ_ORDER[j]), `X.qzeros` int32 [groups, out / 8] alike and `X.scales`
[groups, out]; group = i // group_size. W[o, i] = (q[i, o] - zero[g, o]) * scale[g, o].
Dequantized to the model dtype at load (logged).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.gptq import PackedIntView, unpack
from expertmesh.layers.quantization.view import CheckpointView, LogicalTensor

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AwqFormat:
    group_size: int = 128
    bits: int = 4
    method: str = "awq"
    online: bool = False
    holds_compressed = True  # int codes held as stored where they map exactly (quantization/held.py)

    @classmethod
    def from_config(cls, cfg: dict) -> AwqFormat:
        bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
        version = str(cfg.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or not cfg.get("zero_point", True):
            raise ValueError(
                f"awq bits={bits}, version={version!r}, zero_point={cfg.get('zero_point', True)} is not "
                "supported; supported: bits 4, version 'gemm', zero_point true"
            )
        return cls(int(cfg.get("group_size", cfg.get("q_group_size", 128))))

    def describe(self) -> str:
        return f"awq int4 (groups of {self.group_size})"

    def view(self, handles: dict[str, Any]) -> CheckpointView:
        return PackedIntView(handles, self, AwqTensor)


class AwqTensor(LogicalTensor):
    def __init__(self, base: str, parts: dict[str, Any], fmt: AwqFormat) -> None:
        self.base, self.parts, self.fmt = base, parts, fmt
        qw, qz, sc = (tuple(parts[k].get_shape()) for k in ("qweight", "qzeros", "scales"))
        self.shape = (qw[1] * 8, qw[0])
        if sc[1] != self.shape[0] or qz != (sc[0], qw[1]) or sc[0] != _cdiv(qw[0], fmt.group_size):
            raise ValueError(
                f"awq {base}: qweight {qw}, qzeros {qz} and scales {sc} do not fit groups of {fmt.group_size}"
            )
        self.held_kind = ("int4", fmt.group_size)

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """W = (q - z) * s: codes q (uint4), offset -z * s."""
        (o0, o1), (i0, i1) = rows, cols
        w0, w1 = o0 // 8, _cdiv(o1, 8)
        cut = slice(o0 - w0 * 8, o0 - w0 * 8 + (o1 - o0))
        g = 1 if group != self.fmt.group_size else _cdiv(i1 - i0, group)
        g0 = 0 if group != self.fmt.group_size else g0
        q = unpack(self.parts["qweight"][i0:i1, w0:w1], 4, 1, AWQ_ORDER)[:, cut].t()  # [o, i]
        z = unpack(self.parts["qzeros"][g0 : g0 + g, w0:w1], 4, 1, AWQ_ORDER)[:, cut].t().to(torch.float32)
        s = self.parts["scales"][g0 : g0 + g, o0:o1].to(torch.float32).t()
        return q.to(torch.uint8), s, -z * s

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (o0, o1), (i0, i1) = bounds
        w0, w1 = o0 // 8, _cdiv(o1, 8)
        cut = slice(o0 - w0 * 8, o0 - w0 * 8 + (o1 - o0))
        q = unpack(self.parts["qweight"][i0:i1, w0:w1], 4, 1, AWQ_ORDER)[:, cut]  # [i, o]
        z = unpack(self.parts["qzeros"][:, w0:w1], 4, 1, AWQ_ORDER)[:, cut]  # [groups, o]
        s = self.parts["scales"][:, o0:o1].to(torch.float32)
        g = torch.arange(i0, i1) // self.fmt.group_size
        return ((q - z[g]).to(torch.float32) * s[g]).t()
