"""The weight forms (layers/linear_weight.py, layers/expert_weights.py): whatever form a linear
layer or an expert stack is held in after loading, its product equals plain torch's float64
product written here, its bytes are what the accounting counts, and the forms refuse what they
cannot do with a message naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.cpu_gemm import OneDnnWeight
from expertmesh.cpu.cpu_kernels import PanelWeight
from expertmesh.cpu.expert_forms import ChunkedStacks, PanelStacks, QuantizedStacks
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.expert_weights import DenseExperts, PerExpertWeights
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.linear import ReplicatedLinear, RowParallelLinear
from expertmesh.layers.linear_weight import ChunkedWeight, DenseWeight
from expertmesh.layers.quantization.accounting import resident_weight_bytes
from expertmesh.layers.quantization.online import OnlineScheme
from expertmesh.layers.quantization.packed import QuantizedWeight
from expertmesh.layers.torch_ops import TORCH_OPS

KERNELS = cpu_kernels.load()
WITH_KERNELS = [None] + ([KERNELS] if KERNELS is not None else [])
IDS = ["torch", "kernels"][: len(WITH_KERNELS)]


def _linear(out_f: int = 24, in_f: int = 40) -> tuple[ReplicatedLinear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    layer = ReplicatedLinear(in_f, out_f, bias=True)
    w, b = torch.randn(out_f, in_f, generator=g), torch.randn(out_f, generator=g)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    return layer, w, b


def _bytes(form) -> int:
    return sum(t.numel() * t.element_size() for t, _ in form.resident())


@pytest.mark.parametrize("kernels", WITH_KERNELS, ids=IDS)
def test_a_packed_linear_equals_torch_and_is_held_once(kernels):
    layer, w, b = _linear()
    assert isinstance(layer.weight_form, DenseWeight)
    x = torch.randn(5, 40)
    want = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)  # dense, before packing
    layer.use_ops(ops_for(kernels))
    form = layer.weight_form
    assert isinstance(form, PanelWeight if kernels is not None else (OneDnnWeight, DenseWeight))
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    if not isinstance(form, DenseWeight):
        assert layer.weight.numel() == 0  # the dense copy released: the weight held once
    counts = resident_weight_bytes(layer)
    assert counts["quantized"] == 0 and counts["dense"] == _bytes(form) + b.numel() * 4
    assert (form.native_form(torch.float32, []) is not None) == isinstance(form, PanelWeight)


@pytest.mark.parametrize("kernels", WITH_KERNELS, ids=IDS)
def test_a_quantized_linear_equals_its_dequantized_weight(kernels):
    layer, _, b = _linear()
    layer.use_quantized(OnlineScheme.parse("int8-g8"), ops_for(kernels))
    form = layer.weight_form
    assert isinstance(form, QuantizedWeight) and layer.weight.numel() == 0
    x = torch.randn(3, 40)
    want = (x.double() @ form.dequantize().double().T + b.double()).float()
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    counts = resident_weight_bytes(layer)
    assert counts["quantized"] == _bytes(form) and counts["dense"] == b.numel() * 4


@pytest.mark.parametrize("kernels", WITH_KERNELS, ids=IDS)
def test_deterministic_chunks_sum_to_the_whole_product(kernels):
    group = SimpleNamespace(rank_in_group=0, world_size=1, fixed_chunks=8, ordered_sum=lambda y: y)
    layer = RowParallelLinear(64, 24, bias=True, group=group)
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    x = torch.randn(4, 64, generator=g)
    want = (x.double() @ w.double().T + b.double()).float()
    assert isinstance(layer.weight_form, ChunkedWeight) and layer.weight_form.count == 8
    lazy = layer(x)  # slices of the dense weight (never packed)
    torch.testing.assert_close(lazy, want, rtol=1e-5, atol=1e-5)
    layer.use_ops(ops_for(kernels))
    assert layer.weight.numel() == 0 and len(layer.weight_form.chunks) == 8
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert resident_weight_bytes(layer)["dense"] >= w.numel() * 4 + b.numel() * 4
    with pytest.raises(ValueError, match="the bias joins after the sum"):
        layer.weight_form.apply(x, bias=layer.bias)


def _experts(fixed_chunks: int = 0) -> tuple[FusedExperts, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    fe = FusedExperts(6, list(range(6)), 32, 48, 0, 1, "silu")
    fe.fixed_chunks = fixed_chunks
    w13, w2 = torch.randn(6, 96, 32, generator=g) * 0.2, torch.randn(6, 32, 48, generator=g) * 0.2
    fe.w13.data.copy_(w13)
    fe.w2.data.copy_(w2)
    return fe, w13, w2


def _reference(x, ids, weights, w13, w2, weighted: bool = True) -> torch.Tensor:
    """Per (token, pick) silu(x W_gate^T) * (x W_up^T) W_down^T in float64; summed over the picks
    with their routing weights ([n, H]), or unweighted per pick ([n, k, H])."""
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    n, k = ids.shape
    out = torch.zeros(n, k, x.shape[1], dtype=torch.float64)
    for t in range(n):
        for p in range(k):
            h = w13d[ids[t, p]] @ xd[t]
            out[t, p] = w2d[ids[t, p]] @ (F.silu(h[:48]) * h[48:])
    if not weighted:
        return out.float()
    return (out * weights.double().unsqueeze(2)).sum(1).float()


def _routing(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3 + n)
    x = torch.randn(n, 32, generator=g)
    ids = torch.rand(n, 6, generator=g).argsort(dim=1)[:, :2]
    return x, ids, torch.rand(n, 2, generator=g)


@pytest.mark.parametrize("kernels", WITH_KERNELS, ids=IDS)
def test_every_expert_form_equals_torch(kernels):
    fe, w13, w2 = _experts()
    forms = [type(fe.experts_form)]
    checks = [fe]
    packed, _, _ = _experts()
    packed.use_ops(ops_for(kernels))  # fused stacks with our kernel, else per expert (oneDNN) or dense
    forms.append(type(packed.experts_form))
    checks.append(packed)
    quant, _, _ = _experts()
    quant.use_quantized(OnlineScheme.parse("int8"), ops_for(kernels))
    forms.append(type(quant.experts_form))
    assert forms[0] is DenseExperts
    assert forms[1] in ((PanelStacks,) if kernels is not None else (PerExpertWeights, DenseExperts))
    assert forms[2] is (QuantizedStacks if kernels is not None else PerExpertWeights)
    for n in (0, 1, 5):
        x, ids, weights = _routing(n)
        want = _reference(x, ids, weights, w13, w2)
        for fe_ in checks:
            got = fe_(x, ids, weights)
            assert got.shape == (n, 32) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # int8 codes per channel: close to the float experts, equal to their own dequantized weights
        torch.testing.assert_close(quant(x, ids, weights), want, rtol=0.05, atol=0.05)
    if kernels is not None:
        assert packed.w13.numel() == 0 and packed.native_form([]) is not None
        counts = resident_weight_bytes(packed)
        assert counts["dense"] == _bytes(packed.experts_form)


@pytest.mark.parametrize("kernels", WITH_KERNELS, ids=IDS)
def test_deterministic_expert_forms_give_each_picks_output(kernels):
    fe, w13, w2 = _experts(fixed_chunks=4)
    fe.use_ops(ops_for(kernels))
    assert isinstance(fe.experts_form, ChunkedStacks if kernels is not None else DenseExperts)
    for n in (0, 1, 5):
        x, ids, weights = _routing(n)
        sums = fe.pair_sums(x, ids, weights)
        torch.testing.assert_close(sums, _reference(x, ids, weights, w13, w2, False), rtol=1e-5, atol=1e-5)
    if kernels is not None:
        with pytest.raises(ValueError, match="summed per pick"):
            fe(x, ids, weights)
        assert len(fe.slot_tensors(0)) == 2 * 4  # w13 and w2 of each fixed chunk


def test_forms_refuse_what_they_cannot_run():
    fe, _, _ = _experts()
    q = [
        tuple(QuantizedWeight.quantize(w[e], "int8", 0, TORCH_OPS) for w in (fe.w13, fe.w2)) for e in range(6)
    ]
    fe.hold_quantized(q, TORCH_OPS)  # no kernels: per expert through the torch fallback
    assert isinstance(fe.experts_form, PerExpertWeights)
    x, ids, weights = _routing(2)
    with pytest.raises(ValueError, match="deterministic=True does not serve PerExpertWeights experts"):
        fe.pair_sums(x, ids, weights)
    det, _, _ = _experts(fixed_chunks=2)
    with pytest.raises(ValueError, match="deterministic=True does not serve quantized experts yet"):
        det.hold_quantized(q, TORCH_OPS)
    fe.experts_form = PerExpertWeights([(object(), object())] * 6)
    with pytest.raises(AttributeError, match="'object' object has no attribute 'slot_tensors'"):
        fe.slot_tensors(0)
