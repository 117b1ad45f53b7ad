/* Part of cpu_kernels.c (one translation unit; see its list): int8 / int4 weights with int8 activations
 * (W8A8, W4A8): the activations' quantization and the tiles of many rows. */

/* ---- int8 weights with int8 activations (W8A8, kind 4) -------------------------------------
 * Codes are int8 (symmetric, W = code * s; offsets unused) in panels of 4 inputs: byte
 * ((p * I4 + i / 4) * LANES + l) * 4 + i % 4 is code(p * LANES + l, i), I4 = ceil(I / 4), inputs past I
 * zero. Activations are quantized per row and group of gs inputs (gs a multiple of 4, or one group
 * of all I): sx = amax / 127, xq = round-half-even(x / sx) (amax 0: all codes 0). Per group the
 * exact int32 sum of code * xq is taken, then acc += float(sum) * (s * sx), groups in order. */
#define QMR_A 4

/* AVX-512 (16 lanes): 4 products of unsigned bytes u and signed bytes s summed into each 32-bit lane
 * of acc. AVX512-VNNI's vpdpbusd is exact in int32 (wrapping, so a sum that ends in range is right
 * even where a partial one was not); without VNNI, maddubs sums pairs in int16 with saturation, so
 * callers keep |u * s| pairs below 2^15 there (W8A8 takes |w| and x with w's sign, W4A8's codes are
 * at most 15). */
#if LANES == 16 && defined(__AVX512BW__)
#define Q_A512 1
#include <immintrin.h>
static inline __m512i dot4_512(__m512i acc, __m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}

/* W8A8's signed x signed products on AVX-512, for one step k of NPC panels (w) and R rows (xb[r]: the
 * row's 4 activations broadcast). With VNNI, x + 128 (unsigned) times w costs one instruction a
 * (row, panel) and 128 * sum(w), counted once per panel in comp, is taken off when the group folds
 * (q8_fold_512); without VNNI, |w| times x with w's sign, as the AVX2 tiles do. */
static inline __attribute__((always_inline)) void q8_step_512(__m512i isum[][NP], __m512i comp[NP],
                                                              const __m512i w[NP], const __m512i xb[],
                                                              const int npc, const int rows) {
#if defined(__AVX512VNNI__)
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  for (int j = 0; j < npc; j++) comp[j] = _mm512_dpbusd_epi32(comp[j], _mm512_set1_epi8(1), w[j]);
  for (int r = 0; r < rows; r++) {
    const __m512i xu = _mm512_xor_si512(xb[r], flip);
    for (int j = 0; j < npc; j++) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], xu, w[j]);
  }
#else
  (void)comp;
  for (int j = 0; j < npc; j++) {
    const __m512i aw = _mm512_abs_epi8(w[j]);
    const __mmask64 neg = _mm512_movepi8_mask(w[j]);
    for (int r = 0; r < rows; r++)
      isum[r][j] = dot4_512(isum[r][j], aw, _mm512_mask_sub_epi8(xb[r], neg, _mm512_setzero_si512(), xb[r]));
  }
#endif
}

/* A group's exact integer sum of code * xq as float32 (VNNI: less the 128 * sum(w) of q8_step_512). */
static inline vf q8_fold_512(__m512i isum, __m512i comp) {
#if defined(__AVX512VNNI__)
  isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(comp, 7));
#else
  (void)comp;
#endif
  return (vf)_mm512_cvtepi32_ps(isum);
}
#else
#define Q_A512 0
#endif

/* Bytes of one row of quantized activations: W8A8 reads 4 inputs a step, W4A8 8 (two nibble quads). */
#define A_STRIDE(kind, I) ((kind) == 5 ? 8 * (((I) + 7) / 8) : 4 * (((I) + 3) / 4))

/* x [M, I] float -> xq [M, stride] int8 (zero padded), sx [M, G] and, if xsum is not NULL,
 * xsum [M, G] = sx * sum(xq) over the group (W4A8's offset term); rows [r0, r1). */
static void q_act_rows(const float* x, int64_t I, int64_t gs, int64_t stride, int8_t* xq, float* sx,
                       float* xsum, int64_t r0, int64_t r1) {
  const int64_t G = (I + gs - 1) / gs;
  for (int64_t r = r0; r < r1; r++) {
    const float* xr = x + r * I;
    int8_t* q = xq + r * stride;
    for (int64_t g = 0; g < G; g++) {
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;
      float amax = 0.f; /* not fmaxf: a libm call per input here (perf: ~2% of a w8a8 decode step) */
      _Pragma("omp simd reduction(max : amax)") for (int64_t i = i0; i < i1; i++) {
        const float a = fabsf(xr[i]);
        amax = a > amax ? a : amax;
      }
      const float s = amax / 127.f;
      sx[r * G + g] = s;
      int32_t total = 0;
      if (amax > 0.f) {
        /* round half to even by adding and taking away 1.5 * 2^23 (exact for |v| <= 127.x): what
         * nearbyintf gives, in vectors (nearbyintf was a scalar call with a scalar divide an input:
         * perf, w4a8 batch 32: 8% of a decode step) */
        _Pragma("omp simd reduction(+ : total)") for (int64_t i = i0; i < i1; i++) {
          const int8_t c = (int8_t)(int32_t)((xr[i] / s + 12582912.f) - 12582912.f);
          q[i] = c;
          total += c;
        }
      } else {
        for (int64_t i = i0; i < i1; i++) q[i] = 0;
      }
      if (xsum) xsum[r * G + g] = s * (float)total;
    }
    for (int64_t i = I; i < stride; i++) q[i] = 0;
  }
}

static inline __attribute__((always_inline)) void qtile_a8_body(
    const int8_t* xq, const float* sx, int64_t I, const uint8_t* qp, const float* sp, int64_t G, int64_t gs,
    float* y, int64_t O, int64_t p0, const int npc, const int rows, const float* bias) {
  const int64_t I4 = (I + 3) / 4;
  vf acc[QMR_A][NP];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < NP; j++) acc[r][j] = (vf){0};
  for (int64_t g = 0; g < G; g++) {
    const int64_t k0 = g * gs / 4, k1 = (g + 1) * gs >= I ? I4 : (g + 1) * gs / 4;
#if LANES == 8 && defined(__AVX2__)
    __m256i isum[QMR_A][NP];
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < NP; j++) isum[r][j] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t k = k0; k < k1; k++) {
      __m256i w[NP], aw[NP];
      for (int j = 0; j < npc; j++) {
        w[j] = _mm256_loadu_si256((const __m256i*)(qp + ((p0 + j) * I4 + k) * LANES * 4));
        aw[j] = _mm256_sign_epi8(w[j], w[j]); /* |w|: codes are in [-127, 127] */
      }
      for (int r = 0; r < rows; r++) {
        int32_t four;
        memcpy(&four, xq + r * 4 * I4 + 4 * k, 4);
        const __m256i xb = _mm256_set1_epi32(four);
        for (int j = 0; j < npc; j++) { /* |w| * (x with w's sign) = w * x, pairs summed in int16 */
          const __m256i p16 = _mm256_maddubs_epi16(aw[j], _mm256_sign_epi8(xb, w[j]));
          isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_madd_epi16(p16, ones));
        }
      }
    }
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < npc; j++) {
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[r * G + g];
        acc[r][j] += (vf)_mm256_cvtepi32_ps(isum[r][j]) * s;
      }
#elif Q_A512
    __m512i isum[QMR_A][NP], comp[NP];
    for (int j = 0; j < NP; j++) comp[j] = _mm512_setzero_si512();
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < NP; j++) isum[r][j] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k++) {
      __m512i w[NP], xb[QMR_A];
      for (int j = 0; j < npc; j++) w[j] = _mm512_loadu_si512((const void*)(qp + ((p0 + j) * I4 + k) * LANES * 4));
      for (int r = 0; r < rows; r++) {
        int32_t four;
        memcpy(&four, xq + r * 4 * I4 + 4 * k, 4);
        xb[r] = _mm512_set1_epi32(four);
      }
      q8_step_512(isum, comp, w, xb, npc, rows);
    }
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < npc; j++) {
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[r * G + g];
        acc[r][j] += q8_fold_512(isum[r][j], comp[j]) * s;
      }
#else
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < npc; j++) {
        int32_t isum[LANES] = {0};
        const int8_t* xr = xq + r * 4 * I4;
        for (int64_t k = k0; k < k1; k++) {
          const int8_t* w = (const int8_t*)qp + ((p0 + j) * I4 + k) * LANES * 4;
          for (int l = 0; l < LANES; l++)
            for (int t = 0; t < 4; t++) isum[l] += (int32_t)w[l * 4 + t] * xr[4 * k + t];
        }
        float f[LANES];
        for (int l = 0; l < LANES; l++) f[l] = (float)isum[l];
        vf fv;
        memcpy(&fv, f, sizeof fv);
        acc[r][j] += fv * (load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[r * G + g]);
      }
#endif
  }
  for (int j = 0; j < npc; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    const vf b = bias_vec(bias, o, n);
    for (int r = 0; r < rows; r++) store_row_f32(y + r * O + o, acc[r][j] + b, n);
  }
}

static inline __attribute__((always_inline)) void qtile_a8(
    const int8_t* xq, const float* sx, int64_t I, const uint8_t* qp, const float* sp, int64_t G, int64_t gs,
    float* y, int64_t O, int64_t p0, int64_t np, const int rows, const float* bias) {
  if (np == NP)
    qtile_a8_body(xq, sx, I, qp, sp, G, gs, y, O, p0, NP, rows, bias);
  else
    qtile_a8_body(xq, sx, I, qp, sp, G, gs, y, O, p0, (int)np, rows, bias);
}

/* ---- int4 weights with int8 activations (W4A8, kind 5) ----
 * Codes are int4's (0..15, W = code * s + m) in pairs of quads: byte ((p * I8 + k) * LANES + l) * 4 + t
 * holds code(p * LANES + l, 8k + t) in its low nibble and code(.., 8k + 4 + t) in its high one
 * (I8 = ceil(I / 8), gs a multiple of 8 or one group). Codes are unsigned, so maddubs takes them as
 * they are (pairs at most 2 x 15 x 127; both nibble halves summed in int16: at most 7620); per group
 * acc += float(sum(code * xq)) * (s * sx) + m * (sx * sum(xq)). */
static inline __attribute__((always_inline)) void qtile_a4_body(
    const int8_t* xq, const float* sx, const float* xsum, int64_t I, const uint8_t* qp, const float* sp,
    const float* mp, int64_t G, int64_t gs, float* y, int64_t O, int64_t p0, const int npc, const int rows,
    const float* bias) {
  const int64_t I8 = (I + 7) / 8;
  vf acc[QMR_A][NP];
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < NP; j++) acc[r][j] = (vf){0};
  for (int64_t g = 0; g < G; g++) {
    const int64_t k0 = g * gs / 8, k1 = (g + 1) * gs >= I ? I8 : (g + 1) * gs / 8;
#if LANES == 8 && defined(__AVX2__)
    __m256i isum[QMR_A][NP];
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < NP; j++) isum[r][j] = _mm256_setzero_si256();
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    for (int64_t k = k0; k < k1; k++) {
      __m256i lo[NP], hi[NP];
      for (int j = 0; j < npc; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qp + ((p0 + j) * I8 + k) * LANES * 4));
        lo[j] = _mm256_and_si256(v, low);
        hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < rows; r++) {
        int32_t four[2];
        memcpy(four, xq + r * 8 * I8 + 8 * k, 8);
        const __m256i x0 = _mm256_set1_epi32(four[0]), x1 = _mm256_set1_epi32(four[1]);
        for (int j = 0; j < npc; j++) {
          const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], x0), _mm256_maddubs_epi16(hi[j], x1));
          isum[r][j] = _mm256_add_epi32(isum[r][j], _mm256_madd_epi16(p16, ones));
        }
      }
    }
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < npc; j++) {
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[r * G + g];
        const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);
        acc[r][j] += (vf)_mm256_cvtepi32_ps(isum[r][j]) * s + m * xsum[r * G + g];
      }
#elif Q_A512
    __m512i isum[QMR_A][NP];
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < NP; j++) isum[r][j] = _mm512_setzero_si512();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t k = k0; k < k1; k++) {
      __m512i lo[NP], hi[NP];
      for (int j = 0; j < npc; j++) {
        const __m512i v = _mm512_loadu_si512((const void*)(qp + ((p0 + j) * I8 + k) * LANES * 4));
        lo[j] = _mm512_and_si512(v, low);
        hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int r = 0; r < rows; r++) {
        int32_t four[2];
        memcpy(four, xq + r * 8 * I8 + 8 * k, 8);
        const __m512i x0 = _mm512_set1_epi32(four[0]), x1 = _mm512_set1_epi32(four[1]);
        for (int j = 0; j < npc; j++) isum[r][j] = dot4_512(dot4_512(isum[r][j], lo[j], x0), hi[j], x1);
      }
    }
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < npc; j++) {
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[r * G + g];
        const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);
        acc[r][j] += (vf)_mm512_cvtepi32_ps(isum[r][j]) * s + m * xsum[r * G + g];
      }
#else
    for (int r = 0; r < rows; r++)
      for (int j = 0; j < npc; j++) {
        int32_t isum[LANES] = {0};
        const int8_t* xr = xq + r * 8 * I8;
        for (int64_t k = k0; k < k1; k++) {
          const uint8_t* w = qp + ((p0 + j) * I8 + k) * LANES * 4;
          for (int l = 0; l < LANES; l++)
            for (int t = 0; t < 4; t++)
              isum[l] += (int32_t)(w[l * 4 + t] & 15) * xr[8 * k + t] + (int32_t)(w[l * 4 + t] >> 4) * xr[8 * k + 4 + t];
        }
        float f[LANES];
        for (int l = 0; l < LANES; l++) f[l] = (float)isum[l];
        vf fv;
        memcpy(&fv, f, sizeof fv);
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[r * G + g];
        const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);
        acc[r][j] += fv * s + m * xsum[r * G + g];
      }
#endif
  }
  for (int j = 0; j < npc; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    const vf b = bias_vec(bias, o, n);
    for (int r = 0; r < rows; r++) store_row_f32(y + r * O + o, acc[r][j] + b, n);
  }
}

static inline __attribute__((always_inline)) void qtile_a(
    int kind, const int8_t* xq, const float* sx, const float* xsum, int64_t I, const uint8_t* qp,
    const float* sp, const float* mp, int64_t G, int64_t gs, float* y, int64_t O, int64_t p0, int64_t np,
    const int rows, const float* bias) {
  if (kind == 5) {
    if (np == NP)
      qtile_a4_body(xq, sx, xsum, I, qp, sp, mp, G, gs, y, O, p0, NP, rows, bias);
    else
      qtile_a4_body(xq, sx, xsum, I, qp, sp, mp, G, gs, y, O, p0, (int)np, rows, bias);
  } else {
    qtile_a8(xq, sx, I, qp, sp, G, gs, y, O, p0, np, rows, bias);
  }
}

