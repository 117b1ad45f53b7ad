"""GPTQ checkpoints (`quant_method: gptq`, AutoGPTQ / GPTQModel's v1 format): per linear `X`,
`X.qweight` int32 [in / p, out] packing p = 32 / bits input rows each (lowest bits first),
`X.qzeros` int32 [groups, out / p] packing output columns alike (stored as zero - 1 in v1,
`checkpoint_format: gptq_v2` stores the zero itself), `X.scales` [groups, out] and `X.g_idx` [in],
each input's group (arbitrary with desc_act; i // group_size without it).

W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]. The logical tensor is `X.weight`
[out, in]; a rank's slice reads the packed rows and columns it covers, the scales and zeros of
every group its inputs use. Held compressed as stored (layers/quantization/held.py) where groups
are in input order; with desc_act's scattered groups, with the rank's inputs sorted by group and
the activation gathered to match (layers/quantization/permuted.py); else dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from expertmesh.layers.quantization.permuted import input_order, slices_order_key
from expertmesh.layers.quantization.view import CheckpointView, LogicalTensor

PARTS = ("qweight", "qzeros", "scales", "g_idx")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def unpack(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words holding 32 / bits values each (value j at bits j * bits) -> int64 values along
    `dim` (word w's j-th value at w * p + j, or at w * p + order[j] when an order is given)."""
    p, mask = 32 // bits, (1 << bits) - 1
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    values = (words.unsqueeze(-1) >> shifts) & mask  # [..., words, p] in packing order
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order))]
    values = values.movedim(-1, dim + 1) if dim != packed.dim() - 1 else values
    shape = list(packed.shape)
    shape[dim] *= p
    return values.reshape(shape)


@dataclass(frozen=True)
class GptqFormat:
    bits: int = 4
    group_size: int = 128  # -1: one group per output channel
    desc_act: bool = False
    zero_offset: int = 1  # v1 stores zero - 1
    method: str = "gptq"
    online: bool = False
    holds_compressed = True  # int codes held as stored where they map exactly (quantization/held.py)

    @classmethod
    def from_config(cls, cfg: dict) -> GptqFormat:
        bits = int(cfg.get("bits", 4))
        if bits not in (4, 8):
            raise ValueError(f"gptq bits={bits} is not supported; supported: [4, 8]")
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(
                f"gptq checkpoint_format={fmt!r} is not supported; supported: ['gptq', 'gptq_v2']"
            )
        return cls(
            bits, int(cfg.get("group_size", 128)), bool(cfg.get("desc_act", False)), int(fmt == "gptq")
        )

    def describe(self) -> str:
        group = "per channel" if self.group_size < 1 else f"groups of {self.group_size}"
        act = ", desc_act" if self.desc_act else ""
        return f"gptq int{self.bits} ({group}{act})"

    def view(self, handles: dict[str, Any]) -> CheckpointView:
        return PackedIntView(handles, self, GptqTensor)


class GptqTensor(LogicalTensor):
    def __init__(self, base: str, parts: dict[str, Any], fmt: Any) -> None:
        self.base, self.parts, self.fmt = base, parts, fmt
        p = 32 // fmt.bits
        qw, qz, sc = (tuple(parts[k].get_shape()) for k in ("qweight", "qzeros", "scales"))
        self.shape = (qw[1], qw[0] * p)
        if sc[1] != qw[1] or qz != (sc[0], _cdiv(sc[1], p)):
            raise ValueError(f"gptq {base}: qweight {qw}, qzeros {qz} and scales {sc} do not fit together")
        self.groups = sc[0]
        self.permuted = False  # desc_act: held with each rank's inputs sorted by group
        if self.groups_in_order():
            self.held_kind = (f"int{fmt.bits}", fmt.group_size if fmt.group_size > 0 else 0)
        elif fmt.group_size > 0 and self._g_idx_fits():
            self.held_kind, self.permuted = (f"int{fmt.bits}", fmt.group_size), True

    def _g_idx_fits(self) -> bool:
        g = self.parts["g_idx"][:].to(torch.int64)
        return bool(g.numel() == self.shape[1] and g.min() >= 0 and g.max() < self.groups)

    def held_input_order(self, local_in: int) -> bytes | None:
        """desc_act: the order every rank's `local_in` inputs are held in (None: some rank's slice
        cuts a group); plain groups: b"" (no reorder)."""
        if not self.permuted:
            return b""
        g = self.parts["g_idx"][:].to(torch.int64)
        return slices_order_key(g, local_in, self.fmt.group_size, self.groups)

    def _perm(self, i0: int, i1: int) -> torch.Tensor:
        g = self.parts["g_idx"][:].to(torch.int64)
        perm = input_order(g, i0, i1, self.fmt.group_size, self.groups)
        if perm is None:
            raise ValueError(f"gptq {self.base}: inputs [{i0}, {i1}) cut a desc_act group")
        return perm

    def held_region(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        codes = super().held_region(bounds)
        if self.permuted:
            codes.held_region.perm = self._perm(*bounds[1])
        return codes

    def groups_in_order(self) -> bool:
        """Without g_idx, or with one that is i // group_size (desc_act off, or a trivial order)."""
        if "g_idx" not in self.parts:
            return True
        g = self.parts["g_idx"][:].to(torch.int64)
        return bool(torch.equal(g, self.group_of_ordered(0, self.shape[1])))

    def group_of_ordered(self, i0: int, i1: int) -> torch.Tensor:
        size = self.fmt.group_size if self.fmt.group_size > 0 else self.shape[1]
        return torch.arange(i0, i1) // size

    def quantized(self, rows: tuple[int, int], cols: tuple[int, int], group: int, g0: int) -> tuple:
        """W = (q - z) * s: int4 codes are q (uint4), offset -z * s; int8 codes q - 128 (int8),
        offset -(z - 128) * s."""
        (o0, o1), (i0, i1) = rows, cols
        bits, p = self.fmt.bits, 32 // self.fmt.bits
        g = _cdiv(i1 - i0, group)
        if group != (self.fmt.group_size if self.fmt.group_size > 0 else self.shape[1]):
            g0, g = 0, 1  # one scale a row (per channel), whatever part of the inputs is read
        q = unpack(self.parts["qweight"][i0 // p : _cdiv(i1, p), o0:o1], bits, 0)
        q = q[i0 - i0 // p * p :][: i1 - i0].t()  # [o, i]
        picked = slice(g0, g0 + g)
        if self.permuted:  # inputs sorted by group: the groups they touch, in increasing order
            perm = self._perm(i0, i1)
            q = q[:, perm]
            picked = torch.unique(self.parts["g_idx"][i0:i1].to(torch.int64))
        z = unpack(self.parts["qzeros"][:, o0 // p : _cdiv(o1, p)], bits, 1)[picked]
        z = (z[:, o0 - o0 // p * p :][:, : o1 - o0] + self.fmt.zero_offset).t().to(torch.float32)
        s = self.parts["scales"][:, o0:o1][picked].to(torch.float32).t()
        if bits == 4:
            return q.to(torch.uint8), s, -z * s
        return (q - 128).to(torch.int8).view(torch.uint8), s, -(z - 128) * s

    def group_of(self, i0: int, i1: int) -> torch.Tensor:
        if "g_idx" in self.parts:
            return self.parts["g_idx"][i0:i1].to(torch.int64)
        size = self.fmt.group_size if self.fmt.group_size > 0 else self.shape[1]
        return torch.arange(i0, i1) // size

    def materialize(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (o0, o1), (i0, i1) = bounds
        bits, p = self.fmt.bits, 32 // self.fmt.bits
        q = unpack(self.parts["qweight"][i0 // p : _cdiv(i1, p), o0:o1], bits, 0)
        q = q[i0 - i0 // p * p :][: i1 - i0]  # [i, o]
        z = unpack(self.parts["qzeros"][:, o0 // p : _cdiv(o1, p)], bits, 1)
        z = z[:, o0 - o0 // p * p :][:, : o1 - o0] + self.fmt.zero_offset  # [groups, o]
        s = self.parts["scales"][:, o0:o1].to(torch.float32)
        g = self.group_of(i0, i1)
        if g.numel() and (int(g.min()) < 0 or int(g.max()) >= self.groups):
            raise ValueError(f"gptq {self.base}.g_idx names groups outside [0, {self.groups})")
        return ((q - z[g]).to(torch.float32) * s[g]).t()


class PackedIntView(CheckpointView):
    """Packed-int formats (GPTQ, AWQ): `X.qweight` + its parts served as the logical `X.weight`."""

    def __init__(self, handles: dict[str, Any], fmt: Any, tensor: type) -> None:
        super().__init__(handles)
        self.fmt, self.tensor = fmt, tensor
        need = [k for k in PARTS[:3]]
        for key in self.file_of:
            base, _, part = key.rpartition(".")
            if part in PARTS:
                missing = [f"{base}.{n}" for n in need if f"{base}.{n}" not in self.file_of]
                if missing:
                    raise ValueError(f"{fmt.method} tensor {key!r} comes without {missing}")

    def keys(self) -> list[tuple[str, str]]:
        out = []
        for key, path in super().keys():
            base, _, part = key.rpartition(".")
            if part == "qweight":
                out.append((f"{base}.weight", path))
            elif part not in PARTS:
                out.append((key, path))
        return out

    def get_slice(self, key: str) -> Any:
        if key in self.file_of:
            return self.stored(key)
        base = key[: -len(".weight")]
        parts = {n: self.stored(f"{base}.{n}") for n in PARTS if f"{base}.{n}" in self.file_of}
        return self.serve(key, self.tensor(base, parts, self.fmt))
