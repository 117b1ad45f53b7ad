/* Part of cpu_kernels.c (one translation unit; see its list): prefill attention's "pairs" stages: bf16
 * products on vdpbf16ps (AVX512-BF16). */

/* "pairs" (bf16 with AVX512-BF16): the products on vdpbf16ps, which multiplies pairs of bf16 and
 * accumulates in float32, twice a float32 FMA's products per instruction.
 * Scores: q and K stay bf16, as 32-bit pairs over D (an odd D's last pair is (x, 0)): q [D2] and
 * Kt [D2, PF_KEYS], D2 = ceil(D / 2). A product of two bf16 is exact in float32, so the scores are
 * the wide path's up to the order of the float32 additions; the softmax scale multiplies them
 * afterwards (in both kinds: q is not scaled, and so not rounded, first).
 * Values: the probabilities rounded to bf16 (as torch's CPU flash kernel does for bf16), V as pairs
 * over keys, Vt [PF_KEYS / 2, Dp] of (v[2i][d], v[2i + 1][d]); l sums the rounded probabilities,
 * so the weights still sum to 1. Faster than float32 probabilities (widened V, FMAs), for an error
 * against a float32 reference a little above the bf16 output's own rounding
 * (tests/test_prefill_kernel.py bounds it; docs/benchmarks.md, "Kernel figures"). */
#if defined(__AVX512BF16__) && PF_LANES == 16

static inline int64_t pf_pairs_width(int64_t D) { return (D + 1) / 2; }
enum { pf_pairs_PAIRS = 1 };

static inline void pf_pairs_q(const bf16_t* qr, int64_t D, float* dst) {
  pf_word* w = (pf_word*)dst;
  for (int64_t i = 0; i < D / 2; i++) w[i] = (uint32_t)qr[2 * i] | (uint32_t)qr[2 * i + 1] << 16;
  if (D % 2) w[D / 2] = qr[D - 1];
}

static inline void pf_pairs_kv(const bf16_t* k, const bf16_t* v, int64_t kv_stride, const int32_t* table,
                               int64_t bs, int64_t hk, int64_t j0, int64_t nk, int64_t D, int64_t Dp,
                               float* kt, float* vf) {
  const int64_t W = D / 2; /* whole pairs; an odd D's last one is (k[D - 1], 0) */
  pf_pack_k(k + hk * D, kv_stride, table, bs, j0, nk, W, 2, (pf_word*)kt);
  if (D % 2)
    for (int64_t j = 0; j < PF_KEYS; j++)
      ((pf_word*)kt)[W * PF_KEYS + j] = j < nk ? k[pf_row(table, bs, j0 + j) * kv_stride + hk * D + D - 1] : 0;
  /* V as pairs over keys, zero past D (the task's memset) and past nk */
  pf_word* vt2 = (pf_word*)vf;
  for (int64_t i = 0; i < PF_KEYS / 2; i++) {
    const int64_t j = 2 * i;
    if (j >= nk) {
      for (int64_t d = 0; d < D; d++) vt2[i * Dp + d] = 0;
      continue;
    }
    const bf16_t* v0 = v + pf_row(table, bs, j0 + j) * kv_stride + hk * D;
    if (j + 1 < nk) {
      const bf16_t* v1 = v + pf_row(table, bs, j0 + j + 1) * kv_stride + hk * D;
      for (int64_t d = 0; d < D; d++) vt2[i * Dp + d] = (uint32_t)v0[d] | (uint32_t)v1[d] << 16;
    } else {
      for (int64_t d = 0; d < D; d++) vt2[i * Dp + d] = v0[d];
    }
  }
}

static inline __attribute__((always_inline)) void pf_pairs_scores(const float* const q[PF_NQ], const float* kt,
                                                                  int64_t D, float* const s[PF_NQ]) {
  __m512 a[PF_NQ][4];
  for (int n = 0; n < PF_NQ; n++)
    for (int u = 0; u < 4; u++) a[n][u] = _mm512_setzero_ps();
  for (int64_t i = 0; i < (D + 1) / 2; i++) {
    const pf_word* kr = (const pf_word*)kt + i * PF_KEYS;
    __m512i kv[4];
    for (int u = 0; u < 4; u++) {
      kv[u] = _mm512_loadu_si512((const void*)(kr + u * PF_LANES));
      PF_IN_REGISTER(kv[u]);
    }
    for (int n = 0; n < PF_NQ; n++) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32((int)((const pf_word*)q[n])[i]);
      for (int u = 0; u < 4; u++) a[n][u] = _mm512_dpbf16_ps(a[n][u], (__m512bh)kv[u], x);
    }
  }
  for (int n = 0; n < PF_NQ; n++)
    for (int u = 0; u < 4; u++) _mm512_storeu_ps(s[n] + u * PF_LANES, a[n][u]);
}

/* o[n][0, Dp) += sum_j p[n][j] * V[j, :], p as bf16 pairs over keys, nk keys, n < PF_NQ */
static inline __attribute__((always_inline)) void pf_pairs_values(const float* const p[PF_NQ], const float* vf,
                                                                  int64_t nk, int64_t Dp, float* const o[PF_NQ]) {
  const pf_word* vt2 = (const pf_word*)vf;
  const int64_t nk2 = (nk + 1) / 2;
  int64_t d0 = 0;
  for (; d0 + 4 * PF_LANES <= Dp; d0 += 4 * PF_LANES) {
    __m512 a[PF_NQ][4];
    for (int n = 0; n < PF_NQ; n++)
      for (int u = 0; u < 4; u++) a[n][u] = _mm512_loadu_ps(o[n] + d0 + u * PF_LANES);
    for (int64_t i = 0; i < nk2; i++) {
      __m512i x[4];
      for (int u = 0; u < 4; u++) {
        x[u] = _mm512_loadu_si512((const void*)(vt2 + i * Dp + d0 + u * PF_LANES));
        PF_IN_REGISTER(x[u]);
      }
      for (int n = 0; n < PF_NQ; n++) {
        const __m512bh pn = (__m512bh)_mm512_set1_epi32((int)((const pf_word*)p[n])[i]);
        for (int u = 0; u < 4; u++) a[n][u] = _mm512_dpbf16_ps(a[n][u], (__m512bh)x[u], pn);
      }
    }
    for (int n = 0; n < PF_NQ; n++)
      for (int u = 0; u < 4; u++) _mm512_storeu_ps(o[n] + d0 + u * PF_LANES, a[n][u]);
  }
  for (; d0 < Dp; d0 += PF_LANES) {
    __m512 a[PF_NQ];
    for (int n = 0; n < PF_NQ; n++) a[n] = _mm512_loadu_ps(o[n] + d0);
    for (int64_t i = 0; i < nk2; i++) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512((const void*)(vt2 + i * Dp + d0));
      for (int n = 0; n < PF_NQ; n++)
        a[n] = _mm512_dpbf16_ps(a[n], x, (__m512bh)_mm512_set1_epi32((int)((const pf_word*)p[n])[i]));
    }
    for (int n = 0; n < PF_NQ; n++) _mm512_storeu_ps(o[n] + d0, a[n]);
  }
}
#define PF_PAIRS 1
#else
DEFINE_PF_WIDE(bf16, bf16_t, bf16_to_f32)
#define PF_PAIRS 0
#endif

#if PF_PAIRS
/* exp(v - mx) for probabilities rounded to bf16 next (a relative 2^-9): 2^t for t = (v - mx) log2(e)
 * in one FMA, 2^(t - n) by its degree-4 Taylor polynomial (relative error under 5e-5), times 2^n
 * by vscalefps: 8 instructions. */
static inline pf_v pf_exp_bf16(pf_v v, float mx) {
  const __m512 t = _mm512_fmsub_ps((__m512)v, _mm512_set1_ps(1.44269504088896341f),
                                   _mm512_set1_ps(mx * 1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const pf_v f = (pf_v)_mm512_sub_ps(t, n);
  pf_v p = f * 9.61812910762847716e-3f + 5.55041086648215800e-2f; /* ln2^k / k! */
  p = p * f + 2.40226506959100712e-1f;
  p = p * f + 6.93147180559945309e-1f;
  p = p * f + 1.f;
  return (pf_v)_mm512_scalef_ps((__m512)p, n);
}
#endif

