/* Part of cpu_kernels.c (one translation unit; see its list): kinds 6-9 beyond the pair tiles: many rows of
 * fp8 codes (prefill), one row (decode), qb_tiles which picks, q_bf16_tiles. */

#if QB_TILES
/* Many rows of fp8 codes (prefill, experts that receive many tokens): from QB_MANY rows a call
 * decodes each group's panels once, QB_WIDE at a time, into an L1 buffer (exactly the words qb_body's
 * steps decode), and every row tile then runs 8 x QB_WIDE accumulators over it with no decode in the
 * loop: the dense pair tiles' shape (24 chains, 3 loads and 8 broadcasts a step), which the 8 x 2
 * tiles (quant_bf16.c) cannot take beside the decode's constants (32 registers). The sums are the same
 * chains in the same order, folded per group in the same order: bit for bit qb_body's. fp8 gains
 * from 128 rows; int8 and int4, whose decode costs less, lose (the per-group fold spills the 24
 * accumulators), so they keep the pair tiles (quant_bf16.c; docs/benchmarks.md, "Kernel figures"). */
#define QB_MANY 64
#define QB_WIDE 3

/* rows x npc accumulators over `pairs` decoded steps wb[step][QB_WIDE], then folded into y as qb_body
 * does: y = s * acc + y, then m * sum(x) + y. xg: the tile's pairs of this group [pair][rows]; sg, mg:
 * panel 0's scales and offsets of this group (panel j's at j * G * LANES); xs: the tile's group sums,
 * G apart. */
static inline __attribute__((always_inline)) void qb_many_body(const int wk, const __m512i* wb, const uint32_t* xg,
                                                               int64_t pairs, const float* sg, const float* mg,
                                                               const float* xs, int64_t G, float* y, int64_t O,
                                                               int64_t o0, const int rows, const int npc) {
  __m512 acc[QB_WIDE * QB_ROWS];
  for (int a = 0; a < rows * npc; a++) acc[a] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; i++) {
    __m512i wv[QB_WIDE];
    for (int j = 0; j < npc; j++) wv[j] = _mm512_load_si512(wb + i * QB_WIDE + j);
    for (int r = 0; r < rows; r++) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xg[i * rows + r]);
      for (int j = 0; j < npc; j++) acc[r * npc + j] = _mm512_dpbf16_ps(acc[r * npc + j], (__m512bh)wv[j], xb);
    }
  }
  __m512 s[QB_WIDE], m[QB_WIDE];
  __mmask16 lanes[QB_WIDE];
  for (int j = 0; j < npc; j++) {
    const int64_t o = o0 + j * LANES, n = O - o < LANES ? O - o : LANES;
    lanes[j] = (__mmask16)((1u << n) - 1);
    s[j] = _mm512_loadu_ps(sg + j * G * LANES), m[j] = _mm512_loadu_ps(mg + j * G * LANES);
    qb_fold(wk, &s[j], &m[j]);
  }
  for (int r = 0; r < rows; r++) {
    const __m512 sx = _mm512_set1_ps(xs[r * G]);
    for (int j = 0; j < npc; j++) {
      float* yr = y + r * O + o0 + j * LANES;
      __m512 v = _mm512_maskz_loadu_ps(lanes[j], yr);
      v = _mm512_fmadd_ps(s[j], acc[r * npc + j], v);
      v = _mm512_fmadd_ps(m[j], sx, v);
      _mm512_mask_storeu_ps(yr, lanes[j], v);
    }
  }
}

typedef void (*qb_many_fn)(int wk, const __m512i* wb, const uint32_t* xg, int64_t pairs, const float* sg,
                           const float* mg, const float* xs, int64_t G, float* y, int64_t O, int64_t o0);
#define QB_MANY_TILE(R, N)                                                                                   \
  static __attribute__((noinline)) void qb_many_##R##_##N(int wk, const __m512i* wb, const uint32_t* xg,     \
                                                          int64_t pairs, const float* sg, const float* mg,   \
                                                          const float* xs, int64_t G, float* y, int64_t O,   \
                                                          int64_t o0) {                                      \
    qb_many_body(wk, wb, xg, pairs, sg, mg, xs, G, y, O, o0, R, N);                                          \
  }
#define QB_MANY_TILES(N)                                                                                     \
  QB_MANY_TILE(1, N) QB_MANY_TILE(2, N) QB_MANY_TILE(3, N) QB_MANY_TILE(4, N) QB_MANY_TILE(5, N)             \
  QB_MANY_TILE(6, N) QB_MANY_TILE(7, N) QB_MANY_TILE(8, N)
QB_MANY_TILES(1)
QB_MANY_TILES(2)
QB_MANY_TILES(3)
#define QB_MANY_ROW(N) \
  {NULL, qb_many_1_##N, qb_many_2_##N, qb_many_3_##N, qb_many_4_##N, qb_many_5_##N, qb_many_6_##N, qb_many_7_##N, qb_many_8_##N}
static const qb_many_fn qb_many_tiles[QB_WIDE][QB_ROWS + 1] = {QB_MANY_ROW(1), QB_MANY_ROW(2), QB_MANY_ROW(3)};

/* Inputs [i0, i1) of npc panels of fp8 codes (panel j at qp + j * pb), decoded into wb[pair][QB_WIDE]. */
static __attribute__((noinline)) void qb_unpack_fp8(const uint8_t* qp, int64_t pb, int64_t i0, int64_t i1, int npc,
                                                    __m512i* wb) {
  const int64_t cb = Q_BYTES(2);
  int64_t i = i0, k = 0;
  for (; i + 1 < i1; i += 2, k++)
    for (int j = 0; j < npc; j++) wb[k * QB_WIDE + j] = qb_decode(2, qp + j * pb + i * cb, 0);
  if (i < i1)
    for (int j = 0; j < npc; j++) wb[k * QB_WIDE + j] = qb_decode(2, qp + j * pb + i * cb, 1);
}

/* Rows [r0, r1) against panels [p0, q1) of fp8 codes: per QB_WIDE panels, y set to the bias, then
 * group after group decoded once and run by every row tile (qb_tile_rows of the rows left up to rt,
 * as qb_layout laid rows [.., rt) out; rt = r1 for a whole span of rows, QB_MANY or more). y: row
 * r0's outputs, rows O apart (O also bounds the last panel). wb: room for ceil(gs / 2) * QB_WIDE
 * words. */
static void qb_many(const uint32_t* xp, const float* xsum, int64_t I, const uint8_t* qp, const float* sp,
                    const float* mp, int64_t gs, float* y, int64_t O, int64_t p0, int64_t q1, int64_t r0,
                    int64_t r1, int64_t rt, const float* bias, __m512i* wb) {
  const int wk = 2; /* fp8: the kind whose decode the buffer pays for (QB_MANY) */
  const int64_t G = (I + gs - 1) / gs, h = (gs + 1) / 2, PI = qb_pairs(I, gs), pb = I * Q_BYTES(wk);
  for (int64_t p = p0; p < q1; p += QB_WIDE) {
    const int npc = q1 - p < QB_WIDE ? (int)(q1 - p) : QB_WIDE;
    for (int j = 0; j < npc; j++) {
      const int64_t o = (p + j) * LANES, n = O - o < LANES ? O - o : LANES;
      const __mmask16 lanes = (__mmask16)((1u << n) - 1);
      const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes, bias + o) : _mm512_setzero_ps();
      for (int64_t r = r0; r < r1; r++) _mm512_mask_storeu_ps(y + (r - r0) * O + o, lanes, b);
    }
    for (int64_t g = 0; g < G; g++) {
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I, pairs = (i1 - i0 + 1) / 2;
      qb_unpack_fp8(qp + p * pb, pb, i0, i1, npc, wb);
      for (int64_t r = r0; r < r1;) {
        const int n = qb_tile_rows(rt - r);
        qb_many_tiles[npc - 1][n](wk, wb, xp + r * PI + g * h * n, pairs, sp + (p * G + g) * LANES,
                                  mp + (p * G + g) * LANES, xsum + r * G + g, G, y + (r - r0) * O, O, p * LANES);
        r += n;
      }
    }
  }
}

/* Rows a fused gated item keeps in its buffer at once (whole tiles): 256 x 2 x 48 floats, 96 KB. */
#define QB_GATED_ROWS 256

/* An fp8 expert's w13 (gate panels p, up panels PG + p; PG = I / LANES) for its rows [r0, r1)
 * (>= QB_MANY, laid out by qb_layout from r0) and gate panels [q0, q1): per QB_WIDE gate panels and
 * up to QB_GATED_ROWS rows, qb_many's gate and up products into a small buffer, act_row over it, and
 * the activated values rounded to bf16 into a's rows (width I), as moe_q_ex's passes do over whole
 * rows: the same values, bit for bit, without the [rows, 2I] float32 intermediate going to memory
 * and back. */
static void qb_many_gated(const uint32_t* xp, const float* xsum, int64_t H, const uint8_t* qp, const float* sp,
                          const float* mp, int64_t gs, int64_t I, int64_t q0, int64_t q1, int64_t r0, int64_t r1,
                          const float* bias, int act, float limit, float alpha, float* a) {
  const int64_t G = (H + gs - 1) / gs, pb = H * Q_BYTES(2), PG = I / LANES;
  const int64_t W = 2 * QB_WIDE * LANES; /* the buffer's row width */
  __m512i* wb = (__m512i*)aligned_alloc(64, sizeof(__m512i) * (size_t)(((gs + 1) / 2) * QB_WIDE));
  float* hb = (float*)aligned_alloc(64, sizeof(float) * (size_t)((QB_GATED_ROWS + QB_ROWS) * W));
  for (int64_t rc = r0; rc < r1;) {
    int64_t rc1 = rc; /* whole tiles, as qb_layout cut them from r0 */
    while (rc1 < r1 && rc1 - rc < QB_GATED_ROWS) rc1 += qb_tile_rows(r1 - rc1);
    for (int64_t p = q0; p < q1; p += QB_WIDE) {
      const int64_t n = (q1 - p < QB_WIDE ? q1 - p : QB_WIDE) * LANES;
      /* gate panels at the buffer's columns [0, n), up panels at [n, 2n): each triple as panels
       * 0-2 of a matrix W wide (whole panels, I % LANES == 0) */
      for (int half = 0; half < 2; half++) {
        const int64_t pp = half ? PG + p : p;
        qb_many(xp, xsum, H, qp + pp * pb, sp + pp * G * LANES, mp + pp * G * LANES, gs, hb + half * n, W, 0,
                n / LANES, rc, rc1, r1, bias ? bias + pp * LANES : NULL, wb);
      }
      for (int64_t r = rc; r < rc1; r++) {
        act_row(hb + (r - rc) * W, a + r * I + p * LANES, n, act, limit, alpha);
        qb_round_rows(a + r * I + p * LANES, n, 0, 1);
      }
    }
    rc = rc1;
  }
  free(wb);
  free(hb);
}

/* One row (decode) of uint4 (wk 1) or fp8 (wk 2) codes against the NQ1 panels from p0 (fewer at the
 * matrix's end), as kind 1's / 2's one-row kernel reads them (panel after panel, one sequential
 * stream prefetched Q_ROW1_AHEAD bytes ahead, QR1 partial sums over the pair steps in turn), on
 * pairs: one vdpbf16ps of 32 products where that kernel spends a decode and an FMA on 16. xp: the
 * row's pairs (qb_layout, n = 1). int8's and fp4's one row stay kind 0's / 3's kernels on the
 * rounded inputs (an int8 body like this one was no faster than kind 0's: its decode is two
 * widenings, two conversions and a permute a pair; docs/benchmarks.md, "Kernel figures"). */
static inline __attribute__((always_inline)) void qb_row1(const int wk, const uint32_t* xp, const float* xsum,
                                                           int64_t I, int64_t gs, const uint8_t* qp, const float* sp,
                                                           const float* mp, float* y, int64_t O, int64_t p0,
                                                           const float* bias) {
  const int64_t P = (O + LANES - 1) / LANES, G = (I + gs - 1) / gs, h = (gs + 1) / 2, cb = Q_BYTES(wk);
  const int64_t pb = I * cb;
  for (int64_t j = p0; j < p0 + NQ1 && j < P; j++) {
    const uint8_t* q = qp + j * pb;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;
      const uint32_t* xg = xp + g * h;
      __m512 d[QR1];
      for (int u = 0; u < QR1; u++) d[u] = _mm512_setzero_ps();
      const uint32_t* xi = xg;
      int64_t i = i0;
      for (; i + 2 * QR1 <= i1; i += 2 * QR1, xi += QR1) {
        _mm_prefetch((const char*)(q + i * cb) + Q_ROW1_AHEAD, _MM_HINT_T0);
        for (int u = 0; u < QR1; u++)
          d[u] = _mm512_dpbf16_ps(d[u], (__m512bh)qb_decode(wk, q + (i + 2 * u) * cb, 0),
                                  (__m512bh)_mm512_set1_epi32((int)xi[u]));
      }
      for (int u = 0; i + 1 < i1; i += 2, u++) /* the group's last full pairs, then an odd last input */
        d[u] = _mm512_dpbf16_ps(d[u], (__m512bh)qb_decode(wk, q + i * cb, 0), (__m512bh)_mm512_set1_epi32((int)xi[u]));
      if (i < i1)
        d[3] = _mm512_dpbf16_ps(d[3], (__m512bh)qb_decode(wk, q + i * cb, 1),
                                (__m512bh)_mm512_set1_epi32((int)xg[(i - i0) / 2]));
      __m512 s = _mm512_loadu_ps(sp + (j * G + g) * LANES), m = _mm512_loadu_ps(mp + (j * G + g) * LANES);
      qb_fold(wk, &s, &m);
      acc = _mm512_fmadd_ps(s, _mm512_add_ps(_mm512_add_ps(d[0], d[1]), _mm512_add_ps(d[2], d[3])), acc);
      acc = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[g]), acc);
    }
    const int64_t o = j * LANES, n = O - o < LANES ? O - o : LANES;
    store_row_f32(y + o, (vf)acc + bias_vec(bias, o, n), n);
  }
}

static void qb_row1_1(const uint32_t* xp, const float* xsum, int64_t I, int64_t gs, const uint8_t* qp,
                      const float* sp, const float* mp, float* y, int64_t O, int64_t p0, const float* bias) {
  qb_row1(1, xp, xsum, I, gs, qp, sp, mp, y, O, p0, bias);
}
static void qb_row1_2(const uint32_t* xp, const float* xsum, int64_t I, int64_t gs, const uint8_t* qp,
                      const float* sp, const float* mp, float* y, int64_t O, int64_t p0, const float* bias) {
  qb_row1(2, xp, xsum, I, gs, qp, sp, mp, y, O, p0, bias);
}

/* Kind 6-9's rows [r0, r1) against panels [p0, q1). */
static void qb_tiles(int kind, const uint32_t* xp, const float* xsum, int64_t I, const uint8_t* qp,
                     const float* sp, const float* mp, int64_t gs, float* y, int64_t O, int64_t p0, int64_t q1,
                     int64_t r0, int64_t r1, const float* bias) {
  const int wk = qb_weight_kind(kind);
  if (wk == 2 && r1 - r0 >= QB_MANY) {
    __m512i* wb = (__m512i*)aligned_alloc(64, sizeof(__m512i) * (size_t)(((gs + 1) / 2) * QB_WIDE));
    if (wb) {
      qb_many(xp, xsum, I, qp, sp, mp, gs, y + r0 * O, O, p0, q1, r0, r1, r1, bias, wb);
      free(wb);
      return;
    }
  }
  (wk == 1 ? qb_tiles1 : wk == 3 ? qb_tiles3 : wk == 2 ? qb_tiles2 : qb_tiles0)(xp, xsum, I, qp, sp, mp, gs, y, O, p0,
                                                                                q1, r0, r1, bias);
}
#endif

/* 1 where kinds 6-9 run on bf16 pairs (the Python side picks them for bf16 activations only then). */
int64_t q_bf16_tiles(void) { return QB_TILES; }

