/* Part of cpu_kernels.c (one translation unit; see its list): RMSNorm, rotary embedding + paged cache writes. */

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
/* The rows' loops have no branch and no index that depends on the lane (NeoX: two halves; GPT-J:
 * pairs), so they vectorise; bf16 rounds with f32_to_bf16_vec (f32_to_bf16's NaN branch and the
 * half test in one loop kept bf16 scalar: rope_cache cost 7x float32's at a 2,000-token prefill). */
#define DEFINE_ROPE(SUFFIX, T, LOAD, STORE)                                                      \
  __attribute__((optimize("fp-contract=off"))) static void rope_row_##SUFFIX(                    \
      const T* restrict x, const T* restrict c, const T* restrict s, T* restrict out, int64_t D, \
      int64_t R, int interleaved) {                                                              \
    const int64_t half = R / 2;                                                                  \
    if (interleaved) {                                                                           \
      for (int64_t i = 0; i < half; i++) {                                                       \
        const float x0 = LOAD(x[2 * i]), x1 = LOAD(x[2 * i + 1]);                                \
        const float a0 = LOAD(STORE(x0 * LOAD(c[2 * i]))), b0 = LOAD(STORE(-x1 * LOAD(s[2 * i]))); \
        const float a1 = LOAD(STORE(x1 * LOAD(c[2 * i + 1])));                                   \
        const float b1 = LOAD(STORE(x0 * LOAD(s[2 * i + 1])));                                   \
        out[2 * i] = STORE(a0 + b0);                                                             \
        out[2 * i + 1] = STORE(a1 + b1);                                                         \
      }                                                                                          \
    } else {                                                                                     \
      for (int64_t d = 0; d < half; d++) {                                                       \
        const float a = LOAD(STORE(LOAD(x[d]) * LOAD(c[d])));                                    \
        const float b = LOAD(STORE(-LOAD(x[d + half]) * LOAD(s[d])));                            \
        out[d] = STORE(a + b);                                                                   \
      }                                                                                          \
      for (int64_t d = half; d < R; d++) {                                                       \
        const float a = LOAD(STORE(LOAD(x[d]) * LOAD(c[d])));                                    \
        const float b = LOAD(STORE(LOAD(x[d - half]) * LOAD(s[d])));                             \
        out[d] = STORE(a + b);                                                                   \
      }                                                                                          \
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
DEFINE_ROPE(bf16, bf16_t, bf16_to_f32, f32_to_bf16_vec)

