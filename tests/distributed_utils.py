"""Run a function on N gloo ranks in fresh processes, and never hang doing it.

``fn`` must be importable by name (defined at module level) and its return value picklable.
The first rank that raises fails the run with that rank's traceback; the others are killed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, out: Any, gloo_timeout: float
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)  # N ranks share two cores
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=gloo_timeout)
        )
        result = fn(rank, world_size, *args)
        dist.barrier()  # no rank leaves while a peer may still be receiving from it
        # Plain pickle: torch's queue reducer would pass tensors through shared memory that
        # dies with this process.
        out.put((rank, True, pickle.dumps(result)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(procs: list[Any], graceful: bool) -> None:
    if graceful:  # every rank has reported; give them a moment to exit on their own
        for p in procs:
            p.join(timeout=2)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _context() -> Any:
    """Fresh processes, started cheaply.

    Each spawned rank would import torch again (seconds on a loaded two-core machine); a
    forkserver imports it once per test session and forks clean ranks from that process, not
    from pytest.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "expertmesh.distributed"])
    return ctx


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 45.0, gloo_timeout: float = 30.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, args, results, gloo_timeout),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    ok = False
    try:
        while len(done) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout} s")
            try:
                rank, success, payload = results.get(timeout=min(0.2, left))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} died with exit code {dead[0][1]}") from None
                continue
            if not success:
                raise RuntimeError(f"rank {rank} of {world_size} raised:\n{payload}")
            done[rank] = pickle.loads(payload)
        ok = True
    finally:
        _stop(procs, graceful=ok)
    return [done[r] for r in range(world_size)]
