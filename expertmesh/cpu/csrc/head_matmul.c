/* Part of cpu_kernels.c (one translation unit; see its list): per-head matrix products (multi-head latent
 * attention's absorbed projections). */

/* Per-head matrix products, multi-head latent attention's absorbed projections (q x W_UK per head,
 * and the latent output through W_UV per head):
 *
 *   out[b, h, :] = x[b, h, :] @ w[h]       w [H, K, N] (trans = 0)
 *   out[b, h, :] = x[b, h, :] @ w[h]^T     w [H, N, K] (trans = 1)
 *
 * x: [B, H, K] with strides (sb, sh, 1) (a view of the query rows), w contiguous, out [B, H, N]
 * contiguous. Heads are split over threads; tokens go HEAD_ROWS at a time so their float32
 * accumulators stay in cache while each weight row is read once for all of them.
 */
#define HEAD_ROWS 16
#define DEFINE_HEAD_MATMUL(SUFFIX, T, LOAD, STORE)                                               \
  void head_matmul_##SUFFIX(const T* x, int64_t sb, int64_t sh, const T* w, T* out, int64_t B,   \
                            int64_t H, int64_t K, int64_t N, int trans, int threads) {           \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
    for (int64_t h = 0; h < H; h++) {                                                            \
      float* xf = (float*)malloc(sizeof(float) * (size_t)(HEAD_ROWS * (K + N)));                 \
      float* acc = xf + HEAD_ROWS * K;                                                           \
      const T* wh = w + h * K * N;                                                               \
      for (int64_t b0 = 0; b0 < B; b0 += HEAD_ROWS) {                                            \
        const int64_t nb = B - b0 < HEAD_ROWS ? B - b0 : HEAD_ROWS;                              \
        for (int64_t b = 0; b < nb; b++)                                                         \
          for (int64_t k = 0; k < K; k++) xf[b * K + k] = LOAD(x[(b0 + b) * sb + h * sh + k]);   \
        if (!trans) {                                                                            \
          memset(acc, 0, sizeof(float) * (size_t)(nb * N));                                     \
          for (int64_t k = 0; k < K; k++) {                                                      \
            const T* wr = wh + k * N;                                                            \
            for (int64_t b = 0; b < nb; b++) {                                                   \
              const float xv = xf[b * K + k];                                                    \
              float* a = acc + b * N;                                                            \
              _Pragma("omp simd") for (int64_t n = 0; n < N; n++) a[n] += xv * LOAD(wr[n]);      \
            }                                                                                    \
          }                                                                                      \
        } else {                                                                                 \
          for (int64_t n = 0; n < N; n++) {                                                      \
            const T* wr = wh + n * K;                                                            \
            for (int64_t b = 0; b < nb; b++) {                                                   \
              const float* xb = xf + b * K;                                                      \
              float sum = 0.f;                                                                   \
              _Pragma("omp simd reduction(+ : sum)") for (int64_t k = 0; k < K; k++) sum += xb[k] * LOAD(wr[k]); \
              acc[b * N + n] = sum;                                                              \
            }                                                                                    \
          }                                                                                      \
        }                                                                                        \
        for (int64_t b = 0; b < nb; b++)                                                         \
          for (int64_t n = 0; n < N; n++) out[((b0 + b) * H + h) * N + n] = STORE(acc[b * N + n]); \
      }                                                                                          \
      free(xf);                                                                                  \
    }                                                                                            \
  }

DEFINE_HEAD_MATMUL(f32, float, f32_id, f32_id)
DEFINE_HEAD_MATMUL(bf16, bf16_t, bf16_to_f32, f32_to_bf16)

