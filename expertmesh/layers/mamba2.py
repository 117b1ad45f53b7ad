"""Mamba2 (selective state space, SSD) mixer of hybrid families' recurrent layers (Granite-4.0-H),
with its per-sequence state (engine/state_cache.py).

Per token: in_proj gives the gate z [intermediate], x|B|C [conv channels] and dt [heads]; x|B|C
go through the causal depthwise convolution (with bias, SiLU); per head h with its group's B and
C [state size]: dt = softplus(dt + dt_bias), the state [head_dim, state size] decays by
exp(dt * A), A = -exp(A_log), and takes dt * x_h B^T; the output is state C + D x_h, then
RMSNorm per group of (output * SiLU(z)) times w, and out_proj. Decodes run this recurrent form,
prefill chunks the chunked scan (ssd_chunked), both in float32; on the CPU with our compiled
kernels (cpu/recurrent_kernels.py) decodes and prefill chunks update their states in place in their
slots (a chunk scanned token by token).

Tensor parallelism splits the heads like attention heads (Mamba2Mixer's docstring): in_proj's
rows and the conv's channels are gathered per part for this rank, the gated norm sums its
squares over TP only where a group spans ranks, out_proj is row parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.config.linear_attention_config import Mamba2Config
from expertmesh.distributed.fixed_sum import chunk_count, plain, tree_sum
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.cache_spec import StateSpec
from expertmesh.layers.gated_deltanet import copy_row_parts
from expertmesh.layers.linear import ReplicatedLinear, RowParallelLinear
from expertmesh.layers.recurrent_mixer import RecurrentMixer
from expertmesh.layers.weights import copy_into, read, set_loader


def ssd_chunked(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    chunk: int = 64,
    pw: Callable = plain,
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
        decay = pw(torch.exp, (cum[:, :, None] - cum[:, None, :]).masked_fill(~mask[:m, :m], float("-inf")))
        w = decay * (cs @ bs.transpose(-1, -2)) * dts[:, None, :]  # [H, m, m]
        y = w @ xs + pw(torch.exp, cum)[..., None] * (cs @ state.transpose(-1, -2))  # [H, m, P]
        to_end = pw(torch.exp, cum[:, -1:] - cum) * dts  # [H, m]
        state.mul_(pw(torch.exp, cum[:, -1])[:, None, None]).add_(
            (xs * to_end[..., None]).transpose(-1, -2) @ bs
        )
        out[start:end] = y.transpose(0, 1)
    return out


class GroupGatedRMSNorm(nn.Module):
    """x * SiLU(gate), RMS-normalised per group of `group` channels, times w (float32, rounded once).

    Under TP a rank holds `dim` of the channels from `first` on. Where its channels are whole
    groups it normalises alone; where a group spans ranks (fewer groups than ranks: Granite-4.0-H's
    one group) each rank's partial sum of squares goes into its group's column of a [T, groups]
    tensor summed over the TP group, so every rank divides by its whole group's sum."""

    def __init__(
        self,
        dim: int,
        group: int,
        eps: float,
        dtype=torch.float32,
        tp: Any = None,
        first: int = 0,
        groups: int = 1,
    ) -> None:
        super().__init__()
        self.eps, self.group, self.tp, self.first, self.groups = eps, group, tp, first, groups
        self.spans_ranks = dim < group  # this rank's channels lie inside one group
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src).narrow(0, self.first, param.shape[0]), "gated norm weight")

    pw: Callable = staticmethod(plain)  # deterministic mode: fixed_sum.pointwise, and _fixed_forward

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() * self.pw(F.silu, gate.float())
        if self.pw is not plain:
            return self._fixed_forward(h, dtype)
        if self.spans_ranks:
            partial = h.new_zeros(h.shape[0], self.groups)
            column = self.first // self.group
            partial[:, column] = h.pow(2).sum(-1)
            total = self.tp.all_reduce(partial)[:, column : column + 1]
            g = h * torch.rsqrt(total / self.group + self.eps)
            return self.weight * g.to(dtype)
        g = h.view(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)

    def _fixed_forward(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Deterministic mode: each group's sum of squares over fixed chunks of its channels added
        by the fixed tree (fixed_sum.py), whether its channels lie on one rank or span several;
        spanning ranks' subtree sums meet by the TP group's ordered_sum (every other rank adds
        zeros to the column: exact)."""
        share = self.group // h.shape[-1] if self.spans_ranks else 1  # ranks holding one group
        chunks = chunk_count(self.group, share, "a Mamba2 norm group", even=False)
        local = chunks // share  # this rank's chunks of each group it touches
        width = self.group // chunks
        parts = h.view(h.shape[0], -1, local, width).pow(2).sum(-1)  # [T, groups here, chunks]
        squares = tree_sum(list(parts.unbind(-1)))  # [T, groups here]
        if self.spans_ranks:
            partial = h.new_zeros(h.shape[0], self.groups)
            column = self.first // self.group
            partial[:, column] = squares[:, 0]
            squares = self.tp.ordered_sum(partial)[:, column : column + 1]
        scale = torch.rsqrt(squares / self.group + self.eps)  # [T, groups here]
        g = h.view(h.shape[0], -1, h.shape[-1] if self.spans_ranks else self.group) * scale[..., None]
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(RecurrentMixer):
    """Under tensor parallelism each rank keeps num_heads / TP heads (their z, x, dt, A, D,
    dt_bias, conv channels and states), the groups of B and C those heads read (n_groups / TP
    of them, or the one group a rank's heads share when there are fewer groups than ranks), and
    out_proj's matching input columns (summed over TP as attention's o_proj is)."""

    def __init__(self, m: Mamba2Config, hidden: int, eps: float, tp: Any, dtype) -> None:
        super().__init__()
        t, r = tp.world_size, tp.rank_in_group
        if m.num_heads % t or (m.n_groups % t and t % m.n_groups):
            raise ValueError(
                f"tensor_parallel_size={t}: Mamba2 layers split their {m.num_heads} heads and "
                f"{m.n_groups} groups over TP; both must divide by it (or the groups divide it)"
            )
        self.m = m
        self.heads = m.num_heads // t
        self.groups = max(1, m.n_groups // t)
        self.group0 = (r * self.heads) // (m.num_heads // m.n_groups)  # first group this rank reads
        self.head0 = r * self.heads
        self.inter = self.heads * m.head_dim
        n = m.state_size
        self.conv_dim = self.inter + 2 * self.groups * n
        self.kernel = m.conv_kernel
        full_inter, gn = m.num_heads * m.head_dim, m.n_groups * n
        # (offset, width) of this rank's rows of in_proj [z | x | B | C | dt] and of the conv's [x | B | C]
        x0, b0 = self.head0 * m.head_dim, self.group0 * n
        self._in_rows = (
            (x0, self.inter),
            (full_inter + x0, self.inter),
            (2 * full_inter + b0, self.groups * n),
            (2 * full_inter + gn + b0, self.groups * n),
            (2 * full_inter + 2 * gn + self.head0, self.heads),
        )
        self._conv_rows = tuple((off - full_inter, w) for off, w in self._in_rows[1:4])
        self.in_proj = ReplicatedLinear(hidden, self.inter + self.conv_dim + self.heads, m.proj_bias, dtype)
        set_loader(self.in_proj.weight, self._load_rows)
        if self.in_proj.bias is not None:
            set_loader(self.in_proj.bias, self._load_rows)
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
            set_loader(bias, self._load_conv)
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=dtype), requires_grad=False)
        for p in (self.A_log, self.D, self.dt_bias):
            set_loader(p, self._load_heads)
        self.norm = GroupGatedRMSNorm(
            self.inter, full_inter // m.n_groups, eps, dtype, tp, self.head0 * m.head_dim, m.n_groups
        )
        self.out_proj = RowParallelLinear(full_inter, hidden, m.proj_bias, tp, dtype=dtype)
        self.use_fixed_order(tp)
        self.state_spec = StateSpec(
            "mamba2", ((self.conv_dim, self.kernel - 1), (self.heads, m.head_dim, m.state_size))
        )

    # Each loader reads its source whole, then takes this rank's rows (as the DeltaNet's do), so a
    # one-rank twin's shape check (weights.whole_tensors) sees the same code path.
    def _load_rows(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_row_parts(param, src, self._in_rows, "in_proj rows of this rank's heads and groups")

    def _load_conv(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        whole = read(src)
        rows = torch.cat([whole.narrow(0, off, width) for off, width in self._conv_rows])
        copy_into(param.data, rows.reshape(param.shape), "conv1d channels of this rank")

    def _load_heads(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(param.data, read(src).narrow(0, self.head0, self.heads), "per head parameter")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        m = self.m
        z, xbc, dt = self.in_proj(x).split([self.inter, self.conv_dim, self.heads], dim=-1)
        dt = self.pw(F.softplus, dt.float() + self.dt_bias.float())
        lo, hi = m.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(lo, hi)
        y = self.scan(
            xbc,
            ctx,
            lambda rows, out, state: self._ssm(out, dt[rows], state),
            lambda rows, out, slots: self._ssm_in_place(out, dt[rows], slots),
            lambda rows, out, slots: self._ssm_in_place(out, dt[rows], slots),
        )
        y = self.norm(y.to(x.dtype), z)
        return self.out_proj(y)

    def _ssm(self, xbc: torch.Tensor, dt: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Tokens [L, conv_dim] of one sequence (state [1, ...]) or one token of each of B sequences
        (state [B, ...]): outputs [L or B, intermediate] float32; state updated in place."""
        m, t = self.m, xbc.shape[0]
        n, heads = self.groups * m.state_size, self.heads
        xs, b, c = xbc.float().split([self.inter, n, n], dim=-1)
        xs = xs.view(t, heads, m.head_dim)
        rep = heads // self.groups
        b = b.view(t, self.groups, m.state_size).repeat_interleave(rep, dim=1)  # [t, heads, N]
        c = c.view(t, self.groups, m.state_size).repeat_interleave(rep, dim=1)
        a = -self.pw(torch.exp, self.A_log.float())
        decay = self.pw(torch.exp, dt * a)  # [t, heads]: the decode step's
        d = self.D.float()[:, None]
        if state.shape[0] == t:  # one token per sequence
            state.mul_(decay[:, :, None, None]).add_(dt[:, :, None, None] * xs[..., None] * b[:, :, None, :])
            y = (state * c[:, :, None, :]).sum(-1) + d * xs
            return y.reshape(t, self.inter)
        y = ssd_chunked(state[0], xs, dt, a, b, c, pw=self.pw)  # one sequence's tokens
        return (y + d * xs).reshape(t, self.inter)

    def _ssm_in_place(self, xbc: torch.Tensor, dt: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """_ssm on the kernel (one token per slot, or a prefill chunk's tokens on its one slot,
        scanned token by token), the states updated in their slots."""
        decay = self.pw(torch.exp, dt * -self.pw(torch.exp, self.A_log.float()))  # as _ssm computes it
        return self.recurrent_steps.ssm_step(xbc, dt, decay, self.D, self.rec_state, slots, self.groups)
