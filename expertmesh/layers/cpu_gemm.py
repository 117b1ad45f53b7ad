"""oneDNN-packed weights for CPU matmuls.

On CPU, torch's default float32 matmul here goes through a BLAS that neither uses both cores
for one-row products nor blocks skinny ones well; weights reordered once for oneDNN run the
same products about twice as fast (measured: benchmarks/, docs/benchmarks.md). After packing,
the dense copy is dropped so the weights are held once.
"""

from __future__ import annotations

import torch

_PACKABLE = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> an opaque oneDNN tensor for `linear` (the 32 is a batch-size hint)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 32)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def release(param: torch.nn.Parameter) -> None:
    """Drop a parameter's dense storage once a packed copy serves its matmuls."""
    param.data = torch.empty(0, dtype=param.dtype, device=param.device)
