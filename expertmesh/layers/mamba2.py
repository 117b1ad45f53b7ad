"""Mamba2 (selective state space, SSD) mixer of hybrid families' recurrent layers (Granite-4.0-H),
with its per-sequence state (engine/state_cache.py).

Per token: in_proj gives the gate z [intermediate], x|B|C [conv channels] and dt [heads]; x|B|C
go through the causal depthwise convolution (with bias, SiLU); per head h with its group's B and
C [state size]: dt = softplus(dt + dt_bias), the state [head_dim, state size] decays by
exp(dt * A), A = -exp(A_log), and takes dt * x_h B^T; the output is state C + D x_h, then
RMSNorm per group of (output * SiLU(z)) times w, and out_proj. Decodes run this recurrent form,
prefill chunks the chunked scan (ssd_chunked), both in float32.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.config.linear_attention_config import Mamba2Config
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.cache_spec import StateSpec
from expertmesh.layers.gated_deltanet import RecurrentMixer
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.weights import copy_into, default_loader, read, set_loader


def ssd_chunked(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """The selective scan S_t = exp(dt_t a) S_{t-1} + dt_t x_t b_t^T, y_t = S_t c_t over one
    sequence's L tokens in chunks (state space duality: within a chunk one masked matmul, across
    chunks the state carried). state [H, P, N] (updated in place), x [L, H, P], dt [L, H], a [H],
    b and c [L, H, N]; returns y [L, H, P] without the D skip. Equals the token-by-token update up
    to rounding."""
    n_tok = x.shape[0]
    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    out = torch.empty_like(x)
    for start in range(0, n_tok, chunk):
        end = min(start + chunk, n_tok)
        m = end - start
        xs, dts, bs, cs = (t[start:end].transpose(0, 1) for t in (x, dt, b, c))  # heads first
        cum = (dts * a[:, None]).cumsum(-1)  # [H, m] log decay from the chunk's start
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~mask[:m, :m], float("-inf")).exp()
        w = decay * (cs @ bs.transpose(-1, -2)) * dts[:, None, :]  # [H, m, m]
        y = w @ xs + cum.exp()[..., None] * (cs @ state.transpose(-1, -2))  # [H, m, P]
        to_end = (cum[:, -1:] - cum).exp() * dts  # [H, m]
        state.mul_(cum[:, -1].exp()[:, None, None]).add_((xs * to_end[..., None]).transpose(-1, -2) @ bs)
        out[start:end] = y.transpose(0, 1)
    return out


class GroupGatedRMSNorm(nn.Module):
    """x * SiLU(gate), RMS-normalised per group of `group` channels, times w (float32, rounded once)."""

    def __init__(self, dim: int, group: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps, self.group = eps, group
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(RecurrentMixer):
    def __init__(self, m: Mamba2Config, hidden: int, eps: float, tp: Any, dtype) -> None:
        super().__init__()
        if tp.world_size > 1:
            raise ValueError(
                f"tensor_parallel_size={tp.world_size}: Mamba2 layers are not split over TP yet; "
                "use data or pipeline parallelism for this model"
            )
        self.m = m
        self.inter = m.num_heads * m.head_dim
        self.conv_dim = self.inter + 2 * m.n_groups * m.state_size
        self.kernel = m.conv_kernel
        self.in_proj = ReplicatedLinear(hidden, self.inter + self.conv_dim + m.num_heads, m.proj_bias, dtype)
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, self.kernel, dtype=dtype), requires_grad=False
        )
        set_loader(self.conv_weight, self._load_conv)
        bias = (
            nn.Parameter(torch.empty(self.conv_dim, dtype=dtype), requires_grad=False)
            if m.conv_bias
            else None
        )
        self.register_parameter("conv_bias", bias)
        if bias is not None:
            set_loader(bias, default_loader)
        self.A_log = nn.Parameter(torch.empty(m.num_heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(m.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads, dtype=dtype), requires_grad=False)
        for p in (self.A_log, self.D, self.dt_bias):
            set_loader(p, default_loader)
        self.norm = GroupGatedRMSNorm(self.inter, self.inter // m.n_groups, eps, dtype)
        self.out_proj = ReplicatedLinear(self.inter, hidden, m.proj_bias, dtype)
        self.state_spec = StateSpec(
            "mamba2", ((self.conv_dim, self.kernel - 1), (m.num_heads, m.head_dim, m.state_size))
        )

    def _load_conv(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src).reshape(self.conv_dim, -1), "conv1d weight")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        m = self.m
        z, xbc, dt = self.in_proj(x).split([self.inter, self.conv_dim, m.num_heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = m.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(lo, hi)
        y = self.scan(xbc, ctx, lambda rows, out, state: self._ssm(out, dt[rows], state))
        y = self.norm(y.to(x.dtype), z)
        return self.out_proj(y)

    def _ssm(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Tokens [L, conv_dim] of one sequence (state [1, ...]) or one token of each of B sequences
        (state [B, ...]): outputs [L or B, intermediate] float32; state updated in place."""
        m, t = self.m, xbc.shape[0]
        n, heads = m.n_groups * m.state_size, m.num_heads
        xs, b, c = xbc.float().split([self.inter, n, n], dim=-1)
        xs = xs.view(t, heads, m.head_dim)
        rep = heads // m.n_groups
        b = b.view(t, m.n_groups, m.state_size).repeat_interleave(rep, dim=1)  # [t, heads, N]
        c = c.view(t, m.n_groups, m.state_size).repeat_interleave(rep, dim=1)
        a = -self.A_log.float().exp()
        decay = (dt * a).exp()  # [t, heads]: the decode step's
        d = self.D.float()[:, None]
        if state.shape[0] == t:  # one token per sequence
            state.mul_(decay[:, :, None, None]).add_(dt[:, :, None, None] * xs[..., None] * b[:, :, None, :])
            y = (state * c[:, :, None, :]).sum(-1) + d * xs
            return y.reshape(t, -1)
        y = ssd_chunked(state[0], xs, dt, a, b, c)  # one sequence's tokens
        return (y + d * xs).reshape(t, -1)
