"""GGUF MXFP4 blocks laid straight into the fp4 kind's panels (layers/quantization/mxfp4_blocks.py,
cpu/csrc/mxfp4_panels.c): byte for byte the panels the general path makes of the same weights' int16
`code | exponent << 4` (split_exponents, QuantizedWeight.from_rows), and their values gguf's own
dequantizer's, in every build of the kernel (AVX-512 VBMI permutes, 16-lane SWAR without VBMI, the
8-lane generic build); a region's blocks reach a streamed expert's staging untouched and any other
destination as int16; the value that carries them holds no data, so no other consumer reads zeros."""

import gguf
import numpy as np
import pytest
import torch

from expertmesh.cpu import cpu_kernels, kernel_library
from expertmesh.cpu.ops import CpuOps
from expertmesh.layers.quantization import mxfp4_blocks
from expertmesh.layers.quantization.held import HeldParam, HeldWeights, _weight, split_exponents
from expertmesh.layers.weights import copy_into
from expertmesh.models.gguf import GGUFTensor

MX = gguf.GGMLQuantizationType.MXFP4


def _blocks(rng: np.random.Generator, rows: int, groups: int) -> np.ndarray:
    """Random ggml MXFP4 blocks [rows, groups, 17], scales over e8m0's finite range (0: 2^-127)."""
    raw = rng.integers(0, 256, (rows, groups, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(0, 255, (rows, groups))
    raw[0, 0, 0], raw[-1, -1, 0] = 0, 254
    return raw


@pytest.fixture(scope="module")
def builds(kernels, generic_kernels, tmp_path_factory):
    """The native build, one without VBMI (16 lanes, the SWAR path: AVX-512 CPUs before Ice Lake)
    and the generic 8-lane one."""
    compiler = kernel_library.compiler()
    no_vbmi = tmp_path_factory.mktemp("no-vbmi") / "no_vbmi.so"
    out = {"native": kernels, "generic": generic_kernels}
    if kernels.lanes == 16:
        out["no-vbmi"] = cpu_kernels.build(no_vbmi, compiler, ("-mno-avx512vbmi", "-O1"))
    return out


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # gguf's 12 * 2^127
@pytest.mark.parametrize("rows, groups", [(37, 3), (64, 2), (5, 1)])
def test_blocks_make_the_int16_paths_panels_and_gguf_values(builds, rows, groups):
    raw = _blocks(np.random.default_rng(rows), rows, groups)
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1), MX))
    for name, k in builds.items():
        ops = CpuOps(k)
        h = HeldParam("w", "fp4", 32, (rows, groups * 32), exponents=True)
        int16 = torch.from_numpy(mxfp4_blocks.int16_of(raw, 0, groups * 32))
        ref = _weight(split_exponents(int16, h), h, ops)
        # pieces as a gate / up pair lands: from a panel boundary (called per piece), or not (joined)
        for cut in (k.lanes * (rows // (2 * k.lanes)), rows // 2):
            pieces = [(cut, raw[cut:]), (0, raw[:cut])] if cut else [(0, raw)]
            codes, scales = mxfp4_blocks.panels(pieces, rows, ops, None, 1)
            assert torch.equal(codes, ref.codes), (name, cut)
            assert torch.equal(scales.view(torch.int32), ref.scales.view(torch.int32)), (name, cut)
        # the values, against gguf (e2m1's -0 is +0 in ggml's integer table: compare as floats)
        assert torch.equal(ref.dequantize(), want), name


def test_regions_reach_staging_as_blocks_and_other_storage_as_int16():
    rng = np.random.default_rng(3)
    rows, cols = 8, 96
    raw = _blocks(rng, rows, cols // 32)
    src = GGUFTensor(raw.reshape(rows, -1), MX, (rows, cols), "blk.0.ffn_up_exps.weight[0]")
    src.held = HeldWeights()
    whole = src[2:6]
    assert whole.is_meta and whole.shape == (4, cols)
    assert isinstance(whole.held_region, mxfp4_blocks.Mxfp4Blocks)
    with pytest.raises((RuntimeError, NotImplementedError)):  # no data: a stray consumer fails loudly
        torch.zeros(4, cols, dtype=torch.int16).copy_(whole)
    # a held parameter that does not collect blocks: int16, as the general path gives them
    param = torch.zeros(rows, cols, dtype=torch.int16)
    h = HeldParam("w", "fp4", 32, (rows, cols), exponents=True)
    src.held.by_storage[param.untyped_storage().data_ptr()] = h
    copy_into(param[2:6], whole, "w")
    assert torch.equal(param[2:6], torch.from_numpy(mxfp4_blocks.int16_of(raw[2:6], 0, cols)))
    # a streamed expert's staging that collects them: the blocks as read, the staging untouched
    staging = torch.full((rows, cols), -1, dtype=torch.int16)
    sh = HeldParam("w", "fp4", 32, (rows, cols), exponents=True, blocks=[])
    src.held.by_storage[staging.untyped_storage().data_ptr()] = sh
    copy_into(staging[4:8], src[4:8], "w")
    assert [row for row, _ in sh.blocks] == [4] and np.array_equal(sh.blocks[0][1], raw[4:8])
    assert bool((staging == -1).all())
    # a region that cuts a block: int16 values at once
    cut = src[0:2, 40:96]
    assert not cut.is_meta
    assert torch.equal(cut, torch.from_numpy(mxfp4_blocks.int16_of(raw[0:2], 40, 96)))
