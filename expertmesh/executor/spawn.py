"""Run one function on N fresh gloo ranks on this machine, and never hang doing it.

What `expertmesh verify --world N` (and the test suite) use to get a world without torchrun:
each rank is a fresh process with torchrun's variables set (RANK, WORLD_SIZE, MASTER_*), so the
code it runs is exactly what would run under torchrun. The first rank that raises or dies fails
the run with that rank's traceback or exit code; the others are stopped, never waited on.
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


class RankFailed(RuntimeError):
    """A rank raised, died, or did not finish in time (the message names it)."""


class RankTimeout(RankFailed, TimeoutError):
    """Some ranks did not finish within the run's timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, out: Any, gloo_s: float):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=gloo_s))
        result = fn(rank, world, *args)
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


def context() -> Any:
    """Fresh processes, started cheaply: a forkserver imports torch once and forks clean ranks
    from that process (not from the caller, whose threads and state must not leak in)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "expertmesh.distributed"])
    return ctx


def run_spmd(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600.0, gloo_timeout: float = 60.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank.

    ``fn`` must be importable by name (defined at module level) and its result picklable.
    """
    ctx = context()
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
                raise RankTimeout(f"ranks {missing} of {world_size} did not finish within {timeout} s")
            try:
                rank, success, payload = results.get(timeout=min(0.2, left))
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0][0]} died with exit code {dead[0][1]}") from None
                continue
            if not success:
                raise RankFailed(f"rank {rank} of {world_size} raised:\n{payload}")
            done[rank] = pickle.loads(payload)
        ok = True
    finally:
        _stop(procs, graceful=ok)
    return [done[r] for r in range(world_size)]
