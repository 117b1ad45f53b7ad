/* expertmesh CPU kernels, compiled on first use by expertmesh/cpu/cpu_kernels.py.
 *
 * Plain C with OpenMP: loops are written so that gcc/clang vectorise them for the host
 * (-O3 -march=native), with the common head sizes as compile-time constants so the inner
 * loops unroll fully. Every entry point takes the thread count, so it follows
 * torch.set_num_threads rather than OpenMP's own default. float32 and bfloat16 share one body
 * through the DEFINE_* macros (T = storage type, LOAD/STORE = conversion to and from float).
 *
 * One translation unit, in parts (each part may use what the parts before it define):
 *   attention.c        decode attention over the paged KV cache; per-head products (MLA)
 *   gemm.c             panel GEMM tiles, float32 and bf16 weights (LANES, MR, NP are defined here)
 *   gemm_entry.c       gemm_f32 / gemm_bf16 entry points; bf16 panel groups widened once (many rows)
 *   token_ops.c        RMSNorm, rotary embedding + paged cache writes
 *   moe.c              routed experts in one call (the float32 plan the bf16 ones follow)
 *   bf16_pairs.c       bf16 pair products (AVX512-BF16) and the AVX2 bf16 experts plan
 *   quant.c            weight-only quantized codes (int8, uint4, fp8, fp4), dequantized in registers
 *   quant_a8.c         int8 / int4 weights with int8 activations (W8A8, W4A8)
 *   quant_bf16.c       uint4 weights with activations rounded to bf16, on bf16 pairs (kind 6)
 *   quant_dispatch.c   gemm_q / moe_q: the quantized entry points over the tiles above
 *   decode_layers.c    decode steps: whole decoder layers in one call
 *   recurrent.c        decode steps of the recurrent mixers (Gated DeltaNet, Mamba2) on their states
 */
#include "common.h"

#include "attention.c"
#include "gemm.c"
#include "gemm_entry.c"
#include "token_ops.c"
#include "moe.c"
#include "bf16_pairs.c"
#include "quant.c"
#include "quant_a8.c"
#include "quant_bf16.c"
#include "quant_dispatch.c"
#include "decode_layers.c"
#include "recurrent.c"
