"""Gated activations over a fused [gate | up] projection, and the expert activations by name."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from expertmesh.registries import lookup

_ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),  # Nemotron-H's squared ReLU (its MLPs are not gated)
}


def get_act(name: str):
    if name not in _ACTS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {sorted(_ACTS)}")
    return _ACTS[name]


def gated(x: torch.Tensor, act) -> torch.Tensor:
    """act(gate) * up for x = [gate | up] along the last dim."""
    half = x.shape[-1] // 2
    return act(x[..., :half]) * x[..., half:]


@dataclass(frozen=True)
class GatedActivation:
    """act(gate) * up with the config's hidden_act; our fused experts kernel computes it too."""

    act: str
    parts = (0, 1)  # the checkpoint halves the experts' w13 holds: gate (0) and up (1)

    def __post_init__(self) -> None:
        get_act(self.act)

    @property
    def kernel_name(self) -> str | None:
        return self.act

    @property
    def moe_q_form(self) -> tuple[str, float, float]:
        """moe_q_ex's activation: its name (CpuKernels.MOE_Q_ACTIVATIONS), limit and alpha (unused)."""
        return self.act, 0.0, 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated(x, _ACTS[self.act])


@dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS: gate clamped above at `limit`, up to [-limit, limit];
    (up + 1) * gate * sigmoid(alpha * gate). In moe_q_ex (quantized experts held), not in the float
    experts kernel (kernel_name None: the torch expert path) nor native decode."""

    limit: float = 7.0
    alpha: float = 1.702
    kernel_name = None
    parts = (0, 1)

    @property
    def moe_q_form(self) -> tuple[str, float, float]:
        return "swiglu_clamped", self.limit, self.alpha

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        gate = x[..., :half].clamp(max=self.limit)
        up = x[..., half:].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


@dataclass(frozen=True)
class ClampedGatedActivation:
    """DeepSeek-V4: act(gate clamped above at `limit`) * (up clamped to [-limit, limit]) (its
    swiglu_limit). With SiLU (V4's) in moe_q_ex and moe_*_ex ("silu_clamped"), not in the plain
    experts kernel (kernel_name None) nor native decode; another act: the torch expert path."""

    act: str
    limit: float
    kernel_name = None
    parts = (0, 1)

    def __post_init__(self) -> None:
        get_act(self.act)

    @property
    def moe_q_form(self) -> tuple[str, float, float] | None:
        return ("silu_clamped", self.limit, 0.0) if self.act == "silu" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        gate = x[..., :half].clamp(max=self.limit)
        return _ACTS[self.act](gate) * x[..., half:].clamp(min=-self.limit, max=self.limit)


@dataclass(frozen=True)
class UngatedActivation:
    """act(up) of experts without a gate (Nemotron-H: relu^2 over up_proj, then down_proj). The
    experts' first weight holds only the up rows (`parts`: the checkpoint's up half, shard 1); the
    fused experts kernels compute gated pairs only, so these run on the per-expert path."""

    act: str
    kernel_name = None
    moe_q_form = None  # in no fused kernel of ours
    parts = (1,)

    def __post_init__(self) -> None:
        get_act(self.act)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _ACTS[self.act](x)


EXPERT_ACTIVATIONS = {
    "gated": GatedActivation,
    "swiglu_clamped": ClampedSwiGLU,
    "ungated": UngatedActivation,
    "gated_clamped": ClampedGatedActivation,
}


def expert_activation(name: str, hidden_act: str, limit: float, alpha: float):
    """The activation a family names, with the config's parameters."""
    kind = lookup(EXPERT_ACTIVATIONS, name, "expert activation")
    if kind is ClampedGatedActivation:
        return kind(hidden_act, limit)
    return kind(hidden_act) if kind in (GatedActivation, UngatedActivation) else kind(limit, alpha)
