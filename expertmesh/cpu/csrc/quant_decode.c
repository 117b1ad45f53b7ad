/* Part of cpu_kernels.c (one translation unit; see its list): the quantized codes' decodes (int8, uint4,
 * fp8, fp4 -> float32 vectors), shared by every quantized kernel. */

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
 * q_decode1_one_panel): there the multishift is slightly slower (many FMAs a decode), where it is
 * faster at 1-3 rows (docs/benchmarks.md, "Kernel figures"). */
static inline vf q_decode1_shuffle(const uint8_t* p) { /* 8 bytes, lane 2j the low nibble of byte j */
  const __m128i b = _mm_loadl_epi64((const __m128i*)p), low = _mm_set1_epi8(15);
  const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(b, low), _mm_and_si128(_mm_srli_epi16(b, 4), low));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(nibbles));
}
#if defined(__AVX512VBMI__)
/* Lane l's nibble of 8 code bytes in the low bits of int32 lane l (bits above it: other nibbles):
 * the 8 bytes broadcast to every qword (a load, no shuffle) and one multishift that copies bits
 * 4l.. into lane l's low byte. Cross-lane shuffles were what the one-row int4 kernel waited on (it
 * read at a third of float32's rate). */
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

/* The one-row kernels' decode: fp4 through q_nibble_lanes where it exists (faster at one row, bound
 * by the decode; at 4 rows the tiles were slower with it, so they keep q_decode3:
 * docs/benchmarks.md, "Kernel figures"). */
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

