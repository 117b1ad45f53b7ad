/* Part of cpu_kernels.c (one translation unit; see its list): weight-only quantized codes (int8, uint4, fp8,
 * fp4) dequantized in registers: many rows, a few to some tens of rows, one row. */

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
 * 8 FMAs (faster than the buffer path at 8 rows: docs/benchmarks.md, "Kernel figures"). Every output is the float32
 * tiles' FMA chain over
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
 * (docs/benchmarks.md, "Kernel figures"). Copied once a call, not per span. */
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
 * reads more from memory with more streams in flight (on Zen 3: docs/benchmarks.md, "Kernel
 * figures"). So one row takes NQ1 panels (a whole number of NP groups), each its own accumulator chain. (Software prefetch
 * 512-2048 bytes ahead in each stream made it slower.) Per group the sums fold in as in the tiles:
 * acc += s * sum(code * x) + m * sum(x). */
#define NQ1 (4 * NP)
/* Integer or float partial sums a one-row kernel keeps per panel when it reads a span panel after
 * panel (the AVX-512 build, below and in quant_a8_row.c): enough independent chains for the latency. */
#define QR1 4
/* One-row kernels prefetch their stream 4 KB ahead (a line for each line read): with a cache
 * line of codes taking 4-16 vector steps the core had too few misses in flight and read cold
 * codes at about half float32's rate; 1 KB ahead was half the gain, 8-16 KB the same
 * (docs/benchmarks.md, "Kernel figures"). */
#define Q_ROW1_AHEAD 4096
_Static_assert(QR1 == 4, "qrow1_* (LANES 16) add their partial sums d[0..3] pairwise");
#if LANES == 16
/* AVX-512: the span is read panel after panel, one sequential stream, QR1 partial sums a panel over
 * the inputs in turn (NQ1 panels side by side, the plan below, read cold weights at about half
 * float32's rate on Zen 5: docs/benchmarks.md, "Kernel figures"). Per group the sums fold in as below. */
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

