"""The compiled kernel library: its source (csrc/, one translation unit), the compiler flags, the
cache path keyed by source, compiler and CPU flags, the build (atomic, so ranks building at once
never see half a file), and the ctypes signature of every C entry point. cpu_kernels.py loads it
and wraps the entry points."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.c"


def source_digest(source: Path = SOURCE) -> str:
    """sha256 over a kernel source and the parts beside it: cpu_kernels.c includes the other .c / .h
    files of its folder (one translation unit), so a build's cache key must cover them all."""
    key = hashlib.sha256()
    for part in sorted(p for p in source.parent.iterdir() if p.suffix in (".c", ".h")):
        key.update(part.name.encode() + b"\0" + part.read_bytes())
    return key.hexdigest()


FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def compile_into(compiler: str, out: Path, extra_flags: tuple[str, ...] = (), source: Path = SOURCE) -> None:
    """Compile into a temporary file, then rename: ranks building at once never see half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, *extra_flags, str(source), "-o", tmp, "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library_path(compiler: str) -> Path:
    """Where the build for this source, compiler, flags and CPU lives (built there when missing)."""
    key = hashlib.sha256()
    key.update(source_digest().encode())
    key.update(" ".join([compiler, *FLAGS, platform.machine(), cpu_flags()]).encode())
    root = Path(os.environ.get("EXPERTMESH_CACHE", Path.home() / ".cache" / "expertmesh"))
    return root / "kernels" / key.hexdigest()[:16] / "libexpertmesh_cpu.so"


_c = ctypes.c_void_p
_i64 = ctypes.c_int64
_F32, _INT = ctypes.c_float, ctypes.c_int
# Argument types of each entry point (pointers are c_void_p); every one returns nothing.
SIGNATURES = {
    # q, k_cache, v_cache, tables, lens, out, B, H, Hk, D, Dv, W, block_size, scale, window, chunk,
    # sinks or NULL, threads
    "paged_decode": [_c] * 6 + [_i64] * 7 + [_F32, _i64, _i64, _c, _INT],
    # q, its token stride, k, v, their token stride, table or NULL, block_size, context, L, out,
    # H, Hk, D, scale, window, chunk, sinks or NULL, threads
    "paged_prefill": [_c, _i64, _c, _c, _i64, _c, _i64, _i64, _i64, _c, _i64, _i64, _i64]
    + [_F32, _i64, _i64, _c, _INT],
    # x, its batch and head strides, w, out, B, H, K, N, trans, threads
    "head_matmul": [_c, _i64, _i64, _c, _c] + [_i64] * 4 + [_INT, _INT],
    # x, panels, y, M, O, I, bias or NULL, threads
    "gemm": [_c] * 3 + [_i64] * 3 + [_c, _INT],
    # x, weight, out, rows, H, eps, threads
    "rms_norm": [_c] * 3 + [_i64] * 2 + [_F32, _INT],
    # q, k, v (each with its row stride), cos, sin, slots, k/v caches, q/k/v out, T, H, Hk, D, R,
    # interleaved, threads
    "rope_cache": [_c, _i64] * 3 + [_c] * 8 + [_i64] * 5 + [_INT, _INT],
    # x, n, H, slot, weights, k, w13, w2, E, I, act, out, threads
    "moe": [_c, _i64, _i64, _c, _c, _i64, _c, _c, _i64, _i64, _INT, _c, _INT],
    # moe's, then after act: its limit and alpha (act 3), the biases b13 [E, 2I], b2 [E, H] or NULL
    "moe_ex": [_c, _i64, _i64, _c, _c, _i64, _c, _c, _i64, _i64, _INT, _F32, _F32, _c, _c, _c, _INT],
    # quantized weights (layers/quantization/packed.py): kind, x, codes, scales, offsets, group,
    # y, M, O, I, bias or NULL, threads
    "gemm_q": [_INT, _c, _c, _c, _c, _i64, _c, _i64, _i64, _i64, _c, _INT],
    # kind, x, n, H, slot, weights, k, w13 codes/scales/offsets/group, w2 ditto, E, I, act, out, threads
    "moe_q": [_INT, _c, _i64, _i64, _c, _c, _i64] + [_c, _c, _c, _i64] * 2 + [_i64, _i64, _INT, _c, _INT],
    # moe_q's, then after act: its limit and alpha (act 3), the biases b13 [E, 2I], b2 [E, H] or NULL
    "moe_q_ex": [_INT, _c, _i64, _i64, _c, _c, _i64]
    + [_c, _c, _c, _i64] * 2
    + [_i64, _i64, _INT, _F32, _F32, _c, _c, _c, _INT],
    # loading: GGUF MXFP4 blocks, their row stride, O, G, lanes, codes out, scales out, threads
    "mxfp4_gguf_panels": [_c, _i64, _i64, _i64, _i64, _c, _c, _INT],
}
