"""Process setup: one process, or one engine per torchrun process (external_launcher).

Decides where this process sits in the layout from torchrun's environment (the only place
the environment is read), checks WORLD_SIZE before any collective, initialises
torch.distributed and every group, starts the watchdog (distributed/watchdog.py), and checks
that all ranks were given the same config, and the ranks of one replica the same inputs.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from expertmesh.config import ParallelConfig
from expertmesh.distributed import watchdog
from expertmesh.distributed.layout import check_world_size
from expertmesh.distributed.parallel_groups import ParallelGroups, init_groups

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


def check_model_fits(mc: Any, pc: ParallelConfig) -> None:
    """The model's head counts against tensor_parallel_size, with each number under its own name,
    before any process group is made or weight read. (A vocabulary TP does not divide is padded:
    layers/embedding.py.)"""
    tp = pc.tensor_parallel_size
    valid = [t for t in range(1, mc.num_heads + 1) if _tp_fits(mc, t)]
    hint = f"; tensor_parallel_size values that fit this model: {valid}"
    if mc.num_heads % tp:
        raise ValueError(
            f"num_attention_heads={mc.num_heads} is not divisible by tensor_parallel_size={tp}{hint}"
        )
    if mc.num_kv_heads % tp and tp % mc.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} neither divides num_key_value_heads={mc.num_kv_heads} nor is a "
            f"multiple of it (then each KV head is replicated over tensor_parallel_size / "
            f"num_key_value_heads ranks){hint}"
        )


def _tp_fits(mc: Any, tp: int) -> bool:
    kv_ok = mc.num_kv_heads % tp == 0 or tp % mc.num_kv_heads == 0
    return mc.num_heads % tp == 0 and kv_ok


def collective_timeout(watchdog_s: float) -> timedelta:
    """Process-group timeouts: a backstop well above the watchdog's, so the watchdog names the rank."""
    return timedelta(seconds=2 * watchdog_s + 10)


def default_device(local_rank: int) -> str:
    """One CUDA device a process (vLLM's rule) when this node sees any, else the CPU."""
    if not torch.cuda.is_available():
        return "cpu"
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} needs its own CUDA device but this node sees {count} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); launch at most "
            f"{count} processes a node, or pass device='cpu' (--device cpu) to run on the CPU cores"
        )
    return f"cuda:{local_rank}"


def place_process(
    pc: ParallelConfig, device: str | None, timeout_s: float = watchdog.DEFAULT_TIMEOUT_S
) -> Placement:
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
        return Placement(0, 0, device or default_device(0), ParallelGroups.single(layout))
    if env is None:
        raise ValueError(
            "distributed_executor_backend='external_launcher' needs torchrun's environment "
            f"(RANK, WORLD_SIZE, ...), which is not set; launch with: {torchrun_hint(pc)}"
        )
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    check_world_size(layout, world)  # before any collective
    local_rank = int(env["LOCAL_RANK"] or 0)
    if device is None:
        device = default_device(local_rank)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    timeout = collective_timeout(timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    if world > 1:
        _start_watchdog(env, rank, world, timeout_s)
    groups = init_groups(layout, rank, world, backend, timeout=timeout)
    return Placement(rank, local_rank, device, groups)


def _start_watchdog(env: dict[str, str], rank: int, world: int, timeout_s: float) -> None:
    """This process's watchdog, on its own connection to the rendezvous store."""
    current = watchdog.current()
    if current is not None and (current.rank, current.world_size) == (rank, world):
        current.timeout = float(timeout_s)  # a second engine in this process: same run, same store
        return
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    # A torchrun restart reuses the store: its records must not be read as this attempt's.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    watchdog.install(watchdog.Watchdog(dist.PrefixStore(f"attempt{attempt}/", store), rank, world, timeout_s))


def check_same_config(groups: ParallelGroups, settings: dict[str, str]) -> None:
    """Fail at start-up, naming the rank and the setting, when ranks were given different configs."""
    if groups.world.world_size == 1:
        return
    digest = hashlib.sha256(repr(sorted(settings.items())).encode()).hexdigest()[:16]
    digests = groups.world.all_gather_object(digest)
    if all(d == digests[0] for d in digests):
        return
    every = groups.world.all_gather_object(settings)  # every rank saw the mismatch: all take part
    lines = []
    for rank, theirs in enumerate(every):
        differ = [k for k in sorted(set(every[0]) | set(theirs)) if every[0].get(k) != theirs.get(k)]
        if differ:
            shown = ", ".join(
                f"{k} (rank 0: {every[0].get(k)}, rank {rank}: {theirs.get(k)})" for k in differ[:3]
            )
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            lines.append(f"rank {rank} differs from rank 0 in {shown}{more}")
    raise ValueError(
        "ranks were started with different model/parallel configs: "
        + "; ".join(lines)
        + "; every rank must run the same script with the same arguments"
    )


def request_digest(ids: Sequence[int], error: str | None, params: Any) -> str:
    return hashlib.blake2b(repr((list(ids), error, params)).encode(), digest_size=8).hexdigest()


def check_same_inputs(groups: ParallelGroups, requests: Sequence[Any], params: Sequence[Any]) -> None:
    """Before any forward: the TP and PP ranks of one replica must hold the same prompts and
    sampling params (each rank runs its own scheduler; different inputs would mix up their
    collectives). A mismatch is an error on every rank, naming the ranks and the first prompt
    index that differs."""
    layout = groups.layout
    if layout.tp * layout.pp == 1:
        return  # one rank per replica: nothing to compare
    digests = [request_digest(r.prompt_token_ids, r.error, p) for r, p in zip(requests, params, strict=True)]
    mine = hashlib.blake2b("".join(digests).encode(), digest_size=8).hexdigest()
    dp = layout.coords(groups.global_rank)[0]
    every = groups.world.all_gather_object((dp, mine))
    if _replicas_agree(every):
        return
    lists = groups.world.all_gather_object(digests)  # every rank saw a mismatch: all take part
    raise ValueError(_input_mismatch(every, lists))


def _replicas_agree(every: list[tuple[int, str]]) -> bool:
    first: dict[int, str] = {}
    return all(first.setdefault(dp, digest) == digest for dp, digest in every)


def _input_mismatch(every: list[tuple[int, str]], lists: list[list[str]]) -> str:
    leaders: dict[int, int] = {}
    problems = []
    for rank, (dp, _) in enumerate(every):
        lead = leaders.setdefault(dp, rank)
        a, b = lists[lead], lists[rank]
        if a == b:
            continue
        # a and b may differ in length (one a prefix of the other): that case is the default below
        index = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        problems.append(
            f"rank {rank} differs from rank {lead} (DP replica {dp}) first at prompt index {index} "
            f"(they got {len(b)} and {len(a)} prompts)"
        )
    return (
        "the TP/PP ranks of a replica were given different inputs to generate: "
        + "; ".join(problems)
        + ". Under external_launcher every rank of one DP replica must pass the same prompts and "
        "sampling params in the same order (vLLM's rule); give each DP replica its own share instead"
    )
