"""Run a function on N gloo ranks in fresh processes, and never hang doing it.

``fn`` must be importable by name (defined at module level) and its return value picklable.
The first rank that raises fails the run with that rank's traceback; the others are killed.
The harness is the package's own (expertmesh.executor.spawn, which `expertmesh verify` uses);
tests keep shorter default timeouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from expertmesh.executor.spawn import free_port, run_spmd

__all__ = ["free_port", "run_distributed"]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 45.0, gloo_timeout: float = 30.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    return run_spmd(fn, world_size, *args, timeout=timeout, gloo_timeout=gloo_timeout)
