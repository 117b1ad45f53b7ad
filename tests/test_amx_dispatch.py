"""AMX: run-time detection and the rule that sends many-row bf16 products to oneDNN's matmul.

This project's CI machine has no AMX (AMD Zen 3, AVX2), so the detection is faked here and the
oneDNN route runs torch's own bf16 matmul: what is checked is which path serves a product and that
its result equals the reference, not AMX itself (which was never run by this project)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from expertmesh.cpu import cpu_features, cpu_kernels, cpu_onednn
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.fused_moe import FusedExperts


@pytest.fixture(scope="module")
def native():
    k = cpu_kernels.load()
    assert k is not None, "the CPU kernels did not build"
    return k


@pytest.fixture
def amx_kernels(native):
    """The same library with the AMX dispatch switched on from 16 rows."""
    return cpu_kernels.CpuKernels(native.lib, native.path, onednn_bf16_rows=16)


def test_dispatch_rule():
    rows = cpu_features.ONEDNN_BF16_MIN_ROWS
    assert cpu_features.onednn_bf16_rows(amx=True, onednn_has_bf16=True) == rows
    assert cpu_features.onednn_bf16_rows(amx=True, onednn_has_bf16=False) is None
    assert cpu_features.onednn_bf16_rows(amx=False, onednn_has_bf16=True) is None


@pytest.mark.parametrize(
    "flags,granted,want",
    [
        ({"avx2", "amx_tile", "amx_bf16"}, True, True),
        ({"avx2", "amx_tile", "amx_bf16"}, False, False),
        ({"avx2", "fma"}, True, False),
        ({"amx_tile"}, True, False),
    ],
)
def test_amx_detection_faked(monkeypatch, flags, granted, want):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(cpu_features, "request_amx_permission", lambda: granted)
    cpu_features.amx_bf16.cache_clear()
    try:
        assert cpu_features.amx_bf16() is want
    finally:
        cpu_features.amx_bf16.cache_clear()


def test_amx_detection_on_this_machine(native):
    """Without AMX flags Linux refuses the tile-data request and nothing is routed to oneDNN."""
    flags = cpu_features.cpu_flags()
    if "amx_tile" in flags:
        pytest.skip("this CPU has AMX: the permission depends on the kernel version")
    assert not cpu_features.request_amx_permission()
    assert not cpu_features.amx_bf16()
    assert native.onednn_bf16_rows is None


@pytest.mark.parametrize(
    "dtype,pairs", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_unpack_inverts_pack(native, monkeypatch, dtype, pairs):
    """Both panel layouts (pairs is AVX512-BF16's; faked here, only packed and unpacked)."""
    monkeypatch.setattr(native, "bf16_pairs", pairs)
    for out_f, in_f in [(37, 24), (16, 7), (3, 1)]:
        w = torch.randn(out_f, in_f).to(dtype)
        packed = native.pack(w)
        assert packed.data.dim() == (4 if pairs else 3)
        assert torch.equal(cpu_onednn.unpack(packed.data, out_f, in_f), w)


def _counting(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_linear_sends_many_rows_to_onednn(amx_kernels, monkeypatch):
    calls = _counting(monkeypatch, cpu_kernels.F, "linear")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(37, 24, generator=g), torch.randn(37, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        packed = amx_kernels.pack(w.to(dtype))
        for rows in (0, 1, 15, 16, 40):
            x = torch.randn(rows, 24, generator=g).to(dtype)
            before = len(calls)
            got = amx_kernels.linear(x, packed, b.to(dtype))
            routed = len(calls) > before
            assert routed == (dtype == torch.bfloat16 and rows >= 16), (dtype, rows)
            want = F.linear(x.float(), w.to(dtype).float(), b.to(dtype).float()).to(dtype)
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
    x3 = torch.randn(4, 5, 24, generator=g).to(torch.bfloat16)  # 20 rows in a 3-D input
    assert amx_kernels.linear(x3, amx_kernels.pack(w.to(torch.bfloat16))).shape == (4, 5, 37)


@pytest.mark.parametrize("expert_ids", [[0, 1, 2, 3], [1, 3]])
def test_moe_sends_many_tokens_to_onednn(amx_kernels, monkeypatch, expert_ids):
    """Experts with 16 or more rows on average go through cpu_onednn.moe; fewer through the kernel.
    Both equal the torch path (uneven routing, experts held elsewhere)."""
    calls = _counting(monkeypatch, cpu_onednn, "moe")
    torch.manual_seed(0)
    ref = FusedExperts(4, expert_ids, 40, 24, 0, 1, "silu", torch.bfloat16)
    ref.w13.data.normal_(0, 0.3)
    ref.w2.data.normal_(0, 0.3)
    fused = FusedExperts(4, expert_ids, 40, 24, 0, 1, "silu", torch.bfloat16)
    fused.w13.data.copy_(ref.w13)
    fused.w2.data.copy_(ref.w2)
    fused.use_ops(ops_for(amx_kernels))
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 32, 70):
        x = torch.randn(n, 40, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, 4, (n, 2), generator=g)
        ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 4, ids[:, 1])
        ids[: n // 2, 0] = 2  # skew
        w = torch.rand(n, 2, generator=g)
        before = len(calls)
        got = fused(x, ids, w)
        assert (len(calls) > before) == (n * 2 // 4 >= 16), n
        torch.testing.assert_close(got.float(), ref(x, ids, w).float(), atol=4e-2, rtol=4e-2)


# Every build variant (AVX2 to AMX) is compiled with -Werror by test_kernel_builds.py.
