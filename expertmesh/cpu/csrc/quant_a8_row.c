/* Part of cpu_kernels.c (one translation unit; see its list): int8 / int4 weights with int8 activations
 * (W8A8, W4A8) at one row (decode). */

/* ---- one row of quantized activations against NQ1 panels at once (see qrow1_* in quant.c) ----
 * The same arithmetic as the tiles (exact integer sums, folded in once a group). The portable build
 * (no AVX2) takes the tiles. */
#if LANES == 8 && defined(__AVX2__)
static void qrow1_a8(const int8_t* xq, const float* sx, int64_t I, const uint8_t* qp, const float* sp,
                     int64_t G, int64_t gs, float* y, int64_t O, int64_t p0, const float* bias) {
  const int64_t I4 = (I + 3) / 4, pb = I4 * LANES * 4;
  const uint8_t* q = qp + p0 * pb;
  const __m256i ones = _mm256_set1_epi16(1);
  vf acc[NQ1];
  for (int j = 0; j < NQ1; j++) acc[j] = (vf){0};
  for (int64_t g = 0; g < G; g++) {
    const int64_t k0 = g * gs / 4, k1 = (g + 1) * gs >= I ? I4 : (g + 1) * gs / 4;
    __m256i isum[NQ1];
    for (int j = 0; j < NQ1; j++) isum[j] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k++) {
      int32_t four;
      memcpy(&four, xq + 4 * k, 4);
      const __m256i xb = _mm256_set1_epi32(four);
      for (int j = 0; j < NQ1; j++) { /* |w| * (x with w's sign) = w * x, as in qtile_a8_body */
        const __m256i w = _mm256_loadu_si256((const __m256i*)(q + j * pb + k * 32));
        const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xb, w));
        isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(p16, ones));
      }
    }
    for (int j = 0; j < NQ1; j++)
      acc[j] += (vf)_mm256_cvtepi32_ps(isum[j]) * (load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[g]);
  }
  for (int j = 0; j < NQ1; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    store_row_f32(y + o, acc[j] + bias_vec(bias, o, n), n);
  }
}

#elif Q_A512
/* One row on AVX-512 reads a span panel after panel: one sequential stream. AVX2's plan (the NQ1
 * panels side by side, step by step: NQ1 short streams at once) read cold weights at about half
 * float32's rate here (docs/benchmarks.md, "Kernel figures"). A panel's
 * steps go to QR1 integer sums in turn (latency: one chain would wait on each vpdpbusd); the sums
 * are exact, so how they are split changes no bit. */
static inline void q8_dot1_512(__m512i* isum, __m512i* comp, __m512i w, __m512i xb) {
#if defined(__AVX512VNNI__) /* as q8_step_512: x + 128 times w, and sum(w) to take 128 of off */
  *comp = _mm512_dpbusd_epi32(*comp, _mm512_set1_epi8(1), w);
  *isum = _mm512_dpbusd_epi32(*isum, _mm512_xor_si512(xb, _mm512_set1_epi8((char)0x80)), w);
#else
  (void)comp;
  *isum = dot4_512(*isum, _mm512_abs_epi8(w),
                   _mm512_mask_sub_epi8(xb, _mm512_movepi8_mask(w), _mm512_setzero_si512(), xb));
#endif
}

static void qrow1_a8(const int8_t* xq, const float* sx, int64_t I, const uint8_t* qp, const float* sp,
                     int64_t G, int64_t gs, float* y, int64_t O, int64_t p0, const float* bias) {
  const int64_t I4 = (I + 3) / 4, pb = I4 * LANES * 4;
  for (int j = 0; j < NQ1; j++) {
    const uint8_t* q = qp + (p0 + j) * pb;
    vf acc = (vf){0};
    for (int64_t g = 0; g < G; g++) {
      const int64_t k0 = g * gs / 4, k1 = (g + 1) * gs >= I ? I4 : (g + 1) * gs / 4;
      __m512i isum[QR1], comp[QR1];
      for (int u = 0; u < QR1; u++) isum[u] = comp[u] = _mm512_setzero_si512();
      int64_t k = k0;
      for (; k < k1; k += QR1) /* QR1 steps at a time, the last pass cut at k1 */
        for (int u = 0; u < QR1 && k + u < k1; u++) {
          int32_t four;
          memcpy(&four, xq + 4 * (k + u), 4);
          _mm_prefetch((const char*)(q + (k + u) * 64) + Q_ROW1_AHEAD, _MM_HINT_T0);
          const __m512i w = _mm512_loadu_si512((const void*)(q + (k + u) * 64));
          q8_dot1_512(&isum[u], &comp[u], w, _mm512_set1_epi32(four));
        }
      for (int u = 1; u < QR1; u++) {
        isum[0] = _mm512_add_epi32(isum[0], isum[u]);
        comp[0] = _mm512_add_epi32(comp[0], comp[u]);
      }
      acc += q8_fold_512(isum[0], comp[0]) * (load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[g]);
    }
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    store_row_f32(y + o, acc + bias_vec(bias, o, n), n);
  }
}

#endif

/* W4A8 at one row: step k of a panel is one vector of LANES x 4 bytes
 * (low nibbles: inputs 8k..8k+3, high: 8k+4..8k+7), a4_dot its exact integer products with the
 * row's 8 activations (x0, x1: 4 each, broadcast). */
#if LANES == 8 && defined(__AVX2__)
typedef __m256i a4_vec;
static inline a4_vec a4_load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline a4_vec a4_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline a4_vec a4_zero(void) { return _mm256_setzero_si256(); }
static inline a4_vec a4_dot(a4_vec acc, a4_vec v, a4_vec x0, a4_vec x1) {
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
static inline vf a4_float(a4_vec v) { return (vf)_mm256_cvtepi32_ps(v); }
/* The next span (contiguous after this one) prefetched at the pace this one is read: a panel's
 * stream is I / 2 bytes here, short for the hardware prefetcher. W8A8's streams are twice as long
 * and the same prefetch made qrow1_a8 slower, so it has none (Zen 3, AVX2: docs/benchmarks.md, "Kernel figures");
 * the AVX-512 build reads a span as one stream instead (below). */
#define Q_ROW1_A 1
#elif Q_A512
typedef __m512i a4_vec;
static inline a4_vec a4_load(const uint8_t* p) { return _mm512_loadu_si512((const void*)p); }
static inline a4_vec a4_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline a4_vec a4_zero(void) { return _mm512_setzero_si512(); }
static inline a4_vec a4_dot(a4_vec acc, a4_vec v, a4_vec x0, a4_vec x1) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  return dot4_512(dot4_512(acc, lo, x0), hi, x1);
}
static inline vf a4_float(a4_vec v) { return (vf)_mm512_cvtepi32_ps(v); }
#define Q_ROW1_A 1
#else
#define Q_ROW1_A 0
#endif

#if Q_ROW1_A && Q_A512
/* W4A8 at one row on AVX-512: panel after panel, as qrow1_a8 above. */
static void qrow1_a4(const int8_t* xq, const float* sx, const float* xsum, int64_t I, const uint8_t* qp,
                     const float* sp, const float* mp, int64_t G, int64_t gs, float* y, int64_t O, int64_t p0,
                     const float* bias) {
  const int64_t I8 = (I + 7) / 8, step = LANES * 4, pb = I8 * step;
  for (int j = 0; j < NQ1; j++) {
    const uint8_t* q = qp + (p0 + j) * pb;
    vf acc = (vf){0};
    for (int64_t g = 0; g < G; g++) {
      const int64_t k0 = g * gs / 8, k1 = (g + 1) * gs >= I ? I8 : (g + 1) * gs / 8;
      a4_vec isum[QR1];
      for (int u = 0; u < QR1; u++) isum[u] = a4_zero();
      for (int64_t k = k0; k < k1; k += QR1)
        for (int u = 0; u < QR1 && k + u < k1; u++) {
          int32_t four[2];
          memcpy(four, xq + 8 * (k + u), 8);
          _mm_prefetch((const char*)(q + (k + u) * step) + Q_ROW1_AHEAD, _MM_HINT_T0);
          isum[u] = a4_dot(isum[u], a4_load(q + (k + u) * step), a4_set1(four[0]), a4_set1(four[1]));
        }
      for (int u = 1; u < QR1; u++) isum[0] = _mm512_add_epi32(isum[0], isum[u]);
      const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[g];
      const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);
      acc += a4_float(isum[0]) * s + m * xsum[g];
    }
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    store_row_f32(y + o, acc + bias_vec(bias, o, n), n);
  }
}
#elif Q_ROW1_A
static void qrow1_a4(const int8_t* xq, const float* sx, const float* xsum, int64_t I, const uint8_t* qp,
                     const float* sp, const float* mp, int64_t G, int64_t gs, float* y, int64_t O, int64_t p0,
                     const float* bias) {
  const int64_t I8 = (I + 7) / 8, step = LANES * 4, pb = I8 * step;
  const uint8_t* q = qp + p0 * pb;
  const uint8_t* next = q + NQ1 * pb;
  vf acc[NQ1];
  for (int j = 0; j < NQ1; j++) acc[j] = (vf){0};
  for (int64_t g = 0; g < G; g++) {
    const int64_t k0 = g * gs / 8, k1 = (g + 1) * gs >= I ? I8 : (g + 1) * gs / 8;
    a4_vec isum[NQ1];
    for (int j = 0; j < NQ1; j++) isum[j] = a4_zero();
    for (int64_t k = k0; k < k1; k++) {
      int32_t four[2];
      memcpy(four, xq + 8 * k, 8);
      const a4_vec x0 = a4_set1(four[0]), x1 = a4_set1(four[1]);
      for (int c = 0; c < NQ1 * step; c += 64) __builtin_prefetch(next + k * NQ1 * step + c);
      for (int j = 0; j < NQ1; j++) isum[j] = a4_dot(isum[j], a4_load(q + j * pb + k * step), x0, x1);
    }
    for (int j = 0; j < NQ1; j++) {
      const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES) * sx[g];
      const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);
      acc[j] += a4_float(isum[j]) * s + m * xsum[g];
    }
  }
  for (int j = 0; j < NQ1; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    store_row_f32(y + o, acc[j] + bias_vec(bias, o, n), n);
  }
}
#endif

