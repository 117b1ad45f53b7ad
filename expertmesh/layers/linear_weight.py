"""The weight of a linear layer, held in exactly one form that applies itself.

A linear layer (layers/linear.py, the LM head) holds one `LinearWeight`, chosen once by the model's
ops (layers/ops.py `linear_form`, `quantized_form`, `chunked_linear_form`): after loading
(`use_ops`: packed for our panel GEMM or oneDNN, else dense) or while loading (`use_quantized` /
`hold_quantized`: codes for gemm_q). The layer then calls
``weight_form.apply(x, bias, out_dtype)`` and never asks which backend runs it.

The forms: `DenseWeight` (torch's F.linear over the layer's parameter), `PanelWeight`
(cpu/cpu_kernels.py), `OneDnnWeight` (cpu/cpu_gemm.py), `QuantizedWeight`
(quantization/packed.py), `PermutedInputs` (quantization/permuted.py), and `ChunkedWeight`
(deterministic mode's fixed chunks of a row-parallel input, distributed/fixed_sum.py).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import tree_sum


class LinearWeight(Protocol):
    """An [out, in] weight in one form: its product, its native decode slot, its resident bytes."""

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x @ W.T (+ bias), accumulated in float32, rounded to ``out_dtype`` (default x's) once."""
        ...

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> dict | None:
        """{"fn", "w"} pointers of a native decode layer's GEMM slot (cpu/native_decode.py), or None
        where this form has none (activations in `dtype`; `float32_out`: the product unrounded)."""
        ...

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        """The tensors it holds, each with "quantized" or "dense" (quantization/accounting.py)."""
        ...


class DenseWeight:
    """The layer's own dense parameter, multiplied by torch (no kernel of ours packed it)."""

    def __init__(self, param: nn.Parameter | torch.Tensor) -> None:
        self.param = param  # the Parameter itself: moves (`.to`) and loads replace its data

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if out_dtype in (None, x.dtype) and self.param.dtype == x.dtype:
            return F.linear(x, self.param, bias)
        out_dtype = out_dtype or x.dtype  # float32 logits of a bf16 LM head: exact widening, slow path
        bias = None if bias is None else bias.to(out_dtype)
        return F.linear(x.to(out_dtype), self.param.to(out_dtype), bias)

    __call__ = apply

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> None:
        return None  # torch's product: the layer stays on the per-op path

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(self.param.data, "dense")]


class ChunkedWeight:
    """Deterministic mode's row-parallel weight: this rank's fixed chunks of the input dim, each its
    own float32 product on the same shape, added by the fixed tree (distributed/fixed_sum.py).

    ``apply`` returns this rank's subtree sum in float32 (no bias): the sum over ranks and the
    bias are the layer's (RowParallelLinear._fixed_forward)."""

    def __init__(self, param: nn.Parameter, count: int, chunks: list | None = None) -> None:
        self.param, self.count = param, count
        # Per chunk a packed weight, or a dense [out, width] tensor where no kernel serves it;
        # None: never packed (e.g. not on the CPU), slices of the dense parameter.
        self.chunks = chunks

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        if bias is not None or out_dtype not in (None, torch.float32):
            raise ValueError("a chunked weight returns the float32 chunk sums; the bias joins after the sum")
        if self.chunks is None:
            w = self.param.shape[1] // self.count
            self.chunks = [self.param.data[:, j * w : (j + 1) * w] for j in range(self.count)]
        width = x.shape[-1] // self.count
        parts = []
        for j, w in enumerate(self.chunks):
            xs = x[..., j * width : (j + 1) * width]
            if isinstance(w, torch.Tensor):
                parts.append(F.linear(xs.float(), w.float()))
            else:
                parts.append(w.apply(xs.contiguous(), None, torch.float32))
        return tree_sum(parts)

    __call__ = apply

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> None:
        return None  # the native decode GEMM is one product, not chunk sums

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        if self.chunks is None:
            return [(self.param.data, "dense")]
        dense = lambda w: [(w, "dense")]  # noqa: E731
        return [t for w in self.chunks for t in (dense(w) if isinstance(w, torch.Tensor) else w.resident())]


def release(param: nn.Parameter) -> None:
    """Drop a parameter's dense storage once another form (packed, compressed) serves its matmuls."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def bias_ptr(bias: torch.Tensor | None, keep: list) -> int | None:
    """A float32 copy of a bias (as a native GEMM adds it), held alive by `keep`: its address."""
    if bias is None:
        return None
    b = bias.detach().to(torch.float32).contiguous()
    keep.append(b)
    return b.data_ptr()
