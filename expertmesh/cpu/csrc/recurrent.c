/* Decode steps of the recurrent token mixers (layers/gated_deltanet.py, layers/mamba2.py), in
 * float32, on the per-sequence states where they live: each entry point takes the state tensor's
 * base ([slots + 1, ...], engine/state_cache.py) and one slot index per sequence, and updates that
 * slot in place, so the torch path's gather of the states, its temporaries and its scatter back
 * (several passes over 2 MB a sequence and layer for Qwen3.5) become one pass. Parallel over
 * (sequence, head) pairs; each head's state (64 KB at 128 x 128) stays in L2 between its passes.
 *
 *   conv_step_f32  the causal depthwise convolution's new output (before its SiLU) and the shift
 *                  of the conv state, summed left to right as the torch path does (bit-equal)
 *   gdn_step_f32   Gated DeltaNet: L2-normalised q and k, the decayed delta-rule write, S^T q
 *   gdn_scan_f32   the same over a prefill chunk of one sequence, token by token per head
 *   ssm_step_f32   Mamba2: the decayed state plus dt x B^T (bit-equal), y = S C + D x
 *   ssm_scan_f32   the same over a prefill chunk of one sequence, token by token per head
 */

/* out[b, c] = sum_j window[b, c, j] w[c, j] (+ bias[c]), window = [state | x], accumulated from
 * j = 0 upward, each product and sum rounded (no fused multiply-add: the torch path rounds both);
 * the state then drops its oldest input and takes x. x rows at x_stride; w [C, K]; state base
 * [*, C, K - 1] indexed by slots; out [B, C]. */
__attribute__((optimize("fp-contract=off"))) void conv_step_f32(
    const float* x, int64_t x_stride, const float* w, const float* bias, float* state,
    const int64_t* slots, float* out, int64_t B, int64_t C, int64_t K, int threads) {
  const int64_t km1 = K - 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * C >= 4096)
  for (int64_t bc = 0; bc < B * C; bc++) {
    const int64_t b = bc / C, c = bc % C;
    float* s = state + (slots[b] * C + c) * km1;
    const float* wc = w + c * K;
    const float xv = x[b * x_stride + c];
    float acc = km1 ? s[0] * wc[0] : xv * wc[0];
    for (int64_t j = 1; j < km1; j++) acc = acc + s[j] * wc[j];
    if (km1) acc = acc + xv * wc[km1];
    if (bias) acc = acc + bias[c];
    out[bc] = acc;
    for (int64_t j = 0; j + 1 < km1; j++) s[j] = s[j + 1];
    if (km1) s[km1 - 1] = xv;
  }
}

#define REC_LANES 16 /* partial sums a horizontal sum keeps (vectorised without reassociation) */

static inline float rec_sum_squares(const float* x, int64_t n) {
  float part[REC_LANES] = {0};
  int64_t i = 0;
  for (; i + REC_LANES <= n; i += REC_LANES)
    for (int l = 0; l < REC_LANES; l++) part[l] += x[i + l] * x[i + l];
  for (; i < n; i++) part[0] += x[i] * x[i];
  float total = 0.f;
  for (int l = 0; l < REC_LANES; l++) total += part[l];
  return total;
}

/* One token of the gated delta rule for one value head: q0 and k0 (its key head's, dk each) are
 * L2-normalised (x / sqrt(sum x^2 + 1e-6)), q times dk^-1/2; the state S [dk, dv] decays by
 * e = exp(g), kv = S^T k, S += k (beta (v - kv))^T, o = S^T q. The decode step and the prefill scan
 * share it, so a scan equals its tokens stepped one at a time, bit for bit. */
static inline void gdn_head(const float* q0, const float* k0, const float* v, float e, float bt, float* S,
                            float* o, int64_t dk, int64_t dv) {
  const float scale = 1.f / sqrtf((float)dk);
  float q[dk], k[dk], kv[dv], delta[dv];
  const float rq = 1.f / sqrtf(rec_sum_squares(q0, dk) + 1e-6f);
  const float rk = 1.f / sqrtf(rec_sum_squares(k0, dk) + 1e-6f);
  for (int64_t i = 0; i < dk; i++) {
    q[i] = q0[i] * rq * scale;
    k[i] = k0[i] * rk;
  }
  for (int64_t j = 0; j < dv; j++) kv[j] = 0.f;
  for (int64_t i = 0; i < dk; i++) {
    const float* Si = S + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; j++) kv[j] += Si[j] * e * ki;
  }
  for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - kv[j]) * bt;
  for (int64_t j = 0; j < dv; j++) o[j] = 0.f;
  for (int64_t i = 0; i < dk; i++) {
    float* Si = S + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; j++) {
      const float s = Si[j] * e + ki * delta[j];
      Si[j] = s;
      o[j] += s * qi;
    }
  }
}

/* The decode step: one token for each of B sequences, per value head h (key head h / (nv / nk)).
 * mixed rows [q (nk dk) | k (nk dk) | v (nv dv)] at m_stride; decay = exp(g), beta [B, nv]; state
 * base [*, nv, dk, dv] indexed by slots; out [B, nv, dv]. */
void gdn_step_f32(const float* mixed, int64_t m_stride, const float* decay, const float* beta, float* state,
                  const int64_t* slots, float* out, int64_t B, int64_t nk, int64_t nv, int64_t dk, int64_t dv,
                  int threads) {
  const int64_t ratio = nv / nk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < B * nv; bh++) {
    const int64_t b = bh / nv, h = bh % nv, kh = h / ratio;
    const float* row = mixed + b * m_stride;
    gdn_head(row + kh * dk, row + nk * dk + kh * dk, row + 2 * nk * dk + h * dv, decay[bh], beta[bh],
             state + (slots[b] * nv + h) * dk * dv, out + bh * dv, dk, dv);
  }
}

/* The prefill scan: L tokens of one sequence (state row `slot`), token after token per head (the
 * recurrent form: each head's state stays in cache over the whole chunk), heads in parallel. Rows
 * and decay / beta [L, nv] as gdn_step_f32's; out [L, nv, dv]. */
void gdn_scan_f32(const float* mixed, int64_t m_stride, const float* decay, const float* beta, float* state,
                  int64_t slot, float* out, int64_t L, int64_t nk, int64_t nv, int64_t dk, int64_t dv,
                  int threads) {
  const int64_t ratio = nv / nk;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t h = 0; h < nv; h++) {
    const int64_t kh = h / ratio;
    float* S = state + (slot * nv + h) * dk * dv;
    for (int64_t t = 0; t < L; t++) {
      const float* row = mixed + t * m_stride;
      const int64_t th = t * nv + h;
      gdn_head(row + kh * dk, row + nk * dk + kh * dk, row + 2 * nk * dk + h * dv, decay[th], beta[th], S,
               out + th * dv, dk, dv);
    }
  }
}

/* One token of Mamba2's selective state update for one head: S [P, N] = S e + (dt x) B^T, rounded
 * as the torch path rounds (bit-equal states: no fused multiply-add here), y = S C + D x (skip = D).
 * The decode step and the prefill scan share it. */
__attribute__((optimize("fp-contract=off"))) static inline void ssm_head(
    const float* x, const float* Bv, const float* Cv, float e, float d, float skip, float* S, float* y,
    int64_t P, int64_t N) {
  for (int64_t p = 0; p < P; p++) {
    float* Sp = S + p * N;
    const float dx = d * x[p];
    float part[REC_LANES] = {0};
    int64_t n = 0;
    for (; n + REC_LANES <= N; n += REC_LANES)
      for (int l = 0; l < REC_LANES; l++) {
        const float kept = Sp[n + l] * e;
        const float s = kept + dx * Bv[n + l];
        Sp[n + l] = s;
        part[l] += s * Cv[n + l];
      }
    for (; n < N; n++) {
      const float kept = Sp[n] * e;
      const float s = kept + dx * Bv[n];
      Sp[n] = s;
      part[0] += s * Cv[n];
    }
    float acc = 0.f;
    for (int l = 0; l < REC_LANES; l++) acc += part[l];
    y[p] = acc + skip * x[p];
  }
}

/* The decode step: one token for each of B sequences, per head h (group h / (H / groups)). xbc
 * rows [x (H P) | B (groups N) | C (groups N)] at x_stride; dt, decay = exp(dt A) [B, H]; D [H];
 * state base [*, H, P, N] indexed by slots; out [B, H, P]. */
__attribute__((optimize("fp-contract=off"))) void ssm_step_f32(
    const float* xbc, int64_t x_stride, const float* dt, const float* decay, const float* D, float* state,
    const int64_t* slots, float* out, int64_t B, int64_t H, int64_t P, int64_t N, int64_t groups,
    int threads) {
  const int64_t per_group = H / groups;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t bh = 0; bh < B * H; bh++) {
    const int64_t b = bh / H, h = bh % H, g = h / per_group;
    const float* row = xbc + b * x_stride;
    ssm_head(row + h * P, row + H * P + g * N, row + H * P + groups * N + g * N, decay[bh], dt[bh], D[h],
             state + (slots[b] * H + h) * P * N, out + bh * P, P, N);
  }
}

/* The prefill scan: L tokens of one sequence (state row `slot`), token after token per head, heads
 * in parallel; rows, dt / decay [L, H] and out [L, H, P] as ssm_step_f32's. */
__attribute__((optimize("fp-contract=off"))) void ssm_scan_f32(
    const float* xbc, int64_t x_stride, const float* dt, const float* decay, const float* D, float* state,
    int64_t slot, float* out, int64_t L, int64_t H, int64_t P, int64_t N, int64_t groups, int threads) {
  const int64_t per_group = H / groups;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t h = 0; h < H; h++) {
    const int64_t g = h / per_group;
    float* S = state + (slot * H + h) * P * N;
    for (int64_t t = 0; t < L; t++) {
      const float* row = xbc + t * x_stride;
      const int64_t th = t * H + h;
      ssm_head(row + h * P, row + H * P + g * N, row + H * P + groups * N + g * N, decay[th], dt[th], D[h],
               S, out + th * P, P, N);
    }
  }
}
