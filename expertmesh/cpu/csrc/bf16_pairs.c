/* Part of cpu_kernels.c (one translation unit; see its list): bf16 pair products (AVX512-BF16) and the AVX2 bf16 experts plan. */

/* ---- bfloat16 with AVX512-BF16: products on pairs of inputs ----------------------------------
 * vdpbf16ps multiplies bf16 pairs and accumulates in float32: twice the work of a float32 FMA
 * per instruction. Weights are packed as wp[P][I2][LANES][2] (I2 = ceil(I/2): each lane holds
 * the pair W[o, 2i], W[o, 2i+1]); x is read as pairs too, so one broadcast 32-bit load feeds
 * LANES outputs. Without AVX512-BF16, bf16_pairs() is 0 and bfloat16 weights take gemm_bf16's
 * widening path above or oneDNN (see cpu_gemm.py).
 *
 * Every output is one chain of vdpbf16ps over its pairs in order (i = 0 .. I2-1) from zero, then
 * + bias, whatever tile computes it: a row's product does not depend on how many rows a call has
 * or how they are tiled. Tiles by rows (measured: docs/history/benchmarks-2026-12.md, "bf16 pair products"):
 *   4 and more  8 rows x 3 panels a tile (narrower for a group's last 1-2 panels); the first row
 *               tile of a group reads it from memory, prefetched, the others from cache;
 *   1-3 rows    one pass over the weights, 4-6 panels a tile (1 x 4, 2 x 6, 3 x 4), prefetched
 *               from 2 rows on;
 *   experts     w13's gate and up panels side by side (gated tiles, 12 rows x (1 + 1) panels), the
 *               activation in the tile's epilogue: the [rows, 2I] float32 intermediate is never
 *               written nor read back (I a multiple of LANES; else the plain tiles and a pass). */
#if defined(__AVX512BF16__) && LANES == 16
#include <immintrin.h>

int64_t bf16_pairs(void) { return 1; }

/* One input pair as a 32-bit word: x may be a bf16 tensor's own rows (2-byte aligned). */
typedef uint32_t pair_t __attribute__((aligned(2), may_alias));

/* Tiles that read their weights from memory prefetch each panel this far ahead: an 8-row step is
 * 12 cycles of vdpbf16ps per 3 cache lines, and the hardware prefetcher alone kept one core at
 * well under what it streams (experts at batch 32, ~8 rows each: docs/benchmarks.md, "Kernel figures"). Past a
 * buffer's end they touch nothing: prefetches do not fault. */
#ifndef PAIR_PF
#define PAIR_PF 2048
#endif
/* Panels a work item covers (few-row products, experts): a multiple of the wide tiles' widths 4
 * and 6, halved while there would be fewer than 2 items a thread (many threads, few experts). */
#define PAIR_SPAN 12
static int64_t pair_span(int64_t span, int64_t panels, int64_t parts, int threads) {
  while (span % 2 == 0 && parts * ((panels + span - 1) / span) < 2 * (int64_t)threads) span /= 2;
  return span;
}
/* Row counts up to this take the wide tiles. */
#define PAIR_FEW 3

/* rows x npc accumulators (constants: the loops unroll and stay in registers) over the pairs of
 * x; panel j is read from lo + j * S (S = I2 * 2 * LANES) for j < half, from lo + hi +
 * (j - half) * S after that (the gated tiles' gate and up panels; plain tiles pass half = npc).
 * pf: prefetch each panel stream PAIR_PF bytes ahead. */
static inline __attribute__((always_inline)) void pairs_loop(const pair_t* x, int64_t I2, const bf16_t* lo,
                                                            int64_t hi, const int half, __m512* acc,
                                                            const int rows, const int npc, const int pf) {
  const int64_t S = I2 * 2 * LANES;
  int64_t off[12];
  for (int j = 0; j < npc; j++) off[j] = j < half ? j * S : hi + (j - half) * S;
  for (int a = 0; a < rows * npc; a++) acc[a] = _mm512_setzero_ps();
  const bf16_t* w = lo;
  for (int64_t i = 0; i < I2; i++, w += 2 * LANES) {
    __m512i wv[12];
    for (int j = 0; j < npc; j++) {
      if (pf) __builtin_prefetch((const char*)(w + off[j]) + PAIR_PF, 0, 3);
      wv[j] = _mm512_loadu_si512((const void*)(w + off[j]));
    }
    for (int r = 0; r < rows; r++) {
      const __m512i xb = _mm512_set1_epi32((int)x[r * I2 + i]);
      for (int j = 0; j < npc; j++)
        acc[r * npc + j] = _mm512_dpbf16_ps(acc[r * npc + j], (__m512bh)wv[j], (__m512bh)xb);
    }
  }
}

/* rows x npc panels from p0 into y (rows of width O, bf16 rounded or float32), bias added (a
 * zero vector without one, as before: -0 sums come out +0). */
static inline __attribute__((always_inline)) void tile_pairs(const pair_t* x, int64_t I2, const bf16_t* wp,
                                                            void* y, int y_bf16, int64_t O, int64_t p0,
                                                            const int rows, const int npc, const float* bias,
                                                            const int pf) {
  __m512 acc[24];
  pairs_loop(x, I2, wp + p0 * I2 * 2 * LANES, 0, npc, acc, rows, npc, pf);
  for (int j = 0; j < npc; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + o) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
      const __m512 v = _mm512_add_ps(acc[r * npc + j], b);
      if (y_bf16) /* round to nearest even */
        _mm256_mask_storeu_epi16((bf16_t*)y + r * O + o, mask, (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_mask_storeu_ps((float*)y + r * O + o, mask, v);
    }
  }
}

/* Every tile shape is its own function, called through tables: inlined into one driver, the
 * shapes' loops shared its registers and the 8-row tile spilled its row offsets (3-6% slower). */
typedef void (*pair_tile_fn)(const pair_t* x, int64_t I2, const bf16_t* wp, void* y, int y_bf16, int64_t O,
                             int64_t p0, const float* bias);
#define PAIR_TILE(R, N, PF)                                                                               \
  static __attribute__((noinline)) void pair_tile_##R##_##N##_##PF(                                      \
      const pair_t* x, int64_t I2, const bf16_t* wp, void* y, int y_bf16, int64_t O, int64_t p0,           \
      const float* bias) {                                                                                \
    tile_pairs(x, I2, wp, y, y_bf16, O, p0, R, N, bias, PF);                                              \
  }
#define PAIR_TILES(N, PF)                                                                                 \
  PAIR_TILE(1, N, PF) PAIR_TILE(2, N, PF) PAIR_TILE(3, N, PF) PAIR_TILE(4, N, PF) PAIR_TILE(5, N, PF)     \
  PAIR_TILE(6, N, PF) PAIR_TILE(7, N, PF) PAIR_TILE(8, N, PF)
PAIR_TILES(3, 0)
PAIR_TILES(3, 1)
PAIR_TILES(2, 0)
PAIR_TILES(2, 1)
PAIR_TILES(1, 0)
PAIR_TILES(1, 1)
/* the wide few-row tiles; one row without prefetch: from memory it streams at the bandwidth
 * either way, and from cache the prefetches (and wider tiles: 8 or 12 panels) cost 5-20% */
PAIR_TILE(1, 4, 0)
PAIR_TILE(2, 6, 1)
PAIR_TILE(3, 4, 1)
#define PAIR_TABLE(N, PF)                                                                                 \
  {NULL, pair_tile_1_##N##_##PF, pair_tile_2_##N##_##PF, pair_tile_3_##N##_##PF, pair_tile_4_##N##_##PF, \
   pair_tile_5_##N##_##PF, pair_tile_6_##N##_##PF, pair_tile_7_##N##_##PF, pair_tile_8_##N##_##PF}
/* [panels - 1][pf][rows]: MR x NP tiles and their remainders, narrower ones for a short group */
static const pair_tile_fn pair_tiles[NP][2][MR + 1] = {{PAIR_TABLE(1, 0), PAIR_TABLE(1, 1)},
                                                       {PAIR_TABLE(2, 0), PAIR_TABLE(2, 1)},
                                                       {PAIR_TABLE(3, 0), PAIR_TABLE(3, 1)}};
static const pair_tile_fn wide_tiles[PAIR_FEW + 1] = {NULL, pair_tile_1_4_0, pair_tile_2_6_1, pair_tile_3_4_1};
static const int64_t wide_panels[PAIR_FEW + 1] = {0, 4, 6, 4};

/* Rows [r0, r1) of pairs x (I2 a row) against panels [q0, q1) (outputs of width O) into y's rows:
 * 1-3 rows in wide tiles, one pass over the weights; more in MR-row tiles per group of NP panels,
 * the first streaming the group from memory (prefetched), the others reading it from cache. */
static void run_pairs(const pair_t* x, int64_t I2, const bf16_t* wp, void* y, int y_bf16, int64_t O,
                      int64_t q0, int64_t q1, int64_t r0, int64_t r1, const float* bias) {
  const int64_t n = r1 - r0, esz = y_bf16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
  char* yb = (char*)y;
  int64_t p = q0;
  if (n <= 0) return;
  if (n <= PAIR_FEW) {
    const pair_t* xr = x + r0 * I2;
    void* yr = yb + r0 * O * esz;
    for (; p + wide_panels[n] <= q1; p += wide_panels[n]) wide_tiles[n](xr, I2, wp, yr, y_bf16, O, p, bias);
    for (int64_t np; p < q1; p += np) {
      np = q1 - p < NP ? q1 - p : NP;
      pair_tiles[np - 1][n > 1][n](xr, I2, wp, yr, y_bf16, O, p, bias);
    }
    return;
  }
  for (int64_t np; p < q1; p += np) {
    np = q1 - p < NP ? q1 - p : NP;
    for (int64_t r = r0; r < r1; r += MR) {
      const int64_t rows = r1 - r < MR ? r1 - r : MR;
      pair_tiles[np - 1][r == r0][rows](x + r * I2, I2, wp, yb + r * O * esz, y_bf16, O, p, bias);
    }
  }
}

/* A bf16 row of width I as I2 pairs, an odd tail paired with zero. */
static inline void to_pairs(const bf16_t* x, int64_t I, uint32_t* out) {
  for (int64_t i = 0; i < I / 2; i++) out[i] = (uint32_t)x[2 * i] | ((uint32_t)x[2 * i + 1] << 16);
  if (I % 2) out[I / 2] = (uint32_t)x[I - 1];
}

static void gemm_pairs_to(const bf16_t* x, const bf16_t* wp, void* y, int y_bf16, int64_t M, int64_t O,
                          int64_t I, const float* bias, int threads) {
  const int64_t I2 = (I + 1) / 2, P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;
  if (M <= 0) return;
  /* with I even a bf16 row already is I2 pairs (the even element in the low half); odd ones are
   * copied with a zero after each row's last element */
  uint32_t* xp = NULL;
  const pair_t* xs = (const pair_t*)x;
  if (I % 2) {
    xp = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(M * I2));
    for (int64_t r = 0; r < M; r++) to_pairs(x + r * I, I, xp + r * I2);
    xs = xp;
  }
  if (M <= PAIR_FEW) {
    const int64_t span = pair_span(PAIR_SPAN, P, 1, threads), spans = (P + span - 1) / span;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t s = 0; s < spans; s++) {
      const int64_t q0 = s * span, q1 = q0 + span < P ? q0 + span : P;
      run_pairs(xs, I2, wp, y, y_bf16, O, q0, q1, 0, M, bias);
    }
  } else {
    const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t item = 0; item < blocks * groups; item++) {
      const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
      const int64_t q0 = item % groups * NP, q1 = q0 + NP < P ? q0 + NP : P;
      run_pairs(xs, I2, wp, y, y_bf16, O, q0, q1, r0, r1, bias);
    }
  }
  free(xp);
}

void gemm_bf16_pairs(const bf16_t* x, const bf16_t* wp, bf16_t* y, int64_t M, int64_t O, int64_t I,
                     const float* bias, int threads) {
  gemm_pairs_to(x, wp, y, 1, M, O, I, bias, threads);
}

/* float32 output, not rounded: for partial sums that are added across ranks first. */
void gemm_bf16_pairs_f32(const bf16_t* x, const bf16_t* wp, float* y, int64_t M, int64_t O, int64_t I,
                         const float* bias, int threads) {
  gemm_pairs_to(x, wp, y, 0, M, O, I, bias, threads);
}

/* Gated tiles: rows x (g gate panels from q and the g up panels from PI + q; PI = I / LANES) of
 * the experts' first product; then h = acc + bias rounded to bf16, act_row, its output rounded
 * to bf16 into a (I bf16 a row: the down projection's input pairs). act_row is elementwise, so
 * over a tile's columns it gives what it gives over whole rows; the tile's rows go in one call
 * (gate values of all rows, then up values), its loops over whole vectors. */
static inline __attribute__((always_inline)) void tile_gated(const pair_t* x, int64_t H2, const bf16_t* w13,
                                                            bf16_t* a, int64_t I, int64_t q, const int rows,
                                                            const int g, const float* b13, int act, float limit,
                                                            float alpha, const int pf) {
  __m512 acc[24];
  const int64_t S = H2 * 2 * LANES, PI = I / LANES;
  const int n = rows * g * LANES;
  float h[2 * 12 * LANES], af[12 * LANES];
  pairs_loop(x, H2, w13 + q * S, PI * S, g, acc, rows, 2 * g, pf);
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < 2 * g; j++) {
      const int64_t o = (j < g ? q + j : PI + q + j - g) * LANES;
      const __m512 b = b13 ? _mm512_loadu_ps(b13 + o) : _mm512_setzero_ps();
      _mm512_storeu_ps(h + (j < g ? 0 : n) + (r * g + j % g) * LANES, _mm512_add_ps(acc[r * 2 * g + j], b));
    }
  _Pragma("omp simd") for (int c = 0; c < 2 * n; c++) h[c] = round_bf16(h[c]);
  act_row(h, af, n, act, limit, alpha);
  for (int r = 0; r < rows; r++) {
    bf16_t* ar = a + r * I + q * LANES;
    _Pragma("omp simd") for (int c = 0; c < g * LANES; c++) ar[c] = f32_to_bf16_vec(af[r * g * LANES + c]);
  }
}

typedef void (*gated_tile_fn)(const pair_t* x, int64_t H2, const bf16_t* w13, bf16_t* a, int64_t I, int64_t q,
                              const float* b13, int act, float limit, float alpha);
#define GATED_TILE(R, G, PF)                                                                               \
  static __attribute__((noinline)) void gated_tile_##R##_##G##_##PF(                                      \
      const pair_t* x, int64_t H2, const bf16_t* w13, bf16_t* a, int64_t I, int64_t q, const float* b13,  \
      int act, float limit, float alpha) {                                                                 \
    tile_gated(x, H2, w13, a, I, q, R, G, b13, act, limit, alpha, PF);                                     \
  }
/* Rows a gated tile takes: 12 x (1 + 1) panels, faster than 6 x (2 + 2) at ~8 rows an expert
 * (batch 32: most experts' w13 read once, by one tile) and equal at hundreds (docs/benchmarks.md, "Kernel figures"). */
#define MRG 12
#define GATED_TILES(PF)                                                                                    \
  GATED_TILE(1, 1, PF) GATED_TILE(2, 1, PF) GATED_TILE(3, 1, PF) GATED_TILE(4, 1, PF) GATED_TILE(5, 1, PF) \
  GATED_TILE(6, 1, PF) GATED_TILE(7, 1, PF) GATED_TILE(8, 1, PF) GATED_TILE(9, 1, PF) GATED_TILE(10, 1, PF) \
  GATED_TILE(11, 1, PF) GATED_TILE(12, 1, PF)
GATED_TILES(0)
GATED_TILES(1)
GATED_TILE(1, 2, 0) /* the wide ones, as the plain tiles' */
GATED_TILE(2, 3, 1)
GATED_TILE(3, 2, 1)
#define GATED_TABLE(PF)                                                                                    \
  {NULL, gated_tile_1_1_##PF, gated_tile_2_1_##PF, gated_tile_3_1_##PF, gated_tile_4_1_##PF,                \
   gated_tile_5_1_##PF, gated_tile_6_1_##PF, gated_tile_7_1_##PF, gated_tile_8_1_##PF, gated_tile_9_1_##PF, \
   gated_tile_10_1_##PF, gated_tile_11_1_##PF, gated_tile_12_1_##PF}
static const gated_tile_fn gated_tiles[2][MRG + 1] = {GATED_TABLE(0), GATED_TABLE(1)};
static const gated_tile_fn wide_gated[PAIR_FEW + 1] = {NULL, gated_tile_1_2_0, gated_tile_2_3_1, gated_tile_3_2_1};
static const int64_t wide_gate_panels[PAIR_FEW + 1] = {0, 2, 3, 2};

/* Gate panels [q0, q1) of the gated tiles for rows [r0, r1) (x, a: row 0): 1-3 rows in one pass
 * (wide tiles), more in MRG-row tiles, the first of each panel streaming it from memory. */
static void run_gated(const pair_t* x, int64_t H2, const bf16_t* w13, bf16_t* a, int64_t I, int64_t q0,
                      int64_t q1, int64_t r0, int64_t r1, const float* b13, int act, float limit, float alpha) {
  const int64_t n = r1 - r0;
  int64_t q = q0;
  if (n <= 0) return;
  if (n <= PAIR_FEW) {
    const pair_t* xr = x + r0 * H2;
    bf16_t* ar = a + r0 * I;
    for (; q + wide_gate_panels[n] <= q1; q += wide_gate_panels[n])
      wide_gated[n](xr, H2, w13, ar, I, q, b13, act, limit, alpha);
    for (; q < q1; q++) gated_tiles[n > 1][n](xr, H2, w13, ar, I, q, b13, act, limit, alpha);
    return;
  }
  for (; q < q1; q++)
    for (int64_t r = r0; r < r1; r += MRG) {
      const int64_t rows = r1 - r < MRG ? r1 - r : MRG;
      gated_tiles[r == r0][rows](x + r * H2, H2, w13, a + r * I, I, q, b13, act, limit, alpha);
    }
}

/* moe_f32's plan with bf16 weights and input: pair products; the gate and up outputs rounded to
 * bf16 and the activation's output rounded to bf16 (what a bf16 model's projections return and
 * its down projection receives); the weighted sum written in float32, not rounded: it is a
 * partial sum other ranks may add to, rounded to bf16 once, by the caller, after that.
 * Work items: (expert, span of w2's panels; of w13 the gated tiles' gate panels and their up
 * panels, or plain panels; pair_span); each picks its tiles by its expert's rows. */
void moe_bf16_ex(const bf16_t* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                 const bf16_t* w13, const bf16_t* w2, int64_t E, int64_t I, int act, float limit, float alpha,
                 const float* b13, const float* b2, float* out, int threads) {
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t H2 = (H + 1) / 2, I2 = (I + 1) / 2;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, P2 = (H + LANES - 1) / LANES, PI = I / LANES;
  const int gated = I % LANES == 0; /* gate and up in whole panels: the activation in the tiles */
  const int64_t end13 = gated ? PI : P13; /* w13's items: gate panels (their up panels with them) */
  const int64_t span13 = pair_span(gated ? PAIR_SPAN / 2 : PAIR_SPAN, end13, p.na, threads);
  const int64_t span2 = pair_span(PAIR_SPAN, P2, p.na, threads);
  const int64_t S13 = (end13 + span13 - 1) / span13, S2 = (P2 + span2 - 1) / span2;
  /* one scratch for the call (common.h): pairs of the rows, [h, af] when not gated, pairs of the
   * activated rows, the products; 4-byte words each */
  const int64_t nx = m * H2 + 1, nh = gated ? 0 : m * 2 * I + 1, nf = gated ? 0 : m * I + 1, na = m * I2 + 1;
  uint32_t* buf = (uint32_t*)scratch_get(7, sizeof(uint32_t) * (size_t)(nx + nh + nf + na + m * H + 1));
  uint32_t* xs = buf;
  float* h = gated ? NULL : (float*)(buf + nx);
  float* af = gated ? NULL : (float*)(buf + nx + nh);
  uint32_t* a = buf + nx + nh + nf;
  float* ys = (float*)(a + na);
  if (I % 2) memset(a, 0, sizeof(uint32_t) * (size_t)na); /* odd I: the last pair's second half zero */
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      to_pairs(x + (p.pair_of_row[r] / k) * H, H, xs + r * H2);
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * S13; item++) {
      const int64_t e = p.active[item / S13], q0 = item % S13 * span13;
      const int64_t q1 = q0 + span13 < end13 ? q0 + span13 : end13;
      const bf16_t* we = w13 + e * P13 * H2 * 2 * LANES;
      const float* be = b13 ? b13 + e * 2 * I : NULL;
      if (gated)
        run_gated(xs, H2, we, (bf16_t*)a, I, q0, q1, p.start[e], p.start[e + 1], be, act, limit, alpha);
      else
        run_pairs(xs, H2, we, h, 0, 2 * I, q0, q1, p.start[e], p.start[e + 1], be);
    }
    if (!gated) {
      _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
        float *hr = h + r * 2 * I, *ag = af + r * I;
        bf16_t* ar = (bf16_t*)(a + r * I2); /* odd I: the memset's zero pads the last pair */
        _Pragma("omp simd") for (int64_t i = 0; i < 2 * I; i++) hr[i] = round_bf16(hr[i]);
        act_row(hr, ag, I, act, limit, alpha);
        _Pragma("omp simd") for (int64_t i = 0; i < I; i++) ar[i] = f32_to_bf16_vec(ag[i]);
      }
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * S2; item++) {
      const int64_t e = p.active[item / S2], q0 = item % S2 * span2;
      run_pairs(a, I2, w2 + e * P2 * I2 * 2 * LANES, ys, 0, H, q0, q0 + span2 < P2 ? q0 + span2 : P2, p.start[e],
                p.start[e + 1], b2 ? b2 + e * H : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  scratch_put(7, buf);
  moe_free(&p);
}
#else
int64_t bf16_pairs(void) { return 0; }

/* moe_widened's bf16 plan: on CPUs without pair products (AVX2) the weights are widened to
 * float32 in registers (span_bf16_f32), the inputs once when gathered; the rounding is the pair
 * version's above. */
void moe_bf16_ex(const bf16_t* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                 const bf16_t* w13, const bf16_t* w2, int64_t E, int64_t I, int act, float limit, float alpha,
                 const float* b13, const float* b2, float* out, int threads) {
  moe_widened(1, x, n, H, slot, w, k, w13, w2, E, I, act, limit, alpha, b13, b2, out, threads);
}
#endif

/* moe_bf16_ex without biases, for the gated activations 0-2 (native decode calls it). */
void moe_bf16(const bf16_t* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
              const bf16_t* w13, const bf16_t* w2, int64_t E, int64_t I, int act, float* out,
              int threads) {
  moe_bf16_ex(x, n, H, slot, w, k, w13, w2, E, I, act, 0.f, 0.f, NULL, NULL, out, threads);
}
