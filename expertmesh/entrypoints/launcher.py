"""Process setup: one process, or one engine per torchrun process (external_launcher).

Decides where this process sits in the layout from torchrun's environment (the only place
the environment is read), checks WORLD_SIZE before any collective, initialises
torch.distributed and every group, and checks that all ranks were given the same config.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from expertmesh.config import ParallelConfig
from expertmesh.distributed.group import ParallelGroups, init_groups
from expertmesh.distributed.layout import check_world_size

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Placement:
    rank: int
    local_rank: int
    device: str
    groups: ParallelGroups


def torchrun_env() -> dict[str, str] | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {k: os.environ.get(k, "") for k in TORCHRUN_VARS}


def torchrun_hint(pc: ParallelConfig) -> str:
    return (
        f"torchrun --nproc-per-node={pc.world_size} your_script.py  (with LLM(..., "
        f"tensor_parallel_size={pc.tensor_parallel_size}, data_parallel_size={pc.data_parallel_size}, "
        f"pipeline_parallel_size={pc.pipeline_parallel_size}, "
        "distributed_executor_backend='external_launcher'))"
    )


def place_process(pc: ParallelConfig, device: str | None, timeout_s: float = 300.0) -> Placement:
    layout = pc.layout
    env = torchrun_env()
    launched = pc.distributed_executor_backend == "external_launcher" or (
        env is not None and pc.world_size > 1
    )
    if not launched:
        if pc.world_size > 1:
            raise ValueError(
                f"{pc.world_size} ranks were asked for (DP={pc.data_parallel_size} x PP="
                f"{pc.pipeline_parallel_size} x TP={pc.tensor_parallel_size}) but nothing launched them; "
                f"run under torchrun: {torchrun_hint(pc)}"
            )
        return Placement(0, 0, device or "cpu", ParallelGroups.single(layout))
    if env is None:
        raise ValueError(
            "distributed_executor_backend='external_launcher' needs torchrun's environment "
            f"(RANK, WORLD_SIZE, ...), which is not set; launch with: {torchrun_hint(pc)}"
        )
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    check_world_size(layout, world)  # before any collective
    local_rank = int(env["LOCAL_RANK"] or 0)
    if device is None:
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    groups = init_groups(layout, rank, world, backend, timeout=timedelta(seconds=timeout_s))
    return Placement(rank, local_rank, device, groups)


def check_same_config(groups: ParallelGroups, description: str) -> None:
    """Fail at start-up, naming the rank, when ranks were given different configs."""
    if groups.world.world_size == 1:
        return
    digest = hashlib.sha256(description.encode()).hexdigest()[:16]
    digests = groups.world.all_gather_object(digest)
    bad = [r for r, d in enumerate(digests) if d != digests[0]]
    if bad:
        raise ValueError(
            f"ranks were started with different model/parallel configs: rank(s) {bad} differ from rank 0 "
            f"(config hashes {digests}); every rank must run the same script with the same arguments"
        )
