"""Big CPU weights and the KV cache on transparent huge pages (expertmesh/huge_pages.py)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from expertmesh import huge_pages
from expertmesh.cpu.expert_forms import PanelStacks

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_offered = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="the kernel offers no transparent huge pages",
)


def mapping_kb(ptr: int) -> dict[str, int]:
    """The smaps fields (kB) of the mapping that holds address `ptr`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
        elif inside and head == "THPeligible:":
            fields["THPeligible"] = int(line.split()[1])
    return fields


def mapping_flags(ptr: int) -> list[str]:
    """The VmFlags of the mapping that holds `ptr` ("hg": advised MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_small_tensors_and_other_devices_take_torch():
    small = huge_pages.empty((512, 512), torch.float32)  # 1 MiB: below MIN_BYTES
    assert small.shape == (512, 512) and small.dtype == torch.float32
    assert huge_pages.zeros((8, 8), torch.bfloat16).eq(0).all()
    with torch.device("meta"):
        assert huge_pages.empty((4096, 4096), torch.float32).device.type == "meta"


def test_values_views_and_release():
    t = huge_pages.zeros((3, 1024, 1024), torch.bfloat16)  # 6 MiB
    assert t.is_contiguous() and t.eq(0).all()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t[1].fill_(1.5)
    assert t.view(3, -1).float().sum(1).tolist() == [0.0, 1.5 * 2**20, 0.0]
    copy = huge_pages.adopt(torch.arange(2**21, dtype=torch.float32).view(-1, 64))
    assert copy.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert torch.equal(copy, torch.arange(2**21, dtype=torch.float32).view(-1, 64))
    ptr = t.data_ptr()
    view = t[2]
    del t
    gc.collect()
    view.fill_(2.0)  # the mapping lives while a view does
    assert mapping_kb(ptr)
    del view
    gc.collect()
    assert not mapping_kb(ptr)  # unmapped with its last view


@thp_offered
def test_big_tensors_land_on_huge_pages_and_hold_only_their_bytes():
    t = huge_pages.empty((5 << 20,), torch.uint8)  # 5 MiB: two whole huge pages and a tail
    t.fill_(7)
    kb = mapping_kb(t.data_ptr())
    # What the code decides, exactly: the two whole pages are advised MADV_HUGEPAGE (the advice
    # splits them into their own 4 MiB mapping), eligible, on a 2 MiB boundary.
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert "hg" in mapping_flags(t.data_ptr()) and kb["Size"] == 4096, kb
    assert kb.get("THPeligible", 1) == 1, kb
    # What the kernel then maps is its choice (a page may fall back to 4 KiB ones when memory is
    # fragmented), so only whole huge pages, and at least one where the kernel compacts on a fault
    # in an advised region (defrag "madvise", "defer+madvise" or "always").
    assert kb["AnonHugePages"] in (0, 2048, 4096), kb
    defrag = Path("/sys/kernel/mm/transparent_hugepage/defrag")
    if defrag.exists() and any(
        f"[{m}]" in defrag.read_text() for m in ("always", "madvise", "defer+madvise")
    ):
        assert kb["AnonHugePages"] >= 2048, kb
    # The 1 MiB tail is not advised. (Its mapping may merge with a neighbouring one, so only its
    # flags are read, and only the advised part's RSS.)
    assert "hg" not in mapping_flags(t.data_ptr() + (4 << 20))
    assert kb["Rss"] <= 4096, kb


@thp_offered
def test_a_built_model_holds_its_experts_and_kv_cache_on_huge_pages(checkpoint):
    from expertmesh import LLM, SamplingParams

    # 8 experts of [2 x 2048, 128] float32: 16 MiB of gate / up panels in one stack
    path = checkpoint("mixtral", hidden_size=128, intermediate_size=2048, num_hidden_layers=1)
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    runner = llm.llm_engine.runner
    forms = [getattr(m, "experts_form", None) for m in runner.model.modules()]
    experts = next(f for f in forms if isinstance(f, PanelStacks))
    assert mapping_kb(experts.w13.data_ptr())["AnonHugePages"] >= 8 << 10
    out = llm.generate(
        [{"prompt_token_ids": list(range(1, 40))}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert len(out[0].outputs[0].token_ids) == 4
    assert mapping_kb(runner.kv[0].data_ptr())["AnonHugePages"] >= 2 << 10  # the blocks it wrote
