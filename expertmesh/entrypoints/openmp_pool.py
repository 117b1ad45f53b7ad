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

On a shared, oversubscribed machine `GOMP_SPINCOUNT` (a few thousand) or `OMP_WAIT_POLICY=PASSIVE`
protects served and offline runs alike: a worker spinning for a partner that is not scheduled
burns the time the partner needs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

OMP_PAUSE_HARD = 2  # omp_pause_resource_t: free the calling thread's pool (libgomp: its threads exit)


def loaded_libgomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's), or None (another OpenMP
    runtime, none yet, or no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, dev, inode, path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp") and ".so" in fields[5]:
            return fields[5]
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's libgomp worker pool (its workers exit; the next parallel region
    on this thread builds a new one). Must not be called inside a parallel region. True when a
    libgomp was found and agreed."""
    path = loaded_libgomp()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, no second runtime
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_HARD) == 0
