/* Part of cpu_kernels.c (one translation unit; see its list): the panel GEMM's entry points over
 * gemm.c's tiles, and the widened bf16 panel groups (wide_rows_*). */

/* The NP bf16 panels from p0 widened to float32 into buf ([NP][I][LANES]); returns the pointer
 * that rows_at_* reads as panel p0 (the buffer, offset back by p0 panels). Widening is exact,
 * so the products equal the in-register widening tiles' bit for bit. */
static const float* widen_group(const bf16_t* wp, int64_t I, int64_t P, int64_t p0, float* buf) {
  const int64_t np = P - p0 < NP ? P - p0 : NP;
  const bf16_t* w = wp + p0 * I * LANES;
  for (int64_t k = 0; k < np * I; k++) {
    const vf v = load_panel_bf16(w + k * LANES);
    memcpy(buf + k * LANES, &v, sizeof v);
  }
  return (const float*)((uintptr_t)buf - (uintptr_t)(p0 * I * LANES * (int64_t)sizeof(float)));
}

#define DEFINE_WIDE_ROWS(SUFFIX, TY, WIDE)                                                          \
  static void wide_rows_##SUFFIX(const float* x, int64_t I, const bf16_t* wp, TY* y, int64_t O,     \
                                 int64_t P, int64_t p0, int64_t r0, int64_t r1, const float* bias) { \
    if (r1 - r0 < WIDEN_ROWS) {                                                                     \
      rows_at_##SUFFIX(x, I, wp, y, O, P, p0, r0, r1, bias);                                        \
      return;                                                                                       \
    }                                                                                               \
    float* buf = (float*)malloc(sizeof(float) * (size_t)(NP * I * LANES));                          \
    const float* wide = widen_group(wp, I, P, p0, buf);                                             \
    if (p0 + NP < P) { /* the next group, read from memory while this one's tiles run from cache */ \
      const char* next = (const char*)(wp + (p0 + NP) * I * LANES);                                 \
      for (int64_t b = 0; b < (int64_t)(NP * I * LANES * sizeof(bf16_t)); b += 64)                  \
        __builtin_prefetch(next + b, 0, 2);                                                         \
    }                                                                                               \
    rows_at_##WIDE(x, I, wide, y, O, P, p0, r0, r1, bias);                                          \
    free(buf);                                                                                      \
  }
DEFINE_WIDE_ROWS(bf16, bf16_t, f32_bf16)
DEFINE_WIDE_ROWS(bf16_f32, float, f32)

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
  if (M <= SPAN_ROWS) {
    const int64_t spans = (P + SPAN_PANELS - 1) / SPAN_PANELS;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t s = 0; s < spans; s++) {
      const int64_t q0 = s * SPAN_PANELS, q1 = q0 + SPAN_PANELS < P ? q0 + SPAN_PANELS : P;
      span_f32(x, I, wp, y, O, P, q0, q1, 0, M, bias);
    }
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
  if (M <= SPAN_ROWS) {
    const int64_t spans = (P + SPAN_PANELS - 1) / SPAN_PANELS;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t s = 0; s < spans; s++) {
      const int64_t q0 = s * SPAN_PANELS, q1 = q0 + SPAN_PANELS < P ? q0 + SPAN_PANELS : P;
      if (y_f32)
        span_bf16_f32(xf, I, wp, (float*)y, O, P, q0, q1, 0, M, bias);
      else
        span_bf16(xf, I, wp, (bf16_t*)y, O, P, q0, q1, 0, M, bias);
    }
    free(xf);
    return;
  }
  _Pragma("omp parallel for schedule(static) num_threads(threads)")
  for (int64_t item = 0; item < blocks * groups; item++) {
    const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
    if (y_f32)
      wide_rows_bf16_f32(xf, I, wp, (float*)y, O, P, item % groups * NP, r0, r1, bias);
    else
      wide_rows_bf16(xf, I, wp, (bf16_t*)y, O, P, item % groups * NP, r0, r1, bias);
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

