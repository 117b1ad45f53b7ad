/* gemm_q / moe_q's code kinds, by number. The Python side's names are cpu/cpu_kernels.py's
 * QUANT_KINDS (a kind's number is its index there); tests/test_declared_interfaces.py reads this header and
 * checks that each number below has the name in its comment. */
#ifndef EXPERTMESH_QUANT_KINDS_H
#define EXPERTMESH_QUANT_KINDS_H

#define Q_KIND_I8 0   /* int8: weight-only int8 codes */
#define Q_KIND_U4 1   /* int4: weight-only uint4 codes (int4 shifted by 8) */
#define Q_KIND_F8 2   /* fp8: weight-only fp8 e4m3 codes */
#define Q_KIND_F4 3   /* fp4: weight-only fp4 e2m1 codes (MXFP4) */
#define Q_KIND_A8 4   /* w8a8: int8 codes, activations quantized to int8 per row and group */
#define Q_KIND_A4 5   /* w4a8: uint4 codes, activations quantized to int8 per row and group */
#define Q_KIND_B4 6   /* int4-bf16: uint4 codes against activations rounded to bf16, on bf16 pairs */
#define Q_KIND_B8 7   /* int8-bf16: int8 codes against bf16 activations, on bf16 pairs */
#define Q_KIND_BF4 8  /* fp4-bf16: fp4 codes against bf16 activations, on bf16 pairs */
#define Q_KIND_BF8 9  /* fp8-bf16: fp8 codes against bf16 activations, on bf16 pairs */
#define Q_KINDS 10    /* how many kinds this build knows (q_kinds()) */

#endif
