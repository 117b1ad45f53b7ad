/* Part of cpu_kernels.c (one translation unit; see its list): decode attention over the paged KV cache; per-head products (MLA). */

/* Decode attention over the paged KV cache, reading K and V rows where they lie.
 *
 * q:            [B, H, D]            the newest token of each sequence
 * k/v_cache:    [blocks, bs, Hk, D]  one layer's cache (v_cache may be k_cache itself)
 * block_tables: [B, W] int32         each sequence's blocks (entries past its length unread)
 * context_lens: [B] int32            tokens in each sequence, the newest included
 * out:          [B, H, Dv]
 *
 * Values are the first Dv <= D entries of each v_cache row: Dv = D for per-head K and V; for
 * multi-head latent attention the cache holds one shared "head" per token (Hk = 1) of
 * D = kv_lora_rank + qk_rope_head_dim values, keys are the whole row and values its first
 * Dv = kv_lora_rank (v_cache = k_cache).
 *
 * A task is one sequence, a run of its KV heads [h0, h1) and a run [g0, g1) of each one's query
 * heads: it reads each token's K and V rows for those heads (contiguous in the cache) once, for
 * all those query heads. Scores are kept for the whole context (two-pass softmax). The keys seen
 * start at len - window (a sliding window, if > 0) and at the newest token's chunk start
 * (chunked attention, if chunk > 0). sinks: [H] float32 or NULL, a per-head logit that joins
 * each softmax's denominator only.
 */
#define DEFINE_PAGED_DECODE(SUFFIX, T, LOAD, STORE)                                               \
  static inline __attribute__((always_inline)) void decode_task_##SUFFIX(                        \
      const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,         \
      T* out, int64_t H, int64_t Hk, int64_t h0, int64_t h1, int64_t g0, int64_t g1,             \
      const int64_t D, const int64_t Dv, int64_t bs, float scale, int64_t window, int64_t chunk, \
      const float* sinks, float* work) {                                                         \
    const int64_t G = H / Hk, ng = g1 - g0, nkv = h1 - h0, nh = nkv * ng, row_stride = Hk * D;   \
    int64_t first = (window > 0 && len > window) ? len - window : 0;                             \
    if (chunk > 0 && (len - 1) / chunk * chunk > first) first = (len - 1) / chunk * chunk;       \
    const int64_t n = len - first;                                                               \
    float* qf = work;                   /* [nh, D] */                                            \
    float* acc = qf + nh * D;           /* [nh, Dv] */                                           \
    float* scores = acc + nh * Dv;      /* [nh, n] */                                            \
    /* Local head i = hh * ng + g is query head (h0 + hh) * G + g0 + g. */                       \
    for (int64_t hh = 0; hh < nkv; hh++)                                                         \
      for (int64_t g = 0; g < ng; g++)                                                           \
        for (int64_t d = 0; d < D; d++)                                                          \
          qf[(hh * ng + g) * D + d] = LOAD(q[((h0 + hh) * G + g0 + g) * D + d]) * scale;         \
    /* Token runs within one block: no division per token. */                                   \
    for (int64_t t = 0; t < n;) {                                                                \
      const int64_t pos = first + t, off = pos % bs;                                             \
      const int64_t run = bs - off < n - t ? bs - off : n - t;                                   \
      const T* base = k_cache + ((int64_t)table[pos / bs] * bs + off) * row_stride + h0 * D;     \
      for (int64_t u = 0; u < run; u++)                                                          \
        for (int64_t hh = 0; hh < nkv; hh++) {                                                   \
          const T* kr = base + u * row_stride + hh * D;                                          \
          for (int64_t g = 0; g < ng; g++) {                                                     \
            const float* qi = qf + (hh * ng + g) * D;                                            \
            float s = 0.f;                                                                       \
            _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qi[d] * LOAD(kr[d]); \
            scores[(hh * ng + g) * n + t + u] = s;                                               \
          }                                                                                      \
        }                                                                                        \
      t += run;                                                                                  \
    }                                                                                            \
    for (int64_t i = 0; i < nh; i++) {                                                           \
      float* si = scores + i * n;                                                                \
      const float sink = sinks ? sinks[(h0 + i / ng) * G + g0 + i % ng] : -INFINITY;             \
      float m = sink, sum = 0.f;                                                                 \
      for (int64_t t = 0; t < n; t++) m = si[t] > m ? si[t] : m;                                 \
      _Pragma("omp simd reduction(+ : sum)") for (int64_t t = 0; t < n; t++) {                   \
        si[t] = exp_vec(si[t] - m);                                                              \
        sum += si[t];                                                                            \
      }                                                                                          \
      if (sinks) sum += exp_vec(sink - m);                                                       \
      const float inv = 1.f / sum;                                                               \
      for (int64_t t = 0; t < n; t++) si[t] *= inv;                                              \
    }                                                                                            \
    memset(acc, 0, sizeof(float) * (size_t)(nh * Dv));                                          \
    for (int64_t t = 0; t < n;) {                                                                \
      const int64_t pos = first + t, off = pos % bs;                                             \
      const int64_t run = bs - off < n - t ? bs - off : n - t;                                   \
      const T* base = v_cache + ((int64_t)table[pos / bs] * bs + off) * row_stride + h0 * D;     \
      for (int64_t u = 0; u < run; u++)                                                          \
        for (int64_t hh = 0; hh < nkv; hh++) {                                                   \
          const T* vr = base + u * row_stride + hh * D;                                          \
          for (int64_t g = 0; g < ng; g++) {                                                     \
            const float p = scores[(hh * ng + g) * n + t + u];                                   \
            float* a = acc + (hh * ng + g) * Dv;                                                 \
            _Pragma("omp simd") for (int64_t d = 0; d < Dv; d++) a[d] += p * LOAD(vr[d]);        \
          }                                                                                      \
        }                                                                                        \
      t += run;                                                                                  \
    }                                                                                            \
    for (int64_t hh = 0; hh < nkv; hh++)                                                         \
      for (int64_t g = 0; g < ng; g++)                                                           \
        for (int64_t d = 0; d < Dv; d++)                                                         \
          out[((h0 + hh) * G + g0 + g) * Dv + d] = STORE(acc[(hh * ng + g) * Dv + d]);          \
  }                                                                                              \
                                                                                                 \
  void paged_decode_##SUFFIX(const T* q, const T* k_cache, const T* v_cache,                    \
                             const int32_t* block_tables, const int32_t* context_lens, T* out,   \
                             int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t Dv, int64_t W, \
                             int64_t bs, float scale, int64_t window, int64_t chunk,             \
                             const float* sinks, int threads) {                                  \
    /* Split heads only when there are too few sequences to keep every thread busy: KV heads   \
     * first (each task then reads only its heads' rows), then the query heads sharing one KV   \
     * head (a latent cache has a single one; those tasks read the same rows). */               \
    const int64_t G = H / Hk, want = (4 * threads + B - 1) / B;                                  \
    int64_t splits = want > Hk ? Hk : want;                                                      \
    if (splits < 1) splits = 1;                                                                  \
    while (Hk % splits) splits--;                                                                \
    int64_t gsplits = B * splits < threads ? (threads + B * splits - 1) / (B * splits) : 1;      \
    if (gsplits > G) gsplits = G;                                                                \
    const int64_t per = Hk / splits, tasks = B * splits * gsplits;                               \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                        \
    for (int64_t task = 0; task < tasks; task++) {                                               \
      const int64_t b = task / (splits * gsplits), rest = task % (splits * gsplits);             \
      const int64_t h0 = (rest / gsplits) * per, h1 = h0 + per, gs = rest % gsplits;             \
      const int64_t g0 = gs * G / gsplits, g1 = (gs + 1) * G / gsplits;                          \
      const int64_t len = context_lens[b];                                                       \
      float* work = (float*)malloc(sizeof(float) * (size_t)(per * (g1 - g0) * (D + Dv + len)));  \
      const T* qb = q + b * H * D;                                                               \
      T* ob = out + b * H * Dv;                                                                  \
      const int32_t* table = block_tables + b * W;                                               \
      if (D == 64 && Dv == 64)                                                                   \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, g0, g1, 64, 64, bs, scale, window, chunk, sinks, work); \
      else if (D == 128 && Dv == 128)                                                            \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, g0, g1, 128, 128, bs, scale, window, chunk, sinks, work); \
      else if (D == 576 && Dv == 512) /* DeepSeek's latent row: 512 + 64 */                      \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, g0, g1, 576, 512, bs, scale, window, chunk, sinks, work); \
      else                                                                                       \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, g0, g1, D, Dv, bs, scale, window, chunk, sinks, work); \
      free(work);                                                                                \
    }                                                                                            \
  }

DEFINE_PAGED_DECODE(f32, float, f32_id, f32_id)
DEFINE_PAGED_DECODE(bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/* Per-head matrix products, multi-head latent attention's absorbed projections (q x W_UK per head,
 * and the latent output through W_UV per head):
 *
 *   out[b, h, :] = x[b, h, :] @ w[h]       w [H, K, N] (trans = 0)
 *   out[b, h, :] = x[b, h, :] @ w[h]^T     w [H, N, K] (trans = 1)
 *
 * x: [B, H, K] with strides (sb, sh, 1) (a view of the query rows), w contiguous, out [B, H, N]
 * contiguous. Heads are split over threads; tokens go HEAD_ROWS at a time so their float32
 * accumulators stay in cache while each weight row is read once for all of them.
 */
#define HEAD_ROWS 16
#define DEFINE_HEAD_MATMUL(SUFFIX, T, LOAD, STORE)                                               \
  void head_matmul_##SUFFIX(const T* x, int64_t sb, int64_t sh, const T* w, T* out, int64_t B,   \
                            int64_t H, int64_t K, int64_t N, int trans, int threads) {           \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
    for (int64_t h = 0; h < H; h++) {                                                            \
      float* xf = (float*)malloc(sizeof(float) * (size_t)(HEAD_ROWS * (K + N)));                 \
      float* acc = xf + HEAD_ROWS * K;                                                           \
      const T* wh = w + h * K * N;                                                               \
      for (int64_t b0 = 0; b0 < B; b0 += HEAD_ROWS) {                                            \
        const int64_t nb = B - b0 < HEAD_ROWS ? B - b0 : HEAD_ROWS;                              \
        for (int64_t b = 0; b < nb; b++)                                                         \
          for (int64_t k = 0; k < K; k++) xf[b * K + k] = LOAD(x[(b0 + b) * sb + h * sh + k]);   \
        if (!trans) {                                                                            \
          memset(acc, 0, sizeof(float) * (size_t)(nb * N));                                     \
          for (int64_t k = 0; k < K; k++) {                                                      \
            const T* wr = wh + k * N;                                                            \
            for (int64_t b = 0; b < nb; b++) {                                                   \
              const float xv = xf[b * K + k];                                                    \
              float* a = acc + b * N;                                                            \
              _Pragma("omp simd") for (int64_t n = 0; n < N; n++) a[n] += xv * LOAD(wr[n]);      \
            }                                                                                    \
          }                                                                                      \
        } else {                                                                                 \
          for (int64_t n = 0; n < N; n++) {                                                      \
            const T* wr = wh + n * K;                                                            \
            for (int64_t b = 0; b < nb; b++) {                                                   \
              const float* xb = xf + b * K;                                                      \
              float sum = 0.f;                                                                   \
              _Pragma("omp simd reduction(+ : sum)") for (int64_t k = 0; k < K; k++) sum += xb[k] * LOAD(wr[k]); \
              acc[b * N + n] = sum;                                                              \
            }                                                                                    \
          }                                                                                      \
        }                                                                                        \
        for (int64_t b = 0; b < nb; b++)                                                         \
          for (int64_t n = 0; n < N; n++) out[((b0 + b) * H + h) * N + n] = STORE(acc[b * N + n]); \
      }                                                                                          \
      free(xf);                                                                                  \
    }                                                                                            \
  }

DEFINE_HEAD_MATMUL(f32, float, f32_id, f32_id)
DEFINE_HEAD_MATMUL(bf16, bf16_t, bf16_to_f32, f32_to_bf16)


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
 * vectors) share each loaded block of PF_KEYS keys, transposed (and widened) once into float32
 * Kt [D, PF_KEYS] and Vf [PF_KEYS, Dp] (Dp = D rounded up to whole vectors, zero-padded, so any
 * head_dim runs on whole vectors). Scores are 2 query vectors x PF_KEYS keys in registers, the
 * values' sums 2 vectors x 4 register vectors of D; accumulation is float32 throughout.
 */
#if defined(__AVX512F__)
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

static inline int64_t pf_first_key(int64_t p, int64_t window, int64_t chunk) {
  int64_t first = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
  if (chunk > 0 && p / chunk * chunk > first) first = p / chunk * chunk;
  return first;
}

/* PF_NQ query vectors at a time, each against 4 vectors of keys (scores) or of D (values): AVX2's
 * 16 registers hold 3 x 4 accumulators, a loaded vector and a broadcast; AVX-512's 32 hold 6 x 4
 * (its FMAs broadcast x from memory). Measured with 6 on AVX-512 (benchmarks/attention_bench.py,
 * Zen 5, 2,000 tokens): 1.2-1.4x the 3-vector tiles. A missing vector at the end is passed as a
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
static const int32_t pf_iota[128] = {
    0,   1,   2,   3,   4,   5,   6,   7,   8,   9,   10,  11,  12,  13,  14,  15,  16,  17,  18,
    19,  20,  21,  22,  23,  24,  25,  26,  27,  28,  29,  30,  31,  32,  33,  34,  35,  36,  37,
    38,  39,  40,  41,  42,  43,  44,  45,  46,  47,  48,  49,  50,  51,  52,  53,  54,  55,  56,
    57,  58,  59,  60,  61,  62,  63,  64,  65,  66,  67,  68,  69,  70,  71,  72,  73,  74,  75,
    76,  77,  78,  79,  80,  81,  82,  83,  84,  85,  86,  87,  88,  89,  90,  91,  92,  93,  94,
    95,  96,  97,  98,  99,  100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113,
    114, 115, 116, 117, 118, 119, 120, 121, 122, 123, 124, 125, 126, 127,
}; /* >= PF_KEYS */

static inline pf_v pf_select(pf_i mask, pf_v a, pf_v b) { return (pf_v)(((pf_i)a & mask) | ((pf_i)b & ~mask)); }

/* exp_vec on whole vectors (gcc leaves exp_vec's clamps as branches in this loop's scalar form) */
static inline pf_v pf_exp(pf_v v) {
  const pf_v zero = {0};
  v = pf_select(v < zero - 87.3f, zero - 87.3f, v);
  v = pf_select(v > zero + 88.7f, zero + 88.7f, v);
  const pf_v n = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const pf_v r = (v - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  pf_v p = zero + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return p * (pf_v)((__builtin_convertvector(n, pf_i) + 127) << 23);
}

/* One query vector's online-softmax step over keys [j0, j0 + nk) of which it sees [lo, hi]:
 * s (its scores) becomes its probabilities against the running max m; o and l are rescaled when
 * the max grows. */
static inline void pf_softmax_step(float* s, int64_t j0, int64_t nk, int64_t lo, int64_t hi, float* m,
                                   float* l, float* o, int64_t Dp) {
  if (hi < j0 || lo >= j0 + nk) {
    memset(s, 0, sizeof(float) * PF_KEYS);
    return;
  }
  const int32_t a = (int32_t)(lo > j0 ? lo - j0 : 0), b = (int32_t)(hi - j0 + 1 < nk ? hi - j0 + 1 : nk);
  enum { NV = PF_KEYS / PF_LANES };
  pf_v sv[NV], best = {0};
  pf_i seen[NV];
  best += -INFINITY;
  for (int u = 0; u < NV; u++) {
    const pf_i j = *(const pf_i*)(pf_iota + u * PF_LANES);
    seen[u] = (j >= a) & (j < b);
    sv[u] = pf_select(seen[u], *(const pf_vu*)(s + u * PF_LANES), best);
  }
  pf_v top = best;
  for (int u = 0; u < NV; u++) top = pf_select(sv[u] > top, sv[u], top);
  float mx = m[0];
  for (int e = 0; e < PF_LANES; e++) mx = top[e] > mx ? top[e] : mx;
  if (mx > m[0]) {
    const float c = exp_vec(m[0] - mx); /* m = -inf at first: o and l are still 0 */
    l[0] *= c;
    for (int64_t d = 0; d < Dp; d++) o[d] *= c;
    m[0] = mx;
  }
  pf_v sum = {0};
  for (int u = 0; u < NV; u++) {
    const pf_v p = (pf_v)((pf_i)pf_exp(sv[u] - mx) & seen[u]);
    *(pf_vu*)(s + u * PF_LANES) = p;
    sum += p;
  }
  float total = 0.f;
  for (int e = 0; e < PF_LANES; e++) total += sum[e];
  l[0] += total;
}

#define DEFINE_PAGED_PREFILL(SUFFIX, T, LOAD, STORE)                                              \
  static void prefill_task_##SUFFIX(const T* q, int64_t q_stride, const T* k, const T* v,          \
                                    int64_t kv_stride, const int32_t* table, int64_t bs, int64_t ctx, \
                                    int64_t r0, int64_t r1, int64_t hk, T* out, int64_t H, int64_t G, \
                                    int64_t D, float scale, int64_t window, int64_t chunk,        \
                                    const float* sinks, float* work) {                            \
    const int64_t Dp = (D + PF_LANES - 1) / PF_LANES * PF_LANES, nq = (r1 - r0) * G;               \
    float* qf = work;                 /* [nq, D], scaled */                                       \
    float* o = qf + PF_ROWS * G * D;  /* [nq, Dp] */                                              \
    float* s = o + PF_ROWS * G * Dp;  /* [nq, PF_KEYS] */                                         \
    float* kt = s + PF_ROWS * G * PF_KEYS; /* [D, PF_KEYS] */                                     \
    float* vf = kt + D * PF_KEYS;     /* [PF_KEYS, Dp] */                                         \
    float* m = vf + PF_KEYS * Dp;     /* [nq] */                                                  \
    float* l = m + PF_ROWS * G;       /* [nq] */                                                  \
    /* Query vector i: row r0 + i / G, head hk * G + i % G. */                                     \
    for (int64_t i = 0; i < nq; i++) {                                                            \
      const T* qr = q + (r0 + i / G) * q_stride + (hk * G + i % G) * D;                           \
      for (int64_t d = 0; d < D; d++) qf[i * D + d] = LOAD(qr[d]) * scale;                        \
      m[i] = -INFINITY;                                                                           \
      l[i] = 0.f;                                                                                 \
    }                                                                                             \
    memset(o, 0, sizeof(float) * (size_t)(nq * Dp));                                              \
    memset(vf, 0, sizeof(float) * (size_t)(PF_KEYS * Dp));                                        \
    const int64_t first = pf_first_key(ctx + r0, window, chunk), end = ctx + r1;                  \
    for (int64_t j0 = first; j0 < end; j0 += PF_KEYS) {                                           \
      const int64_t nk = end - j0 < PF_KEYS ? end - j0 : PF_KEYS;                                 \
      for (int64_t j = 0; j < PF_KEYS; j++) {                                                     \
        if (j >= nk) {                                                                            \
          for (int64_t d = 0; d < D; d++) kt[d * PF_KEYS + j] = 0.f;                              \
          continue;                                                                               \
        }                                                                                         \
        const int64_t p = j0 + j;                                                                 \
        const int64_t row = table ? (int64_t)table[p / bs] * bs + p % bs : p;                     \
        const T* kr = k + row * kv_stride + hk * D;                                               \
        const T* vr = v + row * kv_stride + hk * D;                                               \
        for (int64_t d = 0; d < D; d++) kt[d * PF_KEYS + j] = LOAD(kr[d]);                        \
        for (int64_t d = 0; d < D; d++) vf[j * Dp + d] = LOAD(vr[d]);                             \
      }                                                                                           \
      /* per PF_NQ query vectors: scores, softmax, values, while Kt and Vf stay in L1 */          \
      for (int64_t i = 0; i < nq; i += PF_NQ) {                                                   \
        const float *qs[PF_NQ], *ps[PF_NQ];                                                       \
        float *ss[PF_NQ], *os[PF_NQ];                                                             \
        for (int t = 0; t < PF_NQ; t++) {                                                         \
          const int64_t n = i + t < nq ? i + t : i;                                               \
          qs[t] = qf + n * D, ps[t] = ss[t] = s + n * PF_KEYS, os[t] = o + n * Dp;                \
        }                                                                                         \
        for (int64_t c = 0; c < nk; c += PF_TILE) {                                               \
          float* sc[PF_NQ];                                                                       \
          for (int t = 0; t < PF_NQ; t++) sc[t] = ss[t] + c;                                      \
          pf_scores(qs, kt + c, D, sc);                                                           \
        }                                                                                         \
        for (int64_t n = i; n < i + PF_NQ && n < nq; n++) {                                       \
          const int64_t p = ctx + r0 + n / G;                                                     \
          pf_softmax_step(s + n * PF_KEYS, j0, nk, pf_first_key(p, window, chunk), p, m + n, l + n, \
                          o + n * Dp, Dp);                                                        \
        }                                                                                         \
        pf_values(ps, vf, nk, Dp, os);                                                            \
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
    const size_t floats = (size_t)(PF_ROWS * G * (D + Dp + PF_KEYS + 2) + PF_KEYS * (D + Dp));    \
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

DEFINE_PAGED_PREFILL(f32, float, f32_id, f32_id)
DEFINE_PAGED_PREFILL(bf16, bf16_t, bf16_to_f32, f32_to_bf16)
