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

/* All-ones where `condition` holds, else zero: the conversions below compute
 * every case and select with masks, without branches, so that the compiler
 * vectorises the loops that call them (branches on the data cost up to 10x
 * on gradients, whose magnitudes straddle float16's subnormal range). */
static inline uint32_t fr_mask(int condition) { return 0u - (uint32_t)(condition != 0); }

static inline float fr_f16_to_f32(uint16_t h)
{
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t bits = (uint32_t)(h & 0x7fffu) << 13;      /* exponent, mantissa in place */
  uint32_t exponent = bits & 0x0f800000u;
  uint32_t normal = bits + 0x38000000u;               /* rebias the exponent 15 -> 127 */
  uint32_t special = normal + 0x38000000u;            /* inf, nan: exponent 255 */
  /* zero, subnormal: m * 2**-24, exact (and +0 for m = 0) in every rounding mode */
  uint32_t small = fr_f32_to_bits((float)(int32_t)(h & 0x3ffu) * 5.9604644775390625e-8f);
  uint32_t is_special = fr_mask(exponent == 0x0f800000u), is_small = fr_mask(exponent == 0);
  return fr_bits_to_f32(sign | (special & is_special) | (small & is_small)
                        | (normal & ~(is_special | is_small)));
}

static inline uint16_t fr_f32_to_f16(float f)
{
  uint32_t x = fr_f32_to_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t magnitude = x & 0x7fffffffu;
  /* >= 65520 rounds to inf; nan stays a quiet nan */
  uint32_t large = 0x7c00u | (fr_mask(magnitude > 0x7f800000u) & 0x0200u);
  /* below 2**-14, a subnormal half: 0.5f has a float32 ulp of 2**-24, the
   * subnormal half's unit, so adding it rounds the magnitude to that unit,
   * to nearest even */
  uint32_t small = fr_f32_to_bits(fr_bits_to_f32(magnitude) + 0.5f) - 0x3f000000u;
  /* normal: rebias the exponent (127 -> 15) and round the 13 dropped bits */
  uint32_t normal = (magnitude + 0xc8000fffu + ((magnitude >> 13) & 1u)) >> 13;
  uint32_t is_large = fr_mask(magnitude >= 0x477ff000u);
  uint32_t is_small = fr_mask(magnitude < 0x38800000u);
  return (uint16_t)(sign | (large & is_large) | (small & is_small)
                    | (normal & ~(is_large | is_small)));
}

static inline float fr_bf16_to_f32(uint16_t b) { return fr_bits_to_f32((uint32_t)b << 16); }

static inline uint16_t fr_f32_to_bf16(float f)
{
  uint32_t x = fr_f32_to_bits(f);
  uint32_t is_nan = fr_mask((x & 0x7fffffffu) > 0x7f800000u);
  uint32_t quiet_nan = (x >> 16) | 0x40u;             /* nan: keep it a quiet nan */
  uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  return (uint16_t)((quiet_nan & is_nan) | (rounded & ~is_nan));
}

static inline float fr_min_f32(float a, float b) { return (a != a || a < b) ? a : b; }
static inline float fr_max_f32(float a, float b) { return (a != a || a > b) ? a : b; }

/* inout[i] = in[i] (op) inout[i], computed in float32, rounded once. */
#define FR_HALF_USER_FUNCTION(NAME, TO_F32, FROM_F32, EXPR)                    \
  static void NAME(void *in, void *inout, int *len, MPI_Datatype *datatype)   \
  {                                                                           \
    const uint16_t *a = (const uint16_t *)in;                                 \
    uint16_t *b = (uint16_t *)inout;                                          \
    int n = *len;                                                             \
    (void)datatype;                                                           \
    for (int i = 0; i < n; i++) {                                             \
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
