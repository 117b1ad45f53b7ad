"""Keep the server's compute thread the only OpenMP team owner, so it runs as fast as offline.

GNU OpenMP (libgomp, what torch's Linux wheels and our compiled kernels use) keeps one pool of
worker threads per thread that opened a parallel region. While it manages more threads than
there are CPUs, it "throttles": a waiting worker spins 100 times instead of 300,000 before it
sleeps in the kernel, so every parallel region of a step starts with a futex wake-up of each
worker. `expertmesh serve` loads and warms the model on the main thread (one pool), then steps
it on the engine thread (a second pool): on a 2-core machine that is more managed threads than
CPUs, and every served step ran throttled, slower than the same step offline (docs/server.md
has the measurement). Freeing the loading thread's pool before the engine thread starts
(`omp_pause_resource_all`, OpenMP 5.0) leaves one pool, as offline has.

On a shared, oversubscribed machine a worker spinning for a partner that is not scheduled burns
the time the partner needs (the whole process's share, under the kernel's per-session CPU
groups), and a served step collapsed there. `bound_waiting` (called by the `expertmesh` command
before torch loads libgomp, which reads its environment once) caps the spin at DEFAULT_WAIT, long
enough to bridge the gaps between a step's parallel regions, unless the user chose a wait policy
or spin count.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

WAIT_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # libgomp's: what the user may have chosen
DEFAULT_WAIT = {"GOMP_SPINCOUNT": "3000"}  # the `expertmesh` command's choice (docs/server.md)
OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the calling thread's pool (libgomp: its threads exit)
_bounded: dict[str, str] = {}  # what bound_waiting set in this process


def loaded_libgomps() -> list[str]:
    """The paths of every libgomp this process has loaded, in address order: torch's, and any a
    wheel bundles for itself (sentencepiece ships `sentencepiece.libs/libgomp-*.so`, loaded when a
    tokenizer imports it). [] with another OpenMP runtime, none yet, or no /proc."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    paths: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp") and ".so" in fields[5]:
            if fields[5] not in paths:
                paths.append(fields[5])
    return paths


def loaded_libgomp() -> str | None:
    """torch's libgomp (the one inside torch's package when there is one: a bundled copy of another
    wheel may be mapped first), else the first loaded, or None."""
    paths = loaded_libgomps()
    torch_dir = _torch_dir()
    ours = [p for p in paths if torch_dir is not None and p.startswith(torch_dir)]
    return (ours or paths or [None])[0]


def _torch_dir() -> str | None:
    torch = sys.modules.get("torch")
    path = getattr(torch, "__file__", None)
    return os.path.dirname(path) + os.sep if path else None


def release_thread_pool() -> bool:
    """Free the calling thread's worker pools (their workers exit; the next parallel region on this
    thread builds a new one), in every libgomp loaded: pausing only the first found missed torch's
    whenever sentencepiece's bundled copy was mapped before it. Must not be called inside a
    parallel region. True when torch's libgomp was found and agreed."""
    target, agreed = loaded_libgomp(), False
    for path in loaded_libgomps():
        try:
            lib = ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
            pause = lib.omp_pause_resource_all
        except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        ok = pause(OMP_PAUSE_HARD) == 0
        agreed = agreed or (ok and path == target)
    return agreed


def bound_waiting(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set DEFAULT_WAIT in `environ` unless it holds a WAIT_SETTINGS key or libgomp is already
    loaded (it read its environment then: too late). Returns what was set ({} when nothing)."""
    if any(key in environ for key in WAIT_SETTINGS) or loaded_libgomp() is not None:
        return {}
    environ.update(DEFAULT_WAIT)
    _bounded.update(DEFAULT_WAIT)
    return dict(DEFAULT_WAIT)


def describe_waiting() -> str:
    """One log line: how this process's OpenMP workers wait, and who chose it."""
    if _bounded:
        chosen = ", ".join(f"{k}={v}" for k, v in _bounded.items())
        own = " or ".join(WAIT_SETTINGS)
        why = f"expertmesh's default: waiting workers spin briefly, then sleep; {own} chooses"
        return f"OpenMP: {chosen} ({why})"
    chosen = ", ".join(f"{k}={os.environ[k]}" for k in WAIT_SETTINGS if k in os.environ)
    return f"OpenMP: {chosen or 'libgomp defaults (waiting workers spin)'}"
