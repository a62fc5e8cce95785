/* 16-bit floating point (IEEE binary16 and bfloat16) for MPIs that have no
 * such datatype: conversions to and from float32 with round-to-nearest-even,
 * MPI user functions that combine in float32 and round once per operation,
 * and the in-place scaling used by op="avg".
 *
 * Written with integer bit manipulation so that no compiler support for
 * _Float16 or __bf16 is needed.
 */
#ifndef FASTREDUCE_HALFOPS_H
#define FASTREDUCE_HALFOPS_H

#include <stdint.h>
#include <string.h>
#include <mpi.h>

static inline float fr_bits_to_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fr_f32_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float fr_f16_to_f32(uint16_t h)
{
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu)                     /* inf, nan */
    return fr_bits_to_f32(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {                       /* zero, subnormal: mantissa * 2**-24 */
    float magnitude = (float)mantissa * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return fr_bits_to_f32(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t fr_f32_to_f16(float f)
{
  uint32_t x = fr_f32_to_bits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t magnitude = x & 0x7fffffffu;
  if (magnitude > 0x7f800000u)               /* nan: keep it a quiet nan */
    return sign | 0x7e00u;
  if (magnitude >= 0x477ff000u)              /* >= 65520 rounds to inf */
    return sign | 0x7c00u;
  if (magnitude < 0x38800000u) {             /* below 2**-14: a subnormal half */
    /* 0.5f has a float32 ulp of 2**-24, the subnormal half's unit: adding it
     * lets the FPU round the magnitude to that unit, to nearest even. */
    float shifted = fr_bits_to_f32(magnitude) + 0.5f;
    return sign | (uint16_t)(fr_f32_to_bits(shifted) - 0x3f000000u);
  }
  /* normal: rebias the exponent (127 -> 15) and round the 13 dropped bits */
  magnitude += 0xc8000fffu + ((magnitude >> 13) & 1u);
  return sign | (uint16_t)(magnitude >> 13);
}

static inline float fr_bf16_to_f32(uint16_t b) { return fr_bits_to_f32((uint32_t)b << 16); }

static inline uint16_t fr_f32_to_bf16(float f)
{
  uint32_t x = fr_f32_to_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)       /* nan: keep it a quiet nan */
    return (uint16_t)((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}

static inline float fr_min_f32(float a, float b) { return (a != a || a < b) ? a : b; }
static inline float fr_max_f32(float a, float b) { return (a != a || a > b) ? a : b; }

/* inout[i] = in[i] (op) inout[i], computed in float32, rounded once. */
#define FR_HALF_USER_FUNCTION(NAME, TO_F32, FROM_F32, EXPR)                    \
  static void NAME(void *in, void *inout, int *len, MPI_Datatype *datatype)   \
  {                                                                           \
    const uint16_t *a = (const uint16_t *)in;                                 \
    uint16_t *b = (uint16_t *)inout;                                          \
    (void)datatype;                                                           \
    for (int i = 0; i < *len; i++) {                                          \
      float x = TO_F32(a[i]), y = TO_F32(b[i]);                               \
      b[i] = FROM_F32(EXPR);                                                  \
    }                                                                         \
  }

FR_HALF_USER_FUNCTION(fr_f16_sum, fr_f16_to_f32, fr_f32_to_f16, x + y)
FR_HALF_USER_FUNCTION(fr_f16_prod, fr_f16_to_f32, fr_f32_to_f16, x * y)
FR_HALF_USER_FUNCTION(fr_f16_min, fr_f16_to_f32, fr_f32_to_f16, fr_min_f32(x, y))
FR_HALF_USER_FUNCTION(fr_f16_max, fr_f16_to_f32, fr_f32_to_f16, fr_max_f32(x, y))
FR_HALF_USER_FUNCTION(fr_bf16_sum, fr_bf16_to_f32, fr_f32_to_bf16, x + y)
FR_HALF_USER_FUNCTION(fr_bf16_prod, fr_bf16_to_f32, fr_f32_to_bf16, x * y)
FR_HALF_USER_FUNCTION(fr_bf16_min, fr_bf16_to_f32, fr_f32_to_bf16, fr_min_f32(x, y))
FR_HALF_USER_FUNCTION(fr_bf16_max, fr_bf16_to_f32, fr_f32_to_bf16, fr_max_f32(x, y))

/* Element kinds the "avg" division understands (same numbering as _ops.pxd). */
enum { FR_SCALE_F16, FR_SCALE_BF16, FR_SCALE_F32, FR_SCALE_F64, FR_SCALE_C64, FR_SCALE_C128 };

/* data[i] /= divisor for `count` elements (complex: `count` complex numbers). */
static inline void fr_divide(void *data, int64_t count, int kind, int divisor)
{
  int64_t i;
  switch (kind) {
  case FR_SCALE_F16: {
    uint16_t *p = (uint16_t *)data;
    for (i = 0; i < count; i++) p[i] = fr_f32_to_f16(fr_f16_to_f32(p[i]) / (float)divisor);
    break; }
  case FR_SCALE_BF16: {
    uint16_t *p = (uint16_t *)data;
    for (i = 0; i < count; i++) p[i] = fr_f32_to_bf16(fr_bf16_to_f32(p[i]) / (float)divisor);
    break; }
  case FR_SCALE_F32: case FR_SCALE_C64: {
    float *p = (float *)data;
    int64_t n = kind == FR_SCALE_C64 ? 2 * count : count;
    for (i = 0; i < n; i++) p[i] /= (float)divisor;
    break; }
  case FR_SCALE_F64: case FR_SCALE_C128: {
    double *p = (double *)data;
    int64_t n = kind == FR_SCALE_C128 ? 2 * count : count;
    for (i = 0; i < n; i++) p[i] /= (double)divisor;
    break; }
  }
}

#endif /* FASTREDUCE_HALFOPS_H */
