/* Part of cpu_kernels.c (one translation unit; see its list): gemm_q / moe_q: the quantized entry points over the tiles above. */

/* Rows [r0, r1) of quantized activations (xq, sx, xsum) against panel group g (kind 4 or 5). */
static void qrows_a8(int kind, const int8_t* xq, const float* sx, const float* xsum, int64_t I,
                     const uint8_t* qp, const float* sp, const float* mp, int64_t gs, float* y, int64_t O,
                     int64_t g, int64_t r0, int64_t r1, const float* bias) {
  const int64_t P = (O + LANES - 1) / LANES, p0 = g * NP, np = P - p0 < NP ? P - p0 : NP;
  const int64_t G = (I + gs - 1) / gs, xs = A_STRIDE(kind, I);
  int64_t r = r0;
#define QA(rows) \
  qtile_a(kind, xq + r * xs, sx + r * G, xsum ? xsum + r * G : NULL, I, qp, sp, mp, G, gs, y + r * O, O, p0, np, rows, bias)
  for (; r + QMR_A <= r1; r += QMR_A) QA(QMR_A);
  switch (r1 - r) {
    case 3: QA(3); break;
    case 2: QA(2); break;
    case 1: QA(1); break;
    default: break;
  }
#undef QA
}

/* Weight-only rows a span takes in the wide tiles (qwide_*); from this many the panel group is
 * dequantized into a buffer once and read by the float32 tiles (qrows_*). */
#ifndef QW_ROWS
#define QW_ROWS 24
#endif

/* Weight-only rows [r0, r1) as q_span reads them: interleaved for the wide tiles, else as they are. */
static void qw_layout(const float* x, int64_t I, int64_t r0, int64_t r1, float* xt) {
  if (r1 - r0 < QW_ROWS)
    qw_interleave(x, I, r0, r1, xt);
  else
    memcpy(xt + r0 * I, x + r0 * I, sizeof(float) * (size_t)((r1 - r0) * I));
}

/* Rows [r0, r1) against the NQ1 panels from p0 (a multiple of NQ1; fewer at the end): one row of a
 * whole span by the one-row kernels, weight-only kinds at 2 to QW_ROWS - 1 rows by the wide tiles, anything
 * else by the tiles, NP panels at a time. The activations are x (weight-only kinds; in qw_interleave's
 * order where the wide tiles take them, see qw_layout) or their quantized form xq, sx, xsum (kinds 4,
 * 5), all [rows, ...]. Kinds 6-9 (quant_bf16.c): x the rows rounded to bf16 as they are (the one-row
 * kernels of kinds 1, 0, 3, 2 read them), xb and xsum their qb_layout form (the bf16 pair tiles at 2 rows
 * and more, kinds 6 / 9's qb_row1 at one). */
static void q_span(int kind, const float* x, const int8_t* xq, const float* sx, const float* xsum,
                   const uint32_t* xb, int64_t I, const uint8_t* qp, const float* sp, const float* mp, int64_t gs,
                   float* y, int64_t O, int64_t p0, int64_t r0, int64_t r1, const float* bias) {
  const int64_t P = (O + LANES - 1) / LANES;
  const int a8 = kind == Q_KIND_A8 || kind == Q_KIND_A4;
#if QB_TILES
  if (r1 - r0 == 1 && (kind == Q_KIND_B4 || kind == Q_KIND_BF8)) { /* one row on pairs, a whole span or the
                                                                     * matrix's last panels */
    (kind == Q_KIND_B4 ? qb_row1_1 : qb_row1_2)(xb + r0 * qb_pairs(I, gs), xsum + r0 * ((I + gs - 1) / gs), I, gs,
                                                qp, sp, mp, y + r0 * O, O, p0, bias);
    return;
  }
#endif
  /* one row: the one-row kernels, on AVX-512 the matrix's last panels too (they read a span panel
   * after panel; the 1-row wide tile there ran one FMA chain a panel) */
  if (r1 - r0 == 1 && (P - p0 >= NQ1 || (LANES == 16 && !a8)) && (!a8 || Q_ROW1_A)) {
    if (!a8) {
      q_row1(qb_weight_kind(kind))(x + r0 * I, I, qp, sp, mp, gs, y + r0 * O, O, p0, bias);
      return;
    }
#if Q_ROW1_A
    const int64_t xs = A_STRIDE(kind, I), G = (I + gs - 1) / gs;
    if (kind == Q_KIND_A8)
      qrow1_a8(xq + r0 * xs, sx + r0 * G, I, qp, sp, G, gs, y + r0 * O, O, p0, bias);
    else
      qrow1_a4(xq + r0 * xs, sx + r0 * G, xsum + r0 * G, I, qp, sp, mp, G, gs, y + r0 * O, O, p0, bias);
    return;
#endif
  }
#if QB_TILES
  if (QB_KIND(kind)) {
    qb_tiles(kind, xb, xsum, I, qp, sp, mp, gs, y, O, p0, p0 + NQ1 < P ? p0 + NQ1 : P, r0, r1, bias);
    return;
  }
#endif
  if (!a8 && r1 - r0 < QW_ROWS) { /* weight-only, a few to some tens of rows: the wide tiles */
    q_wide(kind)(x, I, qp, sp, mp, gs, y, O, p0, p0 + NQ1 < P ? p0 + NQ1 : P, r0, r1, bias);
    return;
  }
  const int64_t g1 = (p0 + NQ1 < P ? p0 + NQ1 : P + NP - 1) / NP;
  for (int64_t g = p0 / NP; g < g1; g++) {
    if (a8)
      qrows_a8(kind, xq, sx, xsum, I, qp, sp, mp, gs, y, O, g, r0, r1, bias);
    else
      q_rows(kind)(x, I, qp, sp, mp, gs, y, O, g, r0, r1, bias);
  }
}

/* y[M, O] = x[M, I] @ W^T (+ bias), W quantized as above (codes qp, scales sp, offsets mp). */
void gemm_q(int kind, const float* x, const uint8_t* qp, const float* sp, const float* mp, int64_t gs,
            float* y, int64_t M, int64_t O, int64_t I, const float* bias, int threads) {
  const int64_t P = (O + LANES - 1) / LANES, groups = (P + NP - 1) / NP;
  const int64_t blocks = (M + ROW_BLOCK - 1) / ROW_BLOCK;
  q_init();
  /* kinds 6-9: the inputs rounded to bf16 once (a copy), and their pair layout where q_span reads it
   * (qb_reads_pairs) */
  float* xr = NULL;
  uint32_t* xb = NULL;
  float* bsum = NULL;
  if (QB_KIND(kind)) {
    xr = (float*)scratch_get(3, sizeof(float) * (size_t)(M * I + 1));
    memcpy(xr, x, sizeof(float) * (size_t)(M * I));
    qb_round_rows(xr, I, 0, M);
    x = xr;
    if (!QB_TILES) kind = qb_weight_kind(kind);
  }
  if (QB_KIND(kind) && qb_reads_pairs(kind, M)) {
    xb = (uint32_t*)scratch_get(4, sizeof(uint32_t) * (size_t)(M * qb_pairs(I, gs) + 1));
    bsum = (float*)scratch_get(5, sizeof(float) * (size_t)(M * ((I + gs - 1) / gs) + 1));
  }
  if (M == 1) { /* decode: spans of NQ1 panels, the one-row kernels */
    const int64_t spans = (P + NQ1 - 1) / NQ1;
    int8_t* xq = NULL;
    float *sx = NULL, *xsum = bsum;
    if (kind == Q_KIND_A8 || kind == Q_KIND_A4) {
      const int64_t G = (I + gs - 1) / gs;
      xq = (int8_t*)malloc((size_t)A_STRIDE(kind, I) + 1);
      sx = (float*)malloc(sizeof(float) * (size_t)(2 * G));
      xsum = kind == Q_KIND_A4 ? sx + G : NULL;
      q_act_rows(x, I, gs, A_STRIDE(kind, I), xq, sx, xsum, 0, 1);
    }
    if (xb) qb_layout(x, I, gs, 0, 1, xb, bsum); /* kinds 6 / 9's one row (qb_row1) */
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t s = 0; s < spans; s++)
      q_span(kind, x, xq, sx, xsum, xb, I, qp, sp, mp, gs, y, O, s * NQ1, 0, 1, bias);
    free(xq); free(sx);
    scratch_put(3, xr), scratch_put(4, xb), scratch_put(5, bsum);
    return;
  }
  if (kind == Q_KIND_A8 || kind == Q_KIND_A4) {
    const int64_t G = (I + gs - 1) / gs, stride = A_STRIDE(kind, I);
    int8_t* xq = (int8_t*)malloc((size_t)(M * stride + 1));
    float* sx = (float*)malloc(sizeof(float) * (size_t)(M * G + 1));
    float* xsum = kind == Q_KIND_A4 ? (float*)malloc(sizeof(float) * (size_t)(M * G + 1)) : NULL;
    _Pragma("omp parallel num_threads(threads)") {
      _Pragma("omp for schedule(static)") for (int64_t r = 0; r < M; r++)
        q_act_rows(x, I, gs, stride, xq, sx, xsum, r, r + 1);
      _Pragma("omp for schedule(static)") for (int64_t item = 0; item < blocks * groups; item++) {
        const int64_t r0 = item / groups * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
        qrows_a8(kind, xq, sx, xsum, I, qp, sp, mp, gs, y, O, item % groups, r0, r1, bias);
      }
    }
    free(xq); free(sx); free(xsum);
    return;
  }
  /* weight-only: items (block of rows, span of NQ1 panels); q_span picks the wide tiles or the panel
   * buffer by the block's rows, the wide tiles' blocks interleaved first (kinds 6-9: the pair layout) */
  const int64_t spans = (P + NQ1 - 1) / NQ1;
  float* xt = xb ? NULL : (float*)scratch_get(6, sizeof(float) * (size_t)(M * I));
  const float* xs = xb ? x : xt;
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t b = 0; b < blocks; b++) {
      const int64_t r0 = b * ROW_BLOCK, r1 = (b + 1) * ROW_BLOCK < M ? (b + 1) * ROW_BLOCK : M;
      if (xb)
        qb_layout(x, I, gs, r0, r1, xb, bsum);
      else
        qw_layout(x, I, r0, r1, xt);
    }
    _Pragma("omp for schedule(static)") for (int64_t item = 0; item < blocks * spans; item++) {
      const int64_t r0 = item / spans * ROW_BLOCK, r1 = r0 + ROW_BLOCK < M ? r0 + ROW_BLOCK : M;
      q_span(kind, xs, NULL, NULL, bsum, xb, I, qp, sp, mp, gs, y, O, item % spans * NQ1, r0, r1, bias);
    }
  }
  scratch_put(6, xt);
  scratch_put(3, xr), scratch_put(4, xb), scratch_put(5, bsum);
}

/* qb_many_gated on (1, the default) or off: the tests compare the two paths, benchmarks time them. */
static int q_gated_fusion = 1;
void q_set_gated_fusion(int on) { q_gated_fusion = on != 0; }

/* moe_f32's plan over quantized experts: w13 = codes/scales/offsets of E experts' [gate | up]
 * ([2I, H] each, w13_group inputs a group), w2 of their down projections ([H, I], w2_group).
 * Optional float32 biases b13 [E, 2I] and b2 [E, H] (NULL: none) join the products before the
 * activation and before the routing weight, as FusedExperts._expert adds them; act 3 (act_row)
 * takes limit and alpha. */
void moe_q_ex(int kind, const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
              const uint8_t* w13_codes, const float* w13_scales, const float* w13_offsets, int64_t w13_group,
              const uint8_t* w2_codes, const float* w2_scales, const float* w2_offsets, int64_t w2_group,
              int64_t E, int64_t I, int act, float limit, float alpha, const float* b13, const float* b2,
              float* out, int threads) {
  const int a8 = kind == Q_KIND_A8 || kind == Q_KIND_A4; /* activations quantized too */
  /* kinds 6-9: the gathered rows and the activated intermediates rounded to bf16 in place (kinds 1, 0, 3, 2 on
   * them where the pair tiles are not built) */
  const int bp = QB_KIND(kind);
  if (bp && !QB_TILES) kind = qb_weight_kind(kind);
  q_init();
  moe_plan p = moe_sort(slot, n, k, E);
  const int64_t m = p.m;
  /* work items: (active expert, span of NQ1 panels); a span of an expert with one row (decode) goes
   * to the one-row kernels */
  const int64_t w13_panels = (2 * I + LANES - 1) / LANES, w13_spans = (w13_panels + NQ1 - 1) / NQ1;
  const int64_t w2_panels = (H + LANES - 1) / LANES, w2_spans = (w2_panels + NQ1 - 1) / NQ1;
  /* groups per row */
  const int64_t w13_groups = (H + w13_group - 1) / w13_group, w2_groups = (I + w2_group - 1) / w2_group;
  /* bytes of codes per (expert, panel): I * bytes a code for weight-only kinds; W8A8 4 * ceil(I / 4) a
   * lane, W4A8 4 * ceil(I / 8) a lane (two nibbles a byte) */
  const int64_t xs_a = A_STRIDE(kind, H), as_a = A_STRIDE(kind, I);
  const int64_t w13_panel_bytes =
      !a8 ? H * Q_BYTES(qb_weight_kind(kind)) : (kind == Q_KIND_A4 ? xs_a / 2 : xs_a) * LANES;
  const int64_t w2_panel_bytes =
      !a8 ? I * Q_BYTES(qb_weight_kind(kind)) : (kind == Q_KIND_A4 ? as_a / 2 : as_a) * LANES;
  /* one scratch a call for every buffer (was ten allocations; kept between calls: common.h): float32 rows
   * and scales first, then the int8 codes of the quantized activations (kinds 4, 5) */
  /* weight-only: also the gathered rows and the intermediates in the layout q_span reads (qw_layout) */
  const int64_t nf = m * (2 * H + 3 * I) + (a8 ? 2 * m * (w13_groups + w2_groups) : m * (H + I)) + 8;
  float* buf = (float*)scratch_get(0, sizeof(float) * (size_t)nf + (a8 ? (size_t)(m * (xs_a + as_a)) : 0) + 16);
  float *xs = buf, *h = xs + m * H, *a = h + m * 2 * I, *ys = a + m * I, *f = ys + m * H;
  /* quantized activations: the gathered rows and the activated intermediates quantized once, read by
   * every panel group */
  float *xsc = NULL, *asc = NULL, *xsum = NULL, *asum = NULL;
  int8_t *xq = NULL, *aq = NULL;
  if (a8) {
    xsc = f, asc = xsc + m * w13_groups, xsum = asc + m * w2_groups, asum = xsum + m * w13_groups;
    xq = (int8_t*)(buf + nf), aq = xq + m * xs_a;
  }
  if (kind != Q_KIND_A4) xsum = asum = NULL;
  float *xw = xs, *aw = a; /* what the w13 / w2 products read */
  if (!a8) xw = f, aw = xw + m * H;
  /* kinds 6-9 on pairs: the rows as they are (one-row kernels) and their qb_layout form */
  uint32_t *x_pairs = NULL, *a_pairs = NULL;
  float *x_pair_sums = NULL, *a_pair_sums = NULL;
  if (QB_KIND(kind)) {
    const int64_t x_pair_words = qb_pairs(H, w13_group), a_pair_words = qb_pairs(I, w2_group);
    x_pairs = (uint32_t*)scratch_get(1, sizeof(uint32_t) * (size_t)(m * (x_pair_words + a_pair_words) + 1));
    a_pairs = x_pairs + m * x_pair_words;
    x_pair_sums = (float*)scratch_get(2, sizeof(float) * (size_t)(m * (w13_groups + w2_groups) + 1));
    a_pair_sums = x_pair_sums + m * w13_groups;
    xw = xs, aw = a, xsum = x_pair_sums, asum = a_pair_sums;
  }
  /* fp8 on pairs, gate and up in whole panels: an expert with QB_MANY rows or more runs its w13 and
   * the activation in qb_many_gated (rf: its rows, which the activation pass below then skips) */
  unsigned char* rf = NULL;
#if QB_TILES
  if (q_gated_fusion && kind == Q_KIND_BF8 && I % LANES == 0) {
    rf = (unsigned char*)calloc((size_t)m + 1, 1);
    for (int64_t j = 0; j < p.na; j++) {
      const int64_t e = p.active[j];
      if (p.start[e + 1] - p.start[e] >= QB_MANY) memset(rf + p.start[e], 1, (size_t)(p.start[e + 1] - p.start[e]));
    }
  }
#endif
  _Pragma("omp parallel num_threads(threads)") {
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      memcpy(xs + r * H, x + (p.pair_of_row[r] / k) * H, sizeof(float) * (size_t)H);
      if (bp) qb_round_rows(xs, H, r, r + 1);
      if (a8) q_act_rows(xs, H, w13_group, xs_a, xq, xsc, xsum, r, r + 1);
    }
    if (!a8) {
      _Pragma("omp for schedule(static)") for (int64_t j = 0; j < p.na; j++) {
        const int64_t e = p.active[j];
        if (x_pairs) {
          if (qb_reads_pairs(kind, p.start[e + 1] - p.start[e]))
            qb_layout(xs, H, w13_group, p.start[e], p.start[e + 1], x_pairs, x_pair_sums);
        } else
          qw_layout(xs, H, p.start[e], p.start[e + 1], xw);
      }
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * w13_spans; item++) {
      const int64_t e = p.active[item / w13_spans];
#if QB_TILES
      if (rf && rf[p.start[e]]) { /* item s: gate panels [s * NQ1 / 2, ...) and their up panels */
        const int64_t PG = I / LANES, q0 = item % w13_spans * (NQ1 / 2);
        const int64_t q1 = q0 + NQ1 / 2 < PG ? q0 + NQ1 / 2 : PG;
        if (q0 < q1)
          qb_many_gated(x_pairs, x_pair_sums, H, w13_codes + e * w13_panels * w13_panel_bytes,
                        w13_scales + e * w13_panels * w13_groups * LANES,
                        w13_offsets + e * w13_panels * w13_groups * LANES, w13_group, I, q0, q1, p.start[e],
                        p.start[e + 1], b13 ? b13 + e * 2 * I : NULL, act, limit, alpha, a);
        continue;
      }
#endif
      q_span(kind, xw, xq, xsc, xsum, x_pairs, H, w13_codes + e * w13_panels * w13_panel_bytes,
             w13_scales + e * w13_panels * w13_groups * LANES, w13_offsets + e * w13_panels * w13_groups * LANES,
             w13_group, h, 2 * I, item % w13_spans * NQ1, p.start[e], p.start[e + 1],
             b13 ? b13 + e * 2 * I : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t r = 0; r < m; r++) {
      if (rf && rf[r]) continue; /* done by qb_many_gated */
      act_row(h + r * 2 * I, a + r * I, I, act, limit, alpha);
      if (bp) qb_round_rows(a, I, r, r + 1);
      if (a8) q_act_rows(a, I, w2_group, as_a, aq, asc, asum, r, r + 1);
    }
    if (!a8) {
      _Pragma("omp for schedule(static)") for (int64_t j = 0; j < p.na; j++) {
        const int64_t e = p.active[j];
        if (a_pairs) {
          if (qb_reads_pairs(kind, p.start[e + 1] - p.start[e]))
            qb_layout(a, I, w2_group, p.start[e], p.start[e + 1], a_pairs, a_pair_sums);
        } else
          qw_layout(a, I, p.start[e], p.start[e + 1], aw);
      }
    }
    _Pragma("omp for schedule(dynamic, 1)") for (int64_t item = 0; item < p.na * w2_spans; item++) {
      const int64_t e = p.active[item / w2_spans];
      q_span(kind, aw, aq, asc, asum, a_pairs, I, w2_codes + e * w2_panels * w2_panel_bytes,
             w2_scales + e * w2_panels * w2_groups * LANES, w2_offsets + e * w2_panels * w2_groups * LANES,
             w2_group, ys, H, item % w2_spans * NQ1, p.start[e], p.start[e + 1], b2 ? b2 + e * H : NULL);
    }
    _Pragma("omp for schedule(static)") for (int64_t t = 0; t < n; t++)
      moe_combine_row(&p, ys, w, t, k, H, out + t * H);
  }
  scratch_put(0, buf);
  scratch_put(1, x_pairs), scratch_put(2, x_pair_sums);
  free(rf);
  moe_free(&p);
}

/* moe_q_ex without biases, for the gated activations 0-2. */
void moe_q(int kind, const float* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
           const uint8_t* w13_codes, const float* w13_scales, const float* w13_offsets, int64_t w13_group,
           const uint8_t* w2_codes, const float* w2_scales, const float* w2_offsets, int64_t w2_group,
           int64_t E, int64_t I, int act, float* out, int threads) {
  moe_q_ex(kind, x, n, H, slot, w, k, w13_codes, w13_scales, w13_offsets, w13_group, w2_codes, w2_scales,
           w2_offsets, w2_group, E, I, act, 0.f, 0.f, NULL, NULL, out, threads);
}

/* How many code kinds gemm_q / moe_q know (cpu/cpu_kernels.py QUANT_KINDS). */
int64_t q_kinds(void) { return Q_KINDS; }

