/* expertmesh CPU kernels, compiled on first use by expertmesh/layers/cpu_kernels.py.
 *
 * Plain C with OpenMP: loops are written so that gcc/clang vectorise them for the host
 * (-O3 -march=native), with the common head sizes as compile-time constants so the inner
 * loops unroll fully. Every entry point takes the thread count, so it follows
 * torch.set_num_threads rather than OpenMP's own default. float32 and bfloat16 share one body
 * through the DEFINE_* macros (T = storage type, LOAD/STORE = conversion to and from float).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)x << 16;
  return v.f;
}

static inline bf16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
  uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even, as torch does */
  return (bf16_t)((v.u + rounding) >> 16);
}

static inline float f32_id(float x) { return x; }

/* exp(v) for float32, written so the compiler vectorises it (libm's expf is a scalar call):
 * v = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative error
 * about 2e-7, within a float's rounding of expf), times 2^n built in the exponent bits. */
static inline float exp_vec(float v) {
  v = v < -87.3f ? -87.3f : (v > 88.7f ? 88.7f : v);
  /* nearest integer by the 1.5 * 2^23 trick: roundf is a libm call unless vectorised (callgrind:
   * 0.3 M instructions a batch-1 step in silu alone), this is two additions in any vector width */
  const float n = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (v - n * 0.693145751953125f) - n * 1.42860682030941723e-6f; /* ln2 split in two */
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  union { uint32_t u; float f; } scale;
  scale.u = (uint32_t)((int32_t)n + 127) << 23;
  return p * scale.f;
}

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

/* Matrix products y[M, O] = x[M, I] @ W[O, I]^T with W held in panels of LANES output rows:
 * wp[P][I][LANES], P = ceil(O / LANES), rows past O zero (pack_panels in cpu_kernels.py).
 *
 * A tile is MR rows of x against NP panels: MR x NP vector accumulators stay in registers, each
 * step loads NP weight vectors and broadcasts MR scalars of x. Panels are split over threads;
 * within a thread each panel group is read from memory once and then from cache for the next
 * MR rows of x, so small M (decode) streams the weights at memory speed and large M (prefill)
 * runs from cache. bfloat16 weights are widened to float32 in registers; accumulation is float32.
 */
#if defined(__AVX512F__)
#define LANES 16
#define MR 8
#define NP 3
#else
/* AVX2 (16 vector registers): 6 x 2 accumulators + 2 weight vectors + a broadcast = 15. Measured
 * on Zen 3 against 4 x 2 (the previous shape), 4 x 3 and 3 x 4 at the small MoE's shapes, one
 * thread: 6 x 2 is 1.2-1.5x 4 x 2 from 8 rows on, equal at 1 row (docs/benchmarks.md). */
#define LANES 8
#ifndef MR
#define MR 6
#endif
#ifndef NP
#define NP 2
#endif
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vf_unaligned __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

int64_t gemm_lanes(void) { return LANES; }

static inline vf load_panel_f32(const float* p) { return *(const vf_unaligned*)p; }

#if LANES == 8 && defined(__AVX2__)
#include <immintrin.h>
/* One vpmovzxwd from memory and a shift: gcc compiles the generic form below, on 8 lanes, into a
 * 16-byte load, two 4-lane widenings, a byte shift and an insert (measured, kernel_bench.py: bf16
 * at 1 row 1.2-1.5x faster with this one, at 32 rows 51-57 -> 72-82 GFLOP/s a core). */
static inline vf load_panel_bf16(const bf16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return (vf)_mm256_slli_epi32(wide, 16);
}
#else
static inline vf load_panel_bf16(const bf16_t* p) {
  vu wide = __builtin_convertvector(*(const vh*)p, vu) << 16;
  return (vf)wide;
}
#endif

static inline void store_row_f32(float* y, const vf v, int64_t n) {
  if (n == LANES) {
    *(vf_unaligned*)y = v;
  } else {
    float tmp[LANES];
    memcpy(tmp, &v, sizeof tmp);
    memcpy(y, tmp, sizeof(float) * (size_t)n);
  }
}

static inline void store_row_bf16(bf16_t* y, const vf v, int64_t n) {
  float tmp[LANES];
  memcpy(tmp, &v, sizeof tmp);
  for (int64_t l = 0; l < n; l++) y[l] = f32_to_bf16(tmp[l]);
}

/* Bias (float32, may be NULL) is added before the output is rounded, as oneDNN does. */
static inline vf bias_vec(const float* bias, int64_t o, int64_t n) {
  float tmp[LANES] = {0};
  if (bias) memcpy(tmp, bias + o, sizeof(float) * (size_t)n);
  vf v;
  memcpy(&v, tmp, sizeof v);
  return v;
}

/* Panels a one-row product takes at once (row1_*): enough independent FMA chains to cover
 * the FMA latency, where a tile's NP chains leave a one-row decode latency-bound. */
#define NP1 8

/* Rows [r, r1) in tiles: MR rows a tile, then one tile of the 1..7 left, the row count a
 * constant in each case so every tile's loops unroll. The tile takes (..., rows, bias). */
#define TILE_ROWS(r, r1, tile, bias, ...)                    \
  for (; r + MR <= r1; r += MR) tile(__VA_ARGS__, MR, bias); \
  switch (r1 - r) {                                          \
    case 7: tile(__VA_ARGS__, 7, bias); break;               \
    case 6: tile(__VA_ARGS__, 6, bias); break;               \
    case 5: tile(__VA_ARGS__, 5, bias); break;               \
    case 4: tile(__VA_ARGS__, 4, bias); break;               \
    case 3: tile(__VA_ARGS__, 3, bias); break;               \
    case 2: tile(__VA_ARGS__, 2, bias); break;               \
    case 1: tile(__VA_ARGS__, 1, bias); break;               \
    default: break;                                          \
  }

#define DEFINE_GEMM(SUFFIX, TW, TY, LOADW, STOREY)                                               \
  static inline __attribute__((always_inline)) void tile_##SUFFIX(                              \
      const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t p0, int64_t np,        \
      const int rows, const float* bias) {                                                       \
    vf acc[8][NP]; /* 8 >= MR: rows_* below calls tiles of up to 7 remainder rows */             \
    for (int r = 0; r < rows; r++)                                                               \
      for (int j = 0; j < NP; j++) acc[r][j] = (vf){0};                                          \
    const TW* w = wp + p0 * I * LANES;                                                           \
    if (np == NP) {                                                                              \
      for (int64_t i = 0; i < I; i++) {                                                          \
        vf wv[NP];                                                                               \
        for (int j = 0; j < NP; j++) wv[j] = LOADW(w + (j * I + i) * LANES);                    \
        for (int r = 0; r < rows; r++) {                                                         \
          const float xs = x[r * I + i];                                                         \
          for (int j = 0; j < NP; j++) acc[r][j] += wv[j] * xs;                                  \
        }                                                                                        \
      }                                                                                          \
    } else {                                                                                     \
      for (int64_t i = 0; i < I; i++)                                                            \
        for (int j = 0; j < np; j++) {                                                           \
          const vf wv = LOADW(w + (j * I + i) * LANES);                                         \
          for (int r = 0; r < rows; r++) acc[r][j] += wv * x[r * I + i];                         \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < np; j++) {                                                               \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                     \
      const vf b = bias_vec(bias, o, n);                                                         \
      for (int r = 0; r < rows; r++) STOREY(y + r * O + o, acc[r][j] + b, n);                     \
    }                                                                                            \
  }                                                                                              \
                                                                                                 \
  /* Rows [r0, r1) of x against panel group g, in tiles (TILE_ROWS).                       */   \
  static void rows_##SUFFIX(const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t P,\
                            int64_t g, int64_t r0, int64_t r1, const float* bias) {              \
    const int64_t p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;                                   \
    int64_t r = r0;                                                                              \
    TILE_ROWS(r, r1, tile_##SUFFIX, bias, x + r * I, I, wp, y + r * O, O, p0, np);               \
  }                                                                                              \
                                                                                                 \
  /* One row of x against panel group g of NP1 panels (decode): NP1 independent accumulator    \
   * chains instead of a tile's NP, each summed in the same order as in a tile, so the result is \
   * bit for bit the tiles' (a row's product does not depend on how many rows a call has). */   \
  static void row1_##SUFFIX(const float* x, int64_t I, const TW* wp, TY* y, int64_t O, int64_t P,\
                            int64_t g, const float* bias) {                                      \
    const int64_t p0 = g * NP1, np = P - p0 < NP1 ? P - p0 : NP1;                                \
    if (np < NP1) {                                                                              \
      for (int64_t q = p0; q < P; q += NP)                                                       \
        tile_##SUFFIX(x, I, wp, y, O, q, P - q < NP ? P - q : NP, 1, bias);                      \
      return;                                                                                    \
    }                                                                                            \
    vf acc[NP1];                                                                                 \
    for (int j = 0; j < NP1; j++) acc[j] = (vf){0};                                              \
    const TW* w = wp + p0 * I * LANES;                                                           \
    for (int64_t i = 0; i < I; i++) {                                                            \
      const float xs = x[i];                                                                     \
      for (int j = 0; j < NP1; j++) acc[j] += LOADW(w + (j * I + i) * LANES) * xs;              \
    }                                                                                            \
    for (int j = 0; j < NP1; j++) {                                                              \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                     \
      STOREY(y + o, acc[j] + bias_vec(bias, o, n), n);                                           \
    }                                                                                            \
  }

DEFINE_GEMM(f32, float, float, load_panel_f32, store_row_f32)
DEFINE_GEMM(bf16, bf16_t, bf16_t, load_panel_bf16, store_row_bf16)
/* bf16 weights, float32 output: partial sums that other ranks add to (rounded after the sum),
 * and the routed experts' intermediates (moe_bf16 without pairs). */
DEFINE_GEMM(bf16_f32, bf16_t, float, load_panel_bf16, store_row_f32)

/* Work items are (block of ROW_BLOCK rows, panel group): a thread's consecutive items share a
 * row block, which stays in cache while the panel groups stream past it (long prefills). */
#define ROW_BLOCK 256

void gemm_f32(const float* x, const float* wp, float* y, int64_t M, int64_t O, int64_t I,
              const float* bias, int threads) {
  const int64_t P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;
  const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  if (M == 1) {
    const int64_t g1 = (P + NP1 - 1) / NP1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < g1; g++) row1_f32(x, I, wp, y, O, P, g, bias);
    return;
  }
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t item = 0; item < blocks * groups; item++) {
    const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
    rows_f32(x, I, wp, y, O, P, item % groups, r0, r1, bias);
  }
}

/* x is widened to float32 once, so the tiles broadcast plain floats. y: bf16, or float32 when
 * y_f32 (gemm_bf16_f32: the same products, not rounded). */
static void gemm_bf16_to(const bf16_t* x, const bf16_t* wp, void* y, int y_f32, int64_t M, int64_t O,
                         int64_t I, const float* bias, int threads) {
  const int64_t P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;
  float* xf = (float*)malloc(sizeof(float) * (size_t)(M * I + 1));
  for (int64_t k = 0; k < M * I; k++) xf[k] = bf16_to_f32(x[k]);
  const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  if (M == 1) {
    const int64_t g1 = (P + NP1 - 1) / NP1;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t g = 0; g < g1; g++) {
      if (y_f32)
        row1_bf16_f32(xf, I, wp, (float*)y, O, P, g, bias);
      else
        row1_bf16(xf, I, wp, (bf16_t*)y, O, P, g, bias);
    }
    free(xf);
    return;
  }
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t item = 0; item < blocks * groups; item++) {
    const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
    if (y_f32)
      rows_bf16_f32(xf, I, wp, (float*)y, O, P, item % groups, r0, r1, bias);
    else
      rows_bf16(xf, I, wp, (bf16_t*)y, O, P, item % groups, r0, r1, bias);
  }
  free(xf);
}

void gemm_bf16(const bf16_t* x, const bf16_t* wp, bf16_t* y, int64_t M, int64_t O, int64_t I,
               const float* bias, int threads) {
  gemm_bf16_to(x, wp, y, 0, M, O, I, bias, threads);
}

void gemm_bf16_f32(const bf16_t* x, const bf16_t* wp, float* y, int64_t M, int64_t O, int64_t I,
                   const float* bias, int threads) {
  gemm_bf16_to(x, wp, y, 1, M, O, I, bias, threads);
}

/* ---- small per-token ops: fewer, larger calls than torch's chain of elementwise ops --------
 * RMSNorm, in the reference's order: float32 x * rsqrt(mean(x^2) + eps), rounded to the model
 * dtype, then times the weight (and rounded again). rows of width H. */
#define DEFINE_RMSNORM(SUFFIX, T, LOAD, STORE)                                                   \
  void rms_norm_##SUFFIX(const T* x, const T* weight, T* out, int64_t rows, int64_t H,          \
                         float eps, int threads) {                                               \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (rows > 256)")            \
    for (int64_t r = 0; r < rows; r++) {                                                         \
      const T* xr = x + r * H;                                                                   \
      float ss = 0.f;                                                                            \
      _Pragma("omp simd reduction(+ : ss)") for (int64_t c = 0; c < H; c++) {                    \
        const float v = LOAD(xr[c]);                                                             \
        ss += v * v;                                                                             \
      }                                                                                          \
      const float inv = 1.f / sqrtf(ss / (float)H + eps);                                        \
      T* o = out + r * H;                                                                        \
      for (int64_t c = 0; c < H; c++) o[c] = STORE(LOAD(weight[c]) * LOAD(STORE(LOAD(xr[c]) * inv))); \
    }                                                                                            \
  }

DEFINE_RMSNORM(f32, float, f32_id, f32_id)
DEFINE_RMSNORM(bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/* Rotary embedding of q and k, and k, v written into the paged cache.
 * q, k, v: rows of T tokens with their own row strides (views into the fused qkv output);
 * cos, sin: [T, R] in the model dtype, R <= D the rotated dims (partial rotary passes the rest
 * through); interleaved: GPT-J pairs (2i, 2i+1) instead of NeoX halves (i, i + R/2);
 * slots: [T] cache slot of each token (cache rows of Hk*D).
 * Outputs q_out [T, H, D], k_out / v_out [T, Hk, D]. Each product and the sum round to the model
 * dtype as torch's x * cos + rotate(x) * sin does (no fused multiply-add here). */
#define DEFINE_ROPE(SUFFIX, T, LOAD, STORE)                                                      \
  __attribute__((optimize("fp-contract=off"))) static void rope_row_##SUFFIX(                    \
      const T* x, const T* c, const T* s, T* out, int64_t D, int64_t R, int interleaved) {       \
    const int64_t half = R / 2;                                                                  \
    for (int64_t d = 0; d < R; d++) {                                                            \
      float rot;                                                                                 \
      if (interleaved)                                                                           \
        rot = (d & 1) ? LOAD(x[d - 1]) : -LOAD(x[d + 1]);                                        \
      else                                                                                       \
        rot = d < half ? -LOAD(x[d + half]) : LOAD(x[d - half]);                                 \
      const float a = LOAD(STORE(LOAD(x[d]) * LOAD(c[d])));                                      \
      const float b = LOAD(STORE(rot * LOAD(s[d])));                                             \
      out[d] = STORE(a + b);                                                                     \
    }                                                                                            \
    for (int64_t d = R; d < D; d++) out[d] = x[d];                                               \
  }                                                                                              \
  __attribute__((optimize("fp-contract=off"))) void rope_cache_##SUFFIX(                         \
      const T* q, int64_t q_stride, const T* k, int64_t k_stride, const T* v, int64_t v_stride,  \
      const T* cos, const T* sin, const int64_t* slots, T* k_cache, T* v_cache, T* q_out,        \
      T* k_out, T* v_out, int64_t tokens, int64_t H, int64_t Hk, int64_t D, int64_t R,           \
      int interleaved, int threads) {                                                            \
    _Pragma("omp parallel for schedule(static) num_threads(threads) if (tokens > 256)")          \
    for (int64_t t = 0; t < tokens; t++) {                                                       \
      const T* c = cos + t * R;                                                                  \
      const T* s = sin + t * R;                                                                  \
      for (int64_t h = 0; h < H; h++)                                                            \
        rope_row_##SUFFIX(q + t * q_stride + h * D, c, s, q_out + (t * H + h) * D, D, R, interleaved); \
      for (int64_t h = 0; h < Hk; h++)                                                           \
        rope_row_##SUFFIX(k + t * k_stride + h * D, c, s, k_out + (t * Hk + h) * D, D, R, interleaved); \
      memcpy(v_out + t * Hk * D, v + t * v_stride, sizeof(T) * (size_t)(Hk * D));                \
      if (k_cache) {                                                                             \
        memcpy(k_cache + slots[t] * Hk * D, k_out + t * Hk * D, sizeof(T) * (size_t)(Hk * D));   \
        memcpy(v_cache + slots[t] * Hk * D, v_out + t * Hk * D, sizeof(T) * (size_t)(Hk * D));   \
      }                                                                                          \
    }                                                                                            \
  }

DEFINE_ROPE(f32, float, f32_id, f32_id)
DEFINE_ROPE(bf16, bf16_t, bf16_to_f32, f32_to_bf16)

/* ---- routed experts ------------------------------------------------------------------------
 * A routed-experts block in one call: y[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))
 * over the pairs (t, j) whose expert e = slot[t, j] is held here (slot -1: another rank's).
 *
 * x:      [n, H]                   slot, w: [n, k] int32 local expert / float32 weight
 * w13:    E x panels of [gate | up] ([2I, H] each), w2: E x panels of down ([H, I] each)
 * out:    [n, H]                   act: 0 silu, 1 gelu (erf), 2 gelu (tanh)
 *
 * The pairs are sorted by expert (a counting sort) and their tokens gathered; then one OpenMP
 * region runs gate/up for every (expert, panel group), the activation, down for every
 * (expert, panel group) and the weighted sum per token, with a barrier between phases: no
 * per-expert thread start-up and no Python between the products.
 */
typedef struct {
  int64_t m;             /* (token, expert) pairs held here */
  int64_t na;            /* experts with at least one pair */
  int64_t* active;       /* [na] those experts: work items skip the others (128 experts, 1 token) */
  int64_t* start;        /* [E + 1] first sorted row of each expert */
  int64_t* pair_of_row;  /* [m] sorted row -> pair index t * k + j */
  int64_t* row_of_pair;  /* [n * k] pair -> sorted row, or -1 */
} moe_plan;

static moe_plan moe_sort(const int32_t* slot, int64_t n, int64_t k, int64_t E) {
  moe_plan p;
  p.start = (int64_t*)calloc((size_t)(E + 1), sizeof(int64_t));
  for (int64_t q = 0; q < n * k; q++)
    if (slot[q] >= 0) p.start[slot[q] + 1]++;
  for (int64_t e = 0; e < E; e++) p.start[e + 1] += p.start[e];
  p.m = p.start[E];
  int64_t* fill = (int64_t*)malloc(sizeof(int64_t) * (size_t)(E + 1));
  memcpy(fill, p.start, sizeof(int64_t) * (size_t)(E + 1));
  p.pair_of_row = (int64_t*)malloc(sizeof(int64_t) * (size_t)(p.m + 1));
  p.row_of_pair = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n * k + 1));
  for (int64_t q = 0; q < n * k; q++) { /* stable: an expert's rows keep token order */
    p.row_of_pair[q] = -1;
    if (slot[q] >= 0) {
      p.pair_of_row[fill[slot[q]]] = q;
      p.row_of_pair[q] = fill[slot[q]]++;
    }
  }
  free(fill);
  p.active = (int64_t*)malloc(sizeof(int64_t) * (size_t)(E + 1));
  p.na = 0;
  for (int64_t e = 0; e < E; e++)
    if (p.start[e + 1] > p.start[e]) p.active[p.na++] = e;
  return p;
}

static void moe_free(moe_plan* p) {
  free(p->active);
  free(p->start);
  free(p->pair_of_row);
  free(p->row_of_pair);
}

/* sum_j w[t, j] * ys[row of (t, j)] for token t (zero if none of its experts is held here). */
/* No fused multiply-add here: each weighted product is rounded before it is added, so experts
 * split over ranks (EP) sum to exactly what one process gets (a + b either way). */
__attribute__((optimize("fp-contract=off"))) static void moe_combine_row(
    const moe_plan* p, const float* ys, const float* w, int64_t t, int64_t k, int64_t H, float* o) {
  for (int64_t c = 0; c < H; c++) o[c] = 0.f;
  for (int64_t j = 0; j < k; j++) {
    const int64_t r = p->row_of_pair[t * k + j];
    if (r < 0) continue;
    const float wt = w[t * k + j];
    const float* y = ys + r * H;
    for (int64_t c = 0; c < H; c++) o[c] += wt * y[c];
  }
}

/* act(gate) * up over one row of [gate | up] (width 2 * I) into a (width I). */
static inline void gated_row(const float* h, float* a, int64_t I, int act) {
  if (act == 0) {
    _Pragma("omp simd") for (int64_t i = 0; i < I; i++) {
      const float g = h[i];
      a[i] = g / (1.f + exp_vec(-g)) * h[I + i];
    }
  } else if (act == 1) {
    for (int64_t i = 0; i < I; i++) a[i] = 0.5f * h[i] * (1.f + erff(h[i] * 0.70710678118654752f)) * h[I + i];
  } else {
    for (int64_t i = 0; i < I; i++) {
      const float g = h[i];
      a[i] = 0.5f * g * (1.f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g))) * h[I + i];
    }
  }
}

void moe_f32(const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
             const float* w13, const float* w2, int64_t E, int64_t I, int act, float* out,
             int threads) {
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, G13 = (P13 + NP - 1) / NP;
  const int64_t P2 = (H + LANES - 1) / LANES, G2 = (P2 + NP - 1) / NP;
  /* every active expert has one row (a decode at batch 1): row1 items of NP1 panels */
  const int one = m == p.na;
  const int64_t O13 = (P13 + NP1 - 1) / NP1, O2 = (P2 + NP1 - 1) / NP1;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* a = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      memcpy(xs + r * H, x + (p.pair_of_row[r] / k) * H, sizeof(float) * (size_t)H);
    if (one) {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * O13; item++) {
        const int64_t e = p.active[item / O13], r = p.start[e];
        row1_f32(xs + r * H, H, w13 + e * P13 * H * LANES, h + r * 2 * I, 2 * I, P13, item % O13, NULL);
      }
    } else {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G13; item++) {
        const int64_t e = p.active[item / G13];
        rows_f32(xs, H, w13 + e * P13 * H * LANES, h, 2 * I, P13, item % G13, p.start[e], p.start[e + 1], NULL);
      }
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      gated_row(h + r * 2 * I, a + r * I, I, act);
    if (one) {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * O2; item++) {
        const int64_t e = p.active[item / O2], r = p.start[e];
        row1_f32(a + r * I, I, w2 + e * P2 * I * LANES, ys + r * H, H, P2, item % O2, NULL);
      }
    } else {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G2; item++) {
        const int64_t e = p.active[item / G2];
        rows_f32(a, I, w2 + e * P2 * I * LANES, ys, H, P2, item % G2, p.start[e], p.start[e + 1], NULL);
      }
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(a); free(ys);
  moe_free(&p);
}

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
void moe_bf16(const bf16_t* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
              const bf16_t* w13, const bf16_t* w2, int64_t E, int64_t I, int act, float* out,
              int threads) {
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
                 p.start[e + 1], NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      float* hr = h + r * 2 * I;
      bf16_t* ar = (bf16_t*)(a + r * I2);
      for (int64_t i = 0; i < 2 * I; i++) hr[i] = bf16_to_f32(f32_to_bf16(hr[i]));
      gated_row(hr, af + r * I, I, act);
      for (int64_t i = 0; i < I; i++) ar[i] = f32_to_bf16(af[r * I + i]);
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G2; item++) {
      const int64_t e = p.active[item / G2];
      rows_pairs(a, I2, w2 + e * P2 * I2 * 2 * LANES, ys, 0, H, P2, item % G2, p.start[e],
                 p.start[e + 1], NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(af); free(a); free(ys);
  moe_free(&p);
}
#else
int64_t bf16_pairs(void) { return 0; }

/* moe_f32's plan with bf16 weights, input and output on CPUs without pair products (AVX2): the
 * weights are widened to float32 in registers (rows_bf16_f32), the inputs once when gathered. The
 * rounding is the pair version's: gate and up outputs and the activation's output rounded to
 * bf16, the weighted sum kept in float32 and returned unrounded (a partial sum, as the pair
 * version: whoever adds the partials of other ranks rounds once, after that sum). */
void moe_bf16(const bf16_t* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
              const bf16_t* w13, const bf16_t* w2, int64_t E, int64_t I, int act, float* out,
              int threads) {
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, G13 = (P13 + NP - 1) / NP;
  const int64_t P2 = (H + LANES - 1) / LANES, G2 = (P2 + NP - 1) / NP;
  /* every active expert has one row (a decode at batch 1): row1 items of NP1 panels */
  const int one = m == p.na;
  const int64_t O13 = (P13 + NP1 - 1) / NP1, O2 = (P2 + NP1 - 1) / NP1;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* a = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      const bf16_t* xr = x + (p.pair_of_row[r] / k) * H;
      for (int64_t c = 0; c < H; c++) xs[r * H + c] = bf16_to_f32(xr[c]);
    }
    if (one) {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * O13; item++) {
        const int64_t e = p.active[item / O13], r = p.start[e];
        row1_bf16_f32(xs + r * H, H, w13 + e * P13 * H * LANES, h + r * 2 * I, 2 * I, P13, item % O13, NULL);
      }
    } else {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G13; item++) {
        const int64_t e = p.active[item / G13];
        rows_bf16_f32(xs, H, w13 + e * P13 * H * LANES, h, 2 * I, P13, item % G13, p.start[e], p.start[e + 1], NULL);
      }
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      float* hr = h + r * 2 * I;
      float* ar = a + r * I;
      for (int64_t i = 0; i < 2 * I; i++) hr[i] = bf16_to_f32(f32_to_bf16(hr[i]));
      gated_row(hr, ar, I, act);
      for (int64_t i = 0; i < I; i++) ar[i] = bf16_to_f32(f32_to_bf16(ar[i]));
    }
    if (one) {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * O2; item++) {
        const int64_t e = p.active[item / O2], r = p.start[e];
        row1_bf16_f32(a + r * I, I, w2 + e * P2 * I * LANES, ys + r * H, H, P2, item % O2, NULL);
      }
    } else {
      _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G2; item++) {
        const int64_t e = p.active[item / G2];
        rows_bf16_f32(a, I, w2 + e * P2 * I * LANES, ys, H, P2, item % G2, p.start[e], p.start[e + 1], NULL);
      }
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(a); free(ys);
  moe_free(&p);
}
#endif

/* ---- quantized weights: codes in panels, dequantized in registers ----------------------------
 * Weight-only quantization (layers/quantization/packed.py packs these). For panel p (LANES output
 * rows) and input i the codes of the LANES rows are stored together: one byte each (KIND 0 int8,
 * KIND 2 fp8 e4m3) or a nibble each (KIND 1 uint4, KIND 3 fp4 e2m1; lane 2j in the low nibble of
 * byte j). Each (panel, group of gs inputs) has LANES scales s and offsets m in float32:
 * W[o, i] = code(o, i) * s + m (int8 symmetric: m = 0; int4: m = -zero * s). The weight vector is
 * rebuilt in registers with one FMA and used for every row of the tile; x and y are float32. */
#define QMR 4
/* From this many rows in a work item the panel group is dequantized into a float32 buffer first
 * (its decode then costs once per group instead of once per QMR rows). */
#define Q_PANEL_ROWS 8

#if LANES == 8 && defined(__AVX2__)
static inline vf q_decode0(const uint8_t* p) { /* int8 */
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
static inline vf q_decode1(const uint8_t* p) { /* uint4: lane l = bits 4l..4l+3 */
  int32_t word;
  memcpy(&word, p, 4);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), _mm256_set1_epi32(15));
  return (vf)_mm256_cvtepi32_ps(v);
}
#else
static inline vf q_decode0(const uint8_t* p) {
  float t[LANES];
  for (int l = 0; l < LANES; l++) t[l] = (float)(int8_t)p[l];
  vf v;
  memcpy(&v, t, sizeof v);
  return v;
}
static inline vf q_decode1(const uint8_t* p) {
  float t[LANES];
  for (int l = 0; l < LANES; l++) t[l] = (float)((p[l >> 1] >> (4 * (l & 1))) & 15);
  vf v;
  memcpy(&v, t, sizeof v);
  return v;
}
#endif

static float fp8_lut[256]; /* e4m3fn code -> value, filled by q_init() */
static const float fp4_lut[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                  -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

static void q_init(void) {
  static int done = 0;
  if (done) return;
  for (int c = 0; c < 256; c++) {
    const int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
    float v = e ? ldexpf(1.f + m / 8.f, e - 7) : ldexpf(m / 8.f, -6);
    if (e == 15 && m == 7) v = NAN;
    fp8_lut[c] = sign ? -v : v;
  }
  done = 1;
}

/* fp8 e4m3 without a gather (slow on Zen 3): the sign to bit 31 and exponent + mantissa to bits
 * 20..26 make the float32 2^-120 * value, subnormals included (e = 0 maps onto float32
 * subnormals, exact); the 2^120 is one multiply. Code 0x7f / 0xff (NaN) is never written. */
static inline vf q_decode2(const uint8_t* p) {
#if LANES == 8 && defined(__AVX2__)
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i rest = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20);
  return (vf)_mm256_or_si256(sign, rest) * 0x1p120f;
#else
  float t[LANES];
  for (int l = 0; l < LANES; l++) t[l] = fp8_lut[p[l]];
  vf v;
  memcpy(&v, t, sizeof v);
  return v;
#endif
}
static inline vf q_decode3(const uint8_t* p) { /* fp4 e2m1 by lookup */
  float t[LANES];
  for (int l = 0; l < LANES; l++) t[l] = fp4_lut[(p[l >> 1] >> (4 * (l & 1))) & 15];
  vf v;
  memcpy(&v, t, sizeof v);
  return v;
}

/* Bytes of codes per (panel, input): LANES for byte codes, LANES / 2 for nibbles. */
#define Q_BYTES(KIND) ((KIND) & 1 ? LANES / 2 : LANES)

/* A tile of rows <= QMR rows: per group the products with the bare codes are summed, then folded
 * in once a group as acc += s * sum(code * x) + m * sum(x): the scale and offset leave the inner
 * loop (one FMA a vector instead of two). At 1 and 2 rows the sums are split over QU(rows) sets
 * of accumulators (inputs i, i + 1, ...), so the FMAs of a panel are not one dependency chain. */
#define QU(rows) ((rows) == 1 ? 4 : (rows) == 2 ? 2 : 1)
#define DEFINE_QGEMM(KIND)                                                                         \
  static inline __attribute__((always_inline)) void qtile_body##KIND(                            \
      const float* x, int64_t I, const uint8_t* qp, const float* sp, const float* mp, int64_t G,   \
      int64_t gs, float* y, int64_t O, int64_t p0, const int npc, const int rows, const float* bias) { \
    vf acc[QMR][NP];                                                                               \
    for (int r = 0; r < rows; r++)                                                                 \
      for (int j = 0; j < NP; j++) acc[r][j] = (vf){0};                                            \
    const int64_t pb = I * Q_BYTES(KIND);                                                          \
    const int U = QU(rows);                                                                        \
    for (int64_t g = 0; g < G; g++) {                                                              \
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;                                   \
      vf d[4][QMR][NP];                                                                            \
      for (int u = 0; u < U; u++)                                                                  \
        for (int r = 0; r < rows; r++)                                                             \
          for (int j = 0; j < NP; j++) d[u][r][j] = (vf){0};                                       \
      int64_t i = i0;                                                                              \
      for (; i + U <= i1; i += U)                                                                  \
        for (int u = 0; u < U; u++) {                                                              \
          vf c[NP];                                                                                \
          for (int j = 0; j < npc; j++) c[j] = q_decode##KIND(qp + (p0 + j) * pb + (i + u) * Q_BYTES(KIND)); \
          for (int r = 0; r < rows; r++) {                                                         \
            const float xs = x[r * I + i + u];                                                     \
            for (int j = 0; j < npc; j++) d[u][r][j] += c[j] * xs;                                 \
          }                                                                                        \
        }                                                                                          \
      for (; i < i1; i++) {                                                                        \
        vf c[NP];                                                                                  \
        for (int j = 0; j < npc; j++) c[j] = q_decode##KIND(qp + (p0 + j) * pb + i * Q_BYTES(KIND)); \
        for (int r = 0; r < rows; r++) {                                                           \
          const float xs = x[r * I + i];                                                           \
          for (int j = 0; j < npc; j++) d[0][r][j] += c[j] * xs;                                   \
        }                                                                                          \
      }                                                                                            \
      for (int r = 0; r < rows; r++) {                                                             \
        float xsum = 0.f;                                                                          \
        _Pragma("omp simd reduction(+ : xsum)") for (int64_t t = i0; t < i1; t++) xsum += x[r * I + t]; \
        for (int j = 0; j < npc; j++) {                                                            \
          vf dot = d[0][r][j];                                                                     \
          for (int u = 1; u < U; u++) dot += d[u][r][j];                                           \
          const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES);                            \
          const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);                            \
          acc[r][j] += s * dot + m * xsum;                                                         \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
    for (int j = 0; j < npc; j++) {                                                                \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                       \
      const vf b = bias_vec(bias, o, n);                                                           \
      for (int r = 0; r < rows; r++) store_row_f32(y + r * O + o, acc[r][j] + b, n);               \
    }                                                                                              \
  }                                                                                                \
  static inline __attribute__((always_inline)) void qtile##KIND(                                 \
      const float* x, int64_t I, const uint8_t* qp, const float* sp, const float* mp, int64_t G,   \
      int64_t gs, float* y, int64_t O, int64_t p0, int64_t np, const int rows, const float* bias) { \
    if (np == NP)                                                                                  \
      qtile_body##KIND(x, I, qp, sp, mp, G, gs, y, O, p0, NP, rows, bias);                         \
    else                                                                                           \
      qtile_body##KIND(x, I, qp, sp, mp, G, gs, y, O, p0, (int)np, rows, bias);                    \
  }                                                                                                \
  static void qrows##KIND(const float* x, int64_t I, const uint8_t* qp, const float* sp,           \
                          const float* mp, int64_t gs, float* y, int64_t O, int64_t g, int64_t r0, \
                          int64_t r1, const float* bias) {                                         \
    const int64_t P = (O + LANES - 1) / LANES, p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;        \
    const int64_t G = (I + gs - 1) / gs;                                                           \
    if (r1 - r0 >= Q_PANEL_ROWS) { /* many rows: dequantize once, then float32 tiles from cache */   \
      float* buf = (float*)malloc(sizeof(float) * (size_t)(NP * I * LANES));                       \
      for (int64_t j = 0; j < np; j++)                                                             \
        for (int64_t gg = 0; gg < G; gg++) {                                                       \
          const vf s = load_panel_f32(sp + ((p0 + j) * G + gg) * LANES);                           \
          const vf m = load_panel_f32(mp + ((p0 + j) * G + gg) * LANES);                           \
          const int64_t i1 = (gg + 1) * gs < I ? (gg + 1) * gs : I;                                \
          for (int64_t i = gg * gs; i < i1; i++) {                                                 \
            const vf wv = q_decode##KIND(qp + ((p0 + j) * I + i) * Q_BYTES(KIND)) * s + m;         \
            memcpy(buf + (j * I + i) * LANES, &wv, sizeof wv);                                     \
          }                                                                                        \
        }                                                                                          \
      /* rows_f32 reads panel group g at wp + g * NP * I * LANES: point it so that lands on buf */ \
      const float* wp = (const float*)((uintptr_t)buf - (uintptr_t)(p0 * I * LANES * sizeof(float))); \
      rows_f32(x, I, wp, y, O, P, g, r0, r1, bias);                                                \
      free(buf);                                                                                   \
      return;                                                                                      \
    }                                                                                              \
    int64_t r = r0;                                                                                \
    for (; r + QMR <= r1; r += QMR)                                                                \
      qtile##KIND(x + r * I, I, qp, sp, mp, G, gs, y + r * O, O, p0, np, QMR, bias);               \
    switch (r1 - r) {                                                                              \
      case 3: qtile##KIND(x + r * I, I, qp, sp, mp, G, gs, y + r * O, O, p0, np, 3, bias); break;  \
      case 2: qtile##KIND(x + r * I, I, qp, sp, mp, G, gs, y + r * O, O, p0, np, 2, bias); break;  \
      case 1: qtile##KIND(x + r * I, I, qp, sp, mp, G, gs, y + r * O, O, p0, np, 1, bias); break;  \
      default: break;                                                                              \
    }                                                                                              \
  }

DEFINE_QGEMM(0)
DEFINE_QGEMM(1)
DEFINE_QGEMM(2)
DEFINE_QGEMM(3)

typedef void (*qrows_fn)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t,
                         float*, int64_t, int64_t, int64_t, int64_t, const float*);
static qrows_fn q_rows(int kind) {
  q_init();
  switch (kind) {
    case 0: return qrows0;
    case 1: return qrows1;
    case 2: return qrows2;
    default: return qrows3;
  }
}

/* ---- int8 weights with int8 activations (W8A8, kind 4) -------------------------------------
 * Codes are int8 (symmetric, W = code * s; offsets unused) in panels of 4 inputs: byte
 * ((p * I4 + i / 4) * LANES + l) * 4 + i % 4 is code(p * LANES + l, i), I4 = ceil(I / 4), inputs past I
 * zero. Activations are quantized per row and group of gs inputs (gs a multiple of 4, or one group
 * of all I): sx = amax / 127, xq = round-half-even(x / sx) (amax 0: all codes 0). Per group the
 * exact int32 sum of code * xq is taken, then acc += float(sum) * (s * sx), groups in order. */
#define QMR_A 4

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
      float amax = 0.f;
      for (int64_t i = i0; i < i1; i++) amax = fmaxf(amax, fabsf(xr[i]));
      const float s = amax / 127.f;
      sx[r * G + g] = s;
      int32_t total = 0;
      for (int64_t i = i0; i < i1; i++) {
        q[i] = amax > 0.f ? (int8_t)nearbyintf(xr[i] / s) : 0;
        total += q[i];
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

/* Rows [r0, r1) of quantized activations (xq, sx, xsum) against panel group g (kind 4 or 5). */
static void qrows_a8(int kind, const int8_t* xq, const float* sx, const float* xsum, int64_t I,
                     const uint8_t* qp, const float* sp, const float* mp, int64_t gs, float* y, int64_t O,
                     int64_t g, int64_t r0, int64_t r1, const float* bias) {
  const int64_t P = (O + LANES - 1) / LANES, p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;
  const int64_t G = (I + gs - 1) / gs, xs = A_STRIDE(kind, I);
  int64_t r = r0;
#define QA(rows) \
  qtile_a(kind, xq + r * xs, sx + r * G, xsum ? xsum + r * G : NULL, I, qp, sp, mp, G, gs, y + r * O, O, p0, np, rows, bias)
  for (; r + QMR_A <= r1; r += QMR_A) QA(QMR_A);
  switch (r1 - r) {
    case 3: QA(3); break;
    case 2: QA(2); break;
    case 1: QA(1); break;
    default: break;
  }
#undef QA
}

#define Q_KIND_A8 4
#define Q_KIND_A4 5

/* y[M, O] = x[M, I] @ W^T (+ bias), W quantized as above (codes qp, scales sp, offsets mp). */
void gemm_q(int kind, const float* x, const uint8_t* qp, const float* sp, const float* mp, int64_t gs,
            float* y, int64_t M, int64_t O, int64_t I, const float* bias, int threads) {
  const int64_t P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;
  const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  if (kind == Q_KIND_A8 || kind == Q_KIND_A4) {
    const int64_t G = (I + gs - 1) / gs, stride = A_STRIDE(kind, I);
    int8_t* xq = (int8_t*)malloc((size_t)(M * stride + 1));
    float* sx = (float*)malloc(sizeof(float) * (size_t)(M * G + 1));
    float* xsum = kind == Q_KIND_A4 ? (float*)malloc(sizeof(float) * (size_t)(M * G + 1)) : NULL;
    _Pragma("omp parallel num_threads(threads)") {
      _Pragma("omp for schedule(static)") for (int64_t r = 0; r < M; r++)
        q_act_rows(x, I, gs, stride, xq, sx, xsum, r, r + 1);
      _Pragma("omp for schedule(static)") for (int64_t item = 0; item < blocks * groups; item++) {
        const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
        qrows_a8(kind, xq, sx, xsum, I, qp, sp, mp, gs, y, O, item % groups, r0, r1, bias);
      }
    }
    free(xq); free(sx); free(xsum);
    return;
  }
  const qrows_fn rows = q_rows(kind);
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t item = 0; item < blocks * groups; item++) {
    const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
    rows(x, I, qp, sp, mp, gs, y, O, item % groups, r0, r1, bias);
  }
}

/* moe_f32's plan over quantized experts: w13 = codes/scales/offsets of E experts' [gate | up]
 * ([2I, H] each, gs13 inputs a group), w2 of their down projections ([H, I], gs2). */
void moe_q(int kind, const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
           const uint8_t* q13, const float* s13, const float* m13, int64_t gs13, const uint8_t* q2,
           const float* s2, const float* m2, int64_t gs2, int64_t E, int64_t I, int act, float* out,
           int threads) {
  const int a8 = kind == Q_KIND_A8 || kind == Q_KIND_A4; /* activations quantized too */
  const qrows_fn rows = a8 ? NULL : q_rows(kind);
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, G13 = (P13 + NP - 1) / NP;
  const int64_t P2 = (H + LANES - 1) / LANES, G2 = (P2 + NP - 1) / NP;
  const int64_t n13 = (H + gs13 - 1) / gs13, n2 = (I + gs2 - 1) / gs2; /* groups per row */
  /* bytes of codes per (expert, panel): I * bytes a code for weight-only kinds; W8A8 4 * ceil(I / 4) a
   * lane, W4A8 4 * ceil(I / 8) a lane (two nibbles a byte) */
  const int64_t xs_a = A_STRIDE(kind, H), as_a = A_STRIDE(kind, I);
  const int64_t c13 = !a8 ? H * Q_BYTES(kind) : (kind == Q_KIND_A4 ? xs_a / 2 : xs_a) * LANES;
  const int64_t c2 = !a8 ? I * Q_BYTES(kind) : (kind == Q_KIND_A4 ? as_a / 2 : as_a) * LANES;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* a = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  /* quantized activations: the gathered rows and the activated intermediates quantized once, read by
   * every panel group */
  int8_t* xq = a8 ? (int8_t*)malloc((size_t)(m * xs_a + 1)) : NULL;
  int8_t* aq = a8 ? (int8_t*)malloc((size_t)(m * as_a + 1)) : NULL;
  float* xsc = a8 ? (float*)malloc(sizeof(float) * (size_t)(m * n13 + 1)) : NULL;
  float* asc = a8 ? (float*)malloc(sizeof(float) * (size_t)(m * n2 + 1)) : NULL;
  float* xsum = kind == Q_KIND_A4 ? (float*)malloc(sizeof(float) * (size_t)(m * n13 + 1)) : NULL;
  float* asum = kind == Q_KIND_A4 ? (float*)malloc(sizeof(float) * (size_t)(m * n2 + 1)) : NULL;
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      memcpy(xs + r * H, x + (p.pair_of_row[r] / k) * H, sizeof(float) * (size_t)H);
      if (a8) q_act_rows(xs, H, gs13, xs_a, xq, xsc, xsum, r, r + 1);
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G13; item++) {
      const int64_t e = p.active[item / G13];
      if (a8)
        qrows_a8(kind, xq, xsc, xsum, H, q13 + e * P13 * c13, s13 + e * P13 * n13 * LANES,
                 m13 + e * P13 * n13 * LANES, gs13, h, 2 * I, item % G13, p.start[e], p.start[e + 1], NULL);
      else
        rows(xs, H, q13 + e * P13 * c13, s13 + e * P13 * n13 * LANES, m13 + e * P13 * n13 * LANES, gs13, h,
             2 * I, item % G13, p.start[e], p.start[e + 1], NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      gated_row(h + r * 2 * I, a + r * I, I, act);
      if (a8) q_act_rows(a, I, gs2, as_a, aq, asc, asum, r, r + 1);
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * G2; item++) {
      const int64_t e = p.active[item / G2];
      if (a8)
        qrows_a8(kind, aq, asc, asum, I, q2 + e * P2 * c2, s2 + e * P2 * n2 * LANES, m2 + e * P2 * n2 * LANES,
                 gs2, ys, H, item % G2, p.start[e], p.start[e + 1], NULL);
      else
        rows(a, I, q2 + e * P2 * c2, s2 + e * P2 * n2 * LANES, m2 + e * P2 * n2 * LANES, gs2, ys, H,
             item % G2, p.start[e], p.start[e + 1], NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(a); free(ys);
  free(xq); free(aq); free(xsc); free(asc); free(xsum); free(asum);
  moe_free(&p);
}

/* How many code kinds gemm_q / moe_q know (layers/cpu_kernels.py QUANT_KINDS). */
int64_t q_kinds(void) { return 6; }

/* ---- decode steps: whole decoder layers in one call (layers/native_decode.py) ---------------
 * For a decode-only step (B tokens, one per sequence), each layer of a run of eligible layers:
 *
 *   h = rms_norm(x); qkv = h @ Wqkv (+ b); per-head q/k RMSNorm (optional); rotary + KV store;
 *   paged decode attention; o = attn @ Wo (+ b); x = x + m * o
 *   h = rms_norm(x); logits = h @ Wr (+ b); softmax, top-k, renormalise (optional);
 *   y = routed experts (float32), rounded to T; x = x + m * y
 *
 * by the same kernels the per-op path calls, in the same order and with the same roundings, so
 * the result equals that path's (the router's softmax is float32 like torch's, within an ulp).
 * Weights are the layer's packed panels, or quantized ones through the gemm_q / moe_q shims below
 * (q_weight_desc, q_experts_desc); the descriptor (pointers and sizes) is built once by
 * Python, the step's metadata (rotary tables, slots, block tables) once per step for all layers.
 *
 * Top-k's order among equal scores is torch.topk's business, not ours: when two of a token's
 * k + 1 best scores are within a relative 1e-6 (a tie or a near-tie), the call stops before that
 * layer's MoE block and returns the layer's index, with x holding the attention's residual and
 * h_out the normed input of the MoE block; the caller runs that block with torch and calls again
 * from the next layer. Returns n_layers when every layer ran.
 *
 * Every field is 8 bytes (int64, double or a pointer), so the ctypes mirror has no padding. */
typedef void (*gemm_fn_t)(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                          const float* bias, int threads);

/* Routed experts of a MoE block: x [n, H] model dtype -> out [n, H] float32 (as moe_f32 / moe_bf16). */
typedef void (*experts_fn_t)(const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w,
                             int64_t k, const void* ew, int64_t E, int64_t I, int act, float* out,
                             int threads);

/* Quantized weights in a descriptor's GEMM slot (gemm_fn_t): wp points to one of these (built once by
 * packed.py's QuantizedWeight.native_form). The shims do what QuantizedWeight.__call__ does: the
 * input widened to float32 (exact), gemm_q, the float32 product rounded to the model dtype once. */
typedef struct {
  int64_t kind;
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t group;
} q_weight_desc;

void gemm_q_desc_f32(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                     const float* bias, int threads) {
  const q_weight_desc* q = (const q_weight_desc*)wp;
  gemm_q((int)q->kind, (const float*)x, q->codes, q->scales, q->offsets, q->group, (float*)y, M, O, I, bias,
         threads);
}

void gemm_q_desc_bf16(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                      const float* bias, int threads) {
  const q_weight_desc* q = (const q_weight_desc*)wp;
  float* xf = (float*)malloc(sizeof(float) * (size_t)(M * I + M * O + 1));
  float* yf = xf + M * I;
  for (int64_t i = 0; i < M * I; i++) xf[i] = bf16_to_f32(((const bf16_t*)x)[i]);
  gemm_q((int)q->kind, xf, q->codes, q->scales, q->offsets, q->group, yf, M, O, I, bias, threads);
  for (int64_t i = 0; i < M * O; i++) ((bf16_t*)y)[i] = f32_to_bf16(yf[i]);
  free(xf);
}

/* QuantizedExperts' w13 and w2 (packed.py) for moe_q, in a descriptor's experts slot. */
typedef struct {
  int64_t kind;
  const uint8_t* q13;
  const float* s13;
  const float* m13;
  int64_t gs13;
  const uint8_t* q2;
  const float* s2;
  const float* m2;
  int64_t gs2;
} q_experts_desc;

void moe_q_desc_f32(const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                    const void* ew, int64_t E, int64_t I, int act, float* out, int threads) {
  const q_experts_desc* q = (const q_experts_desc*)ew;
  moe_q((int)q->kind, (const float*)x, n, H, slot, w, k, q->q13, q->s13, q->m13, q->gs13, q->q2, q->s2, q->m2,
        q->gs2, E, I, act, out, threads);
}

void moe_q_desc_bf16(const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                     const void* ew, int64_t E, int64_t I, int act, float* out, int threads) {
  float* xf = (float*)malloc(sizeof(float) * (size_t)(n * H + 1));
  for (int64_t i = 0; i < n * H; i++) xf[i] = bf16_to_f32(((const bf16_t*)x)[i]);
  moe_q_desc_f32(xf, n, H, slot, w, k, ew, E, I, act, out, threads);
  free(xf);
}

typedef struct {
  int64_t hidden;
  double eps, residual_multiplier;
  const void* input_norm;
  gemm_fn_t qkv_fn;
  const void* qkv_w;
  const float* qkv_bias;
  int64_t heads, kv_heads, head_dim;
  const void* q_norm; /* per-head RMSNorm(head_dim) weights, or NULL */
  const void* k_norm;
  double qk_eps;
  int64_t use_rope; /* 0: keys and queries as projected (a layer without RoPE) */
  void* k_cache;
  void* v_cache;
  int64_t block_size;
  double scale;
  int64_t window, chunk;
  const float* sinks;
  gemm_fn_t o_fn;
  const void* o_w;
  const float* o_bias;
  const void* post_norm;
  gemm_fn_t router_fn;
  const void* router_w;
  const float* router_bias;
  int64_t experts, top_k, renormalize;
  const void* w13;
  const void* w2;
  int64_t inter, act;
  int64_t* load; /* [E] (token, expert) pairs routed to each expert (engine/expert_load.py), or NULL */
  experts_fn_t experts_fn; /* routed experts held otherwise (quantized: moe_q_desc_*), or NULL: moe_* */
  const void* experts_w;   /* experts_fn's weights (a q_experts_desc) */
} decode_layer_desc;

typedef struct {
  int64_t tokens;
  const void* cos; /* [B, R] model dtype */
  const void* sin;
  int64_t rotary, interleaved; /* R rotated dims, GPT-J pairs instead of NeoX halves */
  const int64_t* slots;
  const int32_t* block_tables; /* [B, W] */
  const int32_t* context_lens;
  int64_t width;
  int64_t count_load; /* 0 for a forward whose tokens are not counted in the expert load */
} decode_step_meta;

/* Softmax over one token's E logits (float32), its top k into w / slot. 0 if two of the k + 1
 * best are (nearly) equal: the caller then routes this layer with torch.topk. */
static int route_softmax_topk(const float* logits, int64_t E, int64_t k, int renormalize, float* probs,
                              float* w, int32_t* slot) {
  float mx = -INFINITY, sum = 0.f;
  for (int64_t e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
  for (int64_t e = 0; e < E; e++) {
    probs[e] = expf(logits[e] - mx);
    sum += probs[e];
  }
  for (int64_t e = 0; e < E; e++) probs[e] /= sum;
  float prev = 0.f;
  const int64_t want = k < E ? k + 1 : k;
  for (int64_t j = 0; j < want; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++)
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    const float v = probs[best];
    if (j > 0 && prev - v <= 1e-6f * prev) return 0;
    prev = v;
    if (j < k) {
      w[j] = v;
      slot[j] = (int32_t)best;
    }
    probs[best] = -1.f; /* taken */
  }
  if (renormalize) {
    float s = 0.f;
    for (int64_t j = 0; j < k; j++) s += w[j];
    for (int64_t j = 0; j < k; j++) w[j] /= s;
  }
  return 1;
}

#define DEFINE_DECODE_LAYERS(SUFFIX, T, LOAD, STORE)                                             \
  static void residual_##SUFFIX(T* x, const T* y, int64_t n, float m) {                          \
    if (m == 1.f)                                                                                \
      for (int64_t i = 0; i < n; i++) x[i] = STORE(LOAD(x[i]) + LOAD(y[i]));                     \
    else                                                                                         \
      for (int64_t i = 0; i < n; i++) x[i] = STORE(LOAD(x[i]) + LOAD(STORE(LOAD(y[i]) * m)));    \
  }                                                                                              \
  static void attention_block_##SUFFIX(const decode_layer_desc* d, const decode_step_meta* m,    \
                                       T* x, T* scratch, int threads) {                          \
    const int64_t B = m->tokens, Hd = d->hidden, H = d->heads, Hk = d->kv_heads, D = d->head_dim; \
    const int64_t C = (H + 2 * Hk) * D;                                                          \
    T *h = scratch, *qkv = h + B * Hd, *q = qkv + B * C, *k = q + B * H * D, *v = k + B * Hk * D; \
    T *att = v + B * Hk * D, *o = att + B * H * D;                                               \
    rms_norm_##SUFFIX(x, (const T*)d->input_norm, h, B, Hd, (float)d->eps, threads);             \
    d->qkv_fn(h, d->qkv_w, qkv, B, C, Hd, d->qkv_bias, threads);                                 \
    if (d->q_norm)                                                                               \
      for (int64_t t = 0; t < B; t++) {                                                          \
        rms_norm_##SUFFIX(qkv + t * C, (const T*)d->q_norm, qkv + t * C, H, D, (float)d->qk_eps, 1); \
        rms_norm_##SUFFIX(qkv + t * C + H * D, (const T*)d->k_norm, qkv + t * C + H * D, Hk, D,  \
                          (float)d->qk_eps, 1);                                                  \
      }                                                                                          \
    rope_cache_##SUFFIX(qkv, C, qkv + H * D, C, qkv + (H + Hk) * D, C, (const T*)m->cos,        \
                        (const T*)m->sin, m->slots, (T*)d->k_cache, (T*)d->v_cache, q, k, v, B, H, \
                        Hk, D, d->use_rope ? m->rotary : 0, (int)m->interleaved, threads);                         \
    paged_decode_##SUFFIX(q, (const T*)d->k_cache, (const T*)d->v_cache, m->block_tables,       \
                          m->context_lens, att, B, H, Hk, D, D, m->width, d->block_size,         \
                          (float)d->scale, d->window, d->chunk, d->sinks, threads);              \
    d->o_fn(att, d->o_w, o, B, Hd, H * D, d->o_bias, threads);                                   \
    residual_##SUFFIX(x, o, B * Hd, (float)d->residual_multiplier);                              \
  }                                                                                              \
  /* 0 if the router needs torch (see above); h_out then holds the block's normed input. */     \
  static int moe_block_##SUFFIX(const decode_layer_desc* d, const decode_step_meta* m, T* x,     \
                                T* h_out, T* scratch, int threads) {                             \
    const int64_t B = m->tokens, Hd = d->hidden, E = d->experts, K = d->top_k;                   \
    T *logits = scratch, *y = logits + B * E;                                                    \
    float* f = (float*)malloc(sizeof(float) * (size_t)(B * (E + Hd + K) + E));                   \
    int32_t* slot = (int32_t*)malloc(sizeof(int32_t) * (size_t)(B * K));                         \
    float *lg = f, *out = lg + B * E, *w = out + B * Hd, *probs = w + B * K;                     \
    int ok = 1;                                                                                  \
    rms_norm_##SUFFIX(x, (const T*)d->post_norm, h_out, B, Hd, (float)d->eps, threads);          \
    d->router_fn(h_out, d->router_w, logits, B, E, Hd, d->router_bias, threads);                 \
    for (int64_t i = 0; i < B * E; i++) lg[i] = LOAD(logits[i]);                                 \
    for (int64_t t = 0; t < B && ok; t++)                                                        \
      ok = route_softmax_topk(lg + t * E, E, K, (int)d->renormalize, probs, w + t * K, slot + t * K); \
    if (ok && m->count_load && d->load)                                                          \
      for (int64_t q = 0; q < B * K; q++) d->load[slot[q]]++;                                    \
    if (ok) {                                                                                    \
      if (d->experts_fn)                                                                         \
        d->experts_fn(h_out, B, Hd, slot, w, K, d->experts_w, E, d->inter, (int)d->act, out, threads); \
      else                                                                                       \
        moe_##SUFFIX(h_out, B, Hd, slot, w, K, d->w13, d->w2, E, d->inter, (int)d->act, out, threads); \
      for (int64_t i = 0; i < B * Hd; i++) y[i] = STORE(out[i]);                                 \
      residual_##SUFFIX(x, y, B * Hd, (float)d->residual_multiplier);                            \
    }                                                                                            \
    free(f);                                                                                     \
    free(slot);                                                                                  \
    return ok;                                                                                   \
  }                                                                                              \
  int64_t decode_layers_##SUFFIX(const decode_layer_desc* layers, int64_t n, const decode_step_meta* m, \
                                 T* x, T* h_out, int threads) {                                  \
    int64_t most = 0;                                                                            \
    for (int64_t i = 0; i < n; i++) {                                                            \
      const decode_layer_desc* d = layers + i;                                                   \
      const int64_t a = 2 * d->hidden + (3 * d->heads + 4 * d->kv_heads) * d->head_dim;          \
      const int64_t b = d->experts + d->hidden;                                                  \
      most = a > most ? a : most;                                                                \
      most = b > most ? b : most;                                                                \
    }                                                                                            \
    T* scratch = (T*)malloc(sizeof(T) * (size_t)(m->tokens * most + 1));                         \
    int64_t i = 0;                                                                               \
    for (; i < n; i++) {                                                                         \
      attention_block_##SUFFIX(layers + i, m, x, scratch, threads);                              \
      if (!moe_block_##SUFFIX(layers + i, m, x, h_out, scratch, threads)) break;                 \
    }                                                                                            \
    free(scratch);                                                                               \
    return i;                                                                                    \
  }

DEFINE_DECODE_LAYERS(f32, float, f32_id, f32_id)
DEFINE_DECODE_LAYERS(bf16, bf16_t, bf16_to_f32, f32_to_bf16)
