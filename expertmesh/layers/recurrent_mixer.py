"""The part every recurrent token mixer shares (Gated DeltaNet, layers/gated_deltanet.py; Mamba2,
layers/mamba2.py): the causal depthwise convolution with its conv state, the recurrent state per
sequence slot, and the walk over one step's decodes, speculative verify rows and prefill chunks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import plain, pointwise
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.cache_spec import StateSpec
from expertmesh.layers.ops import Ops, RecurrentSteps


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
            # (a preempted sequence's replayed rows may pass k: the draft rows keep the first k)
            if later and self.draft_rec is not None and j < self.draft_rec.shape[1]:
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
