/* Part of cpu_kernels.c (one translation unit; see its list): panel GEMM, float32 and bf16 weights (LANES, MR, NP are defined here). */

/* Matrix products y[M, O] = x[M, I] @ W[O, I]^T with W held in panels of LANES output rows:
 * wp[P][I][LANES], P = ceil(O / LANES), rows past O zero (pack_panels in cpu_kernels.py).
 *
 * A tile is MR rows of x against NP panels: MR x NP vector accumulators stay in registers, each
 * step loads NP weight vectors and broadcasts MR scalars of x. Panels are split over threads;
 * within a thread each panel group is read from memory once and then from cache for the next
 * MR rows of x, so small M (decode) streams the weights at memory speed and large M (prefill)
 * runs from cache. bfloat16 weights are widened to float32 in registers; accumulation is float32.
 */
#if defined(__AVX512F__)
#define LANES 16
#define MR 8
#define NP 3
#else
/* AVX2 (16 vector registers): 6 x 2 accumulators + 2 weight vectors + a broadcast = 15; the
 * fastest of 4 x 2, 4 x 3, 3 x 4 and 6 x 2 on Zen 3 from 8 rows on (docs/benchmarks.md, "Kernel figures"). */
#define LANES 8
#ifndef MR
#define MR 6
#endif
#ifndef NP
#define NP 2
#endif
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vf_unaligned __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

int64_t gemm_lanes(void) { return LANES; }

static inline vf load_panel_f32(const float* p) { return *(const vf_unaligned*)p; }

#if LANES == 8 && defined(__AVX2__)
#include <immintrin.h>
/* One vpmovzxwd from memory and a shift: gcc compiles the generic form below, on 8 lanes, into a
 * 16-byte load, two 4-lane widenings, a byte shift and an insert (docs/benchmarks.md, "Kernel figures"). */
static inline vf load_panel_bf16(const bf16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return (vf)_mm256_slli_epi32(wide, 16);
}
#else
static inline vf load_panel_bf16(const bf16_t* p) {
  vu wide = __builtin_convertvector(*(const vh*)p, vu) << 16;
  return (vf)wide;
}
#endif

static inline void store_row_f32(float* y, const vf v, int64_t n) {
  if (n == LANES) {
    *(vf_unaligned*)y = v;
  } else {
    float tmp[LANES];
    memcpy(tmp, &v, sizeof tmp);
    memcpy(y, tmp, sizeof(float) * (size_t)n);
  }
}

/* f32_to_bf16 on a whole vector (round to nearest even, NaN kept quiet) without its branch: the
 * scalar loop was about a tenth of a bf16 prefill's dense products (2,000 rows, o_proj). */
static inline void store_row_bf16(bf16_t* y, const vf v, int64_t n) {
  const vu u = (vu)v;
  const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
  const vh h = __builtin_convertvector((nan & ((u >> 16) | 0x40u)) | (~nan & rounded), vh);
  memcpy(y, &h, sizeof(bf16_t) * (size_t)n);
}

/* Bias (float32, may be NULL) is added before the output is rounded, as oneDNN does. */
static inline vf bias_vec(const float* bias, int64_t o, int64_t n) {
  float tmp[LANES] = {0};
  if (bias) memcpy(tmp, bias + o, sizeof(float) * (size_t)n);
  vf v;
  memcpy(&v, tmp, sizeof v);
  return v;
}

/* Panels a one-row product takes at once (row1_*, and the one-row span tiles: experts with one
 * token): enough independent FMA chains to cover the FMA latency, where a tile's NP chains leave
 * a one-row decode latency-bound. Each panel is its own stream from memory; on AVX2 (Zen 3) more
 * streams read faster, on the AVX-512 build (Zen 5) fewer (docs/benchmarks.md, "Kernel figures"), and 4 chains of
 * 16-lane FMAs still cover the latency at that rate. */
#if LANES == 16
#define NP1 4
#define SPAN1_PANELS 4
#else
#define NP1 8
#define SPAN1_PANELS 12
#endif

/* Rows [r, r1) in tiles: MR rows a tile, then one tile of the 1..7 left, the row count a
 * constant in each case so every tile's loops unroll. The tile takes (..., rows, bias). */
#define TILE_ROWS(r, r1, tile, bias, ...)                    \
  for (; r + MR <= r1; r += MR) tile(__VA_ARGS__, MR, bias); \
  switch (r1 - r) {                                          \
    case 7: tile(__VA_ARGS__, 7, bias); break;               \
    case 6: tile(__VA_ARGS__, 6, bias); break;               \
    case 5: tile(__VA_ARGS__, 5, bias); break;               \
    case 4: tile(__VA_ARGS__, 4, bias); break;               \
    case 3: tile(__VA_ARGS__, 3, bias); break;               \
    case 2: tile(__VA_ARGS__, 2, bias); break;               \
    case 1: tile(__VA_ARGS__, 1, bias); break;               \
    default: break;                                          \
  }

/* Rows a call may have and still take span_* below's few-row tiles; more take MR x NP tiles. */
#define SPAN_ROWS 6
/* Panels a span_* work item covers: a multiple of every few-row tile's width (and of NP). */
#define SPAN_PANELS 12
/* From this many rows bf16 weights are widened once per panel group into a float32 buffer that
 * every row tile then reads (wide_rows_*), instead of widening in every tile. */
#define WIDEN_ROWS 24
/* The wide few-row tiles read 2-12 weight streams that are usually not in cache (experts with
 * one to a few tokens each: the Qwen3-30B-A3B shape at batch 32); a software prefetch this far
 * ahead of each stream is faster than none on that shape's experts (docs/benchmarks.md, "Kernel figures"). */
#ifndef PF_BYTES
#define PF_BYTES 512
#endif

/* The MR x NP tiles prefetch each panel this far ahead: an expert of a batch-32 step has ~8 rows,
 * one row tile, so every tile streams its group from memory (3 streams, 24 FMAs a step), and the
 * hardware prefetcher alone left it well below the memory's rate; 2048 bytes ahead was the best
 * distance on Zen 5 (docs/benchmarks.md, "Kernel figures"). The AVX2 build (unmeasured) keeps none. */
#ifndef TILE_PF
#if LANES == 16
#define TILE_PF 2048
#else
#define TILE_PF 0
#endif
#endif

#define DEFINE_GEMM(SUFFIX, TW, TY, LOADW, STOREY, MANY)                                         \
  static inline __attribute__((always_inline)) void tile_##SUFFIX(                              \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t p0, int64_t np,        \
      const int rows, const float* bias) {                                                       \
    vf acc[8][NP]; /* 8 >= MR: rows_* below calls tiles of up to 7 remainder rows */             \
    for (int r = 0; r < rows; r++)                                                               \
      for (int j = 0; j < NP; j++) acc[r][j] = (vf){0};                                          \
    const TW* w = wp + p0 * I * LANES;                                                           \
    if (np == NP) {                                                                              \
      for (int64_t i = 0; i < I; i++) {                                                          \
        vf wv[NP];                                                                               \
        for (int j = 0; j < NP; j++) {                                                           \
          if (TILE_PF) __builtin_prefetch((const char*)(w + (j * I + i) * LANES) + TILE_PF, 0, 0); \
          wv[j] = LOADW(w + (j * I + i) * LANES);                                                \
        }                                                                                        \
        for (int r = 0; r < rows; r++) {                                                         \
          const float xs = x[r * I + i];                                                         \
          for (int j = 0; j < NP; j++) acc[r][j] += wv[j] * xs;                                  \
        }                                                                                        \
      }                                                                                          \
    } else {                                                                                     \
      for (int64_t i = 0; i < I; i++)                                                            \
        for (int j = 0; j < np; j++) {                                                           \
          const vf wv = LOADW(w + (j * I + i) * LANES);                                         \
          for (int r = 0; r < rows; r++) acc[r][j] += wv * x[r * I + i];                         \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < np; j++) {                                                               \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                     \
      const vf b = bias_vec(bias, o, n);                                                         \
      for (int r = 0; r < rows; r++) STOREY(y + r * O + o, acc[r][j] + b, n);                     \
    }                                                                                            \
  }                                                                                              \
                                                                                                 \
  /* `rows` x `npc` accumulators (both constants, rows * npc <= 12) over np <= npc panels from  \
   * p0: the few-row tiles. Every output is the same chain of FMAs over i as in tile_*, so a    \
   * row's result does not depend on the tile that computed it. */                              \
  static inline __attribute__((always_inline)) void tilew_##SUFFIX(                             \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t p0, int64_t np,        \
      const int rows, const int npc, const float* bias) {                                        \
    vf acc[12];                                                                                  \
    for (int a = 0; a < rows * npc; a++) acc[a] = (vf){0};                                       \
    const TW* w = wp + p0 * I * LANES;                                                           \
    if (np == npc && npc <= rows) { /* tall: the weight vectors in registers, rows broadcast */  \
      for (int64_t i = 0; i < I; i++) {                                                          \
        vf wv[12];                                                                               \
        for (int j = 0; j < npc; j++) wv[j] = LOADW(w + (j * I + i) * LANES);                   \
        for (int r = 0; r < rows; r++) {                                                         \
          const float xs = x[r * I + i];                                                         \
          for (int j = 0; j < npc; j++) acc[r * npc + j] += wv[j] * xs;                          \
        }                                                                                        \
      }                                                                                          \
    } else if (np == npc) { /* wide: the row broadcasts in registers, one weight vector at a time */ \
      for (int64_t i = 0; i < I; i++) {                                                          \
        float xs[12];                                                                            \
        for (int r = 0; r < rows; r++) xs[r] = x[r * I + i];                                     \
        for (int j = 0; j < npc; j++) {                                                          \
          if (PF_BYTES) __builtin_prefetch((const char*)(w + (j * I + i) * LANES) + PF_BYTES, 0, 0); \
          const vf wv = LOADW(w + (j * I + i) * LANES);                                         \
          for (int r = 0; r < rows; r++) acc[r * npc + j] += wv * xs[r];                         \
        }                                                                                        \
      }                                                                                          \
    } else {                                                                                     \
      for (int64_t i = 0; i < I; i++)                                                            \
        for (int j = 0; j < np; j++) {                                                           \
          const vf wv = LOADW(w + (j * I + i) * LANES);                                         \
          for (int r = 0; r < rows; r++) acc[r * npc + j] += wv * x[r * I + i];                  \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < np; j++) {                                                               \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                     \
      const vf b = bias_vec(bias, o, n);                                                         \
      for (int r = 0; r < rows; r++) STOREY(y + r * O + o, acc[r * npc + j] + b, n);             \
    }                                                                                            \
  }                                                                                              \
                                                                                                 \
  /* Rows [r0, r1) of x against the NP panels from p0, in tiles (TILE_ROWS). */                  \
  static __attribute__((unused)) void rows_at_##SUFFIX(                                         \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t P, int64_t p0,         \
      int64_t r0, int64_t r1, const float* bias) {                                               \
    const int64_t np = P - p0 < NP ? P - p0 : NP;                                                \
    int64_t r = r0;                                                                              \
    TILE_ROWS(r, r1, tile_##SUFFIX, bias, x + r * I, I, wp, y + r * O, O, p0, np);               \
  }                                                                                              \
                                                                                                 \
  /* Rows [r0, r1) of x against panel group g (NP panels), in tiles (TILE_ROWS). */              \
  static __attribute__((unused)) void rows_##SUFFIX(                                            \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t P, int64_t g,          \
      int64_t r0, int64_t r1, const float* bias) {                                               \
    rows_at_##SUFFIX(x, I, wp, y, O, P, g * NP, r0, r1, bias);                                   \
  }                                                                                              \
                                                                                                 \
  /* Rows [r0, r1) against panels [q0, q1): 1-6 rows (a small batch, an expert's share of one) \
   * in one pass over the weights, with tiles as wide as the registers allow, so weights        \
   * streamed from memory are read once and by 4-12 independent chains; more rows in MR x NP    \
   * tiles (MANY). Measured: docs/history/benchmarks-2026-12.md, "Performance round 2". */      \
  static __attribute__((unused)) void span_##SUFFIX(                                            \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t P, int64_t q0,         \
      int64_t q1, int64_t r0, int64_t r1, const float* bias) {                                   \
    const int64_t n = r1 - r0;                                                                   \
    if (n > SPAN_ROWS) {                                                                         \
      for (int64_t p = q0; p < q1; p += NP) MANY(x, I, wp, y, O, P, p, r0, r1, bias);            \
      return;                                                                                    \
    }                                                                                            \
    x += r0 * I;                                                                                 \
    y += r0 * O;                                                                                 \
    SPAN_CASES(tilew_##SUFFIX, n, q0, q1, x, I, wp, y, O, bias)                                  \
  }                                                                                              \
                                                                                                 \
  /* One row of x against panel group g of NP1 panels (decode): NP1 independent accumulator    \
   * chains instead of a tile's NP, each summed in the same order as in a tile, so the result is \
   * bit for bit the tiles' (a row's product does not depend on how many rows a call has). */   \
  static __attribute__((unused)) void row1_##SUFFIX(                                            \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t P, int64_t g,          \
      const float* bias) {                                                                       \
    const int64_t p0 = g * NP1, np = P - p0 < NP1 ? P - p0 : NP1;                                \
    if (np < NP1) {                                                                              \
      for (int64_t q = p0; q < P; q += NP)                                                       \
        tile_##SUFFIX(x, I, wp, y, O, q, P - q < NP ? P - q : NP, 1, bias);                      \
      return;                                                                                    \
    }                                                                                            \
    vf acc[NP1];                                                                                 \
    for (int j = 0; j < NP1; j++) acc[j] = (vf){0};                                              \
    const TW* w = wp + p0 * I * LANES;                                                           \
    for (int64_t i = 0; i < I; i++) {                                                            \
      const float xs = x[i];                                                                     \
      for (int j = 0; j < NP1; j++) acc[j] += LOADW(w + (j * I + i) * LANES) * xs;              \
    }                                                                                            \
    for (int j = 0; j < NP1; j++) {                                                              \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                     \
      STOREY(y + o, acc[j] + bias_vec(bias, o, n), n);                                           \
    }                                                                                            \
  }

/* The few-row tiles for n rows (1..6) over panels [q0, q1), width by row count: 12 accumulators
 * at most (AVX2 has 16 registers: the rest hold a weight vector and broadcasts). */
#define SPAN_TILES(tile, rows, npc, q0, q1, x, I, wp, y, O, bias)                                    \
  for (int64_t p = q0; p < q1; p += npc)                                                          \
  tile(x, I, wp, y, O, p, q1 - p < npc ? q1 - p : npc, rows, npc, bias)
#define SPAN_CASES(tile, n, q0, q1, ...)                         \
  switch (n) {                                                   \
    case 1: SPAN_TILES(tile, 1, SPAN1_PANELS, q0, q1, __VA_ARGS__); break; \
    case 2: SPAN_TILES(tile, 2, 6, q0, q1, __VA_ARGS__); break;  \
    case 3: SPAN_TILES(tile, 3, 4, q0, q1, __VA_ARGS__); break;  \
    case 4: SPAN_TILES(tile, 4, 3, q0, q1, __VA_ARGS__); break;  \
    case 5: SPAN_TILES(tile, 5, 2, q0, q1, __VA_ARGS__); break;  \
    case 6: SPAN_TILES(tile, 6, 2, q0, q1, __VA_ARGS__); break;  \
    default: break;                                              \
  }
static void wide_rows_bf16(const float* x, int64_t I, const bf16_t* wp, bf16_t* y, int64_t O, int64_t P,
                           int64_t p0, int64_t r0, int64_t r1, const float* bias);
static void wide_rows_bf16_f32(const float* x, int64_t I, const bf16_t* wp, float* y, int64_t O,
                               int64_t P, int64_t p0, int64_t r0, int64_t r1, const float* bias);

DEFINE_GEMM(f32, float, float, load_panel_f32, store_row_f32, rows_at_f32)
/* float32 weights (a widened bf16 panel group), bf16 output: wide_rows_bf16's tiles. */
DEFINE_GEMM(f32_bf16, float, bf16_t, load_panel_f32, store_row_bf16, rows_at_f32_bf16)
DEFINE_GEMM(bf16, bf16_t, bf16_t, load_panel_bf16, store_row_bf16, wide_rows_bf16)
/* bf16 weights, float32 output: partial sums that other ranks add to (rounded after the sum),
 * and the routed experts' intermediates (moe_bf16 without pairs). */
DEFINE_GEMM(bf16_f32, bf16_t, float, load_panel_bf16, store_row_f32, wide_rows_bf16_f32)
