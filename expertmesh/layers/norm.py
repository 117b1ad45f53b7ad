"""Normalisation layers (RMSNorm in float32 like the reference; LayerNorm with bias for PhiMoE)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.layers.cpu_kernels import CpuKernels
from expertmesh.layers.weights import default_loader, set_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)

    kernels: CpuKernels | None = None  # set by use_cpu_kernels(): one compiled call per norm

    def use_cpu_kernels(self, kernels: CpuKernels | None) -> None:
        self.kernels = kernels  # the model builder passes them only for dtypes they support

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)
        set_loader(self.bias, default_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
