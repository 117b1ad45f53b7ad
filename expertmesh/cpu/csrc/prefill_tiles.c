/* Part of cpu_kernels.c (one translation unit; see its list): prefill attention's vector tiles and the
 * "wide" (float32) stages every CPU runs. */

/* Prefill attention: the new rows of one sequence against every key they see, flash-attention
 * style (online softmax over key blocks: no [L, S] score matrix), causal.
 *
 * q:      [L, H, D] rows with token stride q_stride (elements); row r is position ctx + r
 * k, v:   with `table`: one layer's paged cache [blocks, bs, Hk, D], position p at row
 *         table[p / bs] * bs + p % bs; without (NULL): the sequence's own rows, position p at
 *         row p; a row's heads are contiguous and rows kv_stride elements apart
 * out:    [L, H, D] contiguous
 * window, chunk, sinks: as paged_decode's, for each row's own position.
 *
 * A task is one KV head and a block of PF_ROWS query rows: its G query heads and rows (nq query
 * vectors) share each loaded block of PF_KEYS keys, packed once: K transposed into Kt [D, PF_KEYS],
 * V into Vf [PF_KEYS, Dp] (Dp = D rounded up to whole vectors, zero-padded, so any head_dim runs
 * on whole vectors). Then PF_NQ query vectors at a time: their scores against the block (tiles of
 * PF_TILE keys in registers), an online-softmax step each, their values' sums (4 register vectors
 * of D at a time). Sums are float32 throughout; the products are float32 ("wide": float32, and
 * bf16 widened, on every CPU) or bf16 pairs on vdpbf16ps ("pairs": bf16 with AVX512-BF16).
 */
#if defined(__AVX512F__)
#include <immintrin.h>
#define PF_LANES 16
#else
#define PF_LANES 8 /* AVX2; plain vectors elsewhere */
#endif
#define PF_TILE (4 * PF_LANES) /* keys of one scores tile */
#define PF_KEYS (2 * PF_TILE)
#define PF_ROWS 64
typedef float pf_v __attribute__((vector_size(PF_LANES * 4)));
typedef float pf_vu __attribute__((vector_size(PF_LANES * 4), aligned(4)));
/* A vector loaded once into a register for the 3 products that use it: gcc folds the load into
 * each FMA instead (3 loads of it per step), and 15 loads for 12 FMAs made the tiles load-bound. */
#if defined(__x86_64__) && defined(__AVX__) /* a register that holds the whole vector */
#define PF_IN_REGISTER(x) __asm__("" : "+x"(x))
#else
#define PF_IN_REGISTER(x) (void)0
#endif

/* PF_NQ query vectors at a time, each against 4 vectors of keys (scores) or of D (values): AVX2's
 * 16 registers hold 3 x 4 accumulators, a loaded vector and a broadcast; AVX-512's 32 hold 6 x 4
 * (its FMAs broadcast x from memory): 6 on AVX-512 is faster than the 3-vector tiles
 * (docs/benchmarks.md, "Kernel figures"). A missing vector at the end is passed as a
 * repeat of the first (the same values computed and stored twice). */
#if PF_LANES == 16
#define PF_NQ 6
#else
#define PF_NQ 3
#endif

/* s[n][0, PF_TILE) = q[n] . Kt[:, j], n < PF_NQ (Kt rows PF_KEYS apart) */
static inline __attribute__((always_inline)) void pf_scores(const float* const q[PF_NQ], const float* kt,
                                                            int64_t D, float* const s[PF_NQ]) {
  pf_v a[PF_NQ][4];
  for (int n = 0; n < PF_NQ; n++)
    for (int u = 0; u < 4; u++) a[n][u] = (pf_v){0};
  for (int64_t d = 0; d < D; d++) {
    const float* kr = kt + d * PF_KEYS;
    pf_v kv[4];
    for (int u = 0; u < 4; u++) {
      kv[u] = *(const pf_vu*)(kr + u * PF_LANES);
      PF_IN_REGISTER(kv[u]);
    }
    for (int n = 0; n < PF_NQ; n++) {
      const float x = q[n][d];
      for (int u = 0; u < 4; u++) a[n][u] += x * kv[u];
    }
  }
  for (int n = 0; n < PF_NQ; n++)
    for (int u = 0; u < 4; u++) *(pf_vu*)(s[n] + u * PF_LANES) = a[n][u];
}

/* o[n][0, Dp) += sum_j p[n][j] * Vf[j, :], nk keys, n < PF_NQ */
static inline __attribute__((always_inline)) void pf_values(const float* const p[PF_NQ], const float* vf,
                                                            int64_t nk, int64_t Dp, float* const o[PF_NQ]) {
  int64_t d0 = 0;
  for (; d0 + 4 * PF_LANES <= Dp; d0 += 4 * PF_LANES) {
    pf_v a[PF_NQ][4];
    for (int n = 0; n < PF_NQ; n++)
      for (int u = 0; u < 4; u++) a[n][u] = *(const pf_vu*)(o[n] + d0 + u * PF_LANES);
    for (int64_t j = 0; j < nk; j++) {
      const float* vr = vf + j * Dp + d0;
      pf_v x[4];
      for (int u = 0; u < 4; u++) {
        x[u] = *(const pf_vu*)(vr + u * PF_LANES);
        PF_IN_REGISTER(x[u]);
      }
      for (int n = 0; n < PF_NQ; n++) {
        const float pn = p[n][j];
        for (int u = 0; u < 4; u++) a[n][u] += pn * x[u];
      }
    }
    for (int n = 0; n < PF_NQ; n++)
      for (int u = 0; u < 4; u++) *(pf_vu*)(o[n] + d0 + u * PF_LANES) = a[n][u];
  }
  for (; d0 < Dp; d0 += PF_LANES) {
    pf_v a[PF_NQ];
    for (int n = 0; n < PF_NQ; n++) a[n] = *(const pf_vu*)(o[n] + d0);
    for (int64_t j = 0; j < nk; j++) {
      const pf_v x = *(const pf_vu*)(vf + j * Dp + d0);
      for (int n = 0; n < PF_NQ; n++) a[n] += p[n][j] * x;
    }
    for (int n = 0; n < PF_NQ; n++) *(pf_vu*)(o[n] + d0) = a[n];
  }
}

typedef int32_t pf_i __attribute__((vector_size(PF_LANES * 4)));
/* read as pf_i vectors (aligned loads): its own alignment must be a vector's, not the 4 bytes an
 * int32_t array gets by default (a build whose other tables moved it off 64 crashed there) */
static const int32_t pf_iota[128] __attribute__((aligned(64))) = {
    0,   1,   2,   3,   4,   5,   6,   7,   8,   9,   10,  11,  12,  13,  14,  15,  16,  17,  18,
    19,  20,  21,  22,  23,  24,  25,  26,  27,  28,  29,  30,  31,  32,  33,  34,  35,  36,  37,
    38,  39,  40,  41,  42,  43,  44,  45,  46,  47,  48,  49,  50,  51,  52,  53,  54,  55,  56,
    57,  58,  59,  60,  61,  62,  63,  64,  65,  66,  67,  68,  69,  70,  71,  72,  73,  74,  75,
    76,  77,  78,  79,  80,  81,  82,  83,  84,  85,  86,  87,  88,  89,  90,  91,  92,  93,  94,
    95,  96,  97,  98,  99,  100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113,
    114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127,
}; /* >= PF_KEYS */

static inline pf_v pf_select(pf_i mask, pf_v a, pf_v b) { return (pf_v)(((pf_i)a & mask) | ((pf_i)b & ~mask)); }

/* the larger of a and b in each lane (no NaN here) */
#if PF_LANES == 16
static inline pf_v pf_max(pf_v a, pf_v b) { return (pf_v)_mm512_max_ps((__m512)a, (__m512)b); }
#else
static inline pf_v pf_max(pf_v a, pf_v b) { return pf_select(a > b, a, b); }
#endif

/* a vector's largest lane and its sum: a tree of lane shuffles on AVX-512, not a serial chain */
#if PF_LANES == 16
static inline float pf_hmax(pf_v v) { return _mm512_reduce_max_ps((__m512)v); }
static inline float pf_hsum(pf_v v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float pf_hmax(pf_v v) {
  float x = v[0];
  for (int e = 1; e < PF_LANES; e++) x = v[e] > x ? v[e] : x;
  return x;
}
static inline float pf_hsum(pf_v v) {
  float x = 0.f;
  for (int e = 0; e < PF_LANES; e++) x += v[e];
  return x;
}
#endif

/* exp_vec on whole vectors (gcc leaves exp_vec's clamps as branches in this loop's scalar form).
 * AVX-512's vscalefps multiplies by 2^n for any n (0 below the range, no exponent bits to build
 * and so no clamps): 11 instructions instead of 18. v <= 0 here; -inf (keys not seen) gives NaN,
 * which the caller masks. */
#if PF_LANES == 16
static inline pf_v pf_exp(pf_v v) {
  const __m512 x = (__m512)v;
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  const pf_v rv = (pf_v)r, p = EXP_POLY(rv);
  return (pf_v)_mm512_scalef_ps((__m512)p, n);
}
#else
static inline pf_v pf_exp(pf_v v) {
  const pf_v zero = {0};
  v = pf_select(v < zero - 87.3f, zero - 87.3f, v);
  v = pf_select(v > zero + 88.7f, zero + 88.7f, v);
  const pf_v n = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const pf_v r = (v - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  const pf_v p = EXP_POLY(r);
  return p * (pf_v)((__builtin_convertvector(n, pf_i) + 127) << 23);
}
#endif

typedef uint32_t pf_word __attribute__((may_alias)); /* float bits or bf16 pairs, in the float workspace */

static inline int64_t pf_row(const int32_t* table, int64_t bs, int64_t p) {
  return table ? (int64_t)table[p / bs] * bs + p % bs : p;
}

/* Kt [W, PF_KEYS] from keys [j0, j0 + nk) (zero past nk): Kt[w][j] = 32-bit word w of key j's
 * row (from `row0` on, rows kv_stride T apart), as `kind` says:
 *   0  float32 rows, W = D
 *   1  bf16 rows widened to float32, W = D
 *   2  bf16 rows as pairs (k[2w], k[2w + 1]), W = D / 2 (an odd D's last element: the caller's)
 * With AVX-512: 16 keys x 16 words a time, transposed in registers and stored as whole vectors
 * (with a scalar store per word, packing took 10-18% of the time: the stores filled the queue). */
#if PF_LANES == 16 && defined(__AVX512BW__)
/* r[c] <- column c of the 16 x 16 matrix of 32-bit words whose row t was r[t] */
static inline __attribute__((always_inline)) void pf_transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  /* u[4i + c], 128-bit lane L: column 4L + c of rows 4i .. 4i + 3 */
  for (int i = 0; i < 4; i++) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; c++) {
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(a, e, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xdd);
  }
}

static inline __attribute__((always_inline)) void pf_pack_k(const void* row0, int64_t kv_stride, const int32_t* table,
                                                            int64_t bs, int64_t j0, int64_t nk, int64_t W,
                                                            const int kind, pf_word* kt) {
  const int64_t row_bytes = kv_stride * (kind ? 2 : 4), word_bytes = kind == 2 ? 4 : kind ? 2 : 4;
  for (int64_t j = 0; j < PF_KEYS; j += 16) {
    const char* kr[16];
    for (int t = 0; t < 16; t++)
      kr[t] = j + t < nk ? (const char*)row0 + pf_row(table, bs, j0 + j + t) * row_bytes : NULL;
    for (int64_t w0 = 0; w0 < W; w0 += 16) {
      const __mmask16 mask = (__mmask16)(W - w0 >= 16 ? 0xffffu : (1u << (W - w0)) - 1u);
      __m512i r[16];
      for (int t = 0; t < 16; t++) {
        const void* at = kr[t] + w0 * word_bytes;
        if (!kr[t])
          r[t] = _mm512_setzero_si512();
        else if (kind == 1) /* bf16 -> float32: the bits up by 16 */
          r[t] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, at)), 16);
        else
          r[t] = _mm512_maskz_loadu_epi32(mask, at);
      }
      pf_transpose16(r);
      for (int64_t u = 0; u < 16 && w0 + u < W; u++) _mm512_storeu_si512((void*)(kt + (w0 + u) * PF_KEYS + j), r[u]);
    }
  }
}
#else
static inline void pf_pack_k(const void* row0, int64_t kv_stride, const int32_t* table, int64_t bs, int64_t j0,
                             int64_t nk, int64_t W, const int kind, pf_word* kt) {
  for (int64_t j = 0; j < PF_KEYS; j++) {
    if (j >= nk) {
      for (int64_t w = 0; w < W; w++) kt[w * PF_KEYS + j] = 0;
      continue;
    }
    const int64_t row = pf_row(table, bs, j0 + j);
    if (kind == 0) {
      const pf_word* kr = (const pf_word*)row0 + row * kv_stride;
      for (int64_t w = 0; w < W; w++) kt[w * PF_KEYS + j] = kr[w];
    } else {
      const bf16_t* kr = (const bf16_t*)row0 + row * kv_stride;
      for (int64_t w = 0; w < W; w++)
        kt[w * PF_KEYS + j] = kind == 1 ? (uint32_t)kr[w] << 16 : (uint32_t)kr[2 * w] | (uint32_t)kr[2 * w + 1] << 16;
    }
  }
}
#endif

/* The stages a task runs, in two kinds (the task body in prefill.c names one by its prefix):
 *   _width(D)                 4-byte words in a query vector's row (and rows of Kt)
 *   _q(qr, D, dst)            a query vector into the task's layout
 *   _kv(...)                  a block of keys and values into Kt and Vf
 *   _scores(q, kt, D, s)      PF_NQ query vectors x PF_TILE keys
 *   _PAIRS                    1: the softmax step leaves the probabilities as bf16 (for _values)
 *   _values(p, vf, nk, Dp, o) PF_NQ query vectors' sums over nk keys
 * "wide" (every CPU, float32 and bf16): float32 throughout, pf_scores / pf_values above. */
#define DEFINE_PF_WIDE(SUFFIX, T, LOAD)                                                           \
  static inline int64_t pf_wide_##SUFFIX##_width(int64_t D) { return D; }                        \
  enum { pf_wide_##SUFFIX##_PAIRS = 0 };                                                          \
  static inline void pf_wide_##SUFFIX##_q(const T* qr, int64_t D, float* dst) {                  \
    for (int64_t d = 0; d < D; d++) dst[d] = LOAD(qr[d]);                                         \
  }                                                                                               \
  static inline void pf_wide_##SUFFIX##_kv(const T* k, const T* v, int64_t kv_stride,            \
                                           const int32_t* table, int64_t bs, int64_t hk,          \
                                           int64_t j0, int64_t nk, int64_t D, int64_t Dp,         \
                                           float* kt, float* vf) {                                \
    pf_pack_k(k + hk * D, kv_stride, table, bs, j0, nk, D, sizeof(T) == 2, (pf_word*)kt);          \
    for (int64_t j = 0; j < nk; j++) {                                                            \
      const T* vr = v + pf_row(table, bs, j0 + j) * kv_stride + hk * D;                           \
      for (int64_t d = 0; d < D; d++) vf[j * Dp + d] = LOAD(vr[d]);                               \
    }                                                                                             \
  }                                                                                               \
  static inline __attribute__((always_inline)) void pf_wide_##SUFFIX##_scores(                    \
      const float* const q[PF_NQ], const float* kt, int64_t D, float* const s[PF_NQ]) {           \
    pf_scores(q, kt, D, s);                                                                       \
  }                                                                                               \
  static inline __attribute__((always_inline)) void pf_wide_##SUFFIX##_values(                    \
      const float* const p[PF_NQ], const float* vf, int64_t nk, int64_t Dp, float* const o[PF_NQ]) { \
    pf_values(p, vf, nk, Dp, o);                                                                  \
  }

DEFINE_PF_WIDE(f32, float, f32_id)

