"""Which CPU matmul serves a weight, and the weight packed for it.

torch's default float32 matmul here goes through a BLAS that uses one core for one-row
products and blocks skinny ones poorly. Weights are therefore packed once, after loading, for
one of two kernels, and the dense copy is dropped so every weight is held once:

- expertmesh's own panel GEMM (csrc/cpu_kernels.c) when it builds on this machine: float32
  (faster than oneDNN at decode's 1 to 13 rows, and even at 32-512), and bfloat16 where the CPU
  has AVX512-BF16 pair products;
- otherwise oneDNN's packed linear (bfloat16 without AVX512-BF16, where our widen-to-float32
  path loses to it from about 13 rows on, or no C compiler);
- bfloat16 on a CPU where oneDNN has no bf16 path either (AVX2-only CPUs, e.g. AMD Zen 3, lack
  avx512bw/avx_ne_convert): our widen-to-float32 kernel, else plain F.linear.

On a CPU with AMX, our kernels still hold the weights, and products of many rows (prefill, experts
that receive many tokens) are handed to oneDNN's matmul per call (cpu_features.onednn_bf16_rows,
CpuKernels.linear / moe).

A bf16 weight whose products are partial sums across ranks (``float32_out``: row-parallel
layers, the experts' down projection) needs them unrounded, in float32; oneDNN's packed linear
returns the input's dtype, so such weights take our kernel (or stay dense for F.linear).

Measurements: docs/benchmarks.md, "Dispatch figures".
"""

from __future__ import annotations

import dataclasses

import torch

from expertmesh.cpu.cpu_features import onednn_bf16
from expertmesh.cpu.cpu_kernels import CpuKernels, PanelWeight
from expertmesh.layers.linear_weight import release  # noqa: F401 -- cpu_gemm.release, for callers

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


class OneDnnWeight:
    def __init__(self, weight: torch.Tensor) -> None:
        # The 32 is oneDNN's batch-size hint for choosing the layout.
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if out_dtype not in (None, x.dtype):  # pack() never hands out such a weight
            raise ValueError(f"oneDNN linear returns {x.dtype}, not {out_dtype}")
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")

    __call__ = apply

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> None:
        return None  # oneDNN's opaque layout: no native decode GEMM reads it

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(self.data, "dense")]

    def slot_tensors(self) -> list[torch.Tensor]:
        """What EPLB moves of an expert's weight held in this form."""
        return [self.data]


PackedWeight = OneDnnWeight | PanelWeight


def _onednn_ok(weight: torch.Tensor) -> bool:
    if not (
        weight.dtype in _ONEDNN_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return False
    return weight.dtype != torch.bfloat16 or onednn_bf16()


def pack(
    weight: torch.Tensor, kernels: CpuKernels | None, float32_out: bool = False, in_place: bool = False
) -> PackedWeight | None:
    """A packed copy of a CPU [out, in] weight for its best kernel, or None (keep F.linear).

    ``float32_out``: its callers ask for float32 products of bf16 inputs (``out_dtype``).
    ``in_place``: the caller releases the weight afterwards, so our kernel's panels may be laid
    into its own storage (`pack_in_place`: no second copy of the weight while packing)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() == 0:
        return None
    panels = pack_in_place if in_place else (lambda w, k: k.pack(w))
    if kernels is not None and (
        weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and kernels.bf16_pairs)
    ):
        return panels(weight, kernels)
    if _onednn_ok(weight) and not (float32_out and weight.dtype != torch.float32):
        return OneDnnWeight(weight)
    if kernels is not None and weight.dtype == torch.bfloat16:
        return panels(weight, kernels)  # widens to float32 in registers
    return None


PANELS_PER_CHUNK = 64


def pack_in_place(weight: torch.Tensor, kernels: CpuKernels) -> PanelWeight:
    """`kernels.pack(weight)` written over the weight's own storage, a chunk of panels at a time.

    Panel p holds exactly the values of rows [p * lanes, (p + 1) * lanes), so packing a chunk of
    panels only rewrites that chunk's rows; the peak is one chunk, not a second weight (one-pass
    loading, issue 15). Shapes whose panels are padded (out not a multiple of the lanes, an odd
    `in` for bf16 pairs) take the copying `kernels.pack`."""
    w = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    out_features, in_features = w.shape
    shape = kernels.panel_shape(out_features, in_features, w.dtype)
    if (
        not w.is_contiguous()
        or shape[0] * kernels.lanes != out_features
        or torch.Size(shape).numel() != w.numel()
    ):
        return kernels.pack(w)
    rows = PANELS_PER_CHUNK * kernels.lanes
    flat = w.view(-1)
    probe = None
    for r0 in range(0, out_features, rows):
        block = kernels.pack(w[r0 : r0 + rows])  # a copy of this chunk's rows, packed
        probe = probe or block
        flat[r0 * in_features : r0 * in_features + block.data.numel()].copy_(block.data.view(-1))
    data = w.view(shape)
    return dataclasses.replace(probe, data=data, out_features=out_features, ptr=data.data_ptr())
