"""Quantized weights held compressed, in the panel layout the CPU kernel reads (gemm_q, moe_q in
cpu/csrc/cpu_kernels.c), with a torch fallback that dequantizes per call (no compiler, other devices).

A [O, I] weight becomes codes [P, I, lanes] (one byte a value: int8, fp8 e4m3) or [P, I, lanes/2]
(a nibble: uint4, fp4 e2m1), P = ceil(O / lanes) panels of `lanes` output rows, plus float32
scales and offsets [P, G, lanes] for G groups of `group` inputs: W = code * scale + offset. The
kernel rebuilds each weight vector in registers with one FMA; products accumulate in float32.

Routed experts are stacked per expert (`QuantizedExperts`: codes [E, P, I, .], scales and offsets
[E, P, G, lanes]): expert e's weight is index e of each of the three tensors, so moving one expert
(EPLB) moves three slices.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from expertmesh.cpu import huge_pages
from expertmesh.cpu import native_desc as nd
from expertmesh.cpu.cpu_kernels import QUANT_KINDS
from expertmesh.layers.quantization.mxfp4 import E2M1

# A weight kind's gemm_q code (cpu_kernels.QUANT_KINDS numbers them, cpu/csrc/quant_kinds.h for C)
KINDS = {name: QUANT_KINDS.index(name) for name in ("int8", "int4", "fp8", "fp4", "w8a8", "w4a8")}
# uint4 / int8 / fp4 / fp8 codes (int4's / int8's / fp4's / fp8's) against activations rounded to
# bf16 (product_kind)
INT4_BF16, INT8_BF16, FP4_BF16, FP8_BF16 = (
    QUANT_KINDS.index(f"{k}-bf16") for k in ("int4", "int8", "fp4", "fp8")
)
BF16_PAIRS = {"int4": INT4_BF16, "int8": INT8_BF16, "fp4": FP4_BF16, "fp8": FP8_BF16}
ACTIVATIONS_QUANTIZED = ("w8a8", "w4a8")  # the kernels quantize the inputs to int8 per row and group
NIBBLES = ("int4", "fp4")
FP8_MAX = 448.0


def product_kind(kind: str, dtype: torch.dtype, kernels: Any) -> int:
    """gemm_q / moe_q's code kind for weights of `kind` times activations of `dtype`: a bf16 model's
    int4 / int8 / fp4 / fp8 on bf16 pairs (kinds 6-9: the inputs rounded to bf16, as its torch layers
    round them; the scale and offset folded in once a group) where the build has them, else the
    kind's own."""
    if dtype == torch.bfloat16 and getattr(kernels, "quant_bf16_pairs", False):
        return BF16_PAIRS.get(kind, KINDS[kind])
    return KINDS[kind]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


ROUNDED_KINDS = ("int8", "int4", "fp8", "w8a8", "w4a8")


VALUES_AT_ONCE = (
    1 << 18
)  # values rounded per step: the float32 temporaries stay about 1 MB each (one-pass loading)


def quantize_rows(w: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[O, I] float -> codes [O, I] uint8, scales and offsets [O, G] float32 (group 0: G = 1).
    Rows are rounded a block at a time (each row's codes depend on that row alone)."""
    if kind not in ROUNDED_KINDS:  # fp4 codes come from checkpoints (MXFP4) only
        raise ValueError(f"quantize_rows: no rounding to {kind!r} codes; it rounds to {list(ROUNDED_KINDS)}")
    out_f, in_f = w.shape
    step = max(1, VALUES_AT_ONCE // max(in_f, 1))
    if out_f <= step:
        return _quantize_rows(w, kind, group)
    g = _cdiv(in_f, group or in_f)
    codes = torch.empty(out_f, in_f, dtype=torch.uint8)
    scales, offsets = torch.empty(out_f, g), torch.empty(out_f, g)
    for r in range(0, out_f, step):
        codes[r : r + step], scales[r : r + step], offsets[r : r + step] = _quantize_rows(
            w[r : r + step], kind, group
        )
    return codes, scales, offsets


def _quantize_rows(w: torch.Tensor, kind: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_f, in_f = w.shape
    group = group or in_f
    g = _cdiv(in_f, group)
    padded = torch.zeros(out_f, g * group, dtype=torch.float32)
    padded[:, :in_f] = w.float()
    blocks = padded.view(out_f, g, group)
    real = torch.arange(g * group).view(g, group) < in_f  # the padding of a partial last group is ignored
    if kind in ("int4", "w4a8"):
        mn = torch.where(real, blocks, torch.inf).amin(-1).clamp(max=0)
        mx = torch.where(real, blocks, -torch.inf).amax(-1).clamp(min=0)
        scale = torch.where(mx > mn, (mx - mn) / 15, torch.ones_like(mx))
        zero = torch.round(-mn / scale).clamp(0, 15)
        codes = (torch.round(blocks / scale[..., None]) + zero[..., None]).clamp(0, 15).to(torch.uint8)
        offset = -zero * scale
    else:  # int8 and w8a8 (int8 weights, int8 activations): symmetric
        amax = blocks.abs().amax(-1)
        top = FP8_MAX if kind == "fp8" else 127.0
        scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
        x = blocks / scale[..., None]
        if kind != "fp8":
            codes = torch.round(x).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        else:
            codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        offset = torch.zeros_like(scale)
    return codes.view(out_f, g * group)[:, :in_f].contiguous(), scale, offset


def decode_codes(codes: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 codes (one a value) -> their float32 values before scale and offset."""
    if kind in ("int8", "w8a8"):
        return codes.view(torch.int8).float()
    if kind == "fp8":
        return codes.view(torch.float8_e4m3fn).float()
    if kind == "fp4":
        return torch.tensor(E2M1, dtype=torch.float32)[codes.long()]
    return codes.float()


def _panels(t: torch.Tensor, lanes: int) -> torch.Tensor:
    """[O, C] -> [P, C, lanes], rows past O zero."""
    out_f, c = t.shape
    p = _cdiv(out_f, lanes)
    padded = torch.zeros(p * lanes, c, dtype=t.dtype)
    padded[:out_f] = t
    return padded.view(p, lanes, c).transpose(1, 2).contiguous()


def _unpanel(t: torch.Tensor, out_f: int) -> torch.Tensor:
    """[P, C, lanes] -> [O, C]."""
    p, c, lanes = t.shape
    return t.transpose(1, 2).reshape(p * lanes, c)[:out_f]


def _quads(codes: torch.Tensor, group: int, lanes: int) -> torch.Tensor:
    """W8A8's layout: [O, I] int8 codes -> [P, I4, lanes, 4], lane l of quad k holding inputs
    4k .. 4k + 3 of its row (the kernel's integer products sum 4 adjacent inputs a lane)."""
    out_f, in_f = codes.shape
    if group % 4 and group < in_f:
        raise ValueError(f"w8a8 needs groups of a multiple of 4 inputs (or one a row), got group={group}")
    if bool((codes == 128).any()):  # int8 -128: the kernel's sign trick needs codes in [-127, 127]
        raise ValueError("w8a8 codes must lie in [-127, 127]; found -128")
    i4 = _cdiv(in_f, 4)
    padded = torch.zeros(out_f, 4 * i4, dtype=torch.uint8)
    padded[:, :in_f] = codes
    panels = _panels(padded, lanes)  # [P, 4 * I4, lanes]
    return panels.view(-1, i4, 4, lanes).transpose(2, 3).contiguous()


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's dynamic activation quantization, as the kernel does it: x [M, I] float32 -> codes
    [M, G, group] (float32 integers in [-127, 127], zero past I) and scales [M, G], per row and group
    symmetric: s = amax / 127, code = round-half-even(x / s), a group of zeros all codes 0."""
    m, in_f = x.shape
    g = _cdiv(in_f, group)
    padded = torch.zeros(m, g * group, dtype=torch.float32)
    padded[:, :in_f] = x
    blocks = padded.view(m, g, group)
    amax = blocks.abs().amax(-1)
    s = amax / 127.0
    codes = torch.where(amax[..., None] > 0, torch.round(blocks / s[..., None]), torch.zeros_like(blocks))
    return codes, s


def a8_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [M, I] @ W^T in W8A8 / W4A8 arithmetic (W = code * scale + offset): exact integer sums per
    group (float64 holds them), then y += sum * (scale * sx) + offset * (sx * sum(xq)), groups in
    order, in float32."""
    group = w.group
    xq, sx = quantize_activations(x.float().cpu(), group)
    g = xq.shape[1]
    codes = _unquad(w.codes) if w.kind == "w8a8" else _unoct(w.codes)
    wq = torch.zeros(w.out_features, g * group, dtype=torch.float64)
    wq[:, : w.in_features] = decode_codes(
        _unpanel(codes, w.out_features)[:, : w.in_features], w.kind
    ).double()
    isum = torch.einsum("mgk,ogk->mog", xq.double(), wq.view(w.out_features, g, group)).float()
    xsum = sx * xq.sum(-1)  # [M, G]: integers, exact in float32
    sw, mw = _unpanel(w.scales, w.out_features), _unpanel(w.offsets, w.out_features)  # [O, G]
    y = torch.zeros(x.shape[0], w.out_features, dtype=torch.float32)
    for j in range(g):
        y += isum[:, :, j] * (sw[None, :, j] * sx[:, j, None]) + mw[None, :, j] * xsum[:, j, None]
    return y.to(x.device)


def _octs(codes: torch.Tensor, group: int, lanes: int) -> torch.Tensor:
    """W4A8's layout: [O, I] uint4 codes -> [P, I8, lanes, 4] bytes, byte t of lane l in step k
    holding input 8k + t in its low nibble and 8k + 4 + t in its high one."""
    out_f, in_f = codes.shape
    if group % 8 and group < in_f:
        raise ValueError(f"w4a8 needs groups of a multiple of 8 inputs (or one a row), got group={group}")
    i8 = _cdiv(in_f, 8)
    padded = torch.zeros(out_f, 8 * i8, dtype=torch.uint8)
    padded[:, :in_f] = codes
    panels = _panels(padded, lanes).view(-1, i8, 2, 4, lanes).permute(0, 1, 4, 2, 3)  # [P, I8, lanes, 2, 4]
    return (panels[..., 0, :] | (panels[..., 1, :] << 4)).contiguous()


def _unoct(codes: torch.Tensor) -> torch.Tensor:
    """[P, I8, lanes, 4] nibbles -> [P, 8 * I8, lanes] codes."""
    p, i8, lanes, _ = codes.shape
    halves = torch.stack((codes & 15, codes >> 4), dim=3)  # [P, I8, lanes, 2, 4]
    return halves.permute(0, 1, 3, 4, 2).reshape(p, 8 * i8, lanes)


def _unquad(codes: torch.Tensor) -> torch.Tensor:
    """[P, I4, lanes, 4] -> [P, 4 * I4, lanes]."""
    p, i4, lanes, _ = codes.shape
    return codes.transpose(2, 3).reshape(p, 4 * i4, lanes)


@dataclass
class QuantizedWeight:
    """A compressed [out, in] weight; calling it multiplies by it (as cpu_gemm's packed weights)."""

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
        panels = _panels(codes, lanes)  # [P, I, lanes]
        if kind in NIBBLES:  # lane 2j in the low nibble of byte j
            panels = (panels[..., 0::2] | (panels[..., 1::2] << 4)).contiguous()
        if kind == "w8a8":
            panels = _quads(codes, group, lanes)
        if kind == "w4a8":
            panels = _octs(codes, group, lanes)
        s, m = _panels(scales.float(), lanes), _panels(offsets.float(), lanes)
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
            codes = _unquad(codes)[:, : self.in_features]
        if self.kind == "w4a8":  # [P, I8, lanes, 4] nibbles -> [P, I, lanes]
            codes = _unoct(codes)[:, : self.in_features]
        values = decode_codes(_unpanel(codes, self.out_features), self.kind)
        expand = lambda t: _unpanel(t, self.out_features).repeat_interleave(self.group, 1)[
            :, : self.in_features
        ]
        return values * expand(self.scales) + expand(self.offsets)

    def __call__(
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

    def slot_tensors(self, e: int) -> list[torch.Tensor]:
        """Views of expert slot e (what EPLB copies into in place, so the kernel's pointers and
        native decode's descriptors stay valid); shared zero offsets are never written."""
        return [self.codes[e], self.scales[e]] + ([] if self.shared_offsets else [self.offsets[e]])


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(parts), or without a copy the stack they are already index e of (one-pass
    loading writes each expert into its slot: quantization/streaming.py)."""
    base = parts[0]._base
    if (
        base is not None
        and base.is_contiguous()
        and tuple(base.shape) == (len(parts), *parts[0].shape)
        and all(p._base is base and p.data_ptr() == base[e].data_ptr() for e, p in enumerate(parts))
    ):
        return base
    return torch.stack(parts, out=huge_pages.empty((len(parts), *parts[0].shape), parts[0].dtype))


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
