"""Typed entry points of the recurrent mixers' decode kernels (cpu/csrc/recurrent.c) in the compiled
CPU library: the convolution step with its state shift, the Gated DeltaNet step and the Mamba2 step,
each on float32 states updated in place in their slots. `RecurrentKernels.bind(kernels)` gives None for a
build without them; cpu/ops.py hands them to the mixers (`Ops.recurrent_steps`), else their torch path.
"""

from __future__ import annotations

import ctypes

import torch

from expertmesh.cpu.cpu_kernels import CpuKernels

_c, _i64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

SIGNATURES = {
    # x, its row stride, w [C, K], bias or NULL, state base, slots, out, B, C, K, threads
    "conv_step_f32": [_c, _i64, _c, _c, _c, _c, _c, _i64, _i64, _i64, _INT],
    # mixed, its row stride, decay, beta, state base, slots, out, B, nk, nv, dk, dv, threads
    "gdn_step_f32": [_c, _i64, _c, _c, _c, _c, _c] + [_i64] * 5 + [_INT],
    # mixed, its row stride, decay, beta, state base, slot, out, L, nk, nv, dk, dv, threads
    "gdn_scan_f32": [_c, _i64, _c, _c, _c, _i64, _c] + [_i64] * 5 + [_INT],
    # xbc, its row stride, dt, decay, D, state base, slots, out, B, H, P, N, groups, threads
    "ssm_step_f32": [_c, _i64, _c, _c, _c, _c, _c, _c] + [_i64] * 5 + [_INT],
    # xbc, its row stride, dt, decay, D, state base, slot, out, L, H, P, N, groups, threads
    "ssm_scan_f32": [_c, _i64, _c, _c, _c, _c, _i64, _c] + [_i64] * 5 + [_INT],
}


def _rows(x: torch.Tensor) -> torch.Tensor:
    """float32 rows with unit column stride (a bf16 activation is widened: exact)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_state(state: torch.Tensor, slots: torch.Tensor) -> None:
    if state.dtype != torch.float32 or not state.is_contiguous() or state.device.type != "cpu":
        raise ValueError(f"recurrent kernels need a contiguous float32 CPU state, got {state.dtype}")
    if slots.dtype != torch.int64 or slots.dim() != 1 or not slots.is_contiguous():
        raise ValueError(f"state slots must be a contiguous int64 vector, got {slots.dtype}")
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= state.shape[0]):
        raise ValueError(f"state slots outside the state's {state.shape[0]} rows")


class RecurrentKernels:
    """The three entry points; every call follows torch's thread count."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.fns = {}
        for name, args in SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, args
            self.fns[name] = fn

    @classmethod
    def bind(cls, kernels: CpuKernels) -> RecurrentKernels | None:
        if not all(hasattr(kernels.lib, name) for name in SIGNATURES):
            return None
        return cls(kernels.lib)

    def conv_step(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        state: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, C] (one new input a sequence), weight [C, K] and bias [C] float32, state base
        [*, C, K - 1] shifted in place in `slots`: the convolution before its activation, [B, C]
        float32, summed as RecurrentMixer._conv_decode sums it."""
        _check_state(state, slots)
        b, c = x.shape
        k = weight.shape[1]
        if state.shape[1:] != (c, k - 1) or weight.dtype != torch.float32 or not weight.is_contiguous():
            raise ValueError(f"conv state {tuple(state.shape)} / weight {tuple(weight.shape)} do not match x")
        out = torch.empty(b, c, dtype=torch.float32)
        if b:
            x = _rows(x)
            self.fns["conv_step_f32"](
                x.data_ptr(), x.stride(0), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                state.data_ptr(), slots.data_ptr(), out.data_ptr(), b, c, k, torch.get_num_threads(),
            )  # fmt: skip
        return out

    def gdn_step(
        self,
        mixed: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        nk: int,
    ) -> torch.Tensor:
        """mixed [T, 2 nk dk + nv dv] (the activated conv output: q | k | v), decay = exp(g) and
        beta [T, nv] float32, state base [*, nv, dk, dv] updated in place in `slots`: [T, nv, dv].
        One token for each of T sequences (T slots), or T tokens of one sequence (one slot: a
        prefill chunk, scanned token by token)."""
        _check_state(state, slots)
        nv, dk, dv = state.shape[1:]
        t = mixed.shape[0]
        if mixed.shape[1] != 2 * nk * dk + nv * dv or nv % nk:
            raise ValueError(f"mixed width {mixed.shape[1]} does not match {nk} key / {nv} value heads")
        if slots.numel() not in (t, 1):
            raise ValueError(f"{slots.numel()} state slots for {t} tokens: one a token, or one in all")
        out = torch.empty(t, nv, dv, dtype=torch.float32)
        if t:
            mixed, decay, beta = _rows(mixed), decay.float().contiguous(), beta.float().contiguous()
            args = (mixed.data_ptr(), mixed.stride(0), decay.data_ptr(), beta.data_ptr(), state.data_ptr())
            dims = (t, nk, nv, dk, dv, torch.get_num_threads())
            if slots.numel() == t:
                self.fns["gdn_step_f32"](*args, slots.data_ptr(), out.data_ptr(), *dims)
            else:
                self.fns["gdn_scan_f32"](*args, int(slots[0]), out.data_ptr(), *dims)
        return out

    def ssm_step(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        decay: torch.Tensor,
        d: torch.Tensor,
        state: torch.Tensor,
        slots: torch.Tensor,
        groups: int,
    ) -> torch.Tensor:
        """xbc [T, H P + 2 groups N] (the activated conv output: x | B | C), dt and decay = exp(dt A)
        [T, H] float32, D [H] float32, state base [*, H, P, N] updated in place in `slots`:
        y = S C + D x, [T, H P]. One token for each of T sequences (T slots), or T tokens of one
        sequence (one slot: a prefill chunk, scanned token by token)."""
        _check_state(state, slots)
        h, p, n = state.shape[1:]
        t = xbc.shape[0]
        if xbc.shape[1] != h * p + 2 * groups * n or h % groups:
            raise ValueError(f"xbc width {xbc.shape[1]} does not match {h} heads in {groups} groups")
        if slots.numel() not in (t, 1):
            raise ValueError(f"{slots.numel()} state slots for {t} tokens: one a token, or one in all")
        out = torch.empty(t, h * p, dtype=torch.float32)
        if t:
            xbc, dt, decay = _rows(xbc), dt.float().contiguous(), decay.float().contiguous()
            d = d.float().contiguous()
            args = (xbc.data_ptr(), xbc.stride(0), dt.data_ptr(), decay.data_ptr(), d.data_ptr())
            args += (state.data_ptr(),)
            dims = (t, h, p, n, groups, torch.get_num_threads())
            if slots.numel() == t:
                self.fns["ssm_step_f32"](*args, slots.data_ptr(), out.data_ptr(), *dims)
            else:
                self.fns["ssm_scan_f32"](*args, int(slots[0]), out.data_ptr(), *dims)
        return out
