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

