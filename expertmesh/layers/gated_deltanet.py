"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the token mixer of a hybrid family's
"linear_attention" layers, with its per-sequence state (engine/state_cache.py).

Per token: q, k, v (and the output gate z, the write strength b and the decay input a) are
projected; q, k and v go through a causal depthwise convolution (kernel K, SiLU) whose last K - 1
inputs are the conv state; q and k are L2-normalised, q scaled by d_k^-1/2; then per value head
the recurrent state S [d_k, d_v] decays by exp(g), g = -exp(A_log) * softplus(a + dt_bias), takes
the delta-rule write S += k (beta (v - S^T k))^T with beta = sigmoid(b), and the output is S^T q,
RMS-normalised and gated by SiLU(z). Decodes run the recurrent form, prefill chunks the chunked
form (delta_rule_chunked), both in float32 (a chunk at position 0 starts from a zero state); the
conv and recurrent states are read from and written back to the sequence's slot. On the CPU with our
compiled kernels (cpu/recurrent_kernels.py) a step's decodes update their slots in place in one
call each for the convolution and the delta rule.

Tensor parallelism splits the key heads (with the value heads each serves) like attention heads:
the fused projections are grouped per key head, so a contiguous row shard is a head group; the
convolution's channels [q | k | v] are sharded per part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.config.linear_attention_config import LinearAttentionConfig
from expertmesh.distributed.fixed_sum import plain
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.cache_spec import StateSpec
from expertmesh.layers.linear import ColumnParallelLinear, RowParallelLinear, _divide
from expertmesh.layers.recurrent_mixer import RecurrentMixer
from expertmesh.layers.weights import copy_into, default_loader, read, set_loader


def copy_row_parts(param: nn.Parameter, src: Any, parts: tuple[tuple[int, int], ...], what: str) -> None:
    """Rows [offset, offset + width) of src, part after part, into param's rows. Each part is read on
    its own, so a source held as codes (block FP8: quantization/held.py) places its scales beside
    its rows; where read() gives the whole tensor (the one-rank twin's shape check) the parts are
    cut from it."""
    pieces = [read(src, 0, offset, width) for offset, width in parts]
    if any(piece.shape[0] != width for piece, (_, width) in zip(pieces, parts, strict=True)):
        whole = read(src)
        value = torch.cat([whole.narrow(0, offset, width) for offset, width in parts])
        copy_into(param.data, value, what)
        return
    row = 0
    for piece, (_, width) in zip(pieces, parts, strict=True):
        copy_into(param.data.narrow(0, row, width), piece, what)
        row += width


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    pw: Callable = plain,
) -> torch.Tensor:
    """One token of the gated delta rule for B sequences, in place on `state` [B, H, dk, dv]:
    q, k [B, H, dk] (normalised, q scaled), v [B, H, dv], g and beta [B, H]; returns [B, H, dv]."""
    state.mul_(pw(torch.exp, g)[..., None, None])
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2)


def delta_rule_chunked(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = 64,
    pw: Callable = plain,
) -> torch.Tensor:
    """The gated delta rule over one sequence's L tokens in chunks (the WY / UT form): within a
    chunk the writes are solved as one unit-lower-triangular system, across chunks the state is
    carried. state [1, H, dk, dv] (updated in place), q, k [L, H, dk], v [L, H, dv], g, beta
    [L, H]; returns [L, H, dv]. Equals delta_rule_step token by token, up to rounding."""
    n = q.shape[0]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))  # [H, L', d]
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))  # [H, L']
    h = q.shape[0]
    q, k, v = (x.reshape(h, -1, chunk, x.shape[-1]) for x in (q, k, v))  # [H, N, C, d]
    beta = beta.reshape(h, -1, chunk)
    cum = g.reshape(h, -1, chunk).cumsum(-1)  # log decay from the chunk's start to each token
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = pw(torch.exp, (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower part; unit diagonal
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        system, k_beta * pw(torch.exp, cum)[..., None], upper=False, unitriangular=True
    )
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * pw(torch.exp, cum)[..., None]
    k_dec = k * pw(torch.exp, cum[..., -1:] - cum)[..., None]
    chunk_decay = pw(torch.exp, cum[..., -1])[..., None, None]  # [H, N, 1, 1]
    s = state[0]
    out = torch.empty_like(new_v)
    for i in range(q.shape[1]):
        v_i = new_v[:, i] - k_cum[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_i
        s.mul_(chunk_decay[:, i]).add_(k_dec[:, i].transpose(-1, -2) @ v_i)
    return out.reshape(h, -1, out.shape[-1])[:, :n].transpose(0, 1)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, times w, then times SiLU(gate) (in float32, rounded once)."""

    def __init__(self, dim: int, eps: float, dtype=torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        set_loader(self.weight, default_loader)

    pw: Callable = staticmethod(plain)  # deterministic mode: fixed_sum.pointwise

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(dtype)
        return (y * self.pw(F.silu, gate.float())).to(dtype)


class GatedDeltaNet(RecurrentMixer):
    """Qwen3-Next's layout: fused in_proj_qkvz and in_proj_ba, grouped per key head."""

    def __init__(self, lin: LinearAttentionConfig, hidden: int, eps: float, tp: Any, dtype) -> None:
        super().__init__()
        self.tp_rank, tp_size = tp.rank_in_group, tp.world_size
        self.nk = _divide(lin.num_key_heads, tp_size, "linear_num_key_heads")
        self.nv = lin.num_value_heads // tp_size
        self.ratio = lin.num_value_heads // lin.num_key_heads
        self.dk, self.dv, self.kernel = lin.key_head_dim, lin.value_head_dim, lin.conv_kernel
        self.full = lin
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden, 2 * lin.key_dim + 2 * lin.value_dim, False, tp, dtype
        )
        self.in_proj_ba = ColumnParallelLinear(hidden, 2 * lin.num_value_heads, False, tp, dtype)
        self.conv_weight = nn.Parameter(
            torch.empty(self.conv_dim, self.kernel, dtype=dtype), requires_grad=False
        )
        set_loader(self.conv_weight, self._load_conv)
        self.register_parameter("conv_bias", None)
        self.A_log = nn.Parameter(torch.empty(self.nv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nv, dtype=dtype), requires_grad=False)
        set_loader(self.A_log, self._load_heads)
        set_loader(self.dt_bias, self._load_heads)
        self.norm = GatedRMSNorm(self.dv, eps, dtype)
        self.out_proj = RowParallelLinear(lin.value_dim, hidden, False, tp, dtype=dtype)
        self.use_fixed_order(tp)
        self.state_spec = StateSpec(
            "gated_deltanet", ((self.conv_dim, self.kernel - 1), (self.nv, self.dk, self.dv))
        )

    # ---- loading ----------------------------------------------------------------------------
    def _load_conv(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        """conv1d.weight [channels, 1, K], channels [q | k | v] of every head: this rank's heads
        of each part."""
        value = self._qkv_rows(read(src)).reshape(self.conv_dim, -1)  # small: read whole
        copy_into(param.data, value, "conv1d weight")

    def _qkv_rows(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a [q | k | v]-ordered tensor of every head."""
        kd = self.full.key_dim
        parts = ((0, self.key_dim), (kd, self.key_dim), (2 * kd, self.value_dim))
        return torch.cat([whole.narrow(0, offset + self.tp_rank * width, width) for offset, width in parts])

    def _load_heads(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_into(
            param.data, read(src).narrow(0, self.tp_rank * self.nv, self.nv), "per value head parameter"
        )

    # ---- forward ----------------------------------------------------------------------------
    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, conv_dim] mixed q|k|v (this rank's heads), z [T, nv, dv], b and a [T, nv]."""
        t, r = x.shape[0], self.ratio
        qkvz = self.in_proj_qkvz(x).view(t, self.nk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixed, z, b, a = self._split(x)
        beta = self.pw(torch.sigmoid, b).float()  # in the model dtype, as the reference rounds it
        g = -self.pw(torch.exp, self.A_log.float()) * self.pw(F.softplus, a.float() + self.dt_bias.float())

        def in_place(rows: slice, out: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            steps, state = self.recurrent_steps, self.rec_state
            return steps.gdn_step(out, self.pw(torch.exp, g[rows]), beta[rows], state, slots, self.nk)

        core = self.scan(
            mixed, ctx, lambda rows, out, rec: self._delta(out, g[rows], beta[rows], rec), in_place, in_place
        )
        y = self.norm(core.to(x.dtype), z)
        return self.out_proj(y.reshape(x.shape[0], -1))

    def _delta(
        self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
    ) -> torch.Tensor:
        """The delta rule over tokens [L, conv_dim] of one sequence (state [1, ...]) or one token of
        each of B sequences (state [B, ...]): outputs [L or B, nv, dv] float32; state updated."""
        t = mixed.shape[0]
        mixed = mixed.float()
        if self.pw is not plain:  # the prefill conv's output is transposed: a strided sum over dk in
            mixed = mixed.contiguous()  # l2norm takes an order that follows the heads' count
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(t, self.nk, self.dk)).repeat_interleave(self.ratio, dim=1) * self.dk**-0.5
        k = l2norm(k.reshape(t, self.nk, self.dk)).repeat_interleave(self.ratio, dim=1)
        v = v.reshape(t, self.nv, self.dv)
        if state.shape[0] == t:  # one token per sequence
            return delta_rule_step(state, q, k, v, g, beta, pw=self.pw)
        return delta_rule_chunked(state, q, k, v, g, beta, pw=self.pw)  # one sequence's tokens


class SplitGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's layout: in_proj_qkv ([q | k | v] of every head, the convolution's channel order),
    in_proj_z, in_proj_b and in_proj_a, each of its own; under TP in_proj_qkv is sharded per part
    as the convolution is."""

    def __init__(self, lin: LinearAttentionConfig, hidden: int, eps: float, tp: Any, dtype) -> None:
        super().__init__(lin, hidden, eps, tp, dtype)
        del self.in_proj_qkvz, self.in_proj_ba
        self.in_proj_qkv = ColumnParallelLinear(hidden, 2 * lin.key_dim + lin.value_dim, False, tp, dtype)
        set_loader(self.in_proj_qkv.weight, self._load_qkv)
        self.in_proj_z = ColumnParallelLinear(hidden, lin.value_dim, False, tp, dtype)
        self.in_proj_b = ColumnParallelLinear(hidden, lin.num_value_heads, False, tp, dtype)
        self.in_proj_a = ColumnParallelLinear(hidden, lin.num_value_heads, False, tp, dtype)

    def _load_qkv(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        kd = self.full.key_dim
        widths = (self.key_dim, self.key_dim, self.value_dim)
        parts = tuple((off + self.tp_rank * w, w) for off, w in zip((0, kd, 2 * kd), widths, strict=True))
        copy_row_parts(param, src, parts, "in_proj_qkv weight")

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = x.shape[0]
        z = self.in_proj_z(x).view(t, self.nv, self.dv)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
