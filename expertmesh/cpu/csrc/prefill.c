/* Part of cpu_kernels.c (one translation unit; see its list): prefill attention: the online-softmax step,
 * the task over a block of rows, paged_prefill. */

/* One query vector's online-softmax step over keys [j0, j0 + nk) of which it sees [a, b) (block
 * offsets; `masked` = 0 when that is all PF_KEYS): s (its scores, times `scale`) becomes its
 * probabilities against the running max m, as bf16 when `pairs`; o and l are rescaled when the
 * max grows. */
static inline __attribute__((always_inline)) void pf_softmax_core(float* s, float scale, int32_t a, int32_t b,
                                                                  float* m, float* l, float* o, int64_t Dp,
                                                                  const int masked, const int pairs) {
  enum { NV = PF_KEYS / PF_LANES };
  pf_v sv[NV], best = {0};
  pf_i seen[NV];
  best += -INFINITY;
  for (int u = 0; u < NV; u++) {
    const pf_i j = *(const pf_i*)(pf_iota + u * PF_LANES);
    seen[u] = masked ? (j >= a) & (j < b) : (pf_i){0} - 1;
    sv[u] = *(const pf_vu*)(s + u * PF_LANES) * scale;
    if (masked) sv[u] = pf_select(seen[u], sv[u], best);
  }
  pf_v top[NV / 2]; /* a tree: 3 steps, not 7 */
  for (int u = 0; u < NV / 2; u++) top[u] = pf_max(sv[u], sv[u + NV / 2]);
  for (int w = NV / 4; w > 0; w /= 2)
    for (int u = 0; u < w; u++) top[u] = pf_max(top[u], top[u + w]);
  const float top_max = pf_hmax(top[0]), mx = top_max > m[0] ? top_max : m[0];
  if (mx > m[0]) {
    const float c = exp_vec(m[0] - mx); /* m = -inf at first: o and l are still 0 */
    l[0] *= c;
    for (int64_t d = 0; d < Dp; d++) o[d] *= c;
    m[0] = mx;
  }
  pf_v sum = {0};
#if !PF_PAIRS
  (void)pairs;
#else
  if (pairs) {
    for (int u = 0; u < NV; u += 2) {
      pf_v p0 = pf_exp_bf16(sv[u], mx), p1 = pf_exp_bf16(sv[u + 1], mx);
      if (masked) p0 = (pf_v)((pf_i)p0 & seen[u]), p1 = (pf_v)((pf_i)p1 & seen[u + 1]);
      const __m512bh pb = _mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0);
      _mm512_storeu_si512((void*)((bf16_t*)s + u * PF_LANES), (__m512i)pb);
      /* l sums the probabilities as rounded (the values' weights): pairs times (1, 1) */
      sum = (pf_v)_mm512_dpbf16_ps((__m512)sum, pb, (__m512bh)_mm512_set1_epi32(0x3f803f80));
    }
  } else
#endif
  for (int u = 0; u < NV; u++) {
    pf_v p = pf_exp(sv[u] - mx);
    if (masked) p = (pf_v)((pf_i)p & seen[u]);
    *(pf_vu*)(s + u * PF_LANES) = p;
    sum += p;
  }
  l[0] += pf_hsum(sum);
}

/* pf_softmax_core for keys [j0, j0 + nk) of which the query vector sees [lo, hi] */
static inline __attribute__((always_inline)) void pf_softmax_step(float* s, float scale, int64_t j0, int64_t nk,
                                                                  int64_t lo, int64_t hi, float* m, float* l,
                                                                  float* o, int64_t Dp, const int pairs) {
  if (hi < j0 || lo >= j0 + nk) {
    memset(s, 0, sizeof(float) * PF_KEYS);
    return;
  }
  const int32_t a = (int32_t)(lo > j0 ? lo - j0 : 0), b = (int32_t)(hi - j0 + 1 < nk ? hi - j0 + 1 : nk);
  if (a == 0 && b == PF_KEYS)
    pf_softmax_core(s, scale, a, b, m, l, o, Dp, 0, pairs);
  else
    pf_softmax_core(s, scale, a, b, m, l, o, Dp, 1, pairs);
}

/* PF: the stages' prefix (pf_wide_f32; pf_pairs or pf_wide_bf16). Workspace rows are 4-byte
 * words, floats or bf16 pairs: q's rows are PF##_width(D) words, Kt has as many rows. */
#define DEFINE_PAGED_PREFILL(SUFFIX, T, STORE, PF)                                                \
  static void prefill_task_##SUFFIX(const T* q, int64_t q_stride, const T* k, const T* v,          \
                                    int64_t kv_stride, const int32_t* table, int64_t bs, int64_t ctx, \
                                    int64_t r0, int64_t r1, int64_t hk, T* out, int64_t H, int64_t G, \
                                    int64_t D, float scale, int64_t window, int64_t chunk,        \
                                    const float* sinks, float* work) {                            \
    const int64_t Dp = (D + PF_LANES - 1) / PF_LANES * PF_LANES, nq = (r1 - r0) * G;               \
    const int64_t Dq = PF##_width(D);                                                             \
    float* qf = work;                 /* [nq, Dq] */                                              \
    float* o = qf + PF_ROWS * G * D;  /* [nq, Dp] */                                              \
    float* s = o + PF_ROWS * G * Dp;  /* [PF_NQ, PF_KEYS], the current PF_NQ vectors' */          \
    float* kt = s + PF_NQ * PF_KEYS;  /* [Dq, PF_KEYS] */                                         \
    float* vf = kt + D * PF_KEYS;     /* [PF_KEYS, Dp] */                                         \
    float* m = vf + PF_KEYS * Dp;     /* [nq] */                                                  \
    float* l = m + PF_ROWS * G;       /* [nq, PF_LANES], sums by lane */                          \
    /* Query vector i: row r0 + i / G, head hk * G + i % G. */                                     \
    for (int64_t i = 0; i < nq; i++) {                                                            \
      PF##_q(q + (r0 + i / G) * q_stride + (hk * G + i % G) * D, D, qf + i * Dq);                 \
      m[i] = -INFINITY;                                                                           \
      l[i] = 0.f;                                                                                 \
    }                                                                                             \
    memset(o, 0, sizeof(float) * (size_t)(nq * Dp));                                              \
    memset(vf, 0, sizeof(float) * (size_t)(PF_KEYS * Dp));                                        \
    const int64_t first = pf_first_key(ctx + r0, window, chunk), end = ctx + r1;                  \
    for (int64_t j0 = first; j0 < end; j0 += PF_KEYS) {                                           \
      const int64_t nk = end - j0 < PF_KEYS ? end - j0 : PF_KEYS;                                 \
      PF##_kv(k, v, kv_stride, table, bs, hk, j0, nk, D, Dp, kt, vf);                             \
      /* per PF_NQ query vectors: scores, softmax, values, while Kt and Vf stay in L1 */          \
      for (int64_t i = 0; i < nq; i += PF_NQ) {                                                   \
        const float *qs[PF_NQ], *ps[PF_NQ];                                                       \
        float *ss[PF_NQ], *os[PF_NQ];                                                             \
        for (int t = 0; t < PF_NQ; t++) {                                                         \
          const int64_t n = i + t < nq ? i + t : i;                                               \
          qs[t] = qf + n * Dq, ps[t] = ss[t] = s + (n - i) * PF_KEYS, os[t] = o + n * Dp;         \
        }                                                                                         \
        for (int64_t c = 0; c < nk; c += PF_TILE) {                                               \
          float* sc[PF_NQ];                                                                       \
          for (int t = 0; t < PF_NQ; t++) sc[t] = ss[t] + c;                                      \
          PF##_scores(qs, kt + c, D, sc);                                                         \
        }                                                                                         \
        for (int64_t n = i; n < i + PF_NQ && n < nq; n++) {                                       \
          const int64_t p = ctx + r0 + n / G;                                                     \
          pf_softmax_step(s + (n - i) * PF_KEYS, scale, j0, nk, pf_first_key(p, window, chunk), p, m + n, \
                          l + n, o + n * Dp, Dp, PF##_PAIRS);                                                 \
        }                                                                                         \
        PF##_values(ps, vf, nk, Dp, os);                                                          \
      }                                                                                           \
    }                                                                                             \
    for (int64_t i = 0; i < nq; i++) {                                                            \
      const int64_t h = hk * G + i % G;                                                           \
      float sum = l[i], c = 1.f;                                                                  \
      if (sinks) { /* the sink joins the denominator only */                                      \
        const float mx = sinks[h] > m[i] ? sinks[h] : m[i];                                       \
        c = exp_vec(m[i] - mx);                                                                   \
        sum = sum * c + exp_vec(sinks[h] - mx);                                                   \
      }                                                                                           \
      const float inv = c / sum;                                                                  \
      T* orow = out + ((r0 + i / G) * H + h) * D;                                                 \
      for (int64_t d = 0; d < D; d++) orow[d] = STORE(o[i * Dp + d] * inv);                       \
    }                                                                                             \
  }                                                                                               \
                                                                                                  \
  void paged_prefill_##SUFFIX(const T* q, int64_t q_stride, const T* k, const T* v,               \
                              int64_t kv_stride, const int32_t* table, int64_t bs, int64_t ctx,   \
                              int64_t L, T* out, int64_t H, int64_t Hk, int64_t D, float scale,   \
                              int64_t window, int64_t chunk, const float* sinks, int threads) {   \
    const int64_t G = H / Hk, blocks = (L + PF_ROWS - 1) / PF_ROWS, tasks = blocks * Hk;          \
    const int64_t Dp = (D + PF_LANES - 1) / PF_LANES * PF_LANES;                                  \
    const size_t floats = (size_t)(PF_ROWS * G * (D + Dp + 1 + PF_LANES) + PF_NQ * PF_KEYS + PF_KEYS * (D + Dp)); \
    _Pragma("omp parallel num_threads(threads) if (tasks > 1)") {                                 \
      float* work = (float*)malloc(sizeof(float) * floats);                                       \
      /* the last rows see the most keys: they go first */                                        \
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t t = 0; t < tasks; t++) {               \
        const int64_t b = blocks - 1 - t / Hk, hk = t % Hk;                                       \
        const int64_t r0 = b * PF_ROWS, r1 = r0 + PF_ROWS < L ? r0 + PF_ROWS : L;                 \
        prefill_task_##SUFFIX(q, q_stride, k, v, kv_stride, table, bs, ctx, r0, r1, hk, out, H, G, D, \
                              scale, window, chunk, sinks, work);                                 \
      }                                                                                           \
      free(work);                                                                                 \
    }                                                                                             \
  }

DEFINE_PAGED_PREFILL(f32, float, f32_id, pf_wide_f32)
#if PF_PAIRS
DEFINE_PAGED_PREFILL(bf16, bf16_t, f32_to_bf16, pf_pairs)
#else
DEFINE_PAGED_PREFILL(bf16, bf16_t, f32_to_bf16, pf_wide_bf16)
#endif

