"""A bf16 model's int4, int8, fp4 and fp8 products on bf16 pairs (cpu/csrc/quant_bf16.c, code kinds 6-9).

The inputs are rounded to bf16 (a bf16 model's are already), each pair of uint4 / int8 / fp4 / fp8 codes
(e4m3 codes drawn from every byte but NaN's, so subnormals and both zeros occur) times a
pair of inputs is one vdpbf16ps lane (exact products, float32 sums), and a group's scale and offset fold
in once: y = bias + sum over groups of s * sum(code * x) + m * sum(x). Every row count (the pair
tiles from 2 rows, up to 8 rows a tile; fp8 from 64 rows: each group's panels decoded once, then
8 x 3 tiles; 1 row: the weight kind's one-row kernels on the rounded inputs)
against float64 on the dequantized weight; rows do not depend on the batch from 2 rows (so the
64-row path equals the tiles bit for bit); groups and rows of odd length (a pair with a zero second
input); the routed experts with 0-70 rows each, the
activated intermediate rounded to bf16 as torch's bf16 experts round theirs; and a build without the
pair tiles (kinds 6-9 there: kinds 1 / 0 / 3 / 2 on the rounded inputs).
"""

from __future__ import annotations

import pytest
import torch
from expect import no_kernels
from test_quant_wide_tiles import _weight as wide_tiles_weight

from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.ops import ops_for
from expertmesh.cpu.quantized import QuantizedMoE, product_kind
from expertmesh.layers.quantization.codes import FP4_BF16, FP8_BF16, INT4_BF16, INT8_BF16, KINDS
from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight

ROWS = [0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 24, 33, 49, 64, 83]


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels.load()
    if k is None:
        no_kernels()
    if not k.quant_bf16_pairs:
        pytest.skip(
            "no AVX512-BF16 / VBMI here: kinds 6-9 run as 1 / 0 / 3 / 2 (test_without_the_pair_tiles)"
        )
    return k


def test_the_kind_follows_the_activations(kernels):
    assert product_kind("int4", torch.bfloat16, kernels) == INT4_BF16
    assert product_kind("int4", torch.float32, kernels) == KINDS["int4"]
    assert product_kind("int8", torch.bfloat16, kernels) == INT8_BF16
    assert product_kind("int8", torch.float32, kernels) == KINDS["int8"]
    assert product_kind("fp4", torch.bfloat16, kernels) == FP4_BF16
    assert product_kind("fp8", torch.bfloat16, kernels) == FP8_BF16
    assert product_kind("fp8", torch.float32, kernels) == KINDS["fp8"]
    for kind in ("w8a8", "w4a8"):  # their own kernels whatever the activations
        assert product_kind(kind, torch.bfloat16, kernels) == KINDS[kind]
    assert product_kind("int4", torch.bfloat16, None) == KINDS["int4"]  # the torch fallback
    assert kernels.quant_kinds[INT4_BF16 : FP8_BF16 + 1] == ("int4-bf16", "int8-bf16", "fp4-bf16", "fp8-bf16")


KINDS_ON_PAIRS = ["int4", "int8", "fp4", "fp8"]


@pytest.mark.parametrize("kind", KINDS_ON_PAIRS)
@pytest.mark.parametrize(
    "out_f,in_f,group",
    [
        (203, 200, 32),  # 13 panels a span ... a 2-panel tail, a partial last panel and group
        (203, 200, 128),
        (96, 200, 0),  # one group a row (per-channel)
        (40, 71, 71),  # odd rows: the last pair has no second input
        (40, 66, 33),  # odd groups: each group's last pair alone
    ],
)  # (fp4: MXFP4's groups of 32 whatever the group)
def test_every_row_count_matches_and_rows_do_not_depend_on_the_batch(kernels, kind, out_f, in_f, group):
    g = torch.Generator().manual_seed(7)
    w = _weight(kind, out_f, in_f, group, kernels, g)
    dense = w.dequantize().double()
    b = torch.randn(out_f, generator=g)
    x_all = torch.randn(max(ROWS), in_f, generator=g).bfloat16()
    y_all = w(x_all, b, out_dtype=torch.float32)
    for m in ROWS:
        got = w(x_all[:m], b, out_dtype=torch.float32)
        want = (x_all[:m].double() @ dense.T + b.double()).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if m >= 2:
            assert torch.equal(got, y_all[:m]), m


def test_every_e4m3_code_decodes_exactly(kernels):
    """Output o holds the o-th non-NaN e4m3 byte at every input (scale 1): each output is its value
    times the row's input sum, to float32 rounding of its own size, so a subnormal read as zero (the
    bf16 denormals vdpbf16ps flushes) or any code one mantissa step off fails, however small."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)

    def e4m3(c: int) -> float:
        e, m = c >> 3 & 15, c & 7
        v = m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        return -v if c & 0x80 else v

    values = torch.tensor([e4m3(c) for c in codes.tolist()], dtype=torch.float64)
    assert torch.equal(values, codes.view(torch.float8_e4m3fn).double())  # torch agrees
    in_f = 64
    rows = codes[:, None].expand(-1, in_f).contiguous()
    w = QuantizedWeight.from_rows(
        rows, torch.ones(254, 1), torch.zeros(254, 1), "fp8", in_f, ops_for(kernels)
    )
    x = (
        torch.rand(9, in_f, generator=torch.Generator().manual_seed(1)).bfloat16() + 0.5
    )  # sums ~ 64, no cancellation
    for m in (1, 2, 8, 9):
        got = w(x[:m], None, out_dtype=torch.float32).double()
        want = x[:m].double().sum(1, keepdim=True) * values
        assert ((got - want).abs() <= 1e-6 * want.abs()).all(), m


CODES = [("int4", INT4_BF16), ("int8", INT8_BF16), ("fp4", FP4_BF16), ("fp8", FP8_BF16)]


@pytest.mark.parametrize("kind,code", CODES)
def test_float32_inputs_are_rounded_to_bf16(kernels, kind, code):
    """Kinds 6-8 given float32 inputs (gemm_q directly) compute with them rounded to bf16 values."""
    g = torch.Generator().manual_seed(3)
    w = _weight(kind, 64, 96, 32, kernels, g)
    x = torch.randn(5, 96, generator=g)
    y = torch.empty(5, 64)
    kernels.lib.gemm_q(
        code, x.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), 32,
        y.data_ptr(), 5, 64, 96, None, 1,
    )  # fmt: skip
    rounded = x.bfloat16().double() @ w.dequantize().double().T
    torch.testing.assert_close(y, rounded.float(), rtol=1e-5, atol=1e-5)
    assert (y.double() - x.double() @ w.dequantize().double().T).abs().max() > 1e-4  # it did round


def _weight(kind: str, out_f: int, in_f: int, group: int, kernels, g) -> QuantizedWeight:
    """test_quant_wide_tiles' weights scaled as a model's (outputs of order 1; fp4 as MXFP4 holds
    it, scales 2^-7 .. 2^-4 per 32 inputs); fp8: e4m3 codes drawn from every byte but the NaNs (a
    sixteenth subnormal, where rounding a model's weights makes few), scales of block-scaled FP8."""
    if kind != "fp8":
        return wide_tiles_weight(kind, group, out_f, in_f, kernels, g, in_f**-0.5, fp4_exponents=(-7, -3))
    n = -(-in_f // (group or in_f))
    codes = torch.randint(0, 254, (out_f, in_f), dtype=torch.uint8, generator=g)
    codes += (codes >= 0x7F).to(torch.uint8)  # 0..253 onto every byte but 0x7f / 0xff (NaN)
    scales = torch.rand(out_f, n, generator=g) * 2e-3 / in_f**0.5  # |value| up to 448
    return QuantizedWeight.from_rows(
        codes, scales, torch.zeros(out_f, n), kind, group or in_f, ops_for(kernels)
    )


def _moe_reference_bf16(x, slot, weights, w13, w2, inter):
    """moe_reference with the intermediate rounded to bf16 before the down projection."""
    ref = torch.zeros(x.shape[0], w2[0].out_features, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(slot.shape[1]):
            s = int(slot[t, j])
            h = x[t].double() @ w13[s].dequantize().double().T
            a = (torch.nn.functional.silu(h[:inter].float()) * h[inter:].float()).bfloat16().double()
            ref[t] += weights[t, j].double() * (a @ w2[s].dequantize().double().T)
    return ref.float()


@pytest.mark.parametrize("kind", KINDS_ON_PAIRS)
@pytest.mark.parametrize(
    "k,counts",
    [(2, [0, 1, 2, 3, 5, 8, 12, 14, 23]), (1, [4, 0, 7, 70, 1, 9, 0, 11, 2])],
)
def test_routed_experts_every_row_count_per_expert(kernels, kind, k, counts):
    """Experts receiving 0-50 rows each, hidden 100 and inter 52 (w13: a span and a tail of 5 panels),
    groups of 32 and 16; bf16 tokens, the intermediate rounded to bf16."""
    g = torch.Generator().manual_seed(5)
    e, hidden, inter = len(counts), 100, 52
    w13 = [_weight(kind, 2 * inter, hidden, 32, kernels, g) for _ in range(e)]
    w2 = [_weight(kind, hidden, inter, 16, kernels, g) for _ in range(e)]
    slots = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    n = len(slots) // k
    slot = slots.view(k, n).t()[torch.randperm(n, generator=g)].to(torch.int32).contiguous()
    x, weights = torch.randn(n, hidden, generator=g).bfloat16(), torch.rand(n, k, generator=g)
    out = QuantizedMoE(kernels).moe(
        x, slot, weights, QuantizedExperts.stack(w13), QuantizedExperts.stack(w2), inter, "silu"
    )
    ref = _moe_reference_bf16(x, slot, weights, w13, w2, inter)
    # the intermediate's rounding sits where float32 sums of different order can round it either
    # way: a few values one bf16 step apart, so a bf16 step's scale on the outputs
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    assert (out - ref).abs().mean() < 1e-4


@pytest.mark.parametrize("kind,code", CODES)
def test_without_the_pair_tiles(generic_kernels, monkeypatch, kind, code):
    """A build without them (here -mno-avx512f) reports none, and kinds 6-9 there are kinds 1 / 0 / 3 /
    2 on the inputs rounded to bf16: in gemm_q bit for bit, in moe_q the intermediate rounded too."""
    k = generic_kernels
    assert not k.quant_bf16_pairs and product_kind(kind, torch.bfloat16, k) == KINDS[kind]
    g = torch.Generator().manual_seed(9)
    w = _weight(kind, 64, 96, 32, k, g)
    for m in (1, 2, 9):
        x = torch.randn(m, 96, generator=g)
        y6, y1 = torch.empty(m, 64), torch.empty(m, 64)
        for c, y, xin in ((code, y6, x), (KINDS[kind], y1, x.bfloat16().float())):
            k.lib.gemm_q(
                c, xin.data_ptr(), w.codes.data_ptr(), w.scales.data_ptr(), w.offsets.data_ptr(), 32,
                y.data_ptr(), m, 64, 96, None, 1,
            )  # fmt: skip
        assert torch.equal(y6, y1), m
    monkeypatch.setattr(k, "quant_bf16_pairs", True)  # so QuantizedMoE sends kind 6-9 to this build
    e, hidden, inter = 3, 48, 40
    w13 = [_weight(kind, 2 * inter, hidden, 16, k, g) for _ in range(e)]
    w2 = [_weight(kind, hidden, inter, 8, k, g) for _ in range(e)]
    slot = torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1], [2, 1]], dtype=torch.int32)
    x, weights = torch.randn(5, hidden, generator=g).bfloat16(), torch.rand(5, 2, generator=g)
    out = QuantizedMoE(k).moe(
        x, slot, weights, QuantizedExperts.stack(w13), QuantizedExperts.stack(w2), inter, "silu"
    )
    torch.testing.assert_close(
        out, _moe_reference_bf16(x, slot, weights, w13, w2, inter), rtol=2e-3, atol=2e-3
    )


@pytest.mark.parametrize(
    "act,limit,alpha,biased", [("silu", 0.0, 0.0, False), ("swiglu_clamped", 7.0, 1.702, True)]
)
def test_fp8_experts_with_many_rows_fuse_w13_and_the_activation(kernels, act, limit, alpha, biased):
    """fp8 experts of 64 rows and more with gate and up in whole panels (inter 80: a triple and two
    panels of gate) run w13 and the activation in one pass (qb_many_gated): the same outputs, bit for
    bit, as the two passes (w13 into a float32 intermediate, then the activation) it replaces; close
    to float64; with the clamped SwiGLU's biases and limits too."""
    g = torch.Generator().manual_seed(11)
    counts, hidden, inter = [70, 0, 3, 130, 64, 9], 200, 80
    e = len(counts)
    w13 = [_weight("fp8", 2 * inter, hidden, 128, kernels, g) for _ in range(e)]
    w2 = [_weight("fp8", hidden, inter, 16, kernels, g) for _ in range(e)]
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.1).contiguous() if biased else None
    b2 = (torch.randn(e, hidden, generator=g) * 0.1).contiguous() if biased else None
    moe = QuantizedMoE(kernels, b13, b2, limit, alpha)
    slots = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    n = len(slots) // 2
    slot = slots.view(2, n).t()[torch.randperm(n, generator=g)].to(torch.int32).contiguous()
    x, weights = torch.randn(n, hidden, generator=g).bfloat16(), torch.rand(n, 2, generator=g)
    stacked = QuantizedExperts.stack(w13), QuantizedExperts.stack(w2)
    out = moe.moe(x, slot, weights, *stacked, inter, act)
    try:
        kernels.lib.q_set_gated_fusion(0)
        passes = moe.moe(x, slot, weights, *stacked, inter, act)
    finally:
        kernels.lib.q_set_gated_fusion(1)
    assert torch.equal(out, passes)
    if not biased:
        ref = _moe_reference_bf16(x, slot, weights, w13, w2, inter)
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
