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
from expertmesh.distributed.fixed_sum import plain, pointwise
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.cache_spec import StateSpec
from expertmesh.layers.linear import ColumnParallelLinear, RowParallelLinear, _divide
from expertmesh.layers.ops import Ops, RecurrentSteps
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


class RecurrentMixer(nn.Module):
    """What every recurrent mixer shares: a causal depthwise convolution (`conv_weight`, optional
    `conv_bias`, SiLU) over `conv_dim` channels with its conv state, a recurrent state of shape
    `state_spec.shapes[1]`, both per sequence slot, and the walk over one step's decodes (batched)
    and prefill chunks (each after its sequence's state; a chunk at position 0 starts from zero).
    A dummy forward (no `state_slots`) runs from zero state and keeps nothing."""

    conv_dim: int
    kernel: int
    conv_bias: nn.Parameter | None  # registered by each mixer (None: no bias)
    state_spec: StateSpec
    conv_state: torch.Tensor | None = None  # [slots + 1, conv_dim, K - 1], bind_state
    rec_state: torch.Tensor | None = None  # [slots + 1, *state_spec.shapes[1]]
    # Deterministic mode (the TP group's fixed_chunks): elementwise exp / sigmoid / softplus / SiLU
    # through fixed_sum.pointwise, so an element's bits do not follow the batch or this rank's heads.
    pw: Callable = staticmethod(plain)

    recurrent_steps: RecurrentSteps | None = None  # the ops' in-place steps (use_ops; None: torch path)
    _conv_w32: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the kernel's float32 weights

    def use_fixed_order(self, group: Any) -> None:
        if getattr(group, "fixed_chunks", 0):
            self.pw = self.norm.pw = pointwise

    def bind_state(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.conv_state, self.rec_state = tensors

    # Speculative decoding: [slots, k, ...] states after each verified draft position
    # (engine/state_cache.py DraftStates)
    draft_conv: torch.Tensor | None = None
    draft_rec: torch.Tensor | None = None

    def bind_draft_states(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self.draft_conv, self.draft_rec = tensors

    def use_ops(self, ops: Ops) -> None:
        """Decode steps on the ops' in-place recurrent steps where it has them (after loading: the
        conv weights are widened to float32 once here)."""
        self.recurrent_steps = ops.recurrent_steps()
        if self.recurrent_steps is not None:
            bias = None if self.conv_bias is None else self.conv_bias.detach().float().contiguous()
            self._conv_w32 = (self.conv_weight.detach().float().contiguous(), bias)

    def _in_place(self, slots: torch.Tensor | None) -> bool:
        """Whether decodes run on the kernels, on the states in their slots."""
        return (
            self.recurrent_steps is not None
            and slots is not None
            and self.conv_state is not None
            and self.conv_state.dtype == self.rec_state.dtype == torch.float32
        )

    def scan(
        self,
        mixed: torch.Tensor,
        ctx: ForwardContext,
        rule: Callable,
        step: Callable | None = None,
        chunk_step: Callable | None = None,
    ) -> torch.Tensor:
        """Conv then `rule(rows, conv output, state) -> output rows` over every sequence of the
        step: [T, ...] float32 outputs, the states kept in their slots. With the kernels, the
        decodes take `step(rows, conv output, slots)` instead, and each prefill chunk
        `chunk_step(rows, conv output, its one slot)` where given, on the states in their slots."""
        meta, slots = ctx.attn, ctx.state_slots
        outs: list[torch.Tensor] = []
        nd = meta.num_decodes
        verifying = nd and ctx.state_rows is not None and slots is not None
        first = len(ctx.state_rows) if verifying else nd  # the first prefill's slot: one a sequence
        if verifying:
            outs.append(self._verify(mixed, ctx.state_rows, slots, rule, step))
        elif nd:
            sl = slots[:nd] if slots is not None else None
            outs.append(self._decode(mixed, slice(0, nd), sl, rule, step))
        for i, chunk in enumerate(meta.prefills):
            rows = chunk.rows
            sl = slots[first + i : first + i + 1] if slots is not None else None
            fresh = chunk.context == 0
            conv = self._conv_state(sl, 1, fresh)[0]
            out, conv = self._conv_prefill(mixed[rows], conv)
            if chunk_step is not None and self._in_place(sl):
                if fresh:
                    self.rec_state[sl] = 0.0
                outs.append(chunk_step(rows, out, sl))
                self.conv_state[sl] = conv[None]
                continue
            rec = self._rec_state(sl, 1, fresh)
            outs.append(rule(rows, out, rec))
            self._keep(sl, conv[None], rec)
        return torch.cat(outs)

    def _decode(
        self, mixed: torch.Tensor, rows: Any, sl: torch.Tensor | None, rule: Callable, step: Callable | None
    ) -> torch.Tensor:
        """One decode step of the sequences in slots `sl`, one row each (`rows` of `mixed`)."""
        x = mixed[rows]
        if step is not None and self._in_place(sl):
            return step(rows, self._conv_decode_in_place(x, sl), sl)
        out, conv = self._conv_decode(x, self._conv_state(sl, x.shape[0], fresh=False))
        rec = self._rec_state(sl, x.shape[0], fresh=False)
        y = rule(rows, out, rec)
        self._keep(sl, conv, rec)
        return y

    def _verify(
        self,
        mixed: torch.Tensor,
        counts: list[int],
        slots: torch.Tensor,
        rule: Callable,
        step: Callable | None,
    ) -> torch.Tensor:
        """A verify step's decode rows (`counts[i]` consecutive rows of decode sequence i: its last
        token and its draft) stepped position by position, each position one decode step of the
        sequences reaching it, so every row sees exactly the state plain decoding gives it; the
        state after each row but a sequence's last is kept in the draft rows (DraftStates) for
        the rollback after acceptance."""
        starts = [0]
        for n in counts[:-1]:
            starts.append(starts[-1] + n)
        out: torch.Tensor | None = None
        for j in range(max(counts)):
            here = [i for i, n in enumerate(counts) if n > j]
            rows = torch.tensor([starts[i] + j for i in here], device=mixed.device)
            sl = slots[here]
            y = self._decode(mixed, rows, sl, rule, step)
            if out is None:
                out = y.new_empty(sum(counts), *y.shape[1:])
            out[rows] = y
            later = [i for i in here if counts[i] > j + 1]  # sequences with a row after this one
            if later and self.draft_rec is not None:
                keep = slots[later]
                self.draft_conv[keep, j] = self.conv_state[keep]
                self.draft_rec[keep, j] = self.rec_state[keep]
        return out

    def _conv_state(self, slots: torch.Tensor | None, n: int, fresh: bool) -> torch.Tensor:
        if slots is None or fresh or self.conv_state is None:
            dev = self.A_log.device
            return torch.zeros(n, self.conv_dim, self.kernel - 1, dtype=torch.float32, device=dev)
        return self.conv_state[slots]

    def _rec_state(self, slots: torch.Tensor | None, n: int, fresh: bool) -> torch.Tensor:
        if slots is None or fresh or self.rec_state is None:
            return torch.zeros(n, *self.state_spec.shapes[1], dtype=torch.float32, device=self.A_log.device)
        return self.rec_state[slots]

    def _keep(self, slots: torch.Tensor | None, conv: torch.Tensor, rec: torch.Tensor) -> None:
        if slots is not None and self.conv_state is not None:
            self.conv_state[slots] = conv
            self.rec_state[slots] = rec

    def _conv_decode(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new input per sequence: x [B, C], state [B, C, K-1] -> SiLU(conv) [B, C], new state."""
        w = self.conv_weight
        window = torch.cat((state.to(w.dtype), x.to(w.dtype)[:, :, None]), dim=-1).float()  # [B, C, K]
        w32 = w.float()
        # accumulated in float32 from the oldest input on, rounded once as conv1d is; the kernel
        # (conv_step_f32) sums in this order, so both give the same bits
        out = window[:, :, 0] * w32[:, 0]
        for j in range(1, self.kernel):
            out = out + window[:, :, j] * w32[:, j]
        if self.conv_bias is not None:
            out = out + self.conv_bias.float()
        return self.pw(F.silu, out.to(w.dtype)), window[:, :, 1:]

    def _conv_decode_in_place(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """_conv_decode on the kernel, the conv states shifted in their slots: SiLU(conv) [B, C]."""
        w32, b32 = self._conv_w32
        dtype = self.conv_weight.dtype
        out = self.recurrent_steps.conv_step(x.to(dtype), w32, b32, self.conv_state, slots)
        return self.pw(F.silu, out.to(dtype))

    def _conv_prefill(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk x [L, C] after the state [C, K-1]: SiLU(conv) [L, C] and the last K-1 inputs."""
        w = self.conv_weight
        full = torch.cat((state.to(w.dtype), x.to(w.dtype).t()), dim=-1)  # [C, K-1+L]
        out = F.conv1d(full[None], w[:, None, :], self.conv_bias, groups=self.conv_dim)[0]  # [C, L]
        return self.pw(F.silu, out).t(), full[:, -(self.kernel - 1) :].float()


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
