/* Shared by every part of cpu_kernels.c: includes, bf16 conversions, a vectorisable exp. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_kinds.h"

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
  union { uint32_t u; float f; } v;
  v.u = (uint32_t)x << 16;
  return v.f;
}

static inline bf16_t f32_to_bf16(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u); /* NaN stays NaN */
  uint32_t rounding = 0x7fffu + ((v.u >> 16) & 1u); /* round to nearest even, as torch does */
  return (bf16_t)((v.u + rounding) >> 16);
}

/* f32_to_bf16's rounding, bit for bit, with the NaN case a select instead of a branch: loops over
 * it vectorise (8 lanes on AVX2, widening and narrowing in registers). */
static inline bf16_t f32_to_bf16_vec(float f) {
  union { uint32_t u; float f; } v;
  v.f = f;
  const uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (v.u >> 16) | 0x40u;
  return (bf16_t)((v.u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

static inline float f32_id(float x) { return x; }

/* exp(r) for |r| <= ln2 / 2 by its degree-6 Taylor polynomial (Horner, from 1/720), for a float or
 * any vector of floats: exp_vec below and the prefill attention's pf_exp share it. */
#define EXP_POLY(r) \
  ((((((1.f / 720.f * (r) + 1.f / 120.f) * (r) + 1.f / 24.f) * (r) + 1.f / 6.f) * (r) + 0.5f) * (r) + 1.f) * (r) + 1.f)

/* exp(v) for float32, written so the compiler vectorises it (libm's expf is a scalar call):
 * v = n ln2 + r with |r| <= ln2/2, exp(r) by its degree-6 Taylor polynomial (relative error
 * about 2e-7, within a float's rounding of expf), times 2^n built in the exponent bits. */
static inline float exp_vec(float v) {
  v = v < -87.3f ? -87.3f : (v > 88.7f ? 88.7f : v);
  /* nearest integer by the 1.5 * 2^23 trick: roundf is a libm call unless vectorised (callgrind:
   * 0.3 M instructions a batch-1 step in silu alone), this is two additions in any vector width */
  const float n = (v * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (v - n * 0.693145751953125f) - n * 1.42860682030941723e-6f; /* ln2 split in two */
  const float p = EXP_POLY(r);
  union { uint32_t u; float f; } scale;
  scale.u = (uint32_t)((int32_t)n + 127) << 23;
  return p * scale.f;
}

/* Scratch buffers kept between calls, per calling thread, one per slot: a prefill's buffers run to tens
 * of MB a call (moe_q_ex's rows x (3H + 4I) floats: 92 MB for the small MoE's 4,096 routed rows), past
 * glibc's largest mmap threshold (32 MB), so malloc mapped fresh pages every call and the kernel
 * zeroed them (2 MB huge pages here; ~10% of a held-fp8 prefill in clear_page). Up to SCRATCH_KEEP
 * bytes a slot stay with the thread (grown by a quarter at a time); a larger request is malloc'd
 * and freed per call as before. scratch_get's memory is uninitialised; scratch_put after use (NULL:
 * nothing to give back). */
#define SCRATCH_SLOTS 8
#define SCRATCH_KEEP ((size_t)256 << 20)
static _Thread_local void* scratch_ptr[SCRATCH_SLOTS];
static _Thread_local size_t scratch_size[SCRATCH_SLOTS];
static void* scratch_get(int slot, size_t bytes) {
  if (bytes > SCRATCH_KEEP) return malloc(bytes);
  if (scratch_size[slot] < bytes) {
    size_t grow = bytes + bytes / 4;
    if (grow > SCRATCH_KEEP) grow = SCRATCH_KEEP;
    free(scratch_ptr[slot]);
    scratch_ptr[slot] = malloc(grow);
    scratch_size[slot] = scratch_ptr[slot] ? grow : 0;
    if (!scratch_ptr[slot]) return malloc(bytes);
  }
  return scratch_ptr[slot];
}
static void scratch_put(int slot, void* p) {
  if (p != scratch_ptr[slot]) free(p);
}
