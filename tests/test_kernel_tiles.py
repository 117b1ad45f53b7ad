"""The panel GEMM's tile choices (cpu/csrc/gemm.c) at every row count they special-case.

A product is computed by a tile picked for its row count: few-row tiles as wide as the registers
allow (1-6 rows, span_*), MR x NP tiles beyond, and for bf16 weights from WIDEN_ROWS rows a panel
group widened once to float32. Every path must match torch, and a row's result must not depend on
the path: each output is the same chain of FMAs whatever tile computed it, so a row computed alone
equals the same row inside any batch bit for bit (native decode and the per-op path rely on it).
The routed experts pick tiles per expert, by the rows each receives (including none).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_kernels import _tolerance

from expertmesh.cpu.expert_forms import PanelStacks
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.fused_moe import FusedExperts

# 0-6: few-row tiles; 7, 13: MR x NP with remainders; 23 / 24 / 25: either side of WIDEN_ROWS.
ROW_COUNTS = [0, 1, 2, 3, 4, 5, 6, 7, 13, 23, 24, 25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_every_tile_matches_torch_and_single_rows(kernels, dtype):
    """203 outputs (26 panels of 8: two full spans of 12 panels and a partial one, the last panel
    partly padding), 37 inputs; with a bias."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(203, 37, generator=g).to(dtype)
    b = torch.randn(203, generator=g).to(dtype)
    packed = kernels.pack(w)
    for m in ROW_COUNTS:
        x = torch.randn(m, 37, generator=g).to(dtype)
        got = kernels.linear(x, packed, b)
        want = F.linear(x.float(), w.float(), b.float()).to(dtype)
        torch.testing.assert_close(got, want, **_tolerance(dtype))
        for r in range(m):
            assert torch.equal(got[r : r + 1], kernels.linear(x[r : r + 1], packed, b)), (m, r)


def _experts(dtype, hidden=100, inter=50, num_experts=9):
    torch.manual_seed(3)
    fe = FusedExperts(num_experts, list(range(num_experts)), hidden, inter, 0, 1, "silu", dtype)
    fe.w13.data.normal_(0, 0.3)
    fe.w2.data.normal_(0, 0.3)
    return fe


def _routing(counts, k, g):
    """Token ids for top-k routing where expert e receives exactly counts[e] (token, choice) pairs:
    the pairs sorted by expert, choice j of token t taking pair j * n + t (so a token's choices
    differ while no expert has more than n pairs), tokens then shuffled."""
    slots = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    n = len(slots) // k
    ids = slots.view(k, n).t()
    assert all(len(set(row.tolist())) == k for row in ids)
    return ids[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2])
def test_experts_every_row_count_per_expert(kernels, dtype, k):
    """Nine experts receive 0, 1, 2, 3, 4, 5, 6, 7 and 26 rows (26: MR x NP tiles and, for bf16,
    the widened panels); hidden 100 and 2 x 50 gate/up outputs (13 panels: one span and one panel
    more). Against the torch path, and each token alone against the same token in the batch (not
    bit for bit: the float32 experts were not row-independent before these tiles either)."""
    if not kernels.moe_supports(dtype, "silu"):
        pytest.skip(f"no fused {dtype} experts in this build")
    g = torch.Generator().manual_seed(k)
    counts = [0, 1, 2, 3, 4, 5, 6, 7, 26]
    ids = _routing(counts, k, g)
    n = ids.shape[0]
    torch_path, fused = _experts(dtype), _experts(dtype)
    fused.use_ops(ops_for(kernels))
    assert isinstance(fused.experts_form, PanelStacks)
    x = torch.randn(n, 100, generator=g).to(dtype)
    w = torch.rand(n, k, generator=g)
    got = fused(x, ids, w)
    if dtype == torch.float32:
        torch.testing.assert_close(got, torch_path(x, ids, w), atol=1e-5, rtol=1e-5)
    else:  # within bf16 rounding of float32 arithmetic on the same (bf16) weights
        exact = _experts(torch.float32)
        exact.w13.data.copy_(torch_path.w13.float())
        exact.w2.data.copy_(torch_path.w2.float())
        truth = exact(x.float(), ids, w)
        scale = truth.abs().max().item()
        assert (got - truth).abs().max().item() <= 2**-7 * scale + 1e-3
    for t in range(n):  # a token alone (one row for its expert: the one-row tiles) as in the batch
        torch.testing.assert_close(
            got[t : t + 1], fused(x[t : t + 1], ids[t : t + 1], w[t : t + 1]), atol=1e-5, rtol=1e-5
        )


def test_bf16_output_rounded_as_torch_rounds(kernels):
    """bf16 outputs are the float32 products rounded once to nearest even (as torch's .to rounds),
    NaN kept NaN, at every tile's row count; the float32-output call gives the same products."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(203, 37, generator=g).to(torch.bfloat16)
    packed = kernels.pack(w)
    for m in ROW_COUNTS:
        x = torch.randn(m, 37, generator=g).to(torch.bfloat16)
        if m:
            x[0, 0] = float("nan")  # row 0 all NaN: the NaN path of the rounding
            x[-1] *= 2.0**125  # large products: some overflow to infinity
        got = kernels.linear(x, packed)
        unrounded = kernels.linear(x, packed, out_dtype=torch.float32)
        assert torch.equal(got.isnan(), unrounded.isnan())
        assert torch.equal(got.nan_to_num(), unrounded.to(torch.bfloat16).nan_to_num()), m
