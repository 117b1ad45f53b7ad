"""Quantized weights held compressed, in the panel layout the CPU kernel reads (gemm_q, moe_q in
cpu/csrc/cpu_kernels.c). Their products run on the model's ops (layers/ops.py): our kernel on
cpu/ops.py's CpuOps, or `torch_product`, which dequantizes per call (no compiler, other devices).

A [O, I] weight becomes codes [P, I, lanes] (one byte a value: int8, fp8 e4m3) or [P, I, lanes/2]
(a nibble: uint4, fp4 e2m1), P = ceil(O / lanes) panels of `lanes` output rows, plus float32
scales and offsets [P, G, lanes] for G groups of `group` inputs: W = code * scale + offset. The
kernel rebuilds each weight vector in registers with one FMA; products accumulate in float32.

Routed experts are stacked per expert (`QuantizedExperts`: codes [E, P, I, .], scales and offsets
[E, P, G, lanes]): expert e's weight is index e of each of the three tensors, so moving one expert
(EPLB) moves three slices.

The codes themselves (rounding, decoding, the panel layouts, the kinds' numbers) are codes.py.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from expertmesh import huge_pages
from expertmesh.layers.quantization.codes import (
    ACTIVATIONS_QUANTIZED,
    NIBBLES,
    cdiv,
    decode_codes,
    from_octs,
    from_panels,
    from_quads,
    nibble_panels_into,
    panels_into,
    quantize_activations,
    quantize_rows,
    to_octs,
    to_quads,
)


def a8_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, I] @ W^T in W8A8 / W4A8 arithmetic (W = code * scale + offset): exact integer sums per
    group (float64 holds them), then y += sum * (scale * sx) + offset * (sx * sum(xq)), groups in
    order, in float32."""
    group = w.group
    xq, sx = quantize_activations(x.float().cpu(), group)
    g = xq.shape[1]
    codes = from_quads(w.codes) if w.kind == "w8a8" else from_octs(w.codes)
    wq = torch.zeros(w.out_features, g * group, dtype=torch.float64)
    wq[:, : w.in_features] = decode_codes(
        from_panels(codes, w.out_features)[:, : w.in_features], w.kind
    ).double()
    isum = torch.einsum("mgk,ogk->mog", xq.double(), wq.view(w.out_features, g, group)).float()
    xsum = sx * xq.sum(-1)  # [M, G]: integers, exact in float32
    sw, mw = from_panels(w.scales, w.out_features), from_panels(w.offsets, w.out_features)  # [O, G]
    y = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32)
    for j in range(g):
        y += isum[:, :, j] * (sw[None, :, j] * sx[:, j, None]) + mw[None, :, j] * xsum[:, j, None]
    return y.to(x.device)


class QuantizedProducts(Protocol):
    """The products of QuantizedWeight: the part of the model's ops (layers/ops.py) it runs on."""

    quant_lanes: int  # output rows a panel of codes holds
    # Whether mxfp4_block_panels lays GGUF MXFP4 blocks straight into fp4 panels (mxfp4_blocks.py)
    lays_mxfp4_blocks: bool

    def gemm_q(
        self, w: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """x [M, I] float32 contiguous (activations of `dtype`) @ W^T (+ bias, float32) -> [M, O]
        float32."""
        ...

    def gemm_q_native(
        self, w: QuantizedWeight, dtype: torch.dtype, keep: list, float32_out: bool
    ) -> dict | None:
        """w in a native decode layer's GEMM slot (cpu/native_decode.py), or None."""
        ...

    def mxfp4_block_panels(
        self, raw: np.ndarray, groups: int, codes: torch.Tensor, scales: torch.Tensor, threads: int
    ) -> None:
        """GGUF MXFP4 blocks [rows, groups, 17] (C-contiguous) into the fp4 panels starting at
        `codes` / `scales` (the rows from a panel's first); only where `lays_mxfp4_blocks`."""
        ...


def torch_product(w: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """QuantizedWeight's product through torch: W8A8 / W4A8 in their integer arithmetic
    (a8_reference), the weight-only kinds on the weight dequantized for this call."""
    if w.kind in ACTIVATIONS_QUANTIZED:
        y = a8_reference(x, w)
        return y if bias is None else y + bias
    return F.linear(x, w.dequantize().to(x.device), bias)


@dataclass
class QuantizedWeight:
    """A compressed [out, in] weight; `apply` (or calling it) multiplies by it, like the other linear
    weight forms (layers/linear_weight.py)."""

    kind: str
    codes: torch.Tensor  # [P, I, lanes] or [P, I, lanes / 2] uint8
    scales: torch.Tensor  # [P, G, lanes] float32
    offsets: torch.Tensor  # [P, G, lanes] float32
    out_features: int
    in_features: int
    group: int  # inputs per scale (in_features when per channel)
    lanes: int
    ops: QuantizedProducts  # the model's ops (layers/ops.py): our kernel, or torch_product
    shared_offsets: bool = False  # offsets one zero tensor shared by every expert (MXFP4's)

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str, group: int, ops: QuantizedProducts) -> QuantizedWeight:
        codes, scales, offsets = quantize_rows(weight, kind, group)
        return cls.from_rows(codes, scales, offsets, kind, group or weight.shape[1], ops)

    @classmethod
    def from_rows(
        cls, codes, scales, offsets, kind: str, group: int, ops: QuantizedProducts, into=None
    ) -> QuantizedWeight:
        """Row-major codes [O, I] uint8 and scales / offsets [O, G] laid out in panels. `into`:
        {part: (shape, dtype)} -> {part: tensor}, where the panels are written (a slot of the
        experts' stacks: streaming.ExpertStacks); a part it leaves out is allocated here."""
        lanes = ops.quant_lanes
        out_f, in_f = codes.shape
        p = cdiv(out_f, lanes)
        if kind == "w8a8":
            panels = to_quads(codes, group, lanes)
        elif kind == "w4a8":
            panels = to_octs(codes, group, lanes)
        else:
            panels = None
        code_shape = (p, in_f, lanes // 2 if kind in NIBBLES else lanes) if panels is None else panels.shape
        shapes = {
            "codes": (tuple(code_shape), torch.uint8),
            "scales": ((p, scales.shape[1], lanes), torch.float32),
            "offsets": ((p, offsets.shape[1], lanes), torch.float32),
        }  # fmt: skip
        dst = dict(into(shapes)) if into is not None else {"codes": huge_pages.empty(*shapes["codes"])}
        for part, (shape, dtype) in shapes.items():
            if part not in dst:
                dst[part] = torch.empty(shape, dtype=dtype)
        if panels is not None:
            dst["codes"].copy_(panels)
        elif kind in NIBBLES:  # lane 2j in the low nibble of byte j
            nibble_panels_into(codes, dst["codes"])
        else:
            panels_into(codes, dst["codes"])
        panels_into(scales.float(), dst["scales"])
        panels_into(offsets.float(), dst["offsets"])
        return cls(kind, dst["codes"], dst["scales"], dst["offsets"], out_f, in_f, group, lanes, ops)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def slot_tensors(self) -> list[torch.Tensor]:
        """What EPLB moves of this expert's weight (shared zero offsets are never written)."""
        return [self.codes, self.scales] + ([] if self.shared_offsets else [self.offsets])

    def dequantize(self) -> torch.Tensor:
        """The [out, in] float32 weight this holds (the reference the kernel is tested against)."""
        codes = self.codes
        if self.kind in NIBBLES:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
        if self.kind == "w8a8":  # [P, I4, lanes, 4] -> [P, I, lanes]
            codes = from_quads(codes)[:, : self.in_features]
        if self.kind == "w4a8":  # [P, I8, lanes, 4] nibbles -> [P, I, lanes]
            codes = from_octs(codes)[:, : self.in_features]
        values = decode_codes(from_panels(codes, self.out_features), self.kind)
        expand = lambda t: from_panels(t, self.out_features).repeat_interleave(self.group, 1)[
            :, : self.in_features
        ]
        return values * expand(self.scales) + expand(self.offsets)

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        shape, out_dtype = x.shape, out_dtype or x.dtype
        x2 = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        b = None if bias is None else bias.to(torch.float32).contiguous()
        y = self.ops.gemm_q(self, x2, b, x.dtype)
        return y.to(out_dtype).view(*shape[:-1], self.out_features)

    __call__ = apply

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(t, "quantized") for t in (self.codes, self.scales, self.offsets)]

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> dict | None:
        """This weight in a native decode layer's GEMM slot (cpu/native_decode.py): the gemm_q
        shim for activations in `dtype` (the product rounded to it, or left in float32 with
        `float32_out`) and its q_weight_desc, held by `keep`; None on torch_product or without a
        shim for the dtype."""
        return self.ops.gemm_q_native(self, dtype, keep, float32_out)


@dataclass
class QuantizedExperts:
    """E experts' quantized weights of one kind and shape, stacked: index e is expert e."""

    kind: str
    codes: torch.Tensor  # [E, P, I, .]
    scales: torch.Tensor  # [E, P, G, lanes]
    offsets: torch.Tensor
    group: int
    shared_offsets: bool = False  # offsets a zero stack shared across layers (_zero_stack)

    @classmethod
    def stack(cls, weights: list[QuantizedWeight]) -> QuantizedExperts:
        w = weights[0]
        # Shared by the format (MXFP4), not by chance (a symmetric kind's zeros): every rank's
        # stacks then agree on what EPLB moves, whatever experts they hold.
        shared = all(q.shared_offsets and q.offsets is w.offsets for q in weights) and not w.offsets.any()
        codes, scales = (_stacked([getattr(q, a) for q in weights]) for a in ("codes", "scales"))
        if shared:
            offsets = _zero_stack(len(weights), w.offsets)
        else:
            offsets = _stacked([q.offsets for q in weights])
        return cls(w.kind, codes, scales, offsets, w.group, shared)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(t, "quantized") for t in (self.codes, self.scales, self.offsets)]

    def slot_tensors(self, e: int) -> list[torch.Tensor]:
        """Views of expert slot e (what EPLB copies into in place, so the kernel's pointers and
        native decode's descriptors stay valid); shared zero offsets are never written."""
        return [self.codes[e], self.scales[e]] + ([] if self.shared_offsets else [self.offsets[e]])


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(parts), or without a copy the stack they already lie in, one after the other
    (one-pass loading writes each expert into its slot of one buffer, a flat one when it is on huge
    pages: quantization/streaming.py); a copy there would hold the experts twice."""
    first, base = parts[0], parts[0]._base
    step = first.numel() * first.element_size()
    if (
        base is not None
        and base.is_contiguous()
        and base.dtype == first.dtype
        and base.numel() == len(parts) * first.numel()
        and all(
            p._base is base and p.is_contiguous() and p.data_ptr() == base.data_ptr() + e * step
            for e, p in enumerate(parts)
        )
    ):
        return base.view(len(parts), *first.shape)
    return torch.stack(parts, out=huge_pages.empty((len(parts), *first.shape), first.dtype))


# Offsets all zero (MXFP4's, one tensor for every expert): one stack of zeros a shape serves every
# layer, as long as some layer holds it, so the held experts stay at 0.625 bytes a weight.
_ZERO_STACKS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _zero_stack(experts: int, offsets: torch.Tensor) -> torch.Tensor:
    key = (experts, *offsets.shape, offsets.dtype)
    out = _ZERO_STACKS.get(key)
    if out is None:
        out = _ZERO_STACKS[key] = torch.zeros(experts, *offsets.shape, dtype=offsets.dtype)
    return out
