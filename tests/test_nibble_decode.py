"""The nibble decodes of the quantized kernels (cpu/csrc/quant_decode.c): fp4 e2m1 (q_decode3: a vector
permute on AVX2 and AVX-512, the table elsewhere; q_decode3_row, the one-row kernels' multishift on
AVX512-VBMI) gives the table's float32 values, and uint4 (q_decode1: multishift on AVX512-VBMI, widening
shuffles on other AVX-512 and in the one-panel tiles, q_decode1_one_panel; shifts on AVX2) the code as a
float, every code in every lane.

Through gemm_q the values are checked exactly (x one-hot: each output is one product, no rounding) on
both of gemm_q's paths (tiles of few rows decode per tile; from 8 rows a panel is decoded once);
the sign of -0.0 (code 8) cannot be seen through a product (the sums start at +0.0), so the decode
itself is also compiled into a small program and compared bit for bit with the table.
"""

import subprocess

import pytest
import torch
from expect import no_kernels

from expertmesh.cpu import cpu_features, cpu_kernels, kernel_library
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.quantization.packed import QuantizedWeight, decode_codes

HARNESS = r"""
#include "%s"
#include <stdio.h>
int main(void) {
  int bad = 0;
  for (int lane = 0; lane < LANES; lane++)
    for (int code = 0; code < 16; code++) {
      uint8_t p[LANES / 2];
      int want[LANES];
      for (int l = 0; l < LANES; l++) want[l] = l == lane ? code : (code + 5 * l + 3) & 15;
      for (int j = 0; j < LANES / 2; j++) p[j] = (uint8_t)(want[2 * j] | want[2 * j + 1] << 4);
      const vf v[4] = {q_decode3(p), q_decode3_row(p), q_decode1(p), q_decode1_one_panel(p)};
      float got[4][LANES];
      memcpy(got, v, sizeof got);
      for (int f = 0; f < 4; f++)
        for (int l = 0; l < LANES; l++) {
          const float expect = f < 2 ? fp4_lut[want[l]] : (float)want[l];
          if (memcmp(&got[f][l], &expect, 4)) {
            printf("decode %%d lane %%d code %%d: %%a, want %%a\n", f, l, want[l], got[f][l], expect);
            bad = 1;
          }
        }
    }
  printf("lanes %%d\n", LANES);
  return bad;
}
"""


NATIVE, NO_VBMI = ["-march=native"], ["-march=native", "-mno-avx512vbmi"]


@pytest.mark.parametrize("flags", [NATIVE, NO_VBMI, []], ids=["native", "native-no-vbmi", "portable"])
def test_nibble_decodes_bit_for_bit(tmp_path, flags):
    """Every code (-0.0 included) in every lane position, next to other codes in the other lanes; with
    -march=native the vector decodes of this CPU (without VBMI: the AVX-512 build of CPUs before Ice
    Lake), without (baseline x86-64 or any other) the table."""
    compiler = kernel_library.compiler()
    if compiler is None:
        no_kernels()
    if flags == NO_VBMI and "avx512vbmi" not in cpu_features.cpu_flags():
        pytest.skip("the same build as native here: this CPU has no AVX512-VBMI")
    src, exe = tmp_path / "fp4.c", tmp_path / "fp4"
    src.write_text(HARNESS % kernel_library.SOURCE)
    build = subprocess.run([compiler, "-O0", "-fopenmp", *flags, str(src), "-o", str(exe), "-lm"], text=True)
    assert build.returncode == 0
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout
    assert run.stdout.strip().startswith("lanes "), run.stdout


def test_fp4_gemm_every_code_in_every_lane_is_exact():
    """W[o, i] = code (o + i) mod 16 times 2^k: output row o (a lane of a panel) sees all 16 codes; x
    one-hot, so y = W^T exactly. 16 rows take the panel-decode path, single rows and 3 the tiles."""
    kernels = cpu_kernels.load()
    if kernels is None:
        no_kernels()
    out_f, in_f = 40, 48  # 40 outputs: panels of 8 (AVX2) or 16 (AVX-512) with a partial last one
    o, i = torch.arange(out_f)[:, None], torch.arange(in_f)[None, :]
    codes = ((o + i) % 16).to(torch.uint8)
    scales = torch.exp2(torch.arange(out_f * 2).view(out_f, 2) % 7 - 3.0)
    w = QuantizedWeight.from_rows(codes, scales, torch.zeros(out_f, 2), "fp4", 32, ops_for(kernels))
    dense = decode_codes(codes, "fp4") * scales.repeat_interleave(32, 1)[:, :in_f]
    eye = torch.eye(in_f)
    assert torch.equal(w(eye), dense.T)  # 48 rows: the panel is decoded once into float32
    for r in range(in_f):
        assert torch.equal(w(eye[r : r + 1]), dense.T[r : r + 1]), r
    assert torch.equal(w(eye[5:8]), dense.T[5:8])
