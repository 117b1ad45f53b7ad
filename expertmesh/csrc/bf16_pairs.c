/* Part of cpu_kernels.c (one translation unit; see its list): bf16 pair products (AVX512-BF16) and the AVX2 bf16 experts plan. */

/* ---- bfloat16 with AVX512-BF16: products on pairs of inputs ----------------------------------
 * vdpbf16ps multiplies bf16 pairs and accumulates in float32: twice the work of a float32 FMA
 * per instruction. Weights are packed as wp[P][I2][LANES][2] (I2 = ceil(I/2): each lane holds
 * the pair W[o, 2i], W[o, 2i+1]); x is read as pairs too, so one broadcast 32-bit load feeds
 * LANES outputs. Without AVX512-BF16, bf16_pairs() is 0 and bfloat16 weights take gemm_bf16's
 * widening path above or oneDNN (see cpu_gemm.py). */
#if defined(__AVX512BF16__) && LANES == 16
#include <immintrin.h>

int64_t bf16_pairs(void) { return 1; }

static inline __attribute__((always_inline)) void tile_pairs(const uint32_t* x, int64_t I2,
                                                            const bf16_t* wp, void* y, int y_bf16,
                                                            int64_t O, int64_t p0, int64_t np,
                                                            const int rows, const float* bias) {
  __m512 acc[8][NP];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < NP; j++) acc[r][j] = _mm512_setzero_ps();
  const bf16_t* w = wp + p0 * I2 * 2 * LANES;
  if (np == NP) {
    for (int64_t i = 0; i < I2; i++) {
      __m512i wv[NP];
      for (int j = 0; j < NP; j++) wv[j] = _mm512_loadu_si512((const void*)(w + (j * I2 + i) * 2 * LANES));
      for (int r = 0; r < rows; r++) {
        const __m512i xb = _mm512_set1_epi32((int)x[r * I2 + i]);
        for (int j = 0; j < NP; j++)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv[j], (__m512bh)xb);
      }
    }
  } else {
    for (int64_t i = 0; i < I2; i++)
      for (int j = 0; j < np; j++) {
        const __m512i wv = _mm512_loadu_si512((const void*)(w + (j * I2 + i) * 2 * LANES));
        for (int r = 0; r < rows; r++)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)wv, (__m512bh)_mm512_set1_epi32((int)x[r * I2 + i]));
      }
  }
  for (int j = 0; j < np; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    const __mmask16 mask = (__mmask16)((1u << n) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + o) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
      const __m512 v = _mm512_add_ps(acc[r][j], b);
      if (y_bf16) /* round to nearest even */
        _mm256_mask_storeu_epi16((bf16_t*)y + r * O + o, mask, (__m256i)_mm512_cvtneps_pbh(v));
      else
        _mm512_mask_storeu_ps((float*)y + r * O + o, mask, v);
    }
  }
}

/* Rows [r0, r1) of pairs x (I2 per row) against panel group g; outputs of width O. */
static void rows_pairs(const uint32_t* x, int64_t I2, const bf16_t* wp, void* y, int y_bf16,
                       int64_t O, int64_t P, int64_t g, int64_t r0, int64_t r1, const float* bias) {
  const int64_t p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;
  char* yb = (char*)y;
  const int64_t row_bytes = O * (int64_t)(y_bf16 ? sizeof(bf16_t) : sizeof(float));
  int64_t r = r0;
  TILE_ROWS(r, r1, tile_pairs, bias, x + r * I2, I2, wp, yb + r * row_bytes, y_bf16, O, p0, np);
}

/* A bf16 row of width I as I2 pairs, an odd tail paired with zero. */
static inline void to_pairs(const bf16_t* x, int64_t I, uint32_t* out) {
  for (int64_t i = 0; i < I / 2; i++) out[i] = (uint32_t)x[2 * i] | ((uint32_t)x[2 * i + 1] << 16);
  if (I % 2) out[I / 2] = (uint32_t)x[I - 1];
}

static void gemm_pairs_to(const bf16_t* x, const bf16_t* wp, void* y, int y_bf16, int64_t M, int64_t O,
                          int64_t I, const float* bias, int threads) {
  const int64_t I2 = (I + 1) / 2, P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;
  uint32_t* xp = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(M * I2 + 1));
  for (int64_t r = 0; r < M; r++) to_pairs(x + r * I, I, xp + r * I2);
  const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t item = 0; item < blocks * groups; item++) {
    const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
    rows_pairs(xp, I2, wp, y, y_bf16, O, P, item % groups, r0, r1, bias);
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

/* moe_f32's plan with bf16 weights and input: pair products; the gate and up outputs rounded to
 * bf16 and the activation's output rounded to bf16 (what a bf16 model's projections return and
 * its down projection receives); the weighted sum written in float32, not rounded: it is a
 * partial sum other ranks may add to, rounded to bf16 once, by the caller, after that. */
void moe_bf16_ex(const bf16_t* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                 const bf16_t* w13, const bf16_t* w2, int64_t E, int64_t I, int act, float limit, float alpha,
                 const float* b13, const float* b2, float* out, int threads) {
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t H2 = (H + 1) / 2, I2 = (I + 1) / 2;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, G13 = (P13 + NP - 1) / NP;
  const int64_t P2 = (H + LANES - 1) / LANES, G2 = (P2 + NP - 1) / NP;
  uint32_t* xs = (uint32_t*)malloc(sizeof(uint32_t) * (size_t)(m * H2 + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* af = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  uint32_t* a = (uint32_t*)calloc((size_t)(m * I2 + 1), sizeof(uint32_t));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      to_pairs(x + (p.pair_of_row[r] / k) * H, H, xs + r * H2);
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G13; item++) {
      const int64_t e = p.active[item / G13];
      rows_pairs(xs, H2, w13 + e * P13 * H2 * 2 * LANES, h, 0, 2 * I, P13, item % G13, p.start[e],
                 p.start[e + 1], b13 ? b13 + e * 2 * I : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      float* hr = h + r * 2 * I;
      bf16_t* ar = (bf16_t*)(a + r * I2);
      for (int64_t i = 0; i < 2 * I; i++) hr[i] = bf16_to_f32(f32_to_bf16(hr[i]));
      act_row(hr, af + r * I, I, act, limit, alpha);
      for (int64_t i = 0; i < I; i++) ar[i] = f32_to_bf16(af[r * I + i]);
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G2; item++) {
      const int64_t e = p.active[item / G2];
      rows_pairs(a, I2, w2 + e * P2 * I2 * 2 * LANES, ys, 0, H, P2, item % G2, p.start[e],
                 p.start[e + 1], b2 ? b2 + e * H : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(af); free(a); free(ys);
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
