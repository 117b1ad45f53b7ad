/* Part of cpu_kernels.c (one translation unit; see its list): uint4 / int8 / fp4 / fp8 codes against
 * activations rounded to bf16 (kinds 6-9), by bf16 pair products: the layout and the pair tiles. */

/* ---- kinds 6-9: uint4 / int8 / fp4 / fp8 weights (kind 1's / 0's / 3's / 2's codes, scales and
 * offsets) times bf16 activations ----
 * A bf16 model's layers take bf16 inputs (the torch path rounds every activation to bf16), so its
 * int4, int8, fp4 and fp8 products can run on AVX512-BF16 pairs: a uint4 code (0..15), an int8 code
 * (-128..127), an e2m1 or an e4m3 value is exact in bf16, and vdpbf16ps multiplies 32 code / input
 * pairs into 16 float32 lanes at once, where the weight-only tiles (kinds 1, 0, 3, 2) rebuild W = code * s + m in
 * float32 and spend one FMA of 16 products a row on it. Per group of gs inputs the scale and offset
 * fold in once, as the algebra says:
 *     y += s * sum(code * x) + m * sum(x)          (sums over the group; bf16 x, float32 sums)
 * (uint4 codes enter as 1 + code / 16, whose sums carry sum(x) too, and e4m3 values as 256 times
 * theirs: qb_decode, qb_fold). The only rounding beyond kinds 1 / 0 / 3 / 2 is the inputs' to bf16
 * (which a bf16 model's torch path also does; inside moe_q the activated intermediate is rounded as
 * well, where torch's bf16 experts round theirs) and the float32 sums'. One row (decode): uint4 and
 * fp8 on pairs too (qb_row1), int8 and fp4 by kind 0's / 3's one-row kernels on the rounded inputs.
 * The pair tiles need AVX512-BF16 and VBMI (q_bf16_tiles() says); without them the Python side keeps
 * kinds 1 / 0 / 3 / 2, and a kind 6-9 call here runs its weight kind on the rounded inputs. */
#define QB_KIND(kind) ((kind) >= Q_KIND_B4 && (kind) <= Q_KIND_BF8)
/* The codes' own kind: uint4 (1) for kind 6, int8 (0) for kind 7, fp4 (3) for kind 8, fp8 (2) for
 * kind 9, any other kind itself. */
static inline int qb_weight_kind(int kind) {
  return kind == Q_KIND_B4 ? 1 : kind == Q_KIND_B8 ? 0 : kind == Q_KIND_BF4 ? 3 : kind == Q_KIND_BF8 ? 2 : kind;
}
#if LANES == 16 && defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define QB_TILES 1
#else
#define QB_TILES 0
#endif

/* Rows a pair tile takes out of `left`: at most QB_ROWS, the rows split evenly (32: 4 x 8; 13: 7 + 6). */
#define QB_ROWS 8
static inline int qb_tile_rows(int64_t left) {
  const int64_t tiles = (left + QB_ROWS - 1) / QB_ROWS;
  return (int)((left + tiles - 1) / tiles);
}

/* Whether q_span reads kind 6-9's pair layout for a span of `rows` rows: the tiles from 2 rows, and
 * at one row kinds 6 / 9's qb_row1 only (kinds 7, 8 take their weight kind's one-row kernel, on every
 * panel of the matrix), so decode steps of those skip the layout. */
static inline int qb_reads_pairs(int kind, int64_t rows) {
  return rows > 1 || kind == Q_KIND_B4 || kind == Q_KIND_BF8;
}

/* Pairs a row holds in qb_layout: group g's inputs as ceil(len / 2) pairs from pair g * ceil(gs / 2)
 * (a pair never straddles two groups; an odd group's last pair has a zero second input). */
static inline int64_t qb_pairs(int64_t I, int64_t gs) {
  const int64_t G = (I + gs - 1) / gs, last = I - (G - 1) * gs;
  return (G - 1) * ((gs + 1) / 2) + (last + 1) / 2;
}

/* x rounded to bf16 values (float32 storage), rows [r0, r1) of [rows, I], in place. */
static void qb_round_rows(float* x, int64_t I, int64_t r0, int64_t r1) {
  for (int64_t i = r0 * I; i < r1 * I; i++) x[i] = bf16_to_f32(f32_to_bf16_vec(x[i]));
}

/* Rows [r0, r1) of x (bf16 values already: qb_round_rows) as the tiles read them: a tile of n rows
 * from row r (qb_tile_rows) stored [pair][n] at xp + r * qb_pairs(I, gs), a pair the two bf16 inputs
 * in one 32-bit word (the first in the low half: the high halves of their float32 bits, exact since
 * they are bf16 values); xsum[r * G + g] the group sums. */
static void qb_layout(const float* x, int64_t I, int64_t gs, int64_t r0, int64_t r1, uint32_t* xp, float* xsum) {
  const int64_t G = (I + gs - 1) / gs, PI = qb_pairs(I, gs), h = (gs + 1) / 2;
  /* a tile's rows side by side: its words are stored in order, and its rows' sums (each in its own
   * order, input after input, as before) are n independent chains, not one chain after another
   * (one chain a row left the layout bound by the adds' latency: 5% of a held-fp8 prefill) */
  for (int64_t r = r0; r < r1;) {
    const int n = qb_tile_rows(r1 - r);
    const float* xr = x + r * I;
    for (int64_t g = 0; g < G; g++) {
      const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I, full = i0 + (i1 - i0) / 2 * 2;
      uint32_t* out = xp + r * PI + g * h * n;
      float s[QB_ROWS];
      for (int t = 0; t < n; t++) s[t] = 0.f;
      for (int64_t i = i0; i < full; i += 2, out += n)
        for (int t = 0; t < n; t++) {
          uint32_t a, b;
          memcpy(&a, xr + t * I + i, 4);
          memcpy(&b, xr + t * I + i + 1, 4);
          out[t] = a >> 16 | (b & 0xffff0000u);
          s[t] += xr[t * I + i] + xr[t * I + i + 1];
        }
      if (full < i1) /* an odd group's last input, alone in its pair */
        for (int t = 0; t < n; t++) {
          uint32_t a;
          memcpy(&a, xr + t * I + full, 4);
          out[t] = a >> 16;
          s[t] += xr[t * I + full];
        }
      for (int t = 0; t < n; t++) xsum[(r + t) * G + g] = s[t];
    }
    r += n;
  }
}

#if QB_TILES
/* Accumulators a tile keeps (rows x panels); the group's products are folded into y, so only these
 * live in registers with the decode's constants. */
#define QB_ACC 16
/* Panels a tile of n rows takes: 4 up to 4 rows, 2 for 5-8 (a divisor of NQ1; 10-16 independent
 * vdpbf16ps chains cover its latency, and they, the decode's constants and two decoded panels fit
 * the 32 registers: 11-row tiles of 2 panels spilled and ran slower than kind 1). */
#define QB_NPC(n) ((n) <= 4 ? 4 : 2)

/* Inputs i and i + 1 of one panel's uint4 codes (16 bytes: input i's 16 nibbles, lane 2j in the low
 * nibble of byte j, then input i + 1's; `odd`: input i only) as 32 words, word w = lane w / 2's code
 * byte for input w % 2 in both its bytes: one broadcast load and one byte permute. (odd is a constant
 * at every call, so the hot loops' broadcast stays one load.) */
static inline __attribute__((always_inline)) __m512i qb_nibble_words(const uint8_t* p, const int odd) {
  const __m128i b = odd ? _mm_maskz_loadu_epi8(0x00ff, p) : _mm_loadu_si128((const __m128i*)p);
  /* word w -> source byte (w % 2) * 8 + w / 4 */
  const __m512i perm = _mm512_set_epi8(
      15, 15, 7, 7, 15, 15, 7, 7, 14, 14, 6, 6, 14, 14, 6, 6, 13, 13, 5, 5, 13, 13, 5, 5, 12, 12, 4, 4, 12, 12, 4, 4,
      11, 11, 3, 3, 11, 11, 3, 3, 10, 10, 2, 2, 10, 10, 2, 2, 9, 9, 1, 1, 9, 9, 1, 1, 8, 8, 0, 0, 8, 8, 0, 0);
  return _mm512_permutexvar_epi8(perm, _mm512_broadcast_i32x4(b));
}

/* Inputs i and i + 1 of one panel as 16 bf16 pairs, lane l = (code(l, i), code(l, i + 1)) for int8
 * (wk 0) and (1 + code(l, i) / 16, 1 + code(l, i + 1) / 16) for uint4 (wk 1); `odd`: input i only (a
 * group's last), the second code 0. uint4: the code bytes as words (qb_nibble_words), a per-word
 * shift by 5 or 9 that brings the lane's nibble to bits 3..6 (a bf16 mantissa's top 4 bits), and one
 * ternary op that masks it and sets the exponent of 1: two shuffles where a table lookup of
 * bf16(code) takes three, and the shuffles bound the kernels at few rows (docs/benchmarks.md, "Kernel figures").
 * The sums come out as sum(x) + sum(code * x) / 16,
 * qb_fold takes sum(x) back off. int8: 32 bytes (input i's 16 codes, then input i + 1's), each 16
 * widened to float32 (exact: 8 significant bits, so the low 16 bits are zero) and one two-source
 * word permute taking the high halves, input i's in the even words. fp8 (wk 2): 256 * value (qb_fold
 * takes the 256 back off), the same word order. */
static inline __attribute__((always_inline)) __m512i qb_decode(const int wk, const uint8_t* p, const int odd) {
  if (wk == 2) { /* fp8 e4m3, 32 bytes as int8's: each code byte in both bytes of its word (one byte
                  * permute), then bf16 bits 256 times the value by shifts and masks (no rounding: 3
                  * mantissa bits) with a table for the subnormals, whose bits alone would make bf16
                  * denormals, which vdpbf16ps reads as zero */
    const __m256i b = odd ? _mm256_maskz_loadu_epi8(0x0000ffffu, p) : _mm256_loadu_si256((const __m256i*)p);
    /* word w -> source byte (w % 2) * 16 + w / 2, in both its bytes */
    const __m512i perm = _mm512_set_epi8(
        31, 31, 15, 15, 30, 30, 14, 14, 29, 29, 13, 13, 28, 28, 12, 12, 27, 27, 11, 11, 26, 26, 10, 10,
        25, 25, 9, 9, 24, 24, 8, 8, 23, 23, 7, 7, 22, 22, 6, 6, 21, 21, 5, 5, 20, 20, 4, 4,
        19, 19, 3, 3, 18, 18, 2, 2, 17, 17, 1, 1, 16, 16, 0, 0);
    const __m512i t = _mm512_permutexvar_epi8(perm, _mm512_castsi256_si512(b));
    /* normal codes: exponent and mantissa (bits 8..14 of t) to bits 4..10, exponent field 128 + e */
    __m512i v = _mm512_ternarylogic_epi32(_mm512_srli_epi16(t, 4), _mm512_set1_epi16(0x07f0),
                                          _mm512_set1_epi16(0x4000), 0xEA); /* a & b | c */
    /* subnormals (e = 0; zero too): 256 * m * 2^-9 = m / 2 from a table by t's low bits (= m there) */
    const __m512i sub = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0x4060, 0x4040, 0x4020, 0x4000, 0x3fc0, 0x3f80, 0x3f00, 0);
    v = _mm512_mask_permutexvar_epi16(v, _mm512_testn_epi16_mask(t, _mm512_set1_epi16(0x7800)), t, sub);
    return _mm512_ternarylogic_epi32(v, t, _mm512_set1_epi16((short)0x8000), 0xD8); /* the sign: c ? b : a */
  }
  if (wk == 3) { /* fp4 e2m1: the nibble to bits 0..3 and a word permute through bf16 of the 16 codes
                  * (repeated: bit 4, another nibble's, does not matter); exact, -0.0 for code 8 */
    const __m512i shift = _mm512_set_epi16(4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0,
                                           4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0, 4, 4, 0, 0);
    const __m512i table = _mm512_set_epi16(
        (short)0xc0c0, (short)0xc080, (short)0xc040, (short)0xc000, (short)0xbfc0, (short)0xbf80, (short)0xbf00,
        (short)0x8000, 0x40c0, 0x4080, 0x4040, 0x4000, 0x3fc0, 0x3f80, 0x3f00, 0x0000, (short)0xc0c0,
        (short)0xc080, (short)0xc040, (short)0xc000, (short)0xbfc0, (short)0xbf80, (short)0xbf00, (short)0x8000,
        0x40c0, 0x4080, 0x4040, 0x4000, 0x3fc0, 0x3f80, 0x3f00, 0x0000);
    return _mm512_permutexvar_epi16(_mm512_srlv_epi16(qb_nibble_words(p, odd), shift), table);
  }
  if (wk == 0) {
    const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
    const __m512 b = odd ? _mm512_setzero_ps()
                         : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 16))));
    const __m512i high = _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17,
                                          47, 15, 45, 13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(a), high, _mm512_castps_si512(b));
  }
  const __m512i shift = _mm512_set_epi16(9, 9, 5, 5, 9, 9, 5, 5, 9, 9, 5, 5, 9, 9, 5, 5,
                                         9, 9, 5, 5, 9, 9, 5, 5, 9, 9, 5, 5, 9, 9, 5, 5);
  const __m512i w = _mm512_srlv_epi16(qb_nibble_words(p, odd), shift);
  return _mm512_ternarylogic_epi32(w, _mm512_set1_epi16(0x0078), _mm512_set1_epi16(0x3f80), 0xEA); /* a & b | c */
}

/* A group's scale s and offset m as they multiply the pair sums D and sum(x): y += s * D + m * sum(x);
 * for uint4 D = sum(x) + sum(code * x) / 16 (qb_decode), so s * sum(code * x) = 16 s D - 16 s sum(x);
 * for fp8 D = 256 sum(value * x), exact (a power of two). */
static inline __attribute__((always_inline)) void qb_fold(const int wk, __m512* s, __m512* m) {
  if (wk == 2) *s = _mm512_mul_ps(*s, _mm512_set1_ps(0x1p-8f)); /* e4m3 values entered as 256 times theirs */
  if (wk == 1) {
    *s = _mm512_mul_ps(*s, _mm512_set1_ps(16.f));
    *m = _mm512_sub_ps(*m, *s);
  }
}

/* One pair step of a tile: npc panels decoded, each multiplied into every row's accumulator. */
#define QB_STEP(ODD)                                                                                   \
  {                                                                                                    \
    __m512i wv[4];                                                                                     \
    for (int j = 0; j < npc; j++) wv[j] = qb_decode(wk, qp + (p0 + j) * pb + i * cb, ODD);             \
    for (int r = 0; r < rows; r++) {                                                                   \
      const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)xi[r]);                                     \
      for (int j = 0; j < npc; j++) acc[r * npc + j] = _mm512_dpbf16_ps(acc[r * npc + j], (__m512bh)wv[j], xs); \
    }                                                                                                  \
  }

/* Rows x npc panels from panel p0, codes of weight kind wk (1 or 0, a constant once inlined):
 * y[r, o] = bias + sum over groups of s * sum(code * x) + m * xsum. xp: the tile's pairs
 * [pair][rows]; xsum: [rows, G]. */
static inline __attribute__((always_inline)) void qb_body(const int wk, const uint32_t* xp, const float* xsum,
                                                          int64_t I, int64_t gs, const uint8_t* qp,
                                                          const float* sp, const float* mp, float* y, int64_t O,
                                                          int64_t p0, const int npc, const int rows,
                                                          const float* bias) {
  const int64_t G = (I + gs - 1) / gs, h = (gs + 1) / 2, cb = Q_BYTES(wk), pb = I * cb;
  __mmask16 lanes[4];
  for (int j = 0; j < npc; j++) {
    const int64_t o = (p0 + j) * LANES, n = O - o < LANES ? O - o : LANES;
    lanes[j] = (__mmask16)((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(lanes[j], bias + o) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * O + o, lanes[j], b);
  }
  for (int64_t g = 0; g < G; g++) {
    const int64_t i0 = g * gs, i1 = i0 + gs < I ? i0 + gs : I;
    __m512 acc[QB_ACC];
    for (int a = 0; a < rows * npc; a++) acc[a] = _mm512_setzero_ps();
    const uint32_t* xg = xp + g * h * rows;
    const uint32_t* xi = xg;
    int64_t i = i0;
    for (; i + 1 < i1; i += 2, xi += rows) {
      /* the next tile's panels (contiguous after these), npc * 2 * cb bytes a pair step: cold codes
       * stalled the tiles (quant_kernel_bench.py --cold-mb 96, int4 w13 at 8 rows: 118 us, 93 hot) */
      _mm_prefetch((const char*)(qp + (p0 + npc) * pb + i * npc * cb), _MM_HINT_T0);
      if (npc * cb * 2 > 64) /* int8 / fp8 at 4 panels: 128 bytes a step, two lines */
        _mm_prefetch((const char*)(qp + (p0 + npc) * pb + i * npc * cb + 64), _MM_HINT_T0);
      QB_STEP(0)
    }
    if (i < i1) /* an odd group's last input, alone in its pair */
      QB_STEP(1)
    for (int j = 0; j < npc; j++) {
      __m512 s = _mm512_loadu_ps(sp + ((p0 + j) * G + g) * LANES), m = _mm512_loadu_ps(mp + ((p0 + j) * G + g) * LANES);
      qb_fold(wk, &s, &m);
      const int64_t o = (p0 + j) * LANES;
      for (int r = 0; r < rows; r++) {
        float* yr = y + r * O + o;
        __m512 v = _mm512_maskz_loadu_ps(lanes[j], yr);
        v = _mm512_fmadd_ps(s, acc[r * npc + j], v);
        v = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * G + g]), v);
        _mm512_mask_storeu_ps(yr, lanes[j], v);
      }
    }
  }
}

#define QB_CASE(WK, n)                                                               \
  case n:                                                                            \
    qb_body(WK, xr, sr, I, gs, qp, sp, mp, yr, O, p, QB_NPC(n), n, bias);            \
    break;

/* Rows [r0, r1) against panels [p0, q1) of weight kind WK, x in qb_layout's form (xp, xsum); the
 * matrix's last panels, fewer than a tile's width, by one generic body (qb_tail). */
#define DEFINE_QB_TILES(WK)                                                                                  \
  static __attribute__((noinline)) void qb_tail##WK(const uint32_t* xp, const float* xsum, int64_t I,        \
                                                    int64_t gs, const uint8_t* qp, const float* sp,          \
                                                    const float* mp, float* y, int64_t O, int64_t p0, int npc, \
                                                    int rows, const float* bias) {                           \
    qb_body(WK, xp, xsum, I, gs, qp, sp, mp, y, O, p0, npc, rows, bias);                                     \
  }                                                                                                          \
  static void qb_tiles##WK(const uint32_t* xp, const float* xsum, int64_t I, const uint8_t* qp,              \
                           const float* sp, const float* mp, int64_t gs, float* y, int64_t O, int64_t p0,    \
                           int64_t q1, int64_t r0, int64_t r1, const float* bias) {                          \
    const int64_t G = (I + gs - 1) / gs, PI = qb_pairs(I, gs);                                               \
    for (int64_t r = r0; r < r1;) {                                                                          \
      const int n = qb_tile_rows(r1 - r);                                                                    \
      const uint32_t* xr = xp + r * PI;                                                                      \
      const float* sr = xsum + r * G;                                                                        \
      float* yr = y + r * O;                                                                                 \
      for (int64_t p = p0; p < q1; p += QB_NPC(n)) {                                                         \
        if (q1 - p < QB_NPC(n)) {                                                                            \
          qb_tail##WK(xr, sr, I, gs, qp, sp, mp, yr, O, p, (int)(q1 - p), n, bias);                          \
          continue;                                                                                          \
        }                                                                                                    \
        switch (n) {                                                                                         \
          QB_CASE(WK, 1) QB_CASE(WK, 2) QB_CASE(WK, 3) QB_CASE(WK, 4)                                        \
          QB_CASE(WK, 5) QB_CASE(WK, 6) QB_CASE(WK, 7) QB_CASE(WK, 8) default: break;                        \
        }                                                                                                    \
      }                                                                                                      \
      r += n;                                                                                                \
    }                                                                                                        \
  }

DEFINE_QB_TILES(0)
DEFINE_QB_TILES(1)
DEFINE_QB_TILES(2)
DEFINE_QB_TILES(3)
#undef QB_CASE
#endif /* QB_TILES */

