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

/* Decode attention over the paged KV cache, reading K and V rows where they lie.
 *
 * q:            [B, H, D]            the newest token of each sequence
 * k/v_cache:    [blocks, bs, Hk, D]  one layer's cache
 * block_tables: [B, W] int32         each sequence's blocks (entries past its length unread)
 * context_lens: [B] int32            tokens in each sequence, the newest included
 * out:          [B, H, D]
 *
 * A task is one sequence and a run of its KV heads [h0, h1): it reads each token's K and V
 * rows for those heads (contiguous in the cache) once, for all their query heads. Scores are
 * kept for the whole context (two-pass softmax); the window, if any, starts at len - window.
 */
#define DEFINE_PAGED_DECODE(SUFFIX, T, LOAD, STORE)                                               \
  static inline __attribute__((always_inline)) void decode_task_##SUFFIX(                        \
      const T* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,         \
      T* out, int64_t H, int64_t Hk, int64_t h0, int64_t h1, const int64_t D, int64_t bs,        \
      float scale, int64_t window, float* work) {                                                \
    const int64_t G = H / Hk, nh = (h1 - h0) * G;                                                \
    const int64_t first = (window > 0 && len > window) ? len - window : 0, n = len - first;      \
    float* qf = work;                   /* [nh, D] */                                            \
    float* acc = qf + nh * D;           /* [nh, D] */                                            \
    float* scores = acc + nh * D;       /* [nh, n] */                                            \
    for (int64_t i = 0; i < nh; i++)                                                             \
      for (int64_t d = 0; d < D; d++) qf[i * D + d] = LOAD(q[(h0 * G + i) * D + d]) * scale;     \
    for (int64_t t = 0; t < n; t++) {                                                            \
      const int64_t pos = first + t;                                                             \
      const T* row = k_cache + ((int64_t)table[pos / bs] * bs + pos % bs) * Hk * D + h0 * D;     \
      for (int64_t i = 0; i < nh; i++) {                                                         \
        const T* kr = row + (i / G) * D;                                                         \
        const float* qi = qf + i * D;                                                            \
        float s = 0.f;                                                                           \
        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qi[d] * LOAD(kr[d]); \
        scores[i * n + t] = s;                                                                   \
      }                                                                                          \
    }                                                                                            \
    for (int64_t i = 0; i < nh; i++) {                                                           \
      float* si = scores + i * n;                                                                \
      float m = -INFINITY, sum = 0.f;                                                            \
      for (int64_t t = 0; t < n; t++) m = si[t] > m ? si[t] : m;                                 \
      for (int64_t t = 0; t < n; t++) {                                                          \
        si[t] = expf(si[t] - m);                                                                 \
        sum += si[t];                                                                            \
      }                                                                                          \
      const float inv = 1.f / sum;                                                               \
      for (int64_t t = 0; t < n; t++) si[t] *= inv;                                              \
    }                                                                                            \
    memset(acc, 0, sizeof(float) * (size_t)(nh * D));                                           \
    for (int64_t t = 0; t < n; t++) {                                                            \
      const int64_t pos = first + t;                                                             \
      const T* row = v_cache + ((int64_t)table[pos / bs] * bs + pos % bs) * Hk * D + h0 * D;     \
      for (int64_t i = 0; i < nh; i++) {                                                         \
        const T* vr = row + (i / G) * D;                                                         \
        const float p = scores[i * n + t];                                                       \
        float* a = acc + i * D;                                                                  \
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) a[d] += p * LOAD(vr[d]);             \
      }                                                                                          \
    }                                                                                            \
    for (int64_t i = 0; i < nh; i++)                                                             \
      for (int64_t d = 0; d < D; d++) out[(h0 * G + i) * D + d] = STORE(acc[i * D + d]);         \
  }                                                                                              \
                                                                                                 \
  void paged_decode_##SUFFIX(const T* q, const T* k_cache, const T* v_cache,                    \
                             const int32_t* block_tables, const int32_t* context_lens, T* out,   \
                             int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t W, int64_t bs, \
                             float scale, int64_t window, int threads) {                         \
    /* Split heads only when there are too few sequences to keep every thread busy. */          \
    int64_t splits = (4 * threads + B - 1) / B;                                                  \
    if (splits > Hk) splits = Hk;                                                                \
    if (splits < 1) splits = 1;                                                                  \
    while (Hk % splits) splits--;                                                                \
    const int64_t per = Hk / splits, G = H / Hk;                                                 \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(threads)")                        \
    for (int64_t task = 0; task < B * splits; task++) {                                         \
      const int64_t b = task / splits, h0 = (task % splits) * per, h1 = h0 + per;                \
      const int64_t len = context_lens[b];                                                       \
      float* work = (float*)malloc(sizeof(float) * (size_t)(per * G * (2 * D + len)));           \
      const T* qb = q + b * H * D;                                                               \
      T* ob = out + b * H * D;                                                                   \
      const int32_t* table = block_tables + b * W;                                               \
      if (D == 64)                                                                               \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, 64, bs, scale, window, work); \
      else if (D == 128)                                                                         \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, 128, bs, scale, window, work); \
      else                                                                                       \
        decode_task_##SUFFIX(qb, k_cache, v_cache, table, len, ob, H, Hk, h0, h1, D, bs, scale, window, work); \
      free(work);                                                                                \
    }                                                                                            \
  }

DEFINE_PAGED_DECODE(f32, float, f32_id, f32_id)
DEFINE_PAGED_DECODE(bf16, bf16_t, bf16_to_f32, f32_to_bf16)

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
#define LANES 8
#define MR 4
#define NP 2
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vf_unaligned __attribute__((vector_size(LANES * 4), aligned(4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

int64_t gemm_lanes(void) { return LANES; }

static inline vf load_panel_f32(const float* p) { return *(const vf_unaligned*)p; }

static inline vf load_panel_bf16(const bf16_t* p) {
  vu wide = __builtin_convertvector(*(const vh*)p, vu) << 16;
  return (vf)wide;
}

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

#define DEFINE_GEMM(SUFFIX, T)                                                                   \
  static inline __attribute__((always_inline)) void tile_##SUFFIX(                              \
      const float* x, int64_t I, const T* wp, T* y, int64_t O, int64_t p0, int64_t np,          \
      const int rows) {                                                                          \
    vf acc[8][NP]; /* 8 >= MR: the remainder cases below go up to 7 rows */                                                                           \
    for (int r = 0; r < rows; r++)                                                               \
      for (int j = 0; j < NP; j++) acc[r][j] = (vf){0};                                          \
    const T* w = wp + p0 * I * LANES;                                                            \
    if (np == NP) {                                                                              \
      for (int64_t i = 0; i < I; i++) {                                                          \
        vf wv[NP];                                                                               \
        for (int j = 0; j < NP; j++) wv[j] = load_panel_##SUFFIX(w + (j * I + i) * LANES);      \
        for (int r = 0; r < rows; r++) {                                                         \
          const float xs = x[r * I + i];                                                         \
          for (int j = 0; j < NP; j++) acc[r][j] += wv[j] * xs;                                  \
        }                                                                                        \
      }                                                                                          \
    } else {                                                                                     \
      for (int64_t i = 0; i < I; i++)                                                            \
        for (int j = 0; j < np; j++) {                                                           \
          const vf wv = load_panel_##SUFFIX(w + (j * I + i) * LANES);                           \
          for (int r = 0; r < rows; r++) acc[r][j] += wv * x[r * I + i];                         \
        }                                                                                        \
    }                                                                                            \
    for (int r = 0; r < rows; r++)                                                               \
      for (int j = 0; j < np; j++) {                                                             \
        const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                   \
        store_row_##SUFFIX(y + r * O + o, acc[r][j], n);                                         \
      }                                                                                          \
  }                                                                                              \
                                                                                                 \
  static void gemm_rows_##SUFFIX(const float* x, const T* wp, T* y, int64_t M, int64_t O,       \
                                 int64_t I, int threads) {                                       \
    const int64_t P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;                       \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
    for (int64_t g = 0; g < groups; g++) {                                                       \
      const int64_t p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;                                 \
      int64_t m = 0;                                                                             \
      for (; m + MR <= M; m += MR) tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, MR);    \
      switch (M - m) { /* constant row counts, so each tile's loops unroll */                    \
        case 7: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 7); break;                 \
        case 6: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 6); break;                 \
        case 5: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 5); break;                 \
        case 4: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 4); break;                 \
        case 3: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 3); break;                 \
        case 2: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 2); break;                 \
        case 1: tile_##SUFFIX(x + m * I, I, wp, y + m * O, O, p0, np, 1); break;                 \
        default: break;                                                                          \
      }                                                                                          \
    }                                                                                            \
  }

DEFINE_GEMM(f32, float)
DEFINE_GEMM(bf16, bf16_t)

void gemm_f32(const float* x, const float* wp, float* y, int64_t M, int64_t O, int64_t I, int threads) {
  gemm_rows_f32(x, wp, y, M, O, I, threads);
}

/* x is widened to float32 once, so the tiles broadcast plain floats. */
void gemm_bf16(const bf16_t* x, const bf16_t* wp, bf16_t* y, int64_t M, int64_t O, int64_t I,
               int threads) {
  float* xf = (float*)malloc(sizeof(float) * (size_t)(M * I));
  for (int64_t k = 0; k < M * I; k++) xf[k] = bf16_to_f32(x[k]);
  gemm_rows_bf16(xf, wp, y, M, O, I, threads);
  free(xf);
}

/* A routed-experts block in one call: y[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))
 * over the pairs (t, j) whose expert e = slot[t, j] is held here (slot -1: another rank's).
 *
 * x:      [n, H] float32           slot, w: [n, k] int32 local expert / float32 weight
 * w13:    E x [ceil(2I/LANES)][H][LANES]   [gate | up] rows of each expert, in panels
 * w2:     E x [ceil(H/LANES)][I][LANES]    down rows of each expert, in panels
 * out:    [n, H]                   act: 0 silu, 1 gelu (erf), 2 gelu (tanh)
 *
 * The pairs are sorted by expert (a counting sort), their tokens gathered, and then one OpenMP
 * region runs gate/up for every (expert, panel group), the activation, down for every
 * (expert, panel group) and the weighted sum per token, with a barrier between phases: no
 * per-expert thread start-up and no Python between the products.
 */
static inline float act_fn(float v, int act) {
  switch (act) {
    case 1: return 0.5f * v * (1.f + erff(v * 0.70710678118654752f));
    case 2: return 0.5f * v * (1.f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    default: return v / (1.f + expf(-v));
  }
}

void moe_f32(const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
             const float* w13, const float* w2, int64_t E, int64_t I, int act, float* out,
             int threads) {
  int64_t* start = (int64_t*)calloc((size_t)(E + 1), sizeof(int64_t));
  for (int64_t p = 0; p < n * k; p++)
    if (slot[p] >= 0) start[slot[p] + 1]++;
  for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
  const int64_t m = start[E];
  int64_t* fill = (int64_t*)malloc(sizeof(int64_t) * (size_t)(E + 1));
  memcpy(fill, start, sizeof(int64_t) * (size_t)(E + 1));
  int64_t* pair_of_row = (int64_t*)malloc(sizeof(int64_t) * (size_t)(m + 1));
  int64_t* row_of_pair = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n * k + 1));
  for (int64_t p = 0; p < n * k; p++) { /* stable: rows of an expert keep token order */
    row_of_pair[p] = -1;
    if (slot[p] >= 0) {
      pair_of_row[fill[slot[p]]] = p;
      row_of_pair[p] = fill[slot[p]]++;
    }
  }
  const int64_t P13 = (2 * I + LANES - 1) / LANES, G13 = (P13 + NP - 1) / NP;
  const int64_t P2 = (H + LANES - 1) / LANES, G2 = (P2 + NP - 1) / NP;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* a = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      memcpy(xs + r * H, x + (pair_of_row[r] / k) * H, sizeof(float) * (size_t)H);
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < E * G13; item++) {
      const int64_t e = item / G13, p0 = (item % G13) * NP, np = P13 - p0 < NP ? P13 - p0 : NP;
      const float* we = w13 + e * P13 * H * LANES;
      int64_t r = start[e];
      for (; r + MR <= start[e + 1]; r += MR) tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, MR);
      switch (start[e + 1] - r) {
        case 7: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 7); break;
        case 6: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 6); break;
        case 5: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 5); break;
        case 4: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 4); break;
        case 3: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 3); break;
        case 2: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 2); break;
        case 1: tile_f32(xs + r * H, H, we, h + r * 2 * I, 2 * I, p0, np, 1); break;
        default: break;
      }
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      for (int64_t i = 0; i < I; i++) a[r * I + i] = act_fn(h[r * 2 * I + i], act) * h[r * 2 * I + I + i];
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < E * G2; item++) {
      const int64_t e = item / G2, p0 = (item % G2) * NP, np = P2 - p0 < NP ? P2 - p0 : NP;
      const float* we = w2 + e * P2 * I * LANES;
      int64_t r = start[e];
      for (; r + MR <= start[e + 1]; r += MR) tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, MR);
      switch (start[e + 1] - r) {
        case 7: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 7); break;
        case 6: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 6); break;
        case 5: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 5); break;
        case 4: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 4); break;
        case 3: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 3); break;
        case 2: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 2); break;
        case 1: tile_f32(a + r * I, I, we, ys + r * H, H, p0, np, 1); break;
        default: break;
      }
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++) {
      float* o = out + t * H;
      for (int64_t c = 0; c < H; c++) o[c] = 0.f;
      for (int64_t j = 0; j < k; j++) {
        const int64_t r = row_of_pair[t * k + j];
        if (r < 0) continue;
        const float wt = w[t * k + j];
        const float* y = ys + r * H;
        for (int64_t c = 0; c < H; c++) o[c] += wt * y[c];
      }
    }
  }
  free(xs); free(h); free(a); free(ys);
  free(pair_of_row); free(row_of_pair); free(fill); free(start);
}
