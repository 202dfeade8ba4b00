// common.cuh — helpers every kernel family includes (`#include "common.cuh"`).
//
// Header-free on purpose: the registry compiles kernels with NVRTC and injects this file as
// the only header, so nothing here may include cuda_bf16.h, cuda_fp8.h or any system header.
// Number formats are handled by bit manipulation and must agree BIT FOR BIT with the CPU
// reference in src/weights/dtype.rs and src/weights/quant.rs (tests/gpu_runtime.rs checks it
// through kernels/smoke.cu). Compiled without --use_fast_math: IEEE division, denormals kept.
#pragma once

typedef unsigned short bf16_t;   // bfloat16 bit pattern
typedef unsigned char fp8_t;     // FP8 e4m3fn code
typedef unsigned char ue8m0_t;   // UE8M0 scale byte (2^(e-127))

#define DSV4_INLINE static __device__ __forceinline__

#define DSV4_F32_NAN __int_as_float(0x7fc00000)
#define DSV4_F32_INF __int_as_float(0x7f800000)

// Largest finite e4m3fn and e2m1 values (quant.rs E4M3_MAX, E2M1_MAX).
#define DSV4_E4M3_MAX 448.0f
#define DSV4_E2M1_MAX 6.0f

// 2^k as a float for -149 <= k <= 127, exactly (normal or subnormal).
DSV4_INLINE float dsv4_pow2(int k) {
  return k >= -126 ? __int_as_float((k + 127) << 23) : __int_as_float(1 << (k + 149));
}

// ---------------------------------------------------------------------------------- bf16

// bf16 -> f32, exact (bf16 is the top half of an f32).
DSV4_INLINE float bf16_to_f32(bf16_t b) { return __uint_as_float(((unsigned)b) << 16); }

// f32 -> bf16, round to nearest even; NaN stays NaN (quieted, sign and top payload kept),
// exactly as `half::bf16::from_f32`.
DSV4_INLINE bf16_t f32_to_bf16(float f) {
  unsigned x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((x >> 16) | 0x0040u);
  const unsigned round_bit = 0x8000u;
  if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) return (bf16_t)((x >> 16) + 1u);
  return (bf16_t)(x >> 16);
}

// The nearest bfloat16 value as an f32 (quant.rs round_bf16).
DSV4_INLINE float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// ------------------------------------------------------------------------- grid rounding

// floor(log2(a)) for a positive finite a (normal or subnormal).
DSV4_INLINE int dsv4_floor_log2(float a) {
  unsigned bits = __float_as_uint(a);
  int e = (int)((bits >> 23) & 0xffu);
  if (e == 0) return -149 + (31 - __clz((int)(bits & 0x7fffffu)));
  return e - 127;
}

// Rounds x to the float grid with `mant_bits` explicit mantissa bits, exponents >= min_exp
// (subnormals below), saturating at +-max, ties to even; sign kept, NaN returned as is.
// quant.rs round_to_grid.
DSV4_INLINE float dsv4_round_to_grid(float x, int mant_bits, int min_exp, float max) {
  if (x != x) return x;
  float a = fabsf(x);
  if (a == 0.0f) return x;
  if (a >= max) return copysignf(max, x);
  int e = dsv4_floor_log2(a);
  if (e < min_exp) e = min_exp;
  float q = dsv4_pow2(e - mant_bits);
  float r = fminf(rintf(a / q) * q, max);  // a / q and the product are exact
  return copysignf(r, x);
}

// --------------------------------------------------------------------------- FP8 e4m3fn

// e4m3fn code -> f32, exact (bias 7, no infinities; S.1111.111 is NaN). dtype.rs e4m3_to_f32.
DSV4_INLINE float e4m3_to_f32(fp8_t b) {
  unsigned e = (b >> 3) & 15u, m = b & 7u;
  float v;
  if (e == 15u && m == 7u) return DSV4_F32_NAN;
  if (e == 0u) v = (float)m * 0.001953125f;                    // m/8 * 2^-6 = m * 2^-9
  else v = __uint_as_float(((e + 120u) << 23) | (m << 20));    // (1 + m/8) * 2^(e-7)
  return (b & 0x80u) ? -v : v;
}

// Nearest e4m3fn value (ties to even, saturating at +-448). quant.rs e4m3_round.
DSV4_INLINE float e4m3_round(float x) { return dsv4_round_to_grid(x, 3, -6, DSV4_E4M3_MAX); }

// e4m3fn code of x after rounding (NaN -> 0x7f; -0 keeps its sign bit). quant.rs e4m3_encode.
DSV4_INLINE fp8_t e4m3_encode(float x) {
  if (x != x) return (fp8_t)0x7f;
  float v = e4m3_round(x);
  unsigned sign = (__float_as_uint(v) >> 24) & 0x80u;
  float a = fabsf(v);
  unsigned code;
  if (a < 0.015625f) {                       // below 2^-6: subnormal code m, value m * 2^-9
    code = (unsigned)(a * 512.0f);
  } else {
    unsigned bits = __float_as_uint(a);
    code = ((((bits >> 23) & 0xffu) - 120u) << 3) | ((bits >> 20) & 7u);
  }
  return (fp8_t)(sign | code);
}

// ------------------------------------------------------------------------------ FP4 e2m1

// e2m1 nibble -> f32 (bit 3 = sign, so 8 is -0.0). dtype.rs FP4_LUT.
DSV4_INLINE float e2m1_to_f32(unsigned nibble) {
  unsigned e = (nibble >> 1) & 3u, m = nibble & 1u;
  float v = e == 0u ? (float)m * 0.5f : __uint_as_float(((e + 126u) << 23) | (m << 22));
  return (nibble & 8u) ? -v : v;
}

// Nearest e2m1 value (ties to even, saturating at +-6). quant.rs e2m1_round.
DSV4_INLINE float e2m1_round(float x) { return dsv4_round_to_grid(x, 1, 0, DSV4_E2M1_MAX); }

// e2m1 nibble of x after rounding (bit 3 = sign). quant.rs e2m1_encode (x must not be NaN).
DSV4_INLINE unsigned e2m1_encode(float x) {
  float v = e2m1_round(x);
  unsigned sign = (__float_as_uint(v) >> 28) & 8u;
  float a = fabsf(v);
  unsigned code;
  if (a < 1.0f) {
    code = (unsigned)(a * 2.0f);             // 0 or 0.5
  } else {
    unsigned bits = __float_as_uint(a);
    code = ((((bits >> 23) & 0xffu) - 126u) << 1) | ((bits >> 22) & 1u);
  }
  return sign | code;
}

// ---------------------------------------------------------------------------------- UE8M0

// UE8M0 byte -> 2^(e-127); 255 is NaN, 0 is the subnormal 2^-127. dtype.rs e8m0_to_f32.
DSV4_INLINE float e8m0_to_f32(ue8m0_t e) {
  if (e == 255) return DSV4_F32_NAN;
  if (e == 0) return __uint_as_float(0x00400000u);
  return __uint_as_float(((unsigned)e) << 23);
}

// Unbiased exponent of the UE8M0 scale for a block with max magnitude `amax` and format max
// `qmax`: ceil(log2(amax / qmax)) by the exponent bit trick (exponent of the f32 quotient, +1
// if its mantissa is nonzero), clamped to [-127, 127]. quant.rs ue8m0_scale.
DSV4_INLINE int ue8m0_exponent(float amax, float qmax) {
  unsigned bits = __float_as_uint(amax / qmax);
  int e = (int)((bits >> 23) & 0xffu) - 127;
  if ((bits & 0x7fffffu) != 0u) e += 1;
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// The UE8M0 scale byte (biased exponent) for amax / qmax.
DSV4_INLINE ue8m0_t ue8m0_code(float amax, float qmax) { return (ue8m0_t)(ue8m0_exponent(amax, qmax) + 127); }

// The UE8M0 scale value 2^ceil(log2(amax / qmax)).
DSV4_INLINE float ue8m0_scale(float amax, float qmax) { return dsv4_pow2(ue8m0_exponent(amax, qmax)); }

// ----------------------------------------------------------------------------- reductions

// Butterfly reductions over a full warp (all 32 lanes must call). Every lane gets the same
// result (IEEE add and fmaxf are commutative, so each butterfly pair computes identical
// values). max ignores NaN like fmaxf / Rust's f32::max.
DSV4_INLINE float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

DSV4_INLINE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide reductions for a 1-D block whose size is a multiple of 32 (at most 1024). Every
// thread must call; every thread gets the result. `scratch` is __shared__ float[32]; the
// function ends with a barrier so scratch may be reused right away. Order: warp butterflies,
// then warp 0 butterflies the per-warp results (lanes past the warp count contribute 0 / -inf).
DSV4_INLINE float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? scratch[lane] : 0.0f;
    w = warp_sum(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  float r = scratch[0];
  __syncthreads();
  return r;
}

DSV4_INLINE float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < nwarps ? scratch[lane] : -DSV4_F32_INF;
    w = warp_max(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  float r = scratch[0];
  __syncthreads();
  return r;
}
