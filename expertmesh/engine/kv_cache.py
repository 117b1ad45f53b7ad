"""How many KV blocks a rank gets, and the cache tensors themselves.

The budget is `kv_cache_memory_bytes` when given. Otherwise, on CUDA, `gpu_memory_utilization`
of the device minus what is in use after loading; on CPU, 10% of the RAM available at start,
never more than `max_num_seqs` full-length sequences need.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("expertmesh")

CPU_RAM_FRACTION = 0.10


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def bytes_per_block(
    num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def kv_budget_bytes(explicit: int | None, device: str, utilization: float, useful: int) -> int:
    if explicit is not None:
        return explicit
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        return max(0, int(total * utilization) - (total - free))
    return min(int(available_ram_bytes() * CPU_RAM_FRACTION), useful)


def allocate(
    num_blocks: int, num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype, device: str
) -> torch.Tensor:
    """[2, layers, num_blocks + 1, block_size, kv_heads, head_dim]; the extra last block is a scratch
    slot that dummy forwards write to, so they never touch a real sequence's cache."""
    return torch.zeros(
        2, num_layers, num_blocks + 1, block_size, kv_heads, head_dim, dtype=dtype, device=device
    )
