"""What this CPU can do, read at run time: its feature flags and whether AMX tiles may be used.

AMX (Intel Sapphire Rapids and later: amx_tile, amx_bf16) multiplies bf16 tiles at several times
the rate of AVX-512 (the issue's figures: docs/benchmarks.md, "Dispatch figures"). Linux (5.16+)
hands the tile registers' state to a process only after it asks for it with
arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
oneDNN asks by itself, and asking again is harmless, so a "yes" here means the kernel agreed.
We do not write AMX code: where AMX is usable, large bf16 products go to oneDNN's matmul through
torch (cpu_kernels.CpuKernels.linear / moe), which uses it.
"""

from __future__ import annotations

import ctypes
import platform
from functools import cache

import torch

_SYS_ARCH_PRCTL = 158  # x86-64 syscall number
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@cache
def cpu_flags() -> frozenset[str]:
    """The `flags` (x86) or `Features` (ARM) of /proc/cpuinfo; empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def request_amx_permission() -> bool:
    """Ask Linux for the AMX tile-data state (needed once per process before any tile instruction)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


@cache
def amx_bf16() -> bool:
    """AMX bf16 tiles usable by this process: the CPU has them and the OS granted their state."""
    flags = cpu_flags()
    return {"amx_tile", "amx_bf16"} <= flags and request_amx_permission()


@cache
def onednn_bf16() -> bool:
    """Whether oneDNN has a bf16 matmul on this CPU (it refuses bf16 weights without avx512bw/vl/dq
    or avx_ne_convert, as on AVX2-only CPUs)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


# From this many rows on, a bf16 product goes to oneDNN where it uses AMX. Not measured on an AMX
# machine by this project yet: taken from the issue's figures (docs/benchmarks.md, "Dispatch
# figures"), leaving room for unpacking the weight per call (a copy of its bytes, small next to 128
# rows of products).
ONEDNN_BF16_MIN_ROWS = 128


def onednn_bf16_rows(amx: bool, onednn_has_bf16: bool) -> int | None:
    """The dispatch rule: from how many rows bf16 products (dense and per expert) go to oneDNN's
    matmul instead of our kernels; None: never (no AMX, or no oneDNN bf16 path)."""
    return ONEDNN_BF16_MIN_ROWS if amx and onednn_has_bf16 else None
