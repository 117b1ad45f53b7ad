/* Part of cpu_kernels.c (one translation unit; see its list): routed experts in one call (the float32 plan the bf16 ones follow). */

/* ---- routed experts ------------------------------------------------------------------------
 * A routed-experts block in one call: y[t] = sum_j w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t))
 * over the pairs (t, j) whose expert e = slot[t, j] is held here (slot -1: another rank's).
 *
 * x:      [n, H]                   slot, w: [n, k] int32 local expert / float32 weight
 * w13:    E x panels of [gate | up] ([2I, H] each), w2: E x panels of down ([H, I] each)
 * out:    [n, H]                   act: 0 silu, 1 gelu (erf), 2 gelu (tanh)
 *
 * The pairs are sorted by expert (a counting sort) and their tokens gathered; then one OpenMP
 * region runs gate/up for every (expert, panel group), the activation, down for every
 * (expert, panel group) and the weighted sum per token, with a barrier between phases: no
 * per-expert thread start-up and no Python between the products.
 */
typedef struct {
  int64_t m;             /* (token, expert) pairs held here */
  int64_t na;            /* experts with at least one pair */
  int64_t* active;       /* [na] those experts: work items skip the others (128 experts, 1 token) */
  int64_t* start;        /* [E + 1] first sorted row of each expert */
  int64_t* pair_of_row;  /* [m] sorted row -> pair index t * k + j */
  int64_t* row_of_pair;  /* [n * k] pair -> sorted row, or -1 */
} moe_plan;

static moe_plan moe_sort(const int32_t* slot, int64_t n, int64_t k, int64_t E) {
  moe_plan p;
  p.start = (int64_t*)calloc((size_t)(E + 1), sizeof(int64_t));
  for (int64_t q = 0; q < n * k; q++)
    if (slot[q] >= 0) p.start[slot[q] + 1]++;
  for (int64_t e = 0; e < E; e++) p.start[e + 1] += p.start[e];
  p.m = p.start[E];
  int64_t* fill = (int64_t*)malloc(sizeof(int64_t) * (size_t)(E + 1));
  memcpy(fill, p.start, sizeof(int64_t) * (size_t)(E + 1));
  p.pair_of_row = (int64_t*)malloc(sizeof(int64_t) * (size_t)(p.m + 1));
  p.row_of_pair = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n * k + 1));
  for (int64_t q = 0; q < n * k; q++) { /* stable: an expert's rows keep token order */
    p.row_of_pair[q] = -1;
    if (slot[q] >= 0) {
      p.pair_of_row[fill[slot[q]]] = q;
      p.row_of_pair[q] = fill[slot[q]]++;
    }
  }
  free(fill);
  p.active = (int64_t*)malloc(sizeof(int64_t) * (size_t)(E + 1));
  p.na = 0;
  for (int64_t e = 0; e < E; e++)
    if (p.start[e + 1] > p.start[e]) p.active[p.na++] = e;
  return p;
}

static void moe_free(moe_plan* p) {
  free(p->active);
  free(p->start);
  free(p->pair_of_row);
  free(p->row_of_pair);
}

/* sum_j w[t, j] * ys[row of (t, j)] for token t (zero if none of its experts is held here). */
/* No fused multiply-add here: each weighted product is rounded before it is added, so experts
 * split over ranks (EP) sum to exactly what one process gets (a + b either way). */
__attribute__((optimize("fp-contract=off"))) static void moe_combine_row(
    const moe_plan* p, const float* ys, const float* w, int64_t t, int64_t k, int64_t H, float* o) {
  for (int64_t c = 0; c < H; c++) o[c] = 0.f;
  for (int64_t j = 0; j < k; j++) {
    const int64_t r = p->row_of_pair[t * k + j];
    if (r < 0) continue;
    const float wt = w[t * k + j];
    const float* y = ys + r * H;
    for (int64_t c = 0; c < H; c++) o[c] += wt * y[c];
  }
}

/* act(gate) * up over one row of [gate | up] (width 2 * I) into a (width I). */
static inline void gated_row(const float* h, float* a, int64_t I, int act) {
  if (act == 0) {
    _Pragma("omp simd") for (int64_t i = 0; i < I; i++) {
      const float g = h[i];
      a[i] = g / (1.f + exp_vec(-g)) * h[I + i];
    }
  } else if (act == 1) {
    for (int64_t i = 0; i < I; i++) a[i] = 0.5f * h[i] * (1.f + erff(h[i] * 0.70710678118654752f)) * h[I + i];
  } else {
    for (int64_t i = 0; i < I; i++) {
      const float g = h[i];
      a[i] = 0.5f * g * (1.f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g))) * h[I + i];
    }
  }
}

/* gated_row, or act 3: GPT-OSS's clamped SwiGLU, gate clamped above at limit and up to [-limit,
 * limit], then (up + 1) * gate * sigmoid(alpha * gate) (layers/activation.py ClampedSwiGLU); act 4:
 * DeepSeek-V4's, silu(gate clamped above at limit) * (up clamped to [-limit, limit])
 * (ClampedGatedActivation; alpha unused). */
static inline void act_row(const float* h, float* a, int64_t I, int act, float limit, float alpha) {
  if (act < 3) {
    gated_row(h, a, I, act);
    return;
  }
  if (act == 4) {
    _Pragma("omp simd") for (int64_t i = 0; i < I; i++) {
      const float g = fminf(h[i], limit), u = fminf(fmaxf(h[I + i], -limit), limit);
      a[i] = g / (1.f + exp_vec(-g)) * u;
    }
    return;
  }
  _Pragma("omp simd") for (int64_t i = 0; i < I; i++) {
    const float g = fminf(h[i], limit), u = fminf(fmaxf(h[I + i], -limit), limit);
    a[i] = (u + 1.f) * (g * (1.f / (1.f + exp_vec(-(g * alpha)))));
  }
}

/* bf16_to_f32(f32_to_bf16(f)) without a branch, so its loops vectorise: the same rounding to
 * nearest even, and a NaN stays a (quiet) NaN. */
static inline float round_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
  const uint32_t nan = (v.u & 0xffff0000u) | 0x00400000u;
  v.u = (v.u & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return v.f;
}

/* span_f32, or span_bf16_f32 when the weights are bf16: `off` weights into w. */
static inline void span_widened(int bf16, const float* x, int64_t I, const void* w, int64_t off, float* y,
                                int64_t O, int64_t P, int64_t q0, int64_t r0, int64_t r1, const float* bias) {
  const int64_t q1 = q0 + SPAN_PANELS < P ? q0 + SPAN_PANELS : P;
  if (bf16)
    span_bf16_f32(x, I, (const bf16_t*)w + off, y, O, P, q0, q1, r0, r1, bias);
  else
    span_f32(x, I, (const float*)w + off, y, O, P, q0, q1, r0, r1, bias);
}

/* The experts plan over float32 rows, with moe_q_ex's extras: float32 biases b13 [E, 2I] and
 * b2 [E, H] (NULL: none) added to the products before the activation and before the routing
 * weight; act 3 (act_row) with limit and alpha. bf16 = 0: float32 x, weights. bf16 = 1 (CPUs
 * without pair products): bf16 x and weights, widened to float32 (the input once when gathered,
 * the weights in registers), with the pair version's rounding: gate and up outputs and the
 * activation's output rounded to bf16, the weighted sum kept in float32 and returned unrounded
 * (a partial sum: whoever adds the partials of other ranks rounds once, after that sum). */
static void moe_widened(int bf16, const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w,
                        int64_t k, const void* w13, const void* w2, int64_t E, int64_t I, int act, float limit,
                        float alpha, const float* b13, const float* b2, float* out, int threads) {
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, P2 = (H + LANES - 1) / LANES;
  /* items: (active expert, SPAN_PANELS panels); span_* picks the tiles for the expert's rows */
  const int64_t S13 = (P13 + SPAN_PANELS - 1) / SPAN_PANELS, S2 = (P2 + SPAN_PANELS - 1) / SPAN_PANELS;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* a = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      const int64_t t = p.pair_of_row[r] / k;
      if (bf16)
        for (int64_t c = 0; c < H; c++) xs[r * H + c] = bf16_to_f32(((const bf16_t*)x)[t * H + c]);
      else
        memcpy(xs + r * H, (const float*)x + t * H, sizeof(float) * (size_t)H);
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * S13; item++) {
      const int64_t e = p.active[item / S13];
      span_widened(bf16, xs, H, w13, e * P13 * H * LANES, h, 2 * I, P13, item % S13 * SPAN_PANELS, p.start[e],
                   p.start[e + 1], b13 ? b13 + e * 2 * I : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      float* hr = h + r * 2 * I;
      float* ar = a + r * I;
      if (bf16) _Pragma("omp simd") for (int64_t i = 0; i < 2 * I; i++) hr[i] = round_bf16(hr[i]);
      act_row(hr, ar, I, act, limit, alpha);
      if (bf16) _Pragma("omp simd") for (int64_t i = 0; i < I; i++) ar[i] = round_bf16(ar[i]);
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * S2; item++) {
      const int64_t e = p.active[item / S2];
      span_widened(bf16, a, I, w2, e * P2 * I * LANES, ys, H, P2, item % S2 * SPAN_PANELS, p.start[e],
                   p.start[e + 1], b2 ? b2 + e * H : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(a); free(ys);
  moe_free(&p);
}

void moe_f32_ex(const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                const float* w13, const float* w2, int64_t E, int64_t I, int act, float limit, float alpha,
                const float* b13, const float* b2, float* out, int threads) {
  moe_widened(0, x, n, H, slot, w, k, w13, w2, E, I, act, limit, alpha, b13, b2, out, threads);
}

/* moe_f32_ex without biases, for the gated activations 0-2 (native decode calls it). */
void moe_f32(const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
             const float* w13, const float* w2, int64_t E, int64_t I, int act, float* out,
             int threads) {
  moe_f32_ex(x, n, H, slot, w, k, w13, w2, E, I, act, 0.f, 0.f, NULL, NULL, out, threads);
}
