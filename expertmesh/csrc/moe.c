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
 * limit], then (up + 1) * gate * sigmoid(alpha * gate) (layers/activation.py ClampedSwiGLU). */
static inline void act_row(const float* h, float* a, int64_t I, int act, float limit, float alpha) {
  if (act != 3) {
    gated_row(h, a, I, act);
    return;
  }
  _Pragma("omp simd") for (int64_t i = 0; i < I; i++) {
    const float g = fminf(h[i], limit), u = fminf(fmaxf(h[I + i], -limit), limit);
    a[i] = (u + 1.f) * (g * (1.f / (1.f + exp_vec(-(g * alpha)))));
  }
}

/* moe_f32 with moe_q_ex's extras: float32 biases b13 [E, 2I] and b2 [E, H] (NULL: none) added to
 * the products before the activation and before the routing weight; act 3 (act_row) with limit and
 * alpha. */
void moe_f32_ex(const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                const float* w13, const float* w2, int64_t E, int64_t I, int act, float limit, float alpha,
                const float* b13, const float* b2, float* out, int threads) {
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  const int64_t P13 = (2 * I + LANES - 1) / LANES, P2 = (H + LANES - 1) / LANES;
  /* items: (active expert, SPAN_PANELS panels); span_f32 picks the tiles for the expert's rows */
  const int64_t S13 = (P13 + SPAN_PANELS - 1) / SPAN_PANELS, S2 = (P2 + SPAN_PANELS - 1) / SPAN_PANELS;
  float* xs = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  float* h = (float*)malloc(sizeof(float) * (size_t)(m * 2 * I + 1));
  float* a = (float*)malloc(sizeof(float) * (size_t)(m * I + 1));
  float* ys = (float*)malloc(sizeof(float) * (size_t)(m * H + 1));
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      memcpy(xs + r * H, x + (p.pair_of_row[r] / k) * H, sizeof(float) * (size_t)H);
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * S13; item++) {
      const int64_t e = p.active[item / S13], q0 = item % S13 * SPAN_PANELS;
      span_f32(xs, H, w13 + e * P13 * H * LANES, h, 2 * I, P13, q0, q0 + SPAN_PANELS < P13 ? q0 + SPAN_PANELS : P13,
               p.start[e], p.start[e + 1], b13 ? b13 + e * 2 * I : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++)
      act_row(h + r * 2 * I, a + r * I, I, act, limit, alpha);
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * S2; item++) {
      const int64_t e = p.active[item / S2], q0 = item % S2 * SPAN_PANELS;
      span_f32(a, I, w2 + e * P2 * I * LANES, ys, H, P2, q0, q0 + SPAN_PANELS < P2 ? q0 + SPAN_PANELS : P2,
               p.start[e], p.start[e + 1], b2 ? b2 + e * H : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  free(xs); free(h); free(a); free(ys);
  moe_free(&p);
}

/* moe_f32_ex without biases, for the gated activations 0-2 (native decode calls it). */
void moe_f32(const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
             const float* w13, const float* w2, int64_t E, int64_t I, int act, float* out,
             int threads) {
  moe_f32_ex(x, n, H, slot, w, k, w13, w2, E, I, act, 0.f, 0.f, NULL, NULL, out, threads);
}
