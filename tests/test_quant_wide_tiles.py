"""Weight-only quantized products at a few to some tens of rows (cpu/csrc/quant.c `qwide_*`).

From 2 rows up to QW_ROWS - 1 (23) a span of panels is taken by the wide tiles: each weight vector
W = code * s + m is rebuilt once per tile (up to 12 rows x 1-4 panels, the rows read in
qw_interleave's order); from 24 rows the panel group is dequantized into a buffer and read by the
float32 tiles. Both compute every output as the same FMA chain (acc += W * x over the inputs in order,
then the bias), so a row's result must not depend on how many rows the call has (2 rows or 49), and
every result must match the dequantized weight's product. One row takes the one-row kernels (a group
folded in once: close, not bit-equal) except on a matrix's last panels.
"""

from __future__ import annotations

import pytest
import torch
from expect import no_kernels
from test_quantization import moe_reference

from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.quantized import QuantizedMoE
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight

# every tile height (1-12), uneven splits (13: 7 + 6; 23: 12 + 11), either side of QW_ROWS (24)
ROWS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 23, 24, 25, 49]


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    if k is None:
        no_kernels()
    return k


def _weight(
    kind: str, group: int, out_f: int, in_f: int, kernels, g, scale: float = 1.0, fp4_exponents=(-8, 4)
):
    if (
        kind == "fp4"
    ):  # MXFP4's layout: e2m1 codes, scales 2^k per 32 inputs (k in fp4_exponents), zero offsets
        n = -(-in_f // 32)
        codes = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g)
        scales = torch.exp2(torch.randint(*fp4_exponents, (out_f, n), generator=g).float())
        return QuantizedWeight.from_rows(codes, scales, torch.zeros(out_f, n), "fp4", 32, ops_for(kernels))
    return QuantizedWeight.quantize(
        torch.randn(out_f, in_f, generator=g) * scale, kind, group, ops_for(kernels)
    )


@pytest.mark.parametrize(
    "kind,group", [("int8", 128), ("int8", 0), ("int4", 32), ("int4", 128), ("fp8", 0), ("fp4", 32)]
)
def test_every_row_count_matches_and_rows_do_not_depend_on_the_batch(kernels, kind, group):
    """203 outputs (26 panels of 8: three spans of 8 and a 2-panel tail narrower than the 1-3 row
    tiles' 4, the last panel part padding), 200 inputs (a partial last group of 32 and of 128)."""
    g = torch.Generator().manual_seed(11)
    out_f, in_f = 203, 200
    w = _weight(kind, group, out_f, in_f, kernels, g)
    b = torch.randn(out_f, generator=g)
    dense = w.dequantize().double()
    x_all = torch.randn(max(ROWS), in_f, generator=g)
    y_all = w(x_all, b)  # 49 rows: the panel buffer
    for m in ROWS:
        x = x_all[:m]
        got = w(x, b)
        want = (x.double() @ dense.T + b.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        if m >= 2:
            assert torch.equal(got, y_all[:m]), (kind, group, m)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize(
    "k,counts",
    [(2, [0, 1, 2, 3, 5, 8, 12, 14, 23]), (1, [4, 0, 7, 50, 1, 9, 0, 11, 2])],
)
def test_routed_experts_every_row_count_per_expert(kernels, kind, k, counts):
    """Experts receiving 0-50 rows each (1: the one-row kernels; 50: the panel buffer), hidden 100
    and inter 52 (w13 104 outputs: 13 panels, a span and a tail of 5; w2 100), groups of 32 and of
    16, against each token's experts computed in float64 on the dequantized weights."""
    g = torch.Generator().manual_seed(5)
    e, hidden, inter = len(counts), 100, 52
    # weights scaled as a model's (outputs of order 1, so atol 1e-4 is float32 rounding's scale)
    w13 = [_weight(kind, 32, 2 * inter, hidden, kernels, g, hidden**-0.5) for _ in range(e)]
    w2 = [_weight(kind, 16, hidden, inter, kernels, g, inter**-0.5) for _ in range(e)]
    slots = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    n = len(slots) // k
    slot = slots.view(k, n).t()[torch.randperm(n, generator=g)].to(torch.int32).contiguous()
    assert all(len(set(row.tolist())) == k for row in slot)
    x, weights = torch.randn(n, hidden, generator=g), torch.rand(n, k, generator=g)
    out = QuantizedMoE(kernels).moe(
        x, slot, weights, QuantizedExperts.stack(w13), QuantizedExperts.stack(w2), inter, "silu"
    )
    torch.testing.assert_close(out, moe_reference(x, slot, weights, w13, w2, inter), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,group", [("w4a8", 128), ("w4a8", 16), ("w4a8", 0), ("w8a8", 32)])
def test_activation_quantized_tiles_every_row_count(kernels, kind, group):
    """W4A8 and W8A8 tiles (4 rows x NP panels) at every remainder and the activations' rounding
    (half to even, in vectors), 203 outputs (a panel group of one panel at the end), 200 inputs; a
    row of zeros (codes 0, no division by 0), against the exact integer arithmetic in float64."""
    from test_quantization_w8a8 import reference

    g = torch.Generator().manual_seed(13)
    w = QuantizedWeight.quantize(
        torch.randn(203, 200, generator=g) * 200**-0.5, kind, group, ops_for(kernels)
    )
    b = torch.randn(203, generator=g)
    x_all = torch.randn(19, 200, generator=g) * 3
    x_all[3] = 0
    y_all = w(x_all, b)
    for m in [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 19]:
        got = w(x_all[:m], b)
        torch.testing.assert_close(got, reference(x_all[:m], w, b), rtol=1e-5, atol=1e-4)
        if m >= 2:  # a row's exact integer sums do not depend on the tile that took it
            torch.testing.assert_close(got, y_all[:m], rtol=0, atol=0)
