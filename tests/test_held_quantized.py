"""Quantized checkpoint weights held compressed as stored (layers/quantization/held.py): each
format's codes, scales and offsets of any rank's region rebuild exactly the weights its
dequantization gives (GPTQ, AWQ, compressed-tensors), and a region that cuts a group is an error
naming the sizes. End to end (greedy tokens, TP / EP, resident bytes): test_quantization.py and
test_compressed_tensors.py."""

import pytest
import torch
from quantized_checkpoints import AWQ_ORDER, _int4_groups, _pack
from safetensors import safe_open
from safetensors.torch import save_file

from expertmesh.layers.quantization.awq import AwqFormat, AwqTensor
from expertmesh.layers.quantization.gptq import GptqFormat, GptqTensor
from expertmesh.layers.quantization.held import local_groups
from expertmesh.layers.quantization.packed import decode_codes
from expertmesh.layers.torch_ops import TORCH_OPS

OUT, IN, GROUP = 24, 64, 16
# (rows, columns) a rank reads: whole, TP 2 by rows (cutting a packed word of 8 outputs), by columns
REGIONS = [((0, OUT), (0, IN)), ((12, 24), (0, IN)), ((0, OUT), (32, 64)), ((3, 17), (16, 48))]


def _rebuilt(t, rows, cols) -> torch.Tensor:
    group, g0 = local_groups(t.base, t.held_kind, cols[0], cols[1], t.shape[1])
    codes, scales, offsets = t.quantized(rows, cols, group, g0)
    values = decode_codes(codes, t.held_kind[0])
    expand = lambda v: v.repeat_interleave(group, 1)[:, : cols[1] - cols[0]]
    return values * expand(scales) + expand(offsets)


def _check(t) -> None:
    for rows, cols in REGIONS:
        ref = t[rows[0] : rows[1], cols[0] : cols[1]]
        torch.testing.assert_close(_rebuilt(t, rows, cols), ref, rtol=0, atol=1e-6)


def _int4_parts(method: str):
    torch.manual_seed(3)
    g_idx = torch.arange(IN) // GROUP
    q, z, s = _int4_groups(torch.randn(OUT, IN), GROUP, g_idx)
    if method == "gptq":
        return {
            "qweight": _pack(q, 0),
            "qzeros": _pack(z - 1, 1),
            "scales": s,
            "g_idx": g_idx.to(torch.int32),
        }
    return {"qweight": _pack(q, 1, AWQ_ORDER), "qzeros": _pack(z, 1, AWQ_ORDER), "scales": s}


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_codes_rebuild_their_dequantized_weights(tmp_path, method):
    save_file({k: v.contiguous() for k, v in _int4_parts(method).items()}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        parts = {k: f.get_slice(k) for k in f.keys()}
        if method == "gptq":
            t = GptqTensor("x", parts, GptqFormat(4, GROUP))
        else:
            t = AwqTensor("x", parts, AwqFormat(GROUP))
        assert t.held_kind == ("int4", GROUP)
        _check(t)


def _pack8(values: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 8-bit values -> int32 words of 4 along dim (value j at bits 8j), as GPTQ packs int8."""
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, 4)
    words = sum(v[..., j] << (8 * j) for j in range(4))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim)


def test_gptq_int8_codes_rebuild_their_dequantized_weights(tmp_path):
    """Unsigned 8-bit q and zeros: codes q - 128 as int8, offsets -(z - 128) * s."""
    torch.manual_seed(5)
    q = torch.randint(0, 256, (IN, OUT))
    z = torch.randint(1, 256, (IN // GROUP, OUT))
    s = (torch.rand(IN // GROUP, OUT) / 50).half()
    parts = {"qweight": _pack8(q, 0), "qzeros": _pack8(z - 1, 1), "scales": s}
    save_file({k: v.contiguous() for k, v in parts.items()}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        t = GptqTensor("x", {k: f.get_slice(k) for k in f.keys()}, GptqFormat(8, GROUP))
        assert t.held_kind == ("int8", GROUP)
        g = torch.arange(IN) // GROUP
        torch.testing.assert_close(t[:], ((q - z[g]).float() * s.float()[g]).t(), rtol=0, atol=0)
        _check(t)


@pytest.mark.parametrize(
    "bits,strategy,symmetric",
    [(4, "group", True), (4, "group", False), (8, "channel", False), (8, "tensor", True)],
)
def test_compressed_tensors_codes_rebuild_their_dequantized_weights(tmp_path, bits, strategy, symmetric):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    from expertmesh.layers.quantization.compressed import CompressedTensor

    args = QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
        group_size=GROUP if strategy == "group" else None,
    )  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    torch.manual_seed(4)
    w = torch.randn(OUT, IN)
    blocks = (
        w.view(OUT, -1, GROUP if strategy == "group" else IN) if strategy != "tensor" else w.view(1, 1, -1)
    )
    scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args)
    if strategy == "tensor":
        scale, zero = scale.reshape(1), zero.reshape(1)
    state = BaseCompressor.get_value_from_registry("pack-quantized").compress(
        {"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme
    )
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        t = CompressedTensor("x", {k: f.get_slice(k) for k in f.keys()}, scheme, "pack-quantized")
        assert t.held_kind == (f"int{bits}", GROUP if strategy == "group" else 0)
        _check(t)


def test_a_region_that_cuts_a_group_is_an_error_naming_the_sizes():
    assert local_groups("x", ("int4", 16), 16, 48, 64) == (16, 1)
    assert local_groups("x", ("int8", 0), 32, 64, 64) == (32, 0)  # one scale a row: any slice
    assert local_groups("x", ("int4", 128), 0, 64, 64) == (128, 0)  # one group covers the row
    with pytest.raises(
        ValueError, match=r"x \(int4, groups of 16\): a rank reads its inputs \[8, 40\) of 64"
    ):
        local_groups("x", ("int4", 16), 8, 40, 64)


@pytest.mark.parametrize(
    "bounds",
    [
        [(0, 3), (0, 64), (0, 24)],  # every expert, whole
        [(1, 2), (0, 64), (0, 24)],  # one expert (EP)
        [(0, 3), (32, 64), (0, 24)],  # the inputs' second block (TP over a down projection)
        [(2, 3), (0, 64), (5, 17)],  # outputs cut anywhere (TP over gate / up rows)
    ],
)
def test_mxfp4_held_codes_and_exponents_rebuild_the_dequantized_experts(tmp_path, bounds):
    """The int16 code | exponent << 4 of a region, transposed to [e, out, in] as the family's
    picks do, splits into fp4 codes and 2^(e - 127) per 32 inputs that rebuild materialize()."""
    from quantized_checkpoints import mxfp4_blocks

    from expertmesh.layers.quantization.held import HeldParam, split_exponents
    from expertmesh.layers.quantization.mxfp4 import Mxfp4Experts

    torch.manual_seed(6)
    w = torch.randn(3, 24, 64) * torch.logspace(-3, 2, 24)[:, None]  # [E, out, in]: scales 2^-13..2^5
    blocks, scales = mxfp4_blocks(w)
    save_file({"b": blocks, "s": scales}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        t = Mxfp4Experts("x", f.get_slice("b"), f.get_slice("s"))
        (e0, e1), (i0, i1), (o0, o1) = bounds
        ref = t.materialize(bounds).transpose(1, 2)  # [e, out, in]
        region = t.held_region(bounds).transpose(1, 2).contiguous()
        h = HeldParam("x", "fp4", 32, tuple(region.shape), exponents=True)
        codes = split_exponents(region, h)
        values = decode_codes(codes, "fp4") * h.scales.repeat_interleave(
            32, -1
        ) + h.offsets.repeat_interleave(32, -1)
        torch.testing.assert_close(values, ref, rtol=0, atol=0)
        half = t.held_region([(0, 1), (16, 48), (0, 24)]).transpose(1, 2).contiguous()  # cuts both blocks
        with pytest.raises(RuntimeError, match=r"x: 32 inputs .*different scales|a cut block"):
            split_exponents(half, HeldParam("x", "fp4", 32, tuple(half.shape), exponents=True))


def test_gptq_desc_act_codes_in_group_order_rebuild_the_weights_and_refuse_cut_groups(tmp_path):
    """desc_act: a rank's inputs sorted by group hold contiguous groups whose codes, scales and
    offsets rebuild the dequantized weight's columns in that order; the activation gathered by
    the same order gives W x exactly as the checkpoint's order; a slice cutting a group is named."""
    from expertmesh.layers.quantization.packed import QuantizedWeight
    from expertmesh.layers.quantization.permuted import PermutedInputs

    torch.manual_seed(7)
    half = IN // 2
    order = torch.cat([torch.randperm(half), half + torch.randperm(half)])  # groups within each half
    g_idx = torch.empty(IN, dtype=torch.int64)
    g_idx[order] = torch.arange(IN) // GROUP
    q, z, s = _int4_groups(torch.randn(OUT, IN), GROUP, g_idx)
    parts = {"qweight": _pack(q, 0), "qzeros": _pack(z - 1, 1), "scales": s, "g_idx": g_idx.to(torch.int32)}
    save_file({k: v.contiguous() for k, v in parts.items()}, str(tmp_path / "t.safetensors"))
    with safe_open(str(tmp_path / "t.safetensors"), "pt") as f:
        t = GptqTensor("x", {k: f.get_slice(k) for k in f.keys()}, GptqFormat(4, GROUP, desc_act=True))
        assert t.held_kind == ("int4", GROUP) and t.permuted
        assert t.held_input_order(IN) is not None and t.held_input_order(half) is not None
        assert t.held_input_order(IN // 4) is None  # TP 4: a rank's 16 inputs cut groups
        for rows, cols in [((0, OUT), (0, IN)), ((12, 24), (0, IN)), ((0, OUT), (half, IN))]:
            perm = t._perm(*cols)
            group, g0 = local_groups(t.base, t.held_kind, cols[0], cols[1], t.shape[1])
            codes, scales, offsets = t.quantized(rows, cols, group, g0)
            ref = t[rows[0] : rows[1], cols[0] : cols[1]]
            expand = lambda v, group=group: v.repeat_interleave(group, 1)
            torch.testing.assert_close(
                decode_codes(codes, "int4") * expand(scales) + expand(offsets), ref[:, perm]
            )
            w = PermutedInputs(
                QuantizedWeight.from_rows(codes, scales, offsets, "int4", group, TORCH_OPS), perm
            )
            torch.testing.assert_close(w.dequantize(), ref, rtol=0, atol=1e-6)
            x = torch.randn(3, cols[1] - cols[0])
            torch.testing.assert_close(w(x), x @ ref.t(), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"gptq x: inputs \[8, 24\) cut a desc_act group"):
            t._perm(8, 24)


@pytest.mark.parametrize("kind", ["int8", "int4", "fp4", "w8a8", "w4a8"])
@pytest.mark.parametrize("out_f", [48, 37])
def test_panels_written_into_a_stack_slot_equal_the_plain_layout(kind, out_f):
    """QuantizedWeight.from_rows written straight into a slot of the experts' stacks (one-pass
    loading's `into`) holds what plain torch lays out: codes and scales in panels of `lanes` rows
    (rows past the weight zero), nibble kinds' lanes 2j / 2j + 1 in byte j's low / high nibble."""
    from expertmesh.layers.quantization.packed import QuantizedWeight
    from expertmesh.layers.quantization.streaming import ExpertStacks

    lanes, in_f, group = TORCH_OPS.quant_lanes, 64, 16
    torch.manual_seed(5)
    codes = torch.randint(0, 16 if kind in ("int4", "fp4", "w4a8") else 255, (out_f, in_f), dtype=torch.uint8)
    codes[codes == 128] = 0  # int8 -128: outside w8a8's codes
    scales, offsets = torch.randn(out_f, in_f // group), torch.randn(out_f, in_f // group)
    p = -(-out_f // lanes)
    pad = lambda t: torch.cat([t, t.new_zeros(p * lanes - out_f, t.shape[1])])  # noqa: E731
    panel = lambda t: pad(t).view(p, lanes, t.shape[1]).transpose(1, 2)  # noqa: E731 [P, C, lanes]
    stacks = ExpertStacks(3, shared_offsets=False)
    w = QuantizedWeight.from_rows(codes, scales, offsets, kind, group, TORCH_OPS, stacks.into(1))
    assert w.codes.data_ptr() == stacks.stacks["codes"][1].data_ptr()  # in the slot, not a copy of it
    assert torch.equal(w.scales, panel(scales)) and torch.equal(w.offsets, panel(offsets))
    if kind in ("int8", "int4", "fp4"):
        want = panel(codes)
        if kind != "int8":
            want = want[..., 0::2] | (want[..., 1::2] << 4)
        assert torch.equal(w.codes, want)
    # every kind: the weight it holds is the rows' code * scale + offset
    values = codes.view(torch.int8).float() if kind in ("int8", "w8a8") else decode_codes(codes, kind)
    want_w = values * scales.repeat_interleave(group, 1) + offsets.repeat_interleave(group, 1)
    assert torch.equal(
        QuantizedWeight.from_rows(codes, scales, offsets, kind, group, TORCH_OPS).dequantize(), want_w
    )
    stacks.put(1, w)
    assert torch.equal(stacks.slots[1].dequantize(), want_w)
