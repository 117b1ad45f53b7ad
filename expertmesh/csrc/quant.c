/* Part of cpu_kernels.c (one translation unit; see its list): weight-only quantized codes (int8, uint4, fp8, fp4), dequantized in registers. */

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

/* fp4 e2m1: the nibbles extracted as q_decode1 does, then a permute over a table held in one
 * register (exact: the same float32 values as fp4_lut, -0.0 for code 8). AVX2 permutes 8 entries
 * by the code's low 3 bits v, and the sign comes from shifting the nibble to bits 28..31 (bit 3 to
 * bit 31; the other nibbles shift out): an xor with that sets the sign and also flips bits 28..30
 * by v, which the table entry has flipped beforehand (entry v = bits of |value| ^ v << 28). */
#if LANES == 16 && defined(__AVX512F__)
#include <immintrin.h> /* gemm.c includes it for AVX2 only */
#endif
static inline vf q_decode3(const uint8_t* p) {
#if LANES == 8 && defined(__AVX2__)
#define FP4_ENTRY(bits, v) (int)((bits) ^ (v) << 28)
  const __m256i table = _mm256_setr_epi32(FP4_ENTRY(0u, 0u), FP4_ENTRY(0x3f000000u, 1u), /* 0, .5 */
                                          FP4_ENTRY(0x3f800000u, 2u), FP4_ENTRY(0x3fc00000u, 3u), /* 1, 1.5 */
                                          FP4_ENTRY(0x40000000u, 4u), FP4_ENTRY(0x40400000u, 5u), /* 2, 3 */
                                          FP4_ENTRY(0x40800000u, 6u), FP4_ENTRY(0x40c00000u, 7u)); /* 4, 6 */
#undef FP4_ENTRY
  int32_t word;
  memcpy(&word, p, 4);
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i c = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts); /* lane l: nibble l in bits 0..3 */
  const __m256i v = _mm256_xor_si256(_mm256_permutevar8x32_epi32(table, c), _mm256_slli_epi32(c, 28));
  return (vf)_mm256_castsi256_ps(v);
#elif LANES == 16 && defined(__AVX512F__)
  int32_t lo, hi; /* lanes 0..7 and 8..15 */
  memcpy(&lo, p, 4);
  memcpy(&hi, p + 4, 4);
  const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const __m512i words =
      _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(lo)), _mm256_set1_epi32(hi), 1);
  const __m512i c = _mm512_srlv_epi32(words, shifts);
  const __m512 lut = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f,
                                    -3.f, -4.f, -6.f);
  return (vf)_mm512_permutexvar_ps(c, lut); /* the low 4 bits index: the code, sign included */
#else
  float t[LANES];
  for (int l = 0; l < LANES; l++) t[l] = fp4_lut[(p[l >> 1] >> (4 * (l & 1))) & 15];
  vf v;
  memcpy(&v, t, sizeof v);
  return v;
#endif
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

/* ---- one row (decode) against NQ1 panels at once ----
 * A tile's NP panels are NP streams of codes: at one row the product is bound by memory, and a core
 * reads more from memory with more streams in flight (measured here, Zen 3: 12.5 GB/s with one
 * stream, 18 with eight; the float32 GEMM's 8-panel row1_f32 streams at ~20 GB/s, the NP-panel tiles
 * at ~8). So one row takes NQ1 panels (a whole number of NP groups), each its own accumulator chain.
 * (Software prefetch 512-2048 bytes ahead in each stream made it slower: quant_kernel_bench.py
 * --cold-mb 96, w13 at one row, int8 120 -> 142-148 us.) Per group the sums fold in as in the tiles:
 * acc += s * sum(code * x) + m * sum(x). */
#define NQ1 (4 * NP)
#define DEFINE_QROW1(KIND)                                                                         \
  static void qrow1_##KIND(const float* x, int64_t I, const uint8_t* qp, const float* sp,          \
                           const float* mp, int64_t gs, float* y, int64_t O, int64_t p0,            \
                           const float* bias) {                                                    \
    const int64_t G = (I + gs - 1) / gs, pb = I * Q_BYTES(KIND);                                   \
    const uint8_t* q = qp + p0 * pb;                                                               \
    vf acc[NQ1];                                                                                   \
    for (int j = 0; j < NQ1; j++) acc[j] = (vf){0};                                                \
    for (int64_t g = 0; g < G; g++) {                                                              \
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;                                   \
      vf d[NQ1];                                                                                   \
      for (int j = 0; j < NQ1; j++) d[j] = (vf){0};                                                \
      for (int64_t i = i0; i < i1; i++) {                                                          \
        const float xs = x[i];                                                                     \
        for (int j = 0; j < NQ1; j++) d[j] += q_decode##KIND(q + j * pb + i * Q_BYTES(KIND)) * xs;  \
      }                                                                                            \
      float xsum = 0.f;                                                                            \
      _Pragma("omp simd reduction(+ : xsum)") for (int64_t t = i0; t < i1; t++) xsum += x[t];      \
      for (int j = 0; j < NQ1; j++) {                                                              \
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES);                              \
        const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);                              \
        acc[j] += s * d[j] + m * xsum;                                                             \
      }                                                                                            \
    }                                                                                              \
    for (int j = 0; j < NQ1; j++) {                                                                \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                       \
      store_row_f32(y + o, acc[j] + bias_vec(bias, o, n), n);                                      \
    }                                                                                              \
  }

DEFINE_QROW1(0)
DEFINE_QROW1(1)
DEFINE_QROW1(2)
DEFINE_QROW1(3)

typedef void (*qrow1_fn)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, float*,
                         int64_t, int64_t, const float*);
static qrow1_fn q_row1(int kind) {
  switch (kind) {
    case 0: return qrow1_0;
    case 1: return qrow1_1;
    case 2: return qrow1_2;
    default: return qrow1_3;
  }
}

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

