"""expertmesh's own CPU kernels (csrc/cpu_kernels.c), compiled for this machine on first use:
`load()` and the typed Python entry points (`CpuKernels`); the build itself, its cache key and
the C functions' ctypes signatures are kernel_library.py.

The C source is built with the system C compiler (`cc`, or $CC) as
`-O3 -march=native -fopenmp` into ~/.cache/expertmesh/kernels/ (or $EXPERTMESH_CACHE), keyed by
the source, the compiler and this CPU's feature flags, and loaded with ctypes; it shares torch's
OpenMP runtime. Without a compiler, or if the build fails, `load()` returns None once with a
warning and callers keep their torch path: the kernels are a speed-up, never a requirement.

The environment is read here, once, by the model builder's call to `load()`; layers receive the
loaded `CpuKernels` object (or None), as they receive their groups.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from expertmesh.cpu import cpu_features, cpu_onednn, kernel_library
from expertmesh.cpu.cpu_attention_kernels import AttentionKernels
from expertmesh.cpu.kernel_library import SIGNATURES
from expertmesh.layers.quantization.codes import QUANT_KINDS

log = logging.getLogger("expertmesh")

_i64 = ctypes.c_int64
_threads = torch.get_num_threads  # every entry point follows torch's thread count


@dataclass(frozen=True)
class PanelWeight:
    """A weight laid out for `CpuKernels.linear` (see `CpuKernels.panel_shape`); `apply` (or calling
    it) multiplies by it, like the other linear weight forms (layers/linear_weight.py)."""

    kernels: CpuKernels
    data: torch.Tensor
    out_features: int
    in_features: int
    # Resolved once at packing, not per call (a decode step makes ~30 of these calls a layer
    # group, so Python work per call shows): the entry point for this dtype/layout, and data's address.
    fn: Any = None
    ptr: int = 0
    fn_f32: Any = None  # bf16 weights: the same product with a float32 (unrounded) output

    def apply(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        return self.kernels.linear(x, self, bias, out_dtype)

    __call__ = apply

    def native_form(self, dtype: torch.dtype, keep: list, float32_out: bool = False) -> dict | None:
        """Its entry point and panels' address for a native decode layer's GEMM slot (the product
        rounded to the activations' dtype, or left in float32 with `float32_out`)."""
        fn = self.fn_f32 if float32_out else self.fn
        return None if fn is None else {"fn": ctypes.cast(fn, ctypes.c_void_p).value, "w": self.ptr}

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(self.data, "dense")]

    def slot_tensors(self) -> list[torch.Tensor]:
        """What EPLB moves of an expert's weight held in this form."""
        return [self.data]


class CpuKernels(AttentionKernels):
    """Typed entry points of the compiled library."""

    MOE_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}
    # moe_q_ex's (and moe_*_ex's): the gated ones, GPT-OSS's clamped SwiGLU and DeepSeek-V4's clamped
    # SiLU (not in moe_* nor native decode)
    MOE_Q_ACTIVATIONS = {**MOE_ACTIVATIONS, "swiglu_clamped": 3, "silu_clamped": 4}
    MOE_CHUNK = 512

    def __init__(self, lib: ctypes.CDLL, path: Path, onednn_bf16_rows: int | None = None) -> None:
        self.lib, self.path = lib, path
        # From this many rows bf16 products go to oneDNN's matmul (AMX), None: never; see
        # cpu_features.onednn_bf16_rows, decided in load().
        self.onednn_bf16_rows = onednn_bf16_rows
        lib.gemm_lanes.restype = _i64
        lib.bf16_pairs.restype = _i64
        self.lanes = int(lib.gemm_lanes())
        # bfloat16 products on pairs (AVX512-BF16); without them bf16 weights are widened to
        # float32 in registers (gemm_bf16, and moe_bf16 built on it).
        self.bf16_pairs = bool(lib.bf16_pairs())
        # A fresh, unmasked prompt's attention: our prefill kernel where it is the faster one, the
        # 16-lane (AVX-512) build; the 8-lane (AVX2) build loses to torch's flash kernel, which
        # keeps it there (benchmarks/attention_bench.py; docs/benchmarks.md, "Dispatch figures").
        self.prefill_fresh = self.lanes == 16
        kinds = ("paged_decode", "paged_prefill", "head_matmul", "gemm", "rms_norm", "rope_cache", "moe")
        variants = {kind: ("f32", "bf16") for kind in kinds}
        variants["gemm"] += ("bf16_f32",)  # bf16 weights, float32 output (partial sums)
        if self.bf16_pairs:
            variants["gemm"] += ("bf16_pairs", "bf16_pairs_f32")
        for kind, names in variants.items():
            for name in names:
                fn = getattr(lib, f"{kind}_{name}")
                fn.restype, fn.argtypes = None, SIGNATURES[kind]
        for name in ("gemm_q", "moe_q"):  # quantized weights: one entry point each, the code kind an argument
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = None, SIGNATURES[name]
        # None: an older build (no biases, act 0-2)
        self.moe_q_ex = getattr(lib, "moe_q_ex", None)
        self.moe_ex = {
            t: getattr(lib, f"moe_{n}_ex", None)
            for t, n in ((torch.float32, "f32"), (torch.bfloat16, "bf16"))
        }
        for fn, sig in [(self.moe_q_ex, "moe_q_ex")] + [(f, "moe_ex") for f in self.moe_ex.values()]:
            if fn is not None:
                fn.restype, fn.argtypes = None, SIGNATURES[sig]
        # loading: GGUF MXFP4 blocks into fp4 panels (quantization/mxfp4_blocks.py); older builds lack it
        repack = getattr(lib, "mxfp4_gguf_panels", None)
        if repack is not None:
            repack.restype, repack.argtypes = None, SIGNATURES["mxfp4_gguf_panels"]
        # code kinds gemm_q / moe_q know, in their numbering (codes.KINDS); older builds: the first 4
        lib_kinds = getattr(lib, "q_kinds", None)
        if lib_kinds is not None:
            lib_kinds.restype = _i64
        self.quant_kinds = QUANT_KINDS[: int(lib_kinds()) if lib_kinds is not None else 4]
        # uint4 / int8 / fp4 / fp8 codes against bf16 activations on bf16 pairs (AVX512-BF16 and VBMI):
        # a bf16 model's int4 / int8 / fp4 / fp8 products take code kinds 6-9 then (quantized.product_kind)
        tiles = getattr(lib, "q_bf16_tiles", None)
        if tiles is not None:
            tiles.restype = _i64
        self.quant_bf16_pairs = tiles is not None and bool(tiles())
        self._rms_norm_f32, self._rms_norm_bf16 = lib.rms_norm_f32, lib.rms_norm_bf16

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)

    # ---- matmul ----------------------------------------------------------------------------------
    def panel_shape(self, out_features: int, in_features: int, dtype: torch.dtype) -> tuple[int, ...]:
        """[P, in, lanes]: panels of `lanes` output rows; bf16 on pairs: [P, ceil(in / 2), lanes, 2]."""
        panels = -(-out_features // self.lanes)
        if dtype == torch.bfloat16 and self.bf16_pairs:
            return (panels, -(-in_features // 2), self.lanes, 2)
        return (panels, in_features, self.lanes)

    def pack(self, weight: torch.Tensor) -> PanelWeight:
        """[out, in] weight -> its panels (zero rows past `out`; a zero column pads odd `in` pairs)."""
        out_features, in_features = weight.shape
        shape = self.panel_shape(out_features, in_features, weight.dtype)
        panels = shape[0]
        if len(shape) == 4:  # pairs: lane l of pair i holds W[o, 2i] and W[o, 2i + 1]
            padded = torch.zeros(panels * self.lanes, 2 * shape[1], dtype=weight.dtype)
            padded[:out_features, :in_features] = weight
            data = padded.view(panels, self.lanes, shape[1], 2).permute(0, 2, 1, 3).contiguous()
        else:
            padded = torch.zeros(panels * self.lanes, in_features, dtype=weight.dtype)
            padded[:out_features] = weight
            data = padded.view(panels, self.lanes, in_features).transpose(1, 2).contiguous()
        name = "gemm_f32" if weight.dtype == torch.float32 else "gemm_bf16"
        name = f"{name}_pairs" if data.dim() == 4 else name
        fn = getattr(self.lib, name, None)  # None: layout faked
        fn_f32 = fn if weight.dtype == torch.float32 else getattr(self.lib, f"{name}_f32", None)
        return PanelWeight(self, data, out_features, in_features, fn, data.data_ptr(), fn_f32)

    def _to_onednn(self, rows: int, dtype: torch.dtype) -> bool:
        return dtype == torch.bfloat16 and self.onednn_bf16_rows is not None and rows >= self.onednn_bf16_rows

    def linear(
        self,
        x: torch.Tensor,
        w: PanelWeight,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias) -> [..., out], for a weight packed by `pack`.

        Products accumulate in float32 and are rounded to x's dtype once, at the end; with
        ``out_dtype=torch.float32`` a bf16 product is returned unrounded (a partial sum that other
        ranks add to, rounded once after that sum)."""
        shape, dtype = x.shape, x.dtype
        if shape[-1] != w.in_features or dtype != w.data.dtype:
            raise ValueError(
                f"linear: input {tuple(shape)} {dtype} does not fit weight "
                f"[{w.out_features}, {w.in_features}] {w.data.dtype}"
            )
        out_dtype = out_dtype or dtype
        if out_dtype not in (dtype, torch.float32):
            raise ValueError(f"linear: out_dtype {out_dtype} for {dtype} input; valid: {dtype}, float32")
        x2 = x if len(shape) == 2 and x.is_contiguous() else x.reshape(-1, w.in_features).contiguous()
        rows = x2.shape[0]
        # oneDNN returns x's dtype, i.e. rounded: an unrounded partial sum stays on our kernel.
        if out_dtype == dtype and self._to_onednn(rows, dtype):
            y = F.linear(x2, cpu_onednn.unpack(w.data, w.out_features, w.in_features), bias)
            return y if len(shape) == 2 else y.view(*shape[:-1], w.out_features)
        y = torch.empty((rows, w.out_features), dtype=out_dtype)
        if rows:
            # The bias is added in float32 before the output is rounded (as oneDNN does).
            b = None if bias is None else bias.to(torch.float32).contiguous()  # held through the call
            bp = None if b is None else b.data_ptr()
            fn = w.fn if out_dtype == dtype else w.fn_f32
            fn(x2.data_ptr(), w.ptr, y.data_ptr(), rows, w.out_features, w.in_features, bp, _threads())
        return y if len(shape) == 2 else y.view(*shape[:-1], w.out_features)

    # ---- routed experts --------------------------------------------------------------------------
    def moe_supports(self, dtype: torch.dtype, act: str, extras: bool = False) -> bool:
        """Whether `moe` serves these experts; extras: with biases or the clamped SwiGLU (moe_*_ex)."""
        if extras:
            return self.moe_ex.get(dtype) is not None and act in self.MOE_Q_ACTIVATIONS
        return self.supports(dtype) and act in self.MOE_ACTIVATIONS

    def moe(
        self,
        x: torch.Tensor,
        slot: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        inter: int,
        act: str,
        extras: tuple | None = None,
    ) -> torch.Tensor:
        """Routed experts in one call: x [n, H], slot [n, k] int32 (local expert or -1), weights
        [n, k]; w13 / w2 the experts' [gate | up] and down weights, each packed by `pack`, stacked
        -> [n, H] float32, this rank's partial sum, not rounded to x's dtype (whoever sums the
        partials over ranks rounds once, after that sum). extras: (b13 [E, 2I] or None, b2 [E, H]
        or None, float32 contiguous; limit, alpha) for moe_*_ex, our kernel only (not oneDNN's)."""
        n, hidden = x.shape
        ok = self.moe_supports(x.dtype, act, extras is not None)
        if not ok or slot.dtype != torch.int32 or slot.shape[0] != n:
            raise ValueError(f"moe: unsupported input {x.dtype} / slot {slot.dtype} / activation {act!r}")
        e = w13.shape[0]
        want13 = (e, *self.panel_shape(2 * inter, hidden, x.dtype))
        want2 = (e, *self.panel_shape(hidden, inter, x.dtype))
        if tuple(w13.shape) != want13 or tuple(w2.shape) != want2 or w13.dtype != x.dtype:
            raise ValueError(
                f"moe: weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit H={hidden}, "
                f"I={inter} (want {want13} / {want2} {x.dtype})"
            )
        x, slot = x.contiguous(), slot.contiguous()
        weights = weights.to(torch.float32).contiguous()
        if extras is None and self._to_onednn(n * slot.shape[1] // max(e, 1), x.dtype):  # rows an expert gets
            return cpu_onednn.moe(x, slot, weights, w13, w2, inter, act)
        out = torch.empty(n, hidden, dtype=torch.float32)
        fn = self.lib.moe_f32 if x.dtype == torch.float32 else self.lib.moe_bf16
        if extras is not None:
            b13, b2, limit, alpha = extras
            ptrs = [None if b is None else b.data_ptr() for b in (b13, b2)]
            ex = self.moe_ex[x.dtype]

            def fn(*a):  # noqa: ANN002 - moe's arguments with the extras before out
                ex(*a[:11], limit, alpha, *ptrs, *a[11:])

        k, row_bytes = slot.shape[1], hidden * x.element_size()
        xp, sp, wp, op = x.data_ptr(), slot.data_ptr(), weights.data_ptr(), out.data_ptr()
        # Long prefills go MOE_CHUNK tokens a call, so the block's intermediates stay in cache
        # (faster on a long prefill: docs/benchmarks.md, "Dispatch figures"); weights are re-read
        # per chunk, which costs little next to the products of 512 tokens.
        for i in range(0, n, self.MOE_CHUNK):
            rows = min(self.MOE_CHUNK, n - i)
            fn(
                xp + i * row_bytes,
                rows,
                hidden,
                sp + i * k * 4,  # int32 slots
                wp + i * k * 4,  # float32 weights
                k,
                w13.data_ptr(),
                w2.data_ptr(),
                e,
                inter,
                self.MOE_Q_ACTIVATIONS[act],
                op + i * hidden * 4,  # float32 out
                _threads(),
            )
        return out

    # ---- per-token ops ---------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dim, rounding as the float32-then-cast reference does."""
        shape, dtype = x.shape, x.dtype
        x2 = x if len(shape) == 2 and x.is_contiguous() else x.reshape(-1, shape[-1]).contiguous()
        rows, width = x2.shape
        if dtype != weight.dtype or weight.shape[-1] != width or weight.dim() != 1:
            raise ValueError(
                f"rms_norm: x {tuple(shape)} {dtype} vs weight {tuple(weight.shape)} {weight.dtype}"
            )
        out = torch.empty((rows, width), dtype=dtype)
        fn = self._rms_norm_f32 if dtype == torch.float32 else self._rms_norm_bf16
        fn(x2.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, width, eps, _threads())
        return out if len(shape) == 2 else out.view(shape)

    def rope_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        interleaved: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotary q and k and k, v stored at `slots` of the caches, in one pass.

        q [T, H, D], k and v [T, Hk, D] may be row-strided views (of the fused qkv output); cos and
        sin [T, R] (or [T, 1, R]) for the first R <= D dims (partial rotary passes the rest through),
        NeoX halves or, with `interleaved`, GPT-J pairs; caches [blocks, block_size, Hk, D] or empty
        (no store). Returns contiguous rotated q, rotated k and v."""
        t, h, d = q.shape
        hk, r = k.shape[1], cos.shape[-1]
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.dtype != q.dtype or x.stride(2) != 1 or x.stride(1) != d or x.shape[0] != t:
                raise ValueError(f"rope_cache: {name} must be [T, heads, {d}] with unit-stride heads")
        if r > d or r % 2:
            raise ValueError(f"rope_cache: {r} rotary dims do not fit head_dim {d}")
        cos, sin = cos.reshape(t, r).contiguous(), sin.reshape(t, r).contiguous()
        if cos.dtype != q.dtype or slots.dtype != torch.int64:
            raise ValueError("rope_cache: cos/sin must have q's dtype and slots must be int64")
        q_out, k_out, v_out = (
            torch.empty_like(q, memory_format=torch.contiguous_format),
            *(torch.empty(t, hk, d, dtype=q.dtype) for _ in range(2)),
        )
        store = k_cache.numel() > 0
        fn = self.lib.rope_cache_f32 if q.dtype == torch.float32 else self.lib.rope_cache_bf16
        fn(
            q.data_ptr(),
            q.stride(0),
            k.data_ptr(),
            k.stride(0),
            v.data_ptr(),
            v.stride(0),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.contiguous().data_ptr() if store else None,
            k_cache.data_ptr() if store else None,
            v_cache.data_ptr() if store else None,
            q_out.data_ptr(),
            k_out.data_ptr(),
            v_out.data_ptr(),
            t,
            h,
            hk,
            d,
            r,
            int(interleaved),
            torch.get_num_threads(),
        )
        return q_out, k_out, v_out


# Why the last load() gave None (the compiler's stderr, or the missing compiler), for tests that
# must fail, not skip, when the kernels do not build.
last_error: str | None = None


@cache
def load() -> CpuKernels | None:
    """The compiled kernels for this machine, building them if needed; None if they cannot be built."""
    global last_error
    if os.environ.get("EXPERTMESH_DISABLE_CPU_KERNELS", "0") not in ("", "0"):
        log.info("CPU kernels disabled by EXPERTMESH_DISABLE_CPU_KERNELS; using torch ops")
        return None
    compiler = kernel_library.compiler()
    if compiler is None:
        last_error = "no C compiler found (set CC)"
        log.warning("no C compiler found (set CC); CPU kernels unavailable, using torch ops (slower)")
        return None
    try:
        kernels = build(kernel_library.library_path(compiler), compiler)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        last_error = detail.strip()
        log.warning("CPU kernels could not be built or loaded (%s); using torch ops (slower)", detail.strip())
        return None
    amx, onednn = cpu_features.amx_bf16(), cpu_features.onednn_bf16()
    kernels.onednn_bf16_rows = cpu_features.onednn_bf16_rows(amx, onednn)
    if kernels.onednn_bf16_rows is not None:
        log.info("AMX: bf16 products of %d rows or more go to oneDNN's matmul", kernels.onednn_bf16_rows)
    return kernels


def build(
    path: Path, compiler: str, extra_flags: tuple[str, ...] = (), source: Path = kernel_library.SOURCE
) -> CpuKernels:
    """Compile (unless `path` exists) and load. `extra_flags` lets tests build other variants,
    e.g. `-mno-avx512f` for the generic 8-lane path other CPUs take; `source` another copy of the
    kernels (benchmarks' A/B runs)."""
    if not path.exists():
        log.info("compiling CPU kernels with %s into %s", compiler, path.parent)
        kernel_library.compile_into(compiler, path, extra_flags, source)
    return CpuKernels(ctypes.CDLL(str(path)), path)
