/* expertmesh CPU kernels, compiled on first use by expertmesh/cpu/cpu_kernels.py.
 *
 * Plain C with OpenMP: loops are written so that gcc/clang vectorise them for the host
 * (-O3 -march=native), with the common head sizes as compile-time constants so the inner
 * loops unroll fully. Every entry point takes the thread count, so it follows
 * torch.set_num_threads rather than OpenMP's own default. float32 and bfloat16 share one body
 * through the DEFINE_* macros (T = storage type, LOAD/STORE = conversion to and from float).
 *
 * One translation unit, in parts (each part may use what the parts before it define):
 *   decode_attention.c decode attention over the paged KV cache
 *   head_matmul.c      per-head matrix products (MLA's absorbed projections)
 *   prefill_tiles.c    prefill attention: vector tiles, the float32 ("wide") stages
 *   prefill_pairs.c    prefill attention: the bf16 pair stages (AVX512-BF16)
 *   prefill.c          prefill attention: online softmax, the task, paged_prefill
 *   gemm.c             panel GEMM tiles, float32 and bf16 weights (LANES, MR, NP are defined here)
 *   gemm_entry.c       gemm_f32 / gemm_bf16 entry points; bf16 panel groups widened once (many rows)
 *   token_ops.c        RMSNorm, rotary embedding + paged cache writes
 *   moe.c              routed experts in one call (the float32 plan the bf16 ones follow)
 *   bf16_pairs.c       bf16 pair products (AVX512-BF16) and the AVX2 bf16 experts plan
 *   quant_decode.c     quantized codes (int8, uint4, fp8, fp4) decoded into float32 vectors
 *   quant.c            weight-only quantized codes, dequantized in registers (many / some / one row)
 *   quant_a8.c         int8 / int4 weights with int8 activations (W8A8, W4A8): tiles of many rows
 *   quant_a8_row.c     W8A8 / W4A8 at one row (decode)
 *   quant_bf16.c       codes against activations rounded to bf16 (kinds 6-9): layout, pair tiles
 *   quant_bf16_rows.c  kinds 6-9: many rows of fp8, one row, the tiles' dispatch
 *   quant_dispatch.c   gemm_q / moe_q: the quantized entry points over the tiles above
 *   decode_layers.c    decode steps: whole decoder layers in one call
 *   recurrent.c        decode steps of the recurrent mixers (Gated DeltaNet, Mamba2) on their states
 *   mxfp4_panels.c     loading: GGUF MXFP4 blocks laid straight into the fp4 kind's panels
 */
#include "common.h"

#include "decode_attention.c"
#include "head_matmul.c"
#include "prefill_tiles.c"
#include "prefill_pairs.c"
#include "prefill.c"
#include "gemm.c"
#include "gemm_entry.c"
#include "token_ops.c"
#include "moe.c"
#include "bf16_pairs.c"
#include "quant_decode.c"
#include "quant.c"
#include "quant_a8.c"
#include "quant_a8_row.c"
#include "quant_bf16.c"
#include "quant_bf16_rows.c"
#include "quant_dispatch.c"
#include "decode_layers.c"
#include "recurrent.c"
#include "mxfp4_panels.c"
