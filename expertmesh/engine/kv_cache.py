"""KV-cache budget: how many blocks a rank gets, and the cache tensors themselves.

Each attention layer declares what it caches per token (layers/cache_spec.py: `KVCacheSpec`, one
of KV_CACHE_KINDS):
- "per_head": a K and a V row of `heads` x `width` (GQA/MHA layers: KV heads x head_dim);
- "latent": one row of `width` values shared by every query head (multi-head latent attention:
  the latent kv_lora_rank values and the rotary key, qk_rope_head_dim; layers/latent_attention.py);
- "index_key": one row of index_head_dim values, the lightning indexer's key (DeepSeek Sparse
  Attention, layers/sparse_indexer.py), a slot of its own beside the layer's latent rows;
- "shared_kv" / "compressed_kv": DeepSeek-V4's one K=V row, and on its compressed layers the
  compressor inputs and compressed entries beside it (layers/compressed_attention.py).
The kind decides the bytes per token (and so the block budget) and the layout allocated:
[planes, num_blocks + 1, block_size, heads, width] per layer, planes = K and V, or the latent.

The budget is `kv_cache_memory_bytes` when given. Otherwise, on CUDA, `gpu_memory_utilization`
of the device minus what is in use after loading; on CPU, 10% of the RAM available at start,
never more than `max_num_seqs` full-length sequences need.
"""

from __future__ import annotations

import logging
import os

import torch

from expertmesh import huge_pages
from expertmesh.layers.cache_spec import KV_CACHE_KINDS, CacheKind, KVCacheSpec, element_size  # noqa: F401

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


def bytes_per_token(specs: list[KVCacheSpec], dtype: torch.dtype) -> int:
    """Cache bytes one token takes over all of a rank's layers."""
    return sum(s.values_per_token for s in specs) * element_size(dtype)


def bytes_per_block(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    return block_size * bytes_per_token(specs, dtype)


def describe(specs: list[KVCacheSpec], dtype: torch.dtype) -> str:
    """The start-up line: bytes per token, by kind, and what per-head K/V would need instead."""
    size = element_size(dtype)
    parts = []
    for kind in sorted({s.kind for s in specs}):
        mine = [s for s in specs if s.kind == kind]
        s0 = mine[0]
        # layers of one kind may differ in width (DeepSeek-V4's compressed layers): each width
        widths = " / ".join(str(w) for w in dict.fromkeys(s.width for s in mine))
        shape = f"{s0.planes} x {s0.heads} x {widths}" if s0.planes > 1 else widths
        part = f"{kind} ({len(mine)} layers, {shape} values a layer)"
        if kind != "per_head" and s0.expanded:
            per_head = sum(s.expanded for s in mine) * size
            part += f"; per-head K/V would need {per_head} bytes ({s0.expanded} values a layer)"
        parts.append(part)
    return f"KV cache: {bytes_per_token(specs, dtype)} bytes per token ({dtype}): " + "; ".join(parts)


def kv_budget_bytes(explicit: int | None, device: str, utilization: float, useful: int) -> int:
    if explicit is not None:
        return explicit
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        return max(0, int(total * utilization) - (total - free))
    return min(int(available_ram_bytes() * CPU_RAM_FRACTION), useful)


def allocate(
    specs: list[KVCacheSpec], num_blocks: int, block_size: int, dtype, device: str
) -> list[torch.Tensor]:
    """One [planes, num_blocks + 1, block_size, heads, width] tensor per layer (views of one
    allocation per distinct spec). The extra last block is a scratch slot that dummy forwards write
    to, so they never touch a real sequence's cache."""
    out: list[torch.Tensor | None] = [None] * len(specs)
    for spec in dict.fromkeys(specs):
        layers = [i for i, s in enumerate(specs) if s == spec]
        shape = spec.layer_shape(num_blocks + 1, block_size)
        size = (len(layers), *shape)
        # On huge pages on the CPU: decode attention reads each sequence's blocks, scattered. Touched
        # now, as torch.zeros would: a huge page first written by a decode step is zeroed (2 MiB)
        # inside that step, a visible share of a float32 batch-32 step when blocks are handed out in
        # scattered order (docs/benchmarks.md, "Dispatch figures").
        if device == "cpu":
            whole = huge_pages.empty(size, dtype).zero_()  # zeroed once, huge pages or not
        else:
            whole = torch.zeros(size, dtype=dtype, device=device)
        for j, i in enumerate(layers):
            out[i] = whole[j]
    return out
