/* Part of cpu_kernels.c (one translation unit; see its list): decode steps: whole decoder layers in one call. */

/* ---- decode steps: whole decoder layers in one call (cpu/native_decode.py) ---------------
 * For a decode-only step (B tokens, one per sequence), each layer of a run of eligible layers:
 *
 *   h = rms_norm(x); qkv = h @ Wqkv (+ b); per-head q/k RMSNorm (optional); rotary + KV store;
 *   paged decode attention; o = attn @ Wo (+ b); x = x + m * o
 *   h = rms_norm(x); logits = h @ Wr (+ b); softmax, top-k, renormalise (optional);
 *   y = routed experts (float32), rounded to T; x = x + m * y
 *
 * by the same kernels the per-op path calls, in the same order and with the same roundings, so
 * the result equals that path's (the router's softmax is float32 like torch's, within an ulp).
 * Weights are the layer's packed panels, or quantized ones through the gemm_q / moe_q shims below
 * (q_weight_desc, q_experts_desc); the descriptor (pointers and sizes) is built once by
 * Python, the step's metadata (rotary tables, slots, block tables) once per step for all layers.
 *
 * Top-k's order among equal scores is torch.topk's business, not ours: when two of a token's
 * k + 1 best scores are within a relative 1e-6 (a tie or a near-tie), the call stops before that
 * layer's routed experts and returns the layer's index, with x holding the attention's residual
 * and h_out the normed input of the MoE block; the caller routes the batch with torch (its router
 * and topk) and calls again from that layer with the routing (route_slot [B, k] local experts,
 * route_w [B, k] weights), which resumes at the experts. Returns n_layers when every layer ran.
 *
 * Every field is 8 bytes (int64, double or a pointer), so the ctypes mirror has no padding. */
typedef void (*gemm_fn_t)(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                          const float* bias, int threads);

/* Routed experts of a MoE block: x [n, H] model dtype -> out [n, H] float32 (as moe_f32 / moe_bf16). */
typedef void (*experts_fn_t)(const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w,
                             int64_t k, const void* ew, int64_t E, int64_t I, int act, float* out,
                             int threads);

/* Quantized weights in a descriptor's GEMM slot (gemm_fn_t): wp points to one of these (built once by
 * packed.py's QuantizedWeight.native_form). The shims do what QuantizedWeight.__call__ does: the
 * input widened to float32 (exact), gemm_q, the float32 product rounded to the model dtype once. */
typedef struct {
  int64_t kind;
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t group;
} q_weight_desc;

void gemm_q_desc_f32(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                     const float* bias, int threads) {
  const q_weight_desc* q = (const q_weight_desc*)wp;
  gemm_q((int)q->kind, (const float*)x, q->codes, q->scales, q->offsets, q->group, (float*)y, M, O, I, bias,
         threads);
}

/* A bf16 input widened to float32 (exact), for the shims below; the caller frees it. */
static float* widened_bf16(const void* x, int64_t n) {
  float* xf = (float*)malloc(sizeof(float) * (size_t)(n + 1));
  for (int64_t i = 0; i < n; i++) xf[i] = bf16_to_f32(((const bf16_t*)x)[i]);
  return xf;
}

/* The product left in float32 (an LM head's logits): only the input is widened. */
void gemm_q_desc_bf16_f32(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                          const float* bias, int threads) {
  float* xf = widened_bf16(x, M * I);
  gemm_q_desc_f32(xf, wp, y, M, O, I, bias, threads);
  free(xf);
}

/* ... and rounded to bf16 once, as QuantizedWeight.__call__ does for a bf16 model. */
void gemm_q_desc_bf16(const void* x, const void* wp, void* y, int64_t M, int64_t O, int64_t I,
                      const float* bias, int threads) {
  float* yf = (float*)malloc(sizeof(float) * (size_t)(M * O + 1));
  gemm_q_desc_bf16_f32(x, wp, yf, M, O, I, bias, threads);
  for (int64_t i = 0; i < M * O; i++) ((bf16_t*)y)[i] = f32_to_bf16(yf[i]);
  free(yf);
}

/* QuantizedExperts' w13 and w2 (packed.py) for moe_q_ex, in a descriptor's experts slot, with the
 * experts' biases and the clamped activations' limit and alpha (QuantizedMoE's). */
typedef struct {
  int64_t kind;
  const uint8_t* w13_codes;
  const float* w13_scales;
  const float* w13_offsets;
  int64_t w13_group;
  const uint8_t* w2_codes;
  const float* w2_scales;
  const float* w2_offsets;
  int64_t w2_group;
  double limit, alpha;   /* moe_q_ex's for the clamped activations (3, 4); else unused */
  const float* b13;      /* float32 biases [E, 2I] and [E, H], or NULL */
  const float* b2;
} q_experts_desc;

void moe_q_desc_f32(const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                    const void* ew, int64_t E, int64_t I, int act, float* out, int threads) {
  const q_experts_desc* q = (const q_experts_desc*)ew;
  moe_q_ex((int)q->kind, (const float*)x, n, H, slot, w, k, q->w13_codes, q->w13_scales, q->w13_offsets,
           q->w13_group, q->w2_codes, q->w2_scales, q->w2_offsets, q->w2_group, E, I, act, (float)q->limit,
           (float)q->alpha, q->b13, q->b2, out, threads);
}

void moe_q_desc_bf16(const void* x, int64_t n, int64_t H, const int32_t* slot, const float* w, int64_t k,
                     const void* ew, int64_t E, int64_t I, int act, float* out, int threads) {
  float* xf = widened_bf16(x, n * H);
  moe_q_desc_f32(xf, n, H, slot, w, k, ew, E, I, act, out, threads);
  free(xf);
}

typedef struct {
  int64_t hidden;
  double eps, residual_multiplier;
  const void* input_norm;
  gemm_fn_t qkv_fn;
  const void* qkv_w;
  const float* qkv_bias;
  int64_t heads, kv_heads, head_dim;
  const void* q_norm; /* per-head RMSNorm(head_dim) weights, or NULL */
  const void* k_norm;
  double qk_eps;
  int64_t use_rope; /* 0: keys and queries as projected (a layer without RoPE) */
  void* k_cache;
  void* v_cache;
  int64_t block_size;
  double scale;
  int64_t window, chunk;
  const float* sinks;
  gemm_fn_t o_fn;
  const void* o_w;
  const float* o_bias;
  const void* post_norm;
  gemm_fn_t router_fn;
  const void* router_w;
  const float* router_bias;
  int64_t experts, top_k, renormalize; /* 2: softmax over the top k's logits (route_topk_softmax) */
  const void* w13;
  const void* w2;
  int64_t inter, act;
  int64_t* load; /* [E] (token, expert) pairs routed to each expert (engine/expert_load.py), or NULL */
  experts_fn_t experts_fn; /* routed experts held otherwise (quantized: moe_q_desc_*), or NULL: moe_* */
  const void* experts_w;   /* experts_fn's weights (a q_experts_desc) */
} decode_layer_desc;

typedef struct {
  int64_t tokens;
  const void* cos; /* [B, R] model dtype */
  const void* sin;
  int64_t rotary, interleaved; /* R rotated dims, GPT-J pairs instead of NeoX halves */
  const int64_t* slots;
  const int32_t* block_tables; /* [B, W] */
  const int32_t* context_lens;
  int64_t width;
  int64_t count_load; /* 0 for a forward whose tokens are not counted in the expert load */
  const int64_t* positions; /* [B] or NULL; set: cos / sin are whole tables [rows, R], row = position */
} decode_step_meta;

/* The step's rotary rows when the metadata holds whole tables (positions set): gathered once per
 * call into `rows` ([2, B, R] of elem bytes) and `local` pointed at them; else `local` is *m. */
static const decode_step_meta* rotary_rows(const decode_step_meta* m, decode_step_meta* local, void** rows,
                                           size_t elem) {
  *local = *m;
  *rows = NULL;
  if (!m->positions || !m->rotary) return m;
  const int64_t B = m->tokens, R = m->rotary;
  char* buf = (char*)malloc(elem * (size_t)(2 * B * R) + 1);
  for (int64_t t = 0; t < B; t++) {
    memcpy(buf + elem * (size_t)(t * R), (const char*)m->cos + elem * (size_t)(m->positions[t] * R), elem * R);
    memcpy(buf + elem * (size_t)((B + t) * R), (const char*)m->sin + elem * (size_t)(m->positions[t] * R),
           elem * R);
  }
  local->cos = buf;
  local->sin = buf + elem * (size_t)(B * R);
  local->positions = NULL;
  *rows = buf;
  return local;
}

/* rule 2 (GPT-OSS's topk_softmax): the top k + 1 of the logits, and the softmax over the k picked
 * ones (the max is the first pick); 0 on a (near) tie, as below. */
static int route_topk_softmax(const float* logits, int64_t E, int64_t k, float* probs, float* w, int32_t* slot) {
  float prev = 0.f, sum = 0.f;
  const int64_t want = k < E ? k + 1 : k;
  memcpy(probs, logits, sizeof(float) * (size_t)E);
  unsigned char* taken = (unsigned char*)calloc((size_t)E, 1);
  for (int64_t j = 0; j < want; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++)
      if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
    const float v = probs[best];
    if (j > 0 && prev - v <= 1e-6f * fabsf(prev)) {
      free(taken);
      return 0;
    }
    prev = v;
    taken[best] = 1;
    if (j < k) {
      w[j] = v;
      slot[j] = (int32_t)best;
    }
  }
  free(taken);
  const float mx = w[0];
  for (int64_t j = 0; j < k; j++) {
    w[j] = expf(w[j] - mx);
    sum += w[j];
  }
  for (int64_t j = 0; j < k; j++) w[j] /= sum;
  return 1;
}

/* Softmax over one token's E logits (float32), its top k into w / slot (renormalize 2: the
 * topk_softmax rule above). 0 if two of the k + 1 best are (nearly) equal: the caller then routes
 * this layer with torch.topk. */
static int route_softmax_topk(const float* logits, int64_t E, int64_t k, int renormalize, float* probs,
                              float* w, int32_t* slot) {
  if (renormalize == 2) return route_topk_softmax(logits, E, k, probs, w, slot);
  float mx = -INFINITY, sum = 0.f;
  for (int64_t e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
  for (int64_t e = 0; e < E; e++) {
    probs[e] = expf(logits[e] - mx);
    sum += probs[e];
  }
  for (int64_t e = 0; e < E; e++) probs[e] /= sum;
  float prev = 0.f;
  const int64_t want = k < E ? k + 1 : k;
  for (int64_t j = 0; j < want; j++) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; e++)
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    const float v = probs[best];
    if (j > 0 && prev - v <= 1e-6f * prev) return 0;
    prev = v;
    if (j < k) {
      w[j] = v;
      slot[j] = (int32_t)best;
    }
    probs[best] = -1.f; /* taken */
  }
  if (renormalize) {
    float s = 0.f;
    for (int64_t j = 0; j < k; j++) s += w[j];
    for (int64_t j = 0; j < k; j++) w[j] /= s;
  }
  return 1;
}

/* A whole model on one rank (no TP, one pipeline stage), every layer native: decode_model_*. */
typedef struct {
  int64_t hidden;
  const void* embed; /* [embed_rows, hidden] model dtype */
  int64_t embed_rows;
  double embed_multiplier;
  const decode_layer_desc* layers;
  int64_t n_layers;
  const void* norm; /* the final RMSNorm's weight */
  double norm_eps;
  gemm_fn_t head_fn; /* float32 output (the logits are not rounded to the model dtype) */
  const void* head_w;
  const float* head_bias;
  int64_t vocab;
} decode_model_desc;

#define DEFINE_DECODE_LAYERS(SUFFIX, T, LOAD, STORE)                                             \
  static void residual_##SUFFIX(T* x, const T* y, int64_t n, float m) {                          \
    if (m == 1.f)                                                                                \
      for (int64_t i = 0; i < n; i++) x[i] = STORE(LOAD(x[i]) + LOAD(y[i]));                     \
    else                                                                                         \
      for (int64_t i = 0; i < n; i++) x[i] = STORE(LOAD(x[i]) + LOAD(STORE(LOAD(y[i]) * m)));    \
  }                                                                                              \
  static void attention_block_##SUFFIX(const decode_layer_desc* d, const decode_step_meta* m,    \
                                       T* x, T* scratch, int threads) {                          \
    const int64_t B = m->tokens, Hd = d->hidden, H = d->heads, Hk = d->kv_heads, D = d->head_dim; \
    const int64_t C = (H + 2 * Hk) * D;                                                          \
    T *h = scratch, *qkv = h + B * Hd, *q = qkv + B * C, *k = q + B * H * D, *v = k + B * Hk * D; \
    T *att = v + B * Hk * D, *o = att + B * H * D;                                               \
    rms_norm_##SUFFIX(x, (const T*)d->input_norm, h, B, Hd, (float)d->eps, threads);             \
    d->qkv_fn(h, d->qkv_w, qkv, B, C, Hd, d->qkv_bias, threads);                                 \
    if (d->q_norm)                                                                               \
      for (int64_t t = 0; t < B; t++) {                                                          \
        rms_norm_##SUFFIX(qkv + t * C, (const T*)d->q_norm, qkv + t * C, H, D, (float)d->qk_eps, 1); \
        rms_norm_##SUFFIX(qkv + t * C + H * D, (const T*)d->k_norm, qkv + t * C + H * D, Hk, D,  \
                          (float)d->qk_eps, 1);                                                  \
      }                                                                                          \
    rope_cache_##SUFFIX(qkv, C, qkv + H * D, C, qkv + (H + Hk) * D, C, (const T*)m->cos,        \
                        (const T*)m->sin, m->slots, (T*)d->k_cache, (T*)d->v_cache, q, k, v, B, H, \
                        Hk, D, d->use_rope ? m->rotary : 0, (int)m->interleaved, threads);                         \
    paged_decode_##SUFFIX(q, (const T*)d->k_cache, (const T*)d->v_cache, m->block_tables,       \
                          m->context_lens, att, B, H, Hk, D, D, m->width, d->block_size,         \
                          (float)d->scale, d->window, d->chunk, d->sinks, threads);              \
    d->o_fn(att, d->o_w, o, B, Hd, H * D, d->o_bias, threads);                                   \
    residual_##SUFFIX(x, o, B * Hd, (float)d->residual_multiplier);                              \
  }                                                                                              \
  /* The block's normed input into h_out and its routing into slot / w [B, k]; 0 if a token's  \
   * routing needs torch.topk (see above). */                                                    \
  static int moe_route_##SUFFIX(const decode_layer_desc* d, const decode_step_meta* m, const T* x, \
                                T* h_out, T* scratch, int32_t* slot, float* w, int threads) {   \
    const int64_t B = m->tokens, Hd = d->hidden, E = d->experts, K = d->top_k;                   \
    T* logits = scratch;                                                                         \
    float* f = (float*)malloc(sizeof(float) * (size_t)(B * E + E));                             \
    float *lg = f, *probs = lg + B * E;                                                          \
    int ok = 1;                                                                                  \
    rms_norm_##SUFFIX(x, (const T*)d->post_norm, h_out, B, Hd, (float)d->eps, threads);          \
    d->router_fn(h_out, d->router_w, logits, B, E, Hd, d->router_bias, threads);                 \
    for (int64_t i = 0; i < B * E; i++) lg[i] = LOAD(logits[i]);                                 \
    for (int64_t t = 0; t < B && ok; t++)                                                        \
      ok = route_softmax_topk(lg + t * E, E, K, (int)d->renormalize, probs, w + t * K, slot + t * K); \
    free(f);                                                                                     \
    return ok;                                                                                   \
  }                                                                                              \
  /* The routed experts of h_out (routed by slot / w) added to x; the expert load counted. */     \
  static void moe_experts_##SUFFIX(const decode_layer_desc* d, const decode_step_meta* m, T* x,  \
                                   const T* h_out, T* scratch, const int32_t* slot, const float* w, \
                                   int threads) {                                                \
    const int64_t B = m->tokens, Hd = d->hidden, E = d->experts, K = d->top_k;                   \
    T* y = scratch + B * E;                                                                      \
    float* out = (float*)malloc(sizeof(float) * (size_t)(B * Hd + 1));                          \
    if (m->count_load && d->load)                                                                \
      for (int64_t q = 0; q < B * K; q++) d->load[slot[q]]++;                                    \
    if (d->experts_fn)                                                                           \
      d->experts_fn(h_out, B, Hd, slot, w, K, d->experts_w, E, d->inter, (int)d->act, out, threads); \
    else                                                                                         \
      moe_##SUFFIX(h_out, B, Hd, slot, w, K, d->w13, d->w2, E, d->inter, (int)d->act, out, threads); \
    for (int64_t i = 0; i < B * Hd; i++) y[i] = STORE(out[i]);                                   \
    residual_##SUFFIX(x, y, B * Hd, (float)d->residual_multiplier);                              \
    free(out);                                                                                   \
  }                                                                                              \
  /* route_slot / route_w non-NULL: layers[0] resumes at its routed experts with that routing. */ \
  int64_t decode_layers_##SUFFIX(const decode_layer_desc* layers, int64_t n, const decode_step_meta* m, \
                                 T* x, T* h_out, const int32_t* route_slot, const float* route_w, \
                                 int threads) {                                                  \
    int64_t most = 0, most_k = 1;                                                                \
    for (int64_t i = 0; i < n; i++) {                                                            \
      const decode_layer_desc* d = layers + i;                                                   \
      const int64_t a = 2 * d->hidden + (3 * d->heads + 4 * d->kv_heads) * d->head_dim;          \
      const int64_t b = d->experts + d->hidden;                                                  \
      most = a > most ? a : most;                                                                \
      most = b > most ? b : most;                                                                \
      most_k = d->top_k > most_k ? d->top_k : most_k;                                            \
    }                                                                                            \
    T* scratch = (T*)malloc(sizeof(T) * (size_t)(m->tokens * most + 1));                         \
    int32_t* slot = (int32_t*)malloc(sizeof(int32_t) * (size_t)(m->tokens * most_k));            \
    float* w = (float*)malloc(sizeof(float) * (size_t)(m->tokens * most_k));                     \
    decode_step_meta local;                                                                      \
    void* rows;                                                                                  \
    m = rotary_rows(m, &local, &rows, sizeof(T));                                                \
    int64_t i = 0;                                                                               \
    if (route_slot && n > 0) {                                                                   \
      moe_experts_##SUFFIX(layers, m, x, h_out, scratch, route_slot, route_w, threads);          \
      i = 1;                                                                                     \
    }                                                                                            \
    for (; i < n; i++) {                                                                         \
      attention_block_##SUFFIX(layers + i, m, x, scratch, threads);                              \
      if (!moe_route_##SUFFIX(layers + i, m, x, h_out, scratch, slot, w, threads)) break;        \
      moe_experts_##SUFFIX(layers + i, m, x, h_out, scratch, slot, w, threads);                  \
    }                                                                                            \
    free(scratch);                                                                               \
    free(slot);                                                                                  \
    free(w);                                                                                     \
    free(rows);                                                                                  \
    return i;                                                                                    \
  }                                                                                              \
  /* A whole decode step (decode_model_desc): from start == 0 the embedding, then the layers from \
   * `start` (resuming at its experts with route_slot / route_w, as decode_layers); when they   \
   * all ran, the final norm and the LM head: logits [B, vocab] float32. Returns n_layers when  \
   * done, the index of a layer whose routing needs torch (as decode_layers), or -1 - t when    \
   * token t's id is outside the embedding. */                                                  \
  int64_t decode_model_##SUFFIX(const decode_model_desc* md, int64_t start, const decode_step_meta* m, \
                                const int64_t* ids, T* x, T* h_out, const int32_t* route_slot,   \
                                const float* route_w, float* logits, int threads) {              \
    const int64_t B = m->tokens, Hd = md->hidden, n = md->n_layers;                              \
    if (start == 0 && !route_slot) {                                                             \
      const float mul = (float)md->embed_multiplier;                                             \
      for (int64_t t = 0; t < B; t++) {                                                          \
        if (ids[t] < 0 || ids[t] >= md->embed_rows) return -1 - t;                               \
        memcpy(x + t * Hd, (const T*)md->embed + ids[t] * Hd, sizeof(T) * (size_t)Hd);           \
        if (mul != 1.f)                                                                          \
          for (int64_t i = 0; i < Hd; i++) x[t * Hd + i] = STORE(LOAD(x[t * Hd + i]) * mul);      \
      }                                                                                          \
    }                                                                                            \
    const int64_t done =                                                                         \
        start + decode_layers_##SUFFIX(md->layers + start, n - start, m, x, h_out, route_slot, route_w, threads); \
    if (done < n) return done;                                                                   \
    rms_norm_##SUFFIX(x, (const T*)md->norm, h_out, B, Hd, (float)md->norm_eps, threads);        \
    md->head_fn(h_out, md->head_w, logits, B, md->vocab, Hd, md->head_bias, threads);            \
    return n;                                                                                    \
  }

DEFINE_DECODE_LAYERS(f32, float, f32_id, f32_id)
DEFINE_DECODE_LAYERS(bf16, bf16_t, bf16_to_f32, f32_to_bf16)

