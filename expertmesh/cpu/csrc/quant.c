/* Part of cpu_kernels.c (one translation unit; see its list): weight-only quantized codes (int8, uint4, fp8, fp4), dequantized in registers. */

/* ---- quantized weights: codes in panels, dequantized in registers ----------------------------
 * Weight-only quantization (layers/quantization/packed.py packs these). For panel p (LANES output
 * rows) and input i the codes of the LANES rows are stored together: one byte each (KIND 0 int8,
 * KIND 2 fp8 e4m3) or a nibble each (KIND 1 uint4, KIND 3 fp4 e2m1; lane 2j in the low nibble of
 * byte j). Each (panel, group of gs inputs) has LANES scales s and offsets m in float32:
 * W[o, i] = code(o, i) * s + m (int8 symmetric: m = 0; int4: m = -zero * s). The weight vector is
 * rebuilt with one FMA (in registers, or into a buffer at many rows) and used for every row of a tile;
 * one row folds the scale and offset in once a group instead (qrow1_*). x and y are float32. */

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
#elif LANES == 16 && defined(__AVX512F__)
#include <immintrin.h> /* gemm.c includes it for AVX2 only */
static inline vf q_decode0(const uint8_t* p) { /* int8 */
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
/* uint4 by widening shuffles: AVX-512 without VBMI, and with it the tiles of one panel (7-12 rows,
 * q_decode1_one_panel): there the multishift measured 1.02-1.05x slower (w13 / w2 at 8 rows,
 * moe_q at 32 rows: many FMAs a decode), where it is 1.3x faster at 1-3 rows. */
static inline vf q_decode1_shuffle(const uint8_t* p) { /* 8 bytes, lane 2j the low nibble of byte j */
  const __m128i b = _mm_loadl_epi64((const __m128i*)p), low = _mm_set1_epi8(15);
  const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
}
#if defined(__AVX512VBMI__)
/* Lane l's nibble of 8 code bytes in the low bits of int32 lane l (bits above it: other nibbles):
 * the 8 bytes broadcast to every qword (a load, no shuffle) and one multishift that copies bits
 * 4l.. into lane l's low byte. Cross-lane shuffles were what the one-row int4 kernel waited on (it
 * read 10-11 GB/s, float32 33-37). */
static inline __m512i q_nibble_lanes(const uint8_t* p) {
  int64_t word;
  memcpy(&word, p, 8);
  const __m512i at = _mm512_set_epi64(56 | 60LL << 32, 48 | 52LL << 32, 40 | 44LL << 32, 32 | 36LL << 32,
                                      24 | 28LL << 32, 16 | 20LL << 32, 8 | 12LL << 32, 0 | 4LL << 32);
  return _mm512_multishift_epi64_epi8(at, _mm512_set1_epi64(word));
}
static inline vf q_decode1(const uint8_t* p) { /* uint4: 8 bytes, lane 2j the low nibble of byte j */
  return (vf)_mm512_cvtepi32_ps(_mm512_and_si512(q_nibble_lanes(p), _mm512_set1_epi32(15)));
}
#define q_decode1_one_panel q_decode1_shuffle
#else
#define q_decode1 q_decode1_shuffle
#endif
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

/* fp8 e4m3 without a gather (slow on Zen 3): the code sign-extended to int32 and shifted left by 20
 * puts its sign at bit 31 (and bits 28..30) and its exponent + mantissa at bits 20..26, so one mask
 * makes the float32 2^-120 * value, subnormals included (e = 0 maps onto float32 subnormals, exact);
 * the 2^120 is one multiply. Code 0x7f / 0xff (NaN) is never written. (Four operations where the
 * sign and the rest taken apart were seven: the one-row kernel is bound by them.) */
static inline vf q_decode2(const uint8_t* p) {
#if LANES == 8 && defined(__AVX2__)
  const __m256i b = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)), 20);
  return (vf)_mm256_and_si256(b, _mm256_set1_epi32((int)0x87f00000u)) * 0x1p120f;
#elif LANES == 16 && defined(__AVX512F__)
  const __m512i b = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)), 20);
  return (vf)_mm512_and_si512(b, _mm512_set1_epi32((int)0x87f00000u)) * 0x1p120f;
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
  const __m512 lut = _mm512_loadu_ps(fp4_lut); /* the table in one register */
  return (vf)_mm512_permutexvar_ps(c, lut); /* the low 4 bits index: the code, sign included */
#else
  float t[LANES];
  for (int l = 0; l < LANES; l++) t[l] = fp4_lut[(p[l >> 1] >> (4 * (l & 1))) & 15];
  vf v;
  memcpy(&v, t, sizeof v);
  return v;
#endif
}

/* The one-row kernels' decode: fp4 through q_nibble_lanes where it exists (one row, 1.2-1.3x: the
 * row is bound by the decode; at 4 rows the tiles measured 0.9x with it, so they keep q_decode3). */
#if LANES == 16 && defined(__AVX512VBMI__)
static inline vf q_decode3_row(const uint8_t* p) {
  const __m512 lut = _mm512_loadu_ps(fp4_lut);
  return (vf)_mm512_permutexvar_ps(q_nibble_lanes(p), lut); /* indexes by the low 4 bits only */
}
#else
#define q_decode3_row q_decode3
#endif
#define q_decode0_row q_decode0
#define q_decode1_row q_decode1
#define q_decode2_row q_decode2
/* The wide tiles' decode when a tile takes one panel (QW_NPC: 7-12 rows). */
#ifndef q_decode1_one_panel
#define q_decode1_one_panel q_decode1
#endif
#define q_decode0_one_panel q_decode0
#define q_decode2_one_panel q_decode2
#define q_decode3_one_panel q_decode3

/* Bytes of codes per (panel, input): LANES for byte codes, LANES / 2 for nibbles. */
#define Q_BYTES(KIND) ((KIND) & 1 ? LANES / 2 : LANES)

/* Many rows (QW_ROWS and more, quant_dispatch.c): panel group g is dequantized into a float32 buffer
 * once (W = code * s + m) and read by the float32 tiles, its decode paid once per group. */
#define DEFINE_QGEMM(KIND)                                                                         \
  static void qrows##KIND(const float* x, int64_t I, const uint8_t* qp, const float* sp,           \
                          const float* mp, int64_t gs, float* y, int64_t O, int64_t g, int64_t r0, \
                          int64_t r1, const float* bias) {                                         \
    const int64_t P = (O + LANES - 1) / LANES, p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;        \
    const int64_t G = (I + gs - 1) / gs;                                                           \
    float* buf = (float*)malloc(sizeof(float) * (size_t)(NP * I * LANES));                         \
    for (int64_t j = 0; j < np; j++)                                                               \
      for (int64_t gg = 0; gg < G; gg++) {                                                         \
        const vf s = load_panel_f32(sp + ((p0 + j) * G + gg) * LANES);                             \
        const vf m = load_panel_f32(mp + ((p0 + j) * G + gg) * LANES);                             \
        const int64_t i1 = (gg + 1) * gs < I ? (gg + 1) * gs : I;                                  \
        for (int64_t i = gg * gs; i < i1; i++) {                                                   \
          const vf wv = q_decode##KIND(qp + ((p0 + j) * I + i) * Q_BYTES(KIND)) * s + m;           \
          memcpy(buf + (j * I + i) * LANES, &wv, sizeof wv);                                       \
        }                                                                                          \
      }                                                                                            \
    /* rows_f32 reads panel group g at wp + g * NP * I * LANES: point it so that lands on buf */   \
    const float* wp = (const float*)((uintptr_t)buf - (uintptr_t)(p0 * I * LANES * sizeof(float))); \
    rows_f32(x, I, wp, y, O, P, g, r0, r1, bias);                                                  \
    free(buf);                                                                                     \
  }

DEFINE_QGEMM(0)
DEFINE_QGEMM(1)
DEFINE_QGEMM(2)
DEFINE_QGEMM(3)

/* ---- a few to some tens of rows: each weight vector rebuilt once per tile, in registers ----
 * A tile of `rows` x `npc` panels (rows * npc <= QW_ACC accumulators) rebuilds W = code * s + m for
 * each (panel, input) once and multiplies it into every row of the tile: the decode is neither paid
 * once per 4 rows (the group-folded tiles before) nor written to a buffer and read back (qrows' panel
 * buffer). An expert of a batch-32 step has ~8 rows: one 8 x 1 tile decodes each weight once for
 * 8 FMAs (the buffer path measured 0.63-0.66x the float32 GEMM at 8 rows, these 0.77-1.03x). Every output is the float32 tiles' FMA chain over
 * the dequantized panel (acc += W * x over the inputs in order, then the bias), so a row's result is
 * bit for bit the panel-buffer path's, whatever tile or row count computed it. */
#define QW_ACC 12
/* Panels a tile of n rows takes: 4 for 1-3 rows, 2 for 4-6, 1 for 7-12 (enough independent chains
 * to cover the FMA latency; a divisor of NQ1 on both builds, so a span's tiles are whole but at the
 * matrix end). */
#define QW_NPC(n) ((n) <= 3 ? 4 : (n) <= 6 ? 2 : 1)
/* Rows a wide tile takes out of `left`: tiles of at most QW_ACC rows, the rows split evenly (13:
 * 7 + 6, 32: 11 + 11 + 10). */
static inline int qw_tile_rows(int64_t left) {
  const int64_t tiles = (left + QW_ACC - 1) / QW_ACC;
  return (int)((left + tiles - 1) / tiles);
}

/* x's rows [r0, r1) in the wide tiles' order: a tile of n rows from row r stored [input][n] at
 * xt + r * I, so its broadcasts are one stream. Read row-major, a tile's rows are I floats apart: at
 * I = 1,024 (4 KB) 7-12 of them share one L1 set of 8 ways, and the tiles ran at half speed
 * (measured: w2 at 32 rows 1,051 us against the panel buffer's 510). Copied once a call, not per span. */
static void qw_interleave(const float* x, int64_t I, int64_t r0, int64_t r1, float* xt) {
  for (int64_t r = r0; r < r1;) {
    const int n = qw_tile_rows(r1 - r);
    for (int64_t i = 0; i < I; i++)
      for (int t = 0; t < n; t++) xt[r * I + i * n + t] = x[(r + t) * I + i];
    r += n;
  }
}

#define DEFINE_QWIDE(KIND)                                                                         \
  static inline __attribute__((always_inline)) void qwide_body##KIND(                            \
      const float* x, int64_t I, const uint8_t* qp, const float* sp, const float* mp, int64_t G,   \
      int64_t gs, float* y, int64_t O, int64_t p0, const int npc, const int rows, const float* bias) { \
    vf acc[QW_ACC];                                                                                \
    for (int a = 0; a < rows * npc; a++) acc[a] = (vf){0};                                         \
    const int64_t pb = I * Q_BYTES(KIND);                                                          \
    for (int64_t g = 0; g < G; g++) {                                                              \
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;                                   \
      vf s[4], m[4];                                                                               \
      for (int j = 0; j < npc; j++) {                                                              \
        s[j] = load_panel_f32(sp + ((p0 + j) * G + g) * LANES);                                    \
        m[j] = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);                                    \
      }                                                                                            \
      for (int64_t i = i0; i < i1; i++) {                                                          \
        vf wv[4];                                                                                  \
        for (int j = 0; j < npc; j++) {                                                            \
          const uint8_t* c = qp + (p0 + j) * pb + i * Q_BYTES(KIND);                               \
          wv[j] = (npc == 1 ? q_decode##KIND##_one_panel(c) : q_decode##KIND(c)) * s[j] + m[j];    \
        }                                                                                          \
        for (int r = 0; r < rows; r++) {                                                           \
          const float xs = x[i * rows + r];                                                        \
          for (int j = 0; j < npc; j++) acc[r * npc + j] += wv[j] * xs;                            \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
    for (int j = 0; j < npc; j++) {                                                                \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                       \
      const vf b = bias_vec(bias, o, n);                                                           \
      for (int r = 0; r < rows; r++) store_row_f32(y + r * O + o, acc[r * npc + j] + b, n);        \
    }                                                                                              \
  }                                                                                                \
  /* the matrix's last panels, fewer than a tile's width: one generic body */                      \
  static __attribute__((noinline)) void qwide_tail##KIND(                                         \
      const float* x, int64_t I, const uint8_t* qp, const float* sp, const float* mp, int64_t G,   \
      int64_t gs, float* y, int64_t O, int64_t p0, int npc, int rows, const float* bias) {         \
    qwide_body##KIND(x, I, qp, sp, mp, G, gs, y, O, p0, npc, rows, bias);                          \
  }                                                                                                \
  /* Rows [r0, r1) against panels [p0, q1), x in qw_interleave's order (xt) */                    \
  static void qwide##KIND(const float* x, int64_t I, const uint8_t* qp, const float* sp,           \
                          const float* mp, int64_t gs, float* y, int64_t O, int64_t p0, int64_t q1, \
                          int64_t r0, int64_t r1, const float* bias) {                             \
    const int64_t G = (I + gs - 1) / gs;                                                           \
    for (int64_t r = r0; r < r1;) {                                                                \
      const int n = qw_tile_rows(r1 - r);                                                          \
      const float* xr = x + r * I;                                                                 \
      float* yr = y + r * O;                                                                       \
      for (int64_t p = p0; p < q1; p += QW_NPC(n)) {                                               \
        if (q1 - p < QW_NPC(n)) {                                                                  \
          qwide_tail##KIND(xr, I, qp, sp, mp, G, gs, yr, O, p, (int)(q1 - p), n, bias);            \
          continue;                                                                                \
        }                                                                                          \
        switch (n) {                                                                               \
          QW_CASE(KIND, 1) QW_CASE(KIND, 2) QW_CASE(KIND, 3) QW_CASE(KIND, 4) QW_CASE(KIND, 5)     \
          QW_CASE(KIND, 6) QW_CASE(KIND, 7) QW_CASE(KIND, 8) QW_CASE(KIND, 9) QW_CASE(KIND, 10)    \
          QW_CASE(KIND, 11) QW_CASE(KIND, 12) default: break;                                      \
        }                                                                                          \
      }                                                                                            \
      r += n;                                                                                      \
    }                                                                                              \
  }
#define QW_CASE(KIND, n)                                                                           \
  case n:                                                                                          \
    qwide_body##KIND(xr, I, qp, sp, mp, G, gs, yr, O, p, QW_NPC(n), n, bias);                      \
    break;

DEFINE_QWIDE(0)
DEFINE_QWIDE(1)
DEFINE_QWIDE(2)
DEFINE_QWIDE(3)

typedef void (*qwide_fn)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, float*,
                         int64_t, int64_t, int64_t, int64_t, int64_t, const float*);
static qwide_fn q_wide(int kind) {
  switch (kind) {
    case 0: return qwide0;
    case 1: return qwide1;
    case 2: return qwide2;
    default: return qwide3;
  }
}

/* ---- one row (decode) against NQ1 panels at once ----
 * A tile's NP panels are NP streams of codes: at one row the product is bound by memory, and a core
 * reads more from memory with more streams in flight (measured here, Zen 3: 12.5 GB/s with one
 * stream, 18 with eight; the float32 GEMM's 8-panel row1_f32 streams at ~20 GB/s, the NP-panel tiles
 * at ~8). So one row takes NQ1 panels (a whole number of NP groups), each its own accumulator chain.
 * (Software prefetch 512-2048 bytes ahead in each stream made it slower: quant_kernel_bench.py
 * --cold-mb 96, w13 at one row, int8 120 -> 142-148 us.) Per group the sums fold in as in the tiles:
 * acc += s * sum(code * x) + m * sum(x). */
#define NQ1 (4 * NP)
/* Integer or float partial sums a one-row kernel keeps per panel when it reads a span panel after
 * panel (the AVX-512 build, below and in quant_a8.c): enough independent chains for the latency. */
#define QR1 4
/* One-row kernels prefetch their stream 4 KB ahead (a line for each line read): with a cache
 * line of codes taking 4-16 vector steps the core had too few misses in flight and read cold
 * codes at 15-27 GB/s against float32's 33-37 (quant_kernel_bench.py --rows 1 --cold-mb 96, Zen 5:
 * int8 w13 46.6 -> 35.3 us, int4 31.8 -> 25.4, w2 / qkv 1.1-1.25x; 1 KB ahead was half the gain,
 * 8-16 KB the same). */
#define Q_ROW1_AHEAD 4096
_Static_assert(QR1 == 4, "qrow1_* (LANES 16) add their partial sums d[0..3] pairwise");
#if LANES == 16
/* AVX-512: the span is read panel after panel, one sequential stream, QR1 partial sums a panel over
 * the inputs in turn (NQ1 panels side by side, the plan below, read cold weights at 15-19 GB/s on
 * Zen 5 against float32's 33-37: quant_kernel_bench.py --rows 1 --cold-mb 96). Per group the sums
 * fold in as below. */
#define DEFINE_QROW1(KIND)                                                                         \
  static void qrow1_##KIND(const float* x, int64_t I, const uint8_t* qp, const float* sp,          \
                           const float* mp, int64_t gs, float* y, int64_t O, int64_t p0,            \
                           const float* bias) {                                                    \
    const int64_t G = (I + gs - 1) / gs, pb = I * Q_BYTES(KIND);                                   \
    float xsum[G];                                                                                 \
    for (int64_t g = 0; g < G; g++) {                                                              \
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;                                   \
      float t = 0.f;                                                                               \
      _Pragma("omp simd reduction(+ : t)") for (int64_t i = i0; i < i1; i++) t += x[i];            \
      xsum[g] = t;                                                                                 \
    }                                                                                              \
    const int64_t np = (O + LANES - 1) / LANES - p0; /* NQ1, or fewer: the matrix's last panels */  \
    for (int j = 0; j < NQ1 && j < np; j++) {                                                      \
      const uint8_t* q = qp + (p0 + j) * pb;                                                       \
      vf acc = (vf){0};                                                                            \
      for (int64_t g = 0; g < G; g++) {                                                            \
        const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;                                 \
        vf d[QR1];                                                                                 \
        for (int u = 0; u < QR1; u++) d[u] = (vf){0};                                              \
        for (int64_t i = i0; i < i1; i += QR1) {                                                   \
          _mm_prefetch((const char*)(q + i * Q_BYTES(KIND)) + Q_ROW1_AHEAD, _MM_HINT_T0);          \
          for (int u = 0; u < QR1 && i + u < i1; u++)                                              \
            d[u] += q_decode##KIND##_row(q + (i + u) * Q_BYTES(KIND)) * x[i + u];                  \
        }                                                                                          \
        const vf s = load_panel_f32(sp + ((p0 + j) * G + g) * LANES);                              \
        const vf m = load_panel_f32(mp + ((p0 + j) * G + g) * LANES);                              \
        acc += s * ((d[0] + d[1]) + (d[2] + d[3])) + m * xsum[g];                                  \
      }                                                                                            \
      const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;                       \
      store_row_f32(y + o, acc + bias_vec(bias, o, n), n);                                         \
    }                                                                                              \
  }
#else
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
#endif

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

