"""Our kernels over quantized codes (layers/quantization/packed.py's QuantizedWeight and
QuantizedExperts): gemm_q for one weight, moe_q / moe_q_ex for a block of experts, and their slots
in a native decode layer (gemm_q_desc_* / moe_q_desc_* shims, cpu/native_decode.py)."""

from __future__ import annotations

import torch

from expertmesh.cpu import native_desc as nd
from expertmesh.cpu.cpu_kernels import CpuKernels
from expertmesh.layers.quantization.codes import BF16_PAIRS, KINDS
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight


def product_kind(kind: str, dtype: torch.dtype, kernels: CpuKernels | None) -> int:
    """gemm_q / moe_q's code kind for weights of `kind` times activations of `dtype`: a bf16 model's
    int4 / int8 / fp4 / fp8 on bf16 pairs (kinds 6-9: the inputs rounded to bf16, as its torch layers
    round them; the scale and offset folded in once a group) where the build has them, else the
    kind's own (also for None: the torch path)."""
    if dtype == torch.bfloat16 and kernels is not None and kernels.quant_bf16_pairs:
        return BF16_PAIRS.get(kind, KINDS[kind])
    return KINDS[kind]


def gemm_q(kernels: CpuKernels, w: QuantizedWeight, x: torch.Tensor, bias: torch.Tensor | None, dtype):
    """x [M, I] float32 contiguous (activations of `dtype`) @ W^T (+ bias) -> [M, O] float32."""
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    if x.shape[0]:
        kernels.lib.gemm_q(
            product_kind(w.kind, dtype, kernels), x.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(),
            w.offsets.data_ptr(), w.group, y.data_ptr(), x.shape[0], w.out_features,
            w.in_features, None if bias is None else bias.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
    return y


def gemm_q_native(
    kernels: CpuKernels, w: QuantizedWeight, dtype: torch.dtype, keep: list, float32_out: bool
) -> dict | None:
    """w in a native decode layer's GEMM slot: the gemm_q shim for activations in `dtype` (the
    product rounded to it, or left in float32 with `float32_out`) and its q_weight_desc, held by
    `keep`; None without a shim for the dtype or codes off the CPU."""
    suffix = nd.SHIM_SUFFIX.get(dtype)
    if suffix is None or w.codes.device.type != "cpu":
        return None
    if float32_out and dtype != torch.float32:
        suffix += "_f32"
    fn = nd.c_entry(kernels, f"gemm_q_desc_{suffix}")
    if fn is None:
        return None
    desc = nd.QWeightDesc(
        product_kind(w.kind, dtype, kernels),
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        w.offsets.data_ptr(),
        w.group,
    )
    keep.append(w)  # the tensors the struct points into
    return {"fn": fn, "w": nd.held_struct(keep, desc)}


def experts_native_form(
    kernels: CpuKernels,
    w13: QuantizedExperts,
    w2: QuantizedExperts,
    dtype: torch.dtype,
    keep: list,
    runner: QuantizedMoE | None = None,
) -> dict | None:
    """moe_q_ex's shim and q_experts_desc for a native decode layer's experts slot (with `runner`'s
    biases, limit and alpha), None where there is none (no shim for the model dtype, an older build)."""
    suffix = nd.SHIM_SUFFIX.get(dtype)
    fn = None if suffix is None else nd.c_entry(kernels, f"moe_q_desc_{suffix}")
    if fn is None or w13.kind != w2.kind:
        return None
    t13, t2 = (w13.codes, w13.scales, w13.offsets), (w2.codes, w2.scales, w2.offsets)
    extras = (0.0, 0.0, None, None)  # limit, alpha, b13, b2: plain gated experts
    if runner is not None:
        biases = (None if b is None else b.data_ptr() for b in (runner.b13, runner.b2))
        extras = (runner.limit, runner.alpha, *biases)
    desc = nd.QExpertsDesc(
        product_kind(w13.kind, dtype, kernels),
        *(t.data_ptr() for t in t13),
        w13.group,
        *(t.data_ptr() for t in t2),
        w2.group,
        *extras,
    )
    keep += [w13, w2, runner]
    return {"experts_fn": fn, "experts_w": nd.held_struct(keep, desc)}


class QuantizedMoE:
    """The `kernels.moe(...)` of FusedExperts' fused path, over QuantizedExperts: moe_q_ex with the
    experts' float32 biases ([E, 2I], [E, H]; None: none, read at each call so that copies into
    them are seen) and the activation's limit and alpha (activation.py moe_q_form)."""

    def __init__(
        self,
        kernels: CpuKernels,
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
