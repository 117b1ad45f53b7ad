"""expertmesh's own CPU kernels (csrc/cpu_kernels.c), compiled for this machine on first use.

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
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("expertmesh")

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

_c = ctypes.c_void_p
_i64 = ctypes.c_int64


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _build(compiler: str, out: Path) -> None:
    """Compile into a temporary file, then rename: ranks building at once never see half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass(frozen=True)
class PanelWeight:
    """A weight laid out for `CpuKernels.linear`: [panels, in_features, lanes]."""

    data: torch.Tensor
    out_features: int
    in_features: int


class CpuKernels:
    """Typed entry points of the compiled library."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib, self.path = lib, path
        for name in ("paged_decode_f32", "paged_decode_bf16"):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [_c] * 6 + [_i64] * 6 + [ctypes.c_float, _i64, ctypes.c_int]
        for name in ("gemm_f32", "gemm_bf16"):
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [_c] * 3 + [_i64] * 3 + [ctypes.c_int]
        lib.gemm_lanes.restype = _i64
        lib.moe_f32.restype = None
        lib.moe_f32.argtypes = [
            _c,
            _i64,
            _i64,
            _c,
            _c,
            _i64,
            _c,
            _c,
            _i64,
            _i64,
            ctypes.c_int,
            _c,
            ctypes.c_int,
        ]
        self.lanes = int(lib.gemm_lanes())

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.bfloat16)

    def pack(self, weight: torch.Tensor) -> PanelWeight:
        """[out, in] weight -> panels of `lanes` output rows, [P, in, lanes], zero rows past `out`."""
        out_features, in_features = weight.shape
        panels = -(-out_features // self.lanes)
        padded = torch.zeros(panels * self.lanes, in_features, dtype=weight.dtype)
        padded[:out_features] = weight
        data = padded.view(panels, self.lanes, in_features).transpose(1, 2).contiguous()
        return PanelWeight(data, out_features, in_features)

    def linear(self, x: torch.Tensor, w: PanelWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ W.T (+ bias) -> [..., out], for a weight packed by `pack`."""
        if x.shape[-1] != w.in_features or x.dtype != w.data.dtype:
            raise ValueError(
                f"linear: input {tuple(x.shape)} {x.dtype} does not fit weight "
                f"[{w.out_features}, {w.in_features}] {w.data.dtype}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, w.in_features).contiguous()
        y = torch.empty(x2.shape[0], w.out_features, dtype=x.dtype)
        if x2.shape[0]:
            fn = self.lib.gemm_f32 if x.dtype == torch.float32 else self.lib.gemm_bf16
            fn(
                x2.data_ptr(),
                w.data.data_ptr(),
                y.data_ptr(),
                x2.shape[0],
                w.out_features,
                w.in_features,
                torch.get_num_threads(),
            )
        if bias is not None:
            y += bias
        return y.view(*lead, w.out_features)

    MOE_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_pytorch_tanh": 2}

    def moe_supports(self, dtype: torch.dtype, act: str) -> bool:
        return dtype == torch.float32 and act in self.MOE_ACTIVATIONS

    def moe(
        self,
        x: torch.Tensor,
        slot: torch.Tensor,
        weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        inter: int,
        act: str,
    ) -> torch.Tensor:
        """Routed experts in one call: x [n, H] float32, slot [n, k] int32 (local expert or -1),
        weights [n, k]; w13 / w2 the experts' [gate | up] and down weights stacked in panels
        ([E, P, H, lanes] and [E, P, inter, lanes]) -> [n, H], this rank's partial sum."""
        n, hidden = x.shape
        if x.dtype != torch.float32 or slot.dtype != torch.int32 or slot.shape[0] != n:
            raise ValueError(
                f"moe: x must be float32 [n, H] and slot int32 [n, k], got {x.dtype}, {slot.dtype}"
            )
        if w13.shape[2] != hidden or w2.shape[2] != inter or w13.shape[0] != w2.shape[0]:
            raise ValueError(
                f"moe: weights {tuple(w13.shape)} / {tuple(w2.shape)} do not fit H={hidden}, I={inter}"
            )
        x = x.contiguous()
        slot = slot.contiguous()
        weights = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        self.lib.moe_f32(
            x.data_ptr(),
            n,
            hidden,
            slot.data_ptr(),
            weights.data_ptr(),
            slot.shape[1],
            w13.data_ptr(),
            w2.data_ptr(),
            w13.shape[0],
            inter,
            self.MOE_ACTIVATIONS[act],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """q [B, H, D], caches [blocks, block_size, Hk, D], int32 tables [B, W], lengths [B] -> [B, H, D]."""
        b, h, d = q.shape
        _, bs, hk, _ = k_cache.shape
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not t.is_contiguous() or t.dtype != q.dtype:
                raise ValueError(f"paged_decode: {name} must be contiguous {q.dtype}, got {t.dtype}")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise ValueError("paged_decode: block_tables and context_lens must be int32")
        out = torch.empty_like(q)
        fn = self.lib.paged_decode_f32 if q.dtype == torch.float32 else self.lib.paged_decode_bf16
        fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.contiguous().data_ptr(),
            context_lens.contiguous().data_ptr(),
            out.data_ptr(),
            b,
            h,
            hk,
            d,
            block_tables.shape[1],
            bs,
            scale,
            sliding_window or 0,
            torch.get_num_threads(),
        )
        return out


@cache
def load() -> CpuKernels | None:
    """The compiled kernels for this machine, building them if needed; None if they cannot be built."""
    if os.environ.get("EXPERTMESH_DISABLE_CPU_KERNELS", "0") not in ("", "0"):
        log.info("CPU kernels disabled by EXPERTMESH_DISABLE_CPU_KERNELS; using torch ops")
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler found (set CC); CPU kernels unavailable, using torch ops (slower)")
        return None
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(" ".join([compiler, *FLAGS, platform.machine(), _cpu_flags()]).encode())
    root = Path(os.environ.get("EXPERTMESH_CACHE", Path.home() / ".cache" / "expertmesh"))
    path = root / "kernels" / key.hexdigest()[:16] / "libexpertmesh_cpu.so"
    try:
        if not path.exists():
            log.info("compiling CPU kernels with %s into %s", compiler, path.parent)
            _build(compiler, path)
        return CpuKernels(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("CPU kernels could not be built or loaded (%s); using torch ops (slower)", detail.strip())
        return None
