/* GGUF MXFP4 blocks straight into the fp4 kind's panels (layers/quantization/packed.py), one pass:
 * no per-weight int16 (code | exponent << 4) in between, which the general held path builds.
 *
 * A GGUF MXFP4 block is 17 bytes: the e8m0 exponent, then 16 bytes whose low nibbles are values
 * 0-15 and high nibbles values 16-31 (gguf's dequantize order). The panels: codes [P, I, lanes / 2],
 * byte j of input i holding row 2j's code in its low nibble and row 2j + 1's in its high one; scales
 * [P, G, lanes] float32 2^(e - 127) (exact: e = 0 is the subnormal 2^-127); rows past O zero. */

static inline float e8m0_scale(uint8_t e) {
  union { uint32_t u; float f; } v;
  v.u = e ? (uint32_t)e << 23 : 0x400000u; /* 2^-127 as a subnormal: mantissa bit 22 */
  return v.f;
}

/* Rows r[j], byte k of each, transposed in place: r[k] byte j (three swaps of 4-, 2-, 1-byte blocks) */
static inline void transpose_8x8_bytes(uint64_t r[8]) {
  for (int j = 0; j < 4; j++) {
    const uint64_t t = ((r[j] >> 32) ^ r[j + 4]) & 0x00000000FFFFFFFFull;
    r[j] ^= t << 32, r[j + 4] ^= t;
  }
  for (int j = 0; j < 8; j += (j & 1) ? 3 : 1) { /* 0, 1, 4, 5 */
    const uint64_t t = ((r[j] >> 16) ^ r[j + 2]) & 0x0000FFFF0000FFFFull;
    r[j] ^= t << 16, r[j + 2] ^= t;
  }
  for (int j = 0; j < 8; j += 2) {
    const uint64_t t = ((r[j] >> 8) ^ r[j + 1]) & 0x00FF00FF00FF00FFull;
    r[j] ^= t << 8, r[j + 1] ^= t;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>

/* One panel's block g at 16 lanes (8 row pairs), a row's 16 bytes a 128-bit lane: the pairs' first
 * and second rows gathered apart (rows 0, 2, 4, 6 | 1, 3, 5, 7), their codes combined a byte each
 * (lo: values 0-15, hi: 16-31), then byte permutes lay value v of pair j at v * 8 + j. */
static inline void mxfp4_block_16(const uint8_t *rows[16], uint8_t *out) {
  __m512i z[4];
  for (int q = 0; q < 4; q++) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[4 * q] + 1)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * q + 1] + 1)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * q + 2] + 1)), 2);
    z[q] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[4 * q + 3] + 1)), 3);
  }
  const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8((char)0xF0);
  __m512i lo[2], hi[2];
  for (int h = 0; h < 2; h++) { /* pairs 4h .. 4h + 3 */
    const __m512i a = _mm512_shuffle_i64x2(z[2 * h], z[2 * h + 1], 0x88); /* lanes 0, 2 | 0, 2 */
    const __m512i b = _mm512_shuffle_i64x2(z[2 * h], z[2 * h + 1], 0xDD); /* lanes 1, 3 | 1, 3 */
    lo[h] = _mm512_or_si512(_mm512_and_si512(a, lo4), _mm512_and_si512(_mm512_slli_epi16(b, 4), hi4));
    hi[h] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), lo4), _mm512_and_si512(b, hi4));
  }
  /* out byte v * 8 + j (v < 8, then 8-15 in the second table): pair j's value v, in lo[j / 4] */
  uint8_t first[64], second[64];
  for (int o = 0; o < 64; o++) {
    const int v = o / 8, j = o % 8;
    first[o] = (uint8_t)((j / 4) * 64 + (j % 4) * 16 + v);
    second[o] = (uint8_t)(first[o] + 8);
  }
  const __m512i i0 = _mm512_loadu_si512(first), i1 = _mm512_loadu_si512(second);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi8(lo[0], i0, lo[1]));
  _mm512_storeu_si512(out + 64, _mm512_permutex2var_epi8(lo[0], i1, lo[1]));
  _mm512_storeu_si512(out + 128, _mm512_permutex2var_epi8(hi[0], i0, hi[1]));
  _mm512_storeu_si512(out + 192, _mm512_permutex2var_epi8(hi[0], i1, hi[1]));
}
#else
/* One panel's block g at 16 lanes (8 row pairs): each pair's 16 + 16 code bytes built 8 at a time
 * (SWAR), then four 8x8 byte transposes give the 32 values' 8-byte rows of the panel. */
static inline void mxfp4_block_16(const uint8_t *rows[16], uint8_t *out) {
  const uint64_t lo = 0x0F0F0F0F0F0F0F0Full;
  uint64_t q[4][8]; /* values 0-7, 8-15, 16-23, 24-31; one word a pair */
  for (int j = 0; j < 8; j++) {
    for (int h = 0; h < 2; h++) {
      uint64_t x, y;
      memcpy(&x, rows[2 * j] + 1 + 8 * h, 8);
      memcpy(&y, rows[2 * j + 1] + 1 + 8 * h, 8);
      q[h][j] = (x & lo) | ((y & lo) << 4);
      q[2 + h][j] = ((x >> 4) & lo) | (y & ~lo);
    }
  }
  for (int h = 0; h < 4; h++) {
    transpose_8x8_bytes(q[h]);
    memcpy(out + 64 * h, q[h], 64);
  }
}
#endif

/* blocks [O, G, 17] (rows `stride` bytes apart) -> codes [P, G * 32, lanes / 2], scales [P, G, lanes] */
void mxfp4_gguf_panels(const uint8_t *blocks, int64_t stride, int64_t O, int64_t G, int64_t lanes,
                       uint8_t *codes, float *scales, int threads) {
  const int64_t P = (O + lanes - 1) / lanes, half = lanes / 2, I = G * 32;
  static const uint8_t zeros[17] = {0};
  /* dynamic: on a shared machine one thread may get a fraction of its core; the other takes more */
  _Pragma("omp parallel for schedule(dynamic, 4) num_threads(threads) if (P > 1)")
  for (int64_t p = 0; p < P; p++) {
    const uint8_t *rows[64];
    for (int64_t l = 0; l < lanes; l++) rows[l] = p * lanes + l < O ? blocks + (p * lanes + l) * stride : zeros;
    /* the next panel's rows (one contiguous run of the blocks) fetched while this one is laid out:
     * read as 16 interleaved streams, they otherwise miss the cache at every line */
    const uint8_t *next = blocks + (p + 1) * lanes * stride;
    const int64_t next_bytes = (p + 1) * lanes < O ? (O - (p + 1) * lanes < lanes ? O - (p + 1) * lanes : lanes) * stride : 0;
    const int64_t per_block = (next_bytes / 64 + G) / G; /* cache lines to fetch a block */
    for (int64_t g = 0; g < G; g++) {
      for (int64_t c = g * per_block; c < (g + 1) * per_block && c * 64 < next_bytes; c++)
        __builtin_prefetch(next + c * 64);
      const int64_t step = g * 17;
      const uint8_t *at[64];
      for (int64_t l = 0; l < lanes; l++) {
        at[l] = rows[l] == zeros ? zeros : rows[l] + step;
        scales[(p * G + g) * lanes + l] = rows[l] == zeros ? 0.f : e8m0_scale(at[l][0]);
      }
      uint8_t *out = codes + (p * I + g * 32) * half;
      if (lanes == 16) {
        mxfp4_block_16(at, out);
        continue;
      }
      for (int64_t j = 0; j < half; j++) /* other widths (8 lanes: AVX2 builds), a byte at a time */
        for (int k = 0; k < 16; k++) {
          const uint8_t a = at[2 * j][1 + k], b = at[2 * j + 1][1 + k];
          out[k * half + j] = (uint8_t)((a & 15) | (b << 4));
          out[(16 + k) * half + j] = (uint8_t)((a >> 4) | (b & 0xF0));
        }
    }
  }
}
