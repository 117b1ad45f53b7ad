"""Partial sums across ranks: computed in float32, summed in float32, rounded once after the sum.

Unit level: the bf16 GEMM's float32 output, the experts' float32 partials, the group's
``reduce_dtype``, row-parallel linear and every all2all combine in bf16 on two gloo ranks, each
against one process. The model-level check at a real width is tests/test_bf16_layouts.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed_utils import run_distributed

from expertmesh.cpu import cpu_gemm, cpu_kernels
from expertmesh.cpu.ops import ops_for
from expertmesh.distributed.all2all import make_all2all
from expertmesh.distributed.group import Group
from expertmesh.distributed.moe_plan import expert_owners
from expertmesh.distributed.parallel_groups import ParallelGroups
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.linear import RowParallelLinear
from expertmesh.layers.linear_weight import DenseWeight

BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_float32_output(k: cpu_kernels.CpuKernels) -> None:
    g = _gen(0)
    for out_features, in_features in [(37, 24), (64, 33), (130, 200)]:
        w = torch.randn(out_features, in_features, generator=g).to(BF16)
        b = torch.randn(out_features, generator=g).to(BF16)
        packed = k.pack(w)
        for m in (0, 1, 3, 5, 9, 300):
            x = torch.randn(m, in_features, generator=g).to(BF16)
            y32 = k.linear(x, packed, b, out_dtype=torch.float32)
            assert y32.dtype == torch.float32 and y32.shape == (m, out_features)
            exact = F.linear(x.float(), w.float(), b.float())  # bf16 inputs are exact in float32
            torch.testing.assert_close(y32, exact, atol=1e-5, rtol=1e-5)  # float32 order only
            # The bf16 output is this one rounded: the same products, one rounding at the end.
            assert torch.equal(y32.to(BF16), k.linear(x, packed, b))


def test_bf16_gemm_float32_output(kernels):
    """gemm_bf16_f32 (widening) or gemm_bf16_pairs_f32 (AVX512-BF16), whichever pack chose."""
    _check_float32_output(kernels)
    with pytest.raises(ValueError, match="out_dtype"):
        kernels.linear(
            torch.randn(2, 24).to(BF16), kernels.pack(torch.randn(8, 24).to(BF16)), None, torch.half
        )


def test_bf16_gemm_float32_output_generic_build(generic_kernels):
    """The 8-lane build other CPUs take (-mno-avx512f) has the float32-output entry point too."""
    _check_float32_output(generic_kernels)


def test_float32_out_weights_never_go_to_onednn_bf16(kernels):
    """oneDNN's packed linear returns bf16 for bf16 input: a weight whose products are partial
    sums takes our kernel, or stays dense (F.linear on widened operands) without kernels."""
    w = torch.randn(16, 8).to(BF16)
    assert isinstance(cpu_gemm.pack(w, kernels, float32_out=True), cpu_kernels.PanelWeight)
    assert cpu_gemm.pack(w, None, float32_out=True) is None
    layer = RowParallelLinear(8, 16, True, Group((0,), 0), reduce=False, dtype=BF16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(16).to(BF16))
    x = torch.randn(5, 8).to(BF16)
    want = F.linear(x.float(), w.float(), layer.bias.float())
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)  # dense: float32, unrounded
    layer.use_ops(ops_for(kernels))
    assert not isinstance(layer.weight_form, DenseWeight) and layer(x).dtype == torch.float32
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


def _experts(ids: list[int], shard: tuple[int, int] = (0, 1)) -> FusedExperts:
    """6 experts of 40 (hidden 48), the same bf16 weights whatever slice a rank holds."""
    g = _gen(5)
    w13, w2 = torch.randn(6, 80, 48, generator=g) / 4, torch.randn(6, 48, 40, generator=g) / 4
    rank, size = shard
    fe = FusedExperts(6, ids, 48, 40, rank, size, "silu", BF16)
    inter = 40 // size
    for slot, e in enumerate(ids):
        gate, up = w13[e, :40], w13[e, 40:]
        rows = slice(rank * inter, (rank + 1) * inter)
        fe.w13.data[slot] = torch.cat([gate[rows], up[rows]]).to(BF16)
        fe.w2.data[slot] = w2[e, :, rows].to(BF16)
    return fe


@pytest.mark.parametrize("packed", [False, True])
def test_expert_partials_are_float32_and_sum_like_one_process(kernels, packed):
    """The experts return float32 partials. Split by experts (EP) they add up to one process's
    result exactly (top-2: a + b either way); split along the intermediate dim (TP) they agree
    to float32 order, so after the one rounding only a few elements in a thousand differ, by one
    bf16 step, where rounding each rank's partial first moves most of them."""
    g = _gen(9)
    n = 64
    x = torch.randn(n, 48, generator=g).to(BF16)
    ids = torch.rand(n, 6, generator=g).argsort(1)[:, :2]
    w = torch.rand(n, 2, generator=g)
    whole, ep = _experts(list(range(6))), [_experts([0, 1, 2]), _experts([3, 4, 5])]
    tp = [_experts(list(range(6)), (r, 2)) for r in range(2)]
    for fe in [whole, *ep, *tp] if packed else []:
        fe.use_ops(ops_for(kernels))
    one = whole(x, ids, w)
    assert one.dtype == torch.float32
    assert torch.equal(ep[0](x, ids, w) + ep[1](x, ids, w), one)
    halves = [fe(x, ids, w) for fe in tp]
    torch.testing.assert_close(halves[0] + halves[1], one, atol=1e-5, rtol=1e-5)
    once = (halves[0] + halves[1]).to(BF16)
    differ = (once != one.to(BF16)).float().mean().item()
    assert differ < 0.01 and (once.float() - one.to(BF16).float()).abs().max() <= one.abs().max() / 128
    early = (halves[0].to(BF16) + halves[1].to(BF16)).to(BF16)  # each partial rounded first
    assert (early != one.to(BF16)).float().mean().item() > 5 * max(differ, 0.01)


def test_reduce_dtype_of_a_group():
    g = Group((0,), 0)
    assert g.reduce_dtype == torch.float32
    x32, x16, ints = torch.randn(3), torch.randn(3).to(BF16), torch.arange(3)
    assert g.for_sum(x32) is x32 and g.for_sum(x16) is x16 and g.for_sum(ints) is ints
    groups = ParallelGroups.single()
    groups.set_reduce_dtype(BF16)
    assert all(grp.reduce_dtype == BF16 for grp in (groups.tp, groups.dp, groups.ep, groups.pp))
    assert groups.tp.for_sum(x32).dtype == BF16 and groups.tp.for_sum(x16) is x16
    assert groups.tp.for_sum(ints) is ints
    with pytest.raises(ValueError, match="floating"):
        groups.set_reduce_dtype(torch.int32)


def _partials(rank: int, n: int = 64, width: int = 256) -> torch.Tensor:
    """Float32 partial results of rank `rank`, [n, width]: many values near bf16 rounding ties."""
    return torch.randn(n, width, generator=_gen(100 + rank)) * 3


def _sum_collectives(rank: int, world: int) -> dict:
    group = Group(tuple(range(world)), rank, name="tp")
    sizes = [40, 24]
    out = {}
    for setting in (torch.float32, BF16):
        group.reduce_dtype = setting
        before = group.traffic.bytes_sent
        out[setting, "all_reduce"] = group.all_reduce(_partials(rank).clone())
        out[setting, "bytes"] = group.traffic.bytes_sent - before
        out[setting, "reduce_scatter"] = group.reduce_scatter_v(_partials(rank), sizes)
        for name in ("naive", "allgather_reducescatter"):
            backend = make_all2all(name, group)
            out[setting, name] = backend.combine(_partials(rank), sizes)
        # alltoall: 4 experts, 2 a rank; every token routed to one expert of each rank.
        owners = torch.tensor(expert_owners(4, world))
        a2a = make_all2all("alltoall", group, expert_owner=owners)
        x = torch.randn(sizes[rank], 8, generator=_gen(rank))
        ids = torch.tensor([[0, 2]] * sizes[rank])
        a2a.dispatch(x, ids, torch.ones(sizes[rank], 2), sizes)
        out[setting, "alltoall"] = a2a.combine(_partials(rank, sum(sizes)), sizes)
    group.reduce_dtype = torch.float32  # the default
    layer = RowParallelLinear(64, 96, True, group, dtype=BF16)
    full = torch.randn(96, 64, generator=_gen(1)).to(BF16)
    layer.weight.data.copy_(full[:, rank * 32 : (rank + 1) * 32])
    layer.bias.data.copy_(torch.randn(96, generator=_gen(2)).to(BF16))
    x = torch.randn(48, 64, generator=_gen(3)).to(BF16)
    out["row_parallel"] = layer(x[:, rank * 32 : (rank + 1) * 32])
    group.reduce_dtype = BF16
    out["row_parallel_bf16_wire"] = layer(x[:, rank * 32 : (rank + 1) * 32])
    one = RowParallelLinear(64, 96, True, Group((0,), 0), dtype=BF16)
    one.weight.data.copy_(full)
    one.bias.data.copy_(layer.bias)
    out["one_process"] = one(x)
    return out


@pytest.mark.timeout(60)
def test_sums_across_ranks_in_float32_unless_told_otherwise():
    """On 2 gloo ranks: every summing collective and combine keeps float32 partials float32
    (the exact sum of two floats, rounded once by the caller); with reduce_dtype bf16 each rank's
    partial is rounded first (half the bytes). A bf16 row-parallel layer then matches one
    process but for float32 order, and clearly better than with bf16 on the wire."""
    results = run_distributed(_sum_collectives, 2)
    total = _partials(0) + _partials(1)
    early = (_partials(0).to(BF16) + _partials(1).to(BF16)).float()
    rounded_each = _partials(0).to(BF16).float() + _partials(1).to(BF16).float()
    rows = {0: slice(0, 40), 1: slice(40, 64)}
    for rank, out in enumerate(results):
        assert torch.equal(out[torch.float32, "all_reduce"], total)
        assert torch.equal(out[BF16, "all_reduce"].to(BF16).float(), early)
        assert out[torch.float32, "bytes"] == 2 * out[BF16, "bytes"]
        for name in ("reduce_scatter", "naive", "allgather_reducescatter"):
            assert out[torch.float32, name].dtype == torch.float32, name
            assert torch.equal(out[torch.float32, name], total[rows[rank]]), name
            assert torch.equal(out[BF16, name].to(BF16).float(), early[rows[rank]]), name
        # alltoall: each token's two partials (one per rank) come back and are added at its
        # source, in float32; with bf16 on the wire each was rounded on the way.
        assert torch.equal(out[torch.float32, "alltoall"], total[rows[rank]])
        assert torch.equal(out[BF16, "alltoall"], rounded_each[rows[rank]])
        one = out["one_process"]
        for key, bound in (("row_parallel", 0.01), ("row_parallel_bf16_wire", 1.0)):
            assert out[key].dtype == BF16
            differ = (out[key] != one).float().mean().item()
            if key == "row_parallel":
                assert differ < bound, differ
                assert ((out[key].float() - one.float()).abs() <= one.float().abs() / 128 + 1e-6).all()
            else:  # rounding each partial first: many more elements off
                assert differ > 10 * max((out["row_parallel"] != one).float().mean().item(), 0.005)
