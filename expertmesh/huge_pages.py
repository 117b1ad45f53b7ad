"""Large CPU weights on transparent huge pages (2 MiB), where the OS offers them.

A decode step streams every weight it uses from memory, in products of 0.5-20 MB. On 4 KiB pages
each page costs a TLB miss and a page walk (two levels of them in a VM); a C probe streaming a
batch-1 step's products read them faster from huge pages (docs/benchmarks.md, "Dispatch figures"; the
whole engine gains less, a step being not all streaming). Linux's default THP mode,
"madvise", gives them only to memory that asks, so the big weights are allocated here: an
anonymous mapping advised MADV_HUGEPAGE before its first touch, whose page faults then map whole
2 MiB pages (no copy, no later collapse).

Only the whole 2 MiB pages inside a tensor are advised, so a tensor never holds more resident
memory than its bytes; smaller tensors, other devices and systems without THP take torch.empty.
"""

from __future__ import annotations

import mmap

import torch

HUGE_PAGE = 2 << 20
# Below this a tensor has at most one whole huge page inside it: not worth a mapping of its own.
MIN_BYTES = 2 * HUGE_PAGE
ENABLED = hasattr(mmap, "MADV_HUGEPAGE")  # Linux; benchmarks switch it off for A/B runs


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the current default device; big CPU tensors on huge pages."""
    huge = _on_huge_pages(torch.Size(shape), dtype)
    return torch.empty(shape, dtype=dtype) if huge is None else huge


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) likewise (a fresh anonymous mapping reads as zeros)."""
    huge = _on_huge_pages(torch.Size(shape), dtype)
    return torch.zeros(shape, dtype=dtype) if huge is None else huge


def _on_huge_pages(size: torch.Size, dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = size.numel() * dtype.itemsize
    if not ENABLED or nbytes < MIN_BYTES or torch.empty(0).device.type != "cpu":
        return None
    # One huge page of slack, so the tensor can start on a 2 MiB boundary wherever the map lands.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while any view lives
    offset = -base.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel without THP: plain pages
        pass
    return base[offset : offset + nbytes].view(dtype).view(size)


def adopt(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy of it on huge pages where empty() would place one (weights built
    by torch ops, such as quantized codes laid out in panels)."""
    huge = _on_huge_pages(t.shape, t.dtype) if t.device.type == "cpu" else None
    return t if huge is None else huge.copy_(t)
