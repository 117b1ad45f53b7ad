"""Quantized weights held compressed, in the panel layout the CPU kernel reads (gemm_q, moe_q in
cpu/csrc/cpu_kernels.c), with a torch fallback that dequantizes per call (no compiler, other devices).

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
from typing import Any

import torch
import torch.nn.functional as F

from expertmesh.cpu import huge_pages
from expertmesh.cpu import native_desc as nd
from expertmesh.layers.quantization.codes import (
    ACTIVATIONS_QUANTIZED,
    NIBBLES,
    decode_codes,
    from_octs,
    from_panels,
    from_quads,
    product_kind,
    quantize_activations,
    quantize_rows,
    to_octs,
    to_panels,
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
    kernels: Any = None  # CpuKernels, or None: the torch fallback
    shared_offsets: bool = False  # offsets one zero tensor shared by every expert (MXFP4's)

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str, group: int, kernels: Any) -> QuantizedWeight:
        codes, scales, offsets = quantize_rows(weight, kind, group)
        return cls.from_rows(codes, scales, offsets, kind, group or weight.shape[1], kernels)

    @classmethod
    def from_rows(cls, codes, scales, offsets, kind: str, group: int, kernels: Any) -> QuantizedWeight:
        """Row-major codes [O, I] uint8 and scales / offsets [O, G] laid out in panels."""
        lanes = kernels.lanes if kernels is not None else 8
        out_f, in_f = codes.shape
        panels = to_panels(codes, lanes)  # [P, I, lanes]
        if kind in NIBBLES:  # lane 2j in the low nibble of byte j
            panels = (panels[..., 0::2] | (panels[..., 1::2] << 4)).contiguous()
        if kind == "w8a8":
            panels = to_quads(codes, group, lanes)
        if kind == "w4a8":
            panels = to_octs(codes, group, lanes)
        s, m = to_panels(scales.float(), lanes), to_panels(offsets.float(), lanes)
        return cls(kind, huge_pages.adopt(panels), s, m, out_f, in_f, group, lanes, kernels)

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
        if self.kind in ACTIVATIONS_QUANTIZED and (self.kernels is None or x.device.type != "cpu"):
            y = a8_reference(x2, self)
            y = y if b is None else y + b
        elif self.kernels is None or x.device.type != "cpu":
            y = F.linear(x2, self.dequantize().to(x2.device), b)
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            if x2.shape[0]:
                kind = product_kind(self.kind, x.dtype, self.kernels)
                self.kernels.lib.gemm_q(
                    kind, x2.data_ptr(), self.codes.data_ptr(), self.scales.data_ptr(),
                    self.offsets.data_ptr(), self.group, y.data_ptr(), x2.shape[0], self.out_features,
                    self.in_features, None if b is None else b.data_ptr(), torch.get_num_threads(),
                )  # fmt: skip
        return y.to(out_dtype).view(*shape[:-1], self.out_features)

    __call__ = apply

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(t, "quantized") for t in (self.codes, self.scales, self.offsets)]

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> dict | None:
        """This weight in a native decode layer's GEMM slot (cpu/native_decode.py): the gemm_q
        shim for activations in `dtype` (the product rounded to it, or left in float32 with
        `float32_out`) and its q_weight_desc, held by `keep`; None without our kernel (the torch
        fallback) or a shim for the dtype."""
        suffix = nd.SHIM_SUFFIX.get(dtype)
        if self.kernels is None or suffix is None or self.codes.device.type != "cpu":
            return None
        if float32_out and dtype != torch.float32:
            suffix += "_f32"
        fn = nd.c_entry(self.kernels, f"gemm_q_desc_{suffix}")
        if fn is None:
            return None
        desc = nd.QWeightDesc(
            product_kind(self.kind, dtype, self.kernels),
            self.codes.data_ptr(),
            self.scales.data_ptr(),
            self.offsets.data_ptr(),
            self.group,
        )
        keep.append(self)  # the tensors the struct points into
        return {"fn": fn, "w": nd.held_struct(keep, desc)}


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


def experts_native_form(kernels: Any, w13: QuantizedExperts, w2: QuantizedExperts, dtype, keep: list):
    """moe_q's shim and q_experts_desc for a native decode layer's experts slot, None where there
    is none (no shim for the model dtype, an older build)."""
    suffix = nd.SHIM_SUFFIX.get(dtype)
    fn = None if suffix is None else nd.c_entry(kernels, f"moe_q_desc_{suffix}")
    if fn is None or w13.kind != w2.kind:
        return None
    t13, t2 = (w13.codes, w13.scales, w13.offsets), (w2.codes, w2.scales, w2.offsets)
    desc = nd.QExpertsDesc(
        product_kind(w13.kind, dtype, kernels),
        *(t.data_ptr() for t in t13),
        w13.group,
        *(t.data_ptr() for t in t2),
        w2.group,
    )
    keep += [w13, w2]
    return {"experts_fn": fn, "experts_w": nd.held_struct(keep, desc)}


class QuantizedMoE:
    """The `kernels.moe(...)` of FusedExperts' fused path, over QuantizedExperts: moe_q_ex with the
    experts' float32 biases ([E, 2I], [E, H]; None: none, read at each call so that copies into
    them are seen) and the activation's limit and alpha (activation.py moe_q_form)."""

    def __init__(
        self,
        kernels: Any,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        limit: float = 0.0,
        alpha: float = 0.0,
    ) -> None:
        for b in (b13, b2):
            if b is not None and (b.dtype != torch.float32 or not b.is_contiguous()):
                raise ValueError(f"moe_q_ex takes contiguous float32 biases, not {b.dtype} {tuple(b.shape)}")
        self.kernels, self.b13, self.b2, self.limit, self.alpha = kernels, b13, b2, limit, alpha

    def moe(self, x, slot, weights, w13: QuantizedExperts, w2: QuantizedExperts, inter: int, act: str):
        n, hidden = x.shape
        xf = x.to(torch.float32).contiguous()
        slot, weights = slot.contiguous(), weights.to(torch.float32).contiguous()
        out = torch.empty(n, hidden, dtype=torch.float32)
        lib, kind = self.kernels.lib, product_kind(w13.kind, x.dtype, self.kernels)
        head = (
            kind, xf.data_ptr(), n, hidden, slot.data_ptr(), weights.data_ptr(), slot.shape[1],
            w13.codes.data_ptr(), w13.scales.data_ptr(), w13.offsets.data_ptr(), w13.group,
            w2.codes.data_ptr(), w2.scales.data_ptr(), w2.offsets.data_ptr(), w2.group,
            w13.codes.shape[0], inter, self.kernels.MOE_Q_ACTIVATIONS[act],
        )  # fmt: skip
        if self.kernels.moe_q_ex is None:  # an older build: FusedExperts sends it plain experts only
            lib.moe_q(*head, out.data_ptr(), torch.get_num_threads())
            return out
        biases = [None if b is None else b.data_ptr() for b in (self.b13, self.b2)]
        self.kernels.moe_q_ex(*head, self.limit, self.alpha, *biases, out.data_ptr(), torch.get_num_threads())
        return out
