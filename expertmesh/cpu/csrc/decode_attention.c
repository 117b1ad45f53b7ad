/* Part of cpu_kernels.c (one translation unit; see its list): decode attention over the paged KV cache. */

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
 * its loops (KV_PF_INITIAL). Both cut the call's time by about a third to a half, 8 tokens being
 * the best of 4, 8 and 16 (docs/benchmarks.md, "Kernel figures"). */
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
/* bf16 only: on float32 rows (1 KB a token at 4 x 64) this task was no faster than the generic one
 * from memory, on bf16 rows clearly faster (docs/benchmarks.md, "Kernel figures"). D as a constant so the row loops
 * unroll. */
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

