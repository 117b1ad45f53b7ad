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
/* Decode attention reads each sequence's K and V rows once, from memory (a batch's KV cache does
 * not stay cached between steps), a few hundred bytes a token in blocks scattered over the cache,
 * and waited on those loads (perf: most of its samples on the row loads). Each row is prefetched
 * this many tokens ahead (its block looked up; 0: none), and a task's first rows of K and V before
 * its loops (KV_PF_INITIAL). Measured on Zen 5, one thread, 32 sequences of 40-90 tokens, 8 / 4
 * heads of 64, a 256 MB cache (cold, random blocks), three alternated processes: bf16 530-590 us a
 * call without, 335-385 with 8 ahead (4: 360-383, 16: 330-348), 323-340 with the first rows too;
 * float32 626-648 without, 328-403 with both. */
#ifndef KV_PF_TOKENS
#define KV_PF_TOKENS 8
#endif
#ifndef KV_PF_INITIAL
#define KV_PF_INITIAL 1
#endif
static inline void prefetch_kv_row(const void* cache, const int32_t* table, int64_t pos, int64_t len, int64_t bs,
                                   int64_t row_bytes, int64_t offset, int64_t bytes) {
  if (!KV_PF_TOKENS || pos >= len) return;
  const char* row = (const char*)cache + ((int64_t)table[pos / bs] * bs + pos % bs) * row_bytes + offset;
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
}

/* The first key a query at position p sees: the last `window` keys (window > 0), within p's
 * `chunk` (chunk > 0). Decode tasks (p = len - 1) and prefill tasks share it. */
static inline int64_t pf_first_key(int64_t p, int64_t window, int64_t chunk) {
  int64_t first = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
  if (chunk > 0 && p / chunk * chunk > first) first = p / chunk * chunk;
  return first;
}

/* A task's first KV_PF_TOKENS rows of K and V (its loops prefetch that far ahead of themselves). */
static inline void prefetch_kv_first(const void* k_cache, const void* v_cache, const int32_t* table, int64_t first,
                                     int64_t len, int64_t bs, int64_t row_bytes, int64_t offset, int64_t bytes) {
  for (int64_t t = 0; t < KV_PF_TOKENS && KV_PF_INITIAL; t++) {
    prefetch_kv_row(k_cache, table, first + t, len, bs, row_bytes, offset, bytes);
    prefetch_kv_row(v_cache, table, first + t, len, bs, row_bytes, offset, bytes);
  }
}

/* A decode task's nh score rows (`stride` apart, n scores each; row i is query head
 * (h0 + i / ng) * G + g0 + i % ng) to their softmax probabilities; a head's sink, if any, joins
 * the denominator only. */
static inline void decode_softmax(float* scores, int64_t stride, int64_t nh, int64_t n, const float* sinks,
                                  int64_t h0, int64_t G, int64_t g0, int64_t ng) {
  for (int64_t i = 0; i < nh; i++) {
    float* si = scores + i * stride;
    const float sink = sinks ? sinks[(h0 + i / ng) * G + g0 + i % ng] : -INFINITY;
    float m = sink, sum = 0.f;
    for (int64_t t = 0; t < n; t++) m = si[t] > m ? si[t] : m;
    _Pragma("omp simd reduction(+ : sum)") for (int64_t t = 0; t < n; t++) {
      si[t] = exp_vec(si[t] - m);
      sum += si[t];
    }
    if (sinks) sum += exp_vec(sink - m);
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n; t++) si[t] *= inv;
  }
}

/* The AVX-512 decode task for bf16 caches, D = Dv (64, 128), up to DF_HEADS query heads a task:
 * the generic task below computes each score as its own dot product ending in a horizontal sum and
 * adds each token's value row into accumulators in memory (~45 cycles a token and head from the
 * L3). Here a token's K row is read once for all the task's heads, each score's 16 partial sums go
 * to a buffer and 16 tokens' scores come out of one transposing add tree, and the value
 * accumulators stay in registers. Same softmax; the values' sums are the generic task's (one FMA a
 * token, in token order); the scores differ only in the order their 16 partials add. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define DF_HEADS 32
static inline __m512 df_row_bf16(const bf16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
/* Where token t's partial sums go so that lane t of df_hsum16's result is token t's sum (the add
 * tree's lane order, an involution). */
static const int df_slot[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
/* 16 vectors -> one whose lanes are their sums (v in df_slot order). */
static inline __m512 df_hsum16(const float* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; i++) {
    const __m512 a = _mm512_loadu_ps(v + 16 * i), b = _mm512_loadu_ps(v + 16 * (i + 8));
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  }
  for (int i = 0; i < 4; i++)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[i], w[i + 4], 0x88), _mm512_shuffle_f32x4(w[i], w[i + 4], 0xdd));
  for (int i = 0; i < 2; i++)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[i], x[i + 2], 0x44), _mm512_shuffle_ps(x[i], x[i + 2], 0xee));
  return _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xdd));
}

#define DEFINE_DECODE_FAST(SUFFIX, T, ROW, STORE)                                                  \
  static inline __attribute__((always_inline)) void decode_fast_##SUFFIX(                         \
      const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len, T* out,  \
      int64_t H, int64_t Hk, int64_t h0, int64_t h1, int64_t g0, int64_t g1, const int64_t D,     \
      int64_t bs, float scale, int64_t window, int64_t chunk, const float* sinks, float* work) {  \
    enum { NC_MAX = 8 };                                                                          \
    const int64_t G = H / Hk, ng = g1 - g0, nkv = h1 - h0, nh = nkv * ng, row_stride = Hk * D;    \
    const int64_t NC = D / 16;                                                                    \
    const int64_t first = pf_first_key(len - 1, window, chunk);                                   \
    const int64_t n = len - first;                                                                \
    float* qf = work;            /* [nh, D] */                                                    \
    float* scores = qf + nh * D; /* [nh, n + 16] */                                               \
    const int64_t sn = n + 16;                                                                    \
    float part[DF_HEADS][16 * 16]; /* [head][16 tokens' partial sums], df_slot order */          \
    for (int64_t hh = 0; hh < nkv; hh++)                                                          \
      for (int64_t g = 0; g < ng; g++)                                                            \
        for (int64_t d = 0; d < D; d++)                                                           \
          qf[(hh * ng + g) * D + d] = LOAD_##SUFFIX(q[((h0 + hh) * G + g0 + g) * D + d]) * scale; \
    const int64_t row_bytes = row_stride * (int64_t)sizeof(T), head_off = h0 * D * (int64_t)sizeof(T); \
    const int64_t head_bytes = nkv * D * (int64_t)sizeof(T);                                      \
    prefetch_kv_first(k_cache, v_cache, table, first, len, bs, row_bytes, head_off, head_bytes);  \
    /* scores: 16 tokens at a time, each token's K row read once for all the task's heads */     \
    int64_t blk = first / bs, off = first % bs;                                                   \
    for (int64_t t0 = 0; t0 < n; t0 += 16) {                                                      \
      const int64_t cnt = n - t0 < 16 ? n - t0 : 16;                                              \
      for (int64_t u = 0; u < 16; u++) {                                                          \
        if (u >= cnt) { /* past the end: zero partials, their lanes not stored */                 \
          for (int64_t i = 0; i < nh; i++) _mm512_storeu_ps(part[i] + 16 * df_slot[u], _mm512_setzero_ps()); \
          continue;                                                                               \
        }                                                                                         \
        prefetch_kv_row(k_cache, table, first + t0 + u + KV_PF_TOKENS, len, bs, row_bytes, head_off, head_bytes); \
        const T* row = k_cache + ((int64_t)table[blk] * bs + off) * row_stride + h0 * D;          \
        if (++off == bs) off = 0, blk++;                                                          \
        for (int64_t hh = 0; hh < nkv; hh++) {                                                    \
          __m512 kv[NC_MAX];                                                                      \
          for (int64_t c = 0; c < NC; c++) kv[c] = ROW(row + hh * D + 16 * c);                    \
          for (int64_t g = 0; g < ng; g++) {                                                      \
            const float* qi = qf + (hh * ng + g) * D;                                             \
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qi), kv[0]);                                 \
            for (int64_t c = 1; c < NC; c++) a = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), kv[c], a); \
            _mm512_storeu_ps(part[hh * ng + g] + 16 * df_slot[u], a);                             \
          }                                                                                       \
        }                                                                                         \
      }                                                                                           \
      for (int64_t i = 0; i < nh; i++) _mm512_storeu_ps(scores + i * sn + t0, df_hsum16(part[i])); \
    }                                                                                             \
    decode_softmax(scores, sn, nh, n, sinks, h0, G, g0, ng);                                      \
    /* values: the task's query heads (i = hh * ng + g) in passes of as many as 24 accumulator  \
     * vectors hold, each pass once over the tokens, a V row's part widened once per KV head */   \
    const int64_t per_pass = 24 / NC;                                                             \
    for (int64_t i0 = 0; i0 < nh; i0 += per_pass) {                                               \
      const int64_t gn = nh - i0 < per_pass ? nh - i0 : per_pass;                                 \
      __m512 acc[24];                                                                             \
      for (int64_t a = 0; a < gn * NC; a++) acc[a] = _mm512_setzero_ps();                         \
      for (int64_t t = 0; t < n;) {                                                               \
        const int64_t pos = first + t, off = pos % bs;                                            \
        const int64_t run = bs - off < n - t ? bs - off : n - t;                                  \
        const T* base = v_cache + ((int64_t)table[pos / bs] * bs + off) * row_stride + h0 * D;    \
        for (int64_t u = 0; u < run; u++) {                                                       \
          if (i0 == 0)                                                                            \
            prefetch_kv_row(v_cache, table, pos + u + KV_PF_TOKENS, len, bs, row_bytes, head_off, head_bytes); \
          const T* vr = base + u * row_stride;                                                    \
          __m512 vv[NC_MAX];                                                                      \
          int64_t loaded = -1;                                                                    \
          for (int64_t g = 0; g < gn; g++) {                                                      \
            const int64_t i = i0 + g, hh = i / ng;                                                \
            if (hh != loaded)                                                                     \
              for (int64_t c = 0; c < NC; c++) vv[c] = ROW(vr + hh * D + 16 * c);                 \
            loaded = hh;                                                                          \
            const __m512 p = _mm512_set1_ps(scores[i * sn + t + u]);                              \
            for (int64_t c = 0; c < NC; c++) acc[g * NC + c] = _mm512_fmadd_ps(p, vv[c], acc[g * NC + c]); \
          }                                                                                       \
        }                                                                                         \
        t += run;                                                                                 \
      }                                                                                           \
      for (int64_t g = 0; g < gn; g++) {                                                          \
        const int64_t i = i0 + g, hh = i / ng;                                                    \
        T* orow = out + ((h0 + hh) * G + g0 + i % ng) * D;                                        \
        float tmp[16];                                                                            \
        for (int64_t c = 0; c < NC; c++) {                                                        \
          _mm512_storeu_ps(tmp, acc[g * NC + c]);                                                 \
          for (int d = 0; d < 16; d++) orow[16 * c + d] = STORE(tmp[d]);                          \
        }                                                                                         \
      }                                                                                           \
    }                                                                                             \
  }
#define LOAD_bf16(v) bf16_to_f32(v)
DEFINE_DECODE_FAST(bf16, bf16_t, df_row_bf16, f32_to_bf16)
/* bf16 only: float32 rows (1 KB a token at 4 x 64) measured 0.88-0.95x the generic task from
 * memory, 1.0-1.14x from the L3; bf16 1.3-1.6x and 1.7x (paged_decode, 32 sequences of 140-160
 * tokens, 8 / 4 heads of 64, alternated runs). D as a constant so the row loops unroll. */
#define DECODE_FAST_bf16(q, kc, vc, tb, len, o, H, Hk, h0, h1, g0, g1, D, Dv, heads, ...)            \
  (D == Dv && (D == 64 || D == 128) && (heads) <= DF_HEADS                                         \
       ? ((D) == 64 ? decode_fast_bf16(q, kc, vc, tb, len, o, H, Hk, h0, h1, g0, g1, 64, __VA_ARGS__) \
                    : decode_fast_bf16(q, kc, vc, tb, len, o, H, Hk, h0, h1, g0, g1, 128, __VA_ARGS__)), \
         1                                                                                          \
       : 0)
#else
#define DECODE_FAST_bf16(...) 0
#endif
#define DECODE_FAST_f32(...) 0

#define DEFINE_PAGED_DECODE(SUFFIX, T, LOAD, STORE)                                               \
  static inline __attribute__((always_inline)) void decode_task_##SUFFIX(                        \
      const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,         \
      T* out, int64_t H, int64_t Hk, int64_t h0, int64_t h1, int64_t g0, int64_t g1,             \
      const int64_t D, const int64_t Dv, int64_t bs, float scale, int64_t window, int64_t chunk, \
      const float* sinks, float* work) {                                                         \
    const int64_t G = H / Hk, ng = g1 - g0, nkv = h1 - h0, nh = nkv * ng, row_stride = Hk * D;   \
    const int64_t first = pf_first_key(len - 1, window, chunk);                                  \
    const int64_t n = len - first;                                                               \
    float* qf = work;                   /* [nh, D] */                                            \
    float* acc = qf + nh * D;           /* [nh, Dv] */                                           \
    float* scores = acc + nh * Dv;      /* [nh, n] */                                            \
    /* Local head i = hh * ng + g is query head (h0 + hh) * G + g0 + g. */                       \
    for (int64_t hh = 0; hh < nkv; hh++)                                                         \
      for (int64_t g = 0; g < ng; g++)                                                           \
        for (int64_t d = 0; d < D; d++)                                                          \
          qf[(hh * ng + g) * D + d] = LOAD(q[((h0 + hh) * G + g0 + g) * D + d]) * scale;         \
    /* This task's part of a token's row (its KV heads), in bytes, for the prefetches. */       \
    const int64_t row_bytes = row_stride * (int64_t)sizeof(T), head_off = h0 * D * (int64_t)sizeof(T); \
    const int64_t head_bytes = nkv * D * (int64_t)sizeof(T);                                     \
    prefetch_kv_first(k_cache, v_cache, table, first, len, bs, row_bytes, head_off, head_bytes); \
    /* Token runs within one block: no division per token. */                                   \
    for (int64_t t = 0; t < n;) {                                                                \
      const int64_t pos = first + t, off = pos % bs;                                             \
      const int64_t run = bs - off < n - t ? bs - off : n - t;                                   \
      const T* base = k_cache + ((int64_t)table[pos / bs] * bs + off) * row_stride + h0 * D;     \
      for (int64_t u = 0; u < run; u++) {                                                        \
        prefetch_kv_row(k_cache, table, pos + u + KV_PF_TOKENS, len, bs, row_bytes, head_off, head_bytes); \
        for (int64_t hh = 0; hh < nkv; hh++) {                                                   \
          const T* kr = base + u * row_stride + hh * D;                                          \
          for (int64_t g = 0; g < ng; g++) {                                                     \
            const float* qi = qf + (hh * ng + g) * D;                                            \
            float s = 0.f;                                                                       \
            _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qi[d] * LOAD(kr[d]); \
            scores[(hh * ng + g) * n + t + u] = s;                                               \
          }                                                                                      \
        }                                                                                        \
      }                                                                                          \
      t += run;                                                                                  \
    }                                                                                            \
    decode_softmax(scores, n, nh, n, sinks, h0, G, g0, ng);                                      \
    memset(acc, 0, sizeof(float) * (size_t)(nh * Dv));                                          \
    for (int64_t t = 0; t < n;) {                                                                \
      const int64_t pos = first + t, off = pos % bs;                                             \
      const int64_t run = bs - off < n - t ? bs - off : n - t;                                   \
      const T* base = v_cache + ((int64_t)table[pos / bs] * bs + off) * row_stride + h0 * D;     \
      for (int64_t u = 0; u < run; u++) {                                                        \
        prefetch_kv_row(v_cache, table, pos + u + KV_PF_TOKENS, len, bs, row_bytes, head_off, head_bytes); \
        for (int64_t hh = 0; hh < nkv; hh++) {                                                   \
          const T* vr = base + u * row_stride + hh * D;                                          \
          for (int64_t g = 0; g < ng; g++) {                                                     \
            const float p = scores[(hh * ng + g) * n + t + u];                                   \
            float* a = acc + (hh * ng + g) * Dv;                                                 \
            _Pragma("omp simd") for (int64_t d = 0; d < Dv; d++) a[d] += p * LOAD(vr[d]);        \
          }                                                                                      \
        }                                                                                        \
      }                                                                                          \
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
      float* work = (float*)malloc(sizeof(float) * (size_t)(per * (g1 - g0) * (D + Dv + len + 16))); \
      const T* qb = q + b * H * D;                                                               \
      T* ob = out + b * H * Dv;                                                                  \
      const int32_t* table = block_tables + b * W;                                               \
      if (DECODE_FAST_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, g0, g1, D, Dv, per * (g1 - g0), bs, scale, window, chunk, sinks, work)) \
        ;                                                                                        \
      else if (D == 64 && Dv == 64)                                                              \
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

/* The stages a task runs, in two kinds (the task body below names one by its prefix):
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

/* "pairs" (bf16 with AVX512-BF16): the products on vdpbf16ps, which multiplies pairs of bf16 and
 * accumulates in float32, twice a float32 FMA's products per instruction.
 * Scores: q and K stay bf16, as 32-bit pairs over D (an odd D's last pair is (x, 0)): q [D2] and
 * Kt [D2, PF_KEYS], D2 = ceil(D / 2). A product of two bf16 is exact in float32, so the scores are
 * the wide path's up to the order of the float32 additions; the softmax scale multiplies them
 * afterwards (in both kinds: q is not scaled, and so not rounded, first).
 * Values: the probabilities rounded to bf16 (as torch's CPU flash kernel does for bf16), V as pairs
 * over keys, Vt [PF_KEYS / 2, Dp] of (v[2i][d], v[2i + 1][d]); l sums the rounded probabilities,
 * so the weights still sum to 1. Against float32 probabilities (widened V, FMAs): 1.3-1.5x the
 * speed at 2,000 tokens; the error against a float32 reference 1.1-1.25x the bf16 output's own
 * rounding instead of 1.0x (tests/test_prefill_kernel.py). */
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
