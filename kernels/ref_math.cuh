// ref_math.cuh — the reference-kernel math helpers several families share, one copy each
// (`#include "ref_math.cuh"` after common.cuh; injected by the registry like common.cuh).
//
// Each helper reproduces a CPU reference function bit for bit (src/reference/ops.rs,
// src/reference/precision.rs, src/weights/quant.rs): f64 evaluation rounded once to f32, and
// every f32 operation an explicit round-to-nearest intrinsic so nothing contracts into an FMA.
// Changing the order of any operation here changes the numerics of every kernel using it.
#pragma once
#include "common.cuh"

// ------------------------------------------------------------------------- f64 reductions

// Butterfly sum of one double per lane over a full warp (all 32 lanes call; every lane gets
// the same value: IEEE add is commutative, so each butterfly pair computes identical values).
DSV4_INLINE double ref_warp_sum_f64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __dadd_rn(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum of one double per thread over a 1-D block (size a multiple of 32, at most 1024); every
// thread gets the result. `scratch` is __shared__ double[32]; ends with a barrier so scratch
// may be reused right away. The order is fixed by the thread layout (warp butterflies, then a
// butterfly over the per-warp sums, lanes past the warp count contributing 0), so results are
// deterministic run to run.
DSV4_INLINE double ref_block_sum_f64(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = ref_warp_sum_f64(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double w = lane < nwarps ? scratch[lane] : 0.0;
    w = ref_warp_sum_f64(w);
    if (lane == 0) scratch[0] = w;
  }
  __syncthreads();
  const double r = scratch[0];
  __syncthreads();
  return r;
}

// ------------------------------------------------------------------ elementary functions

// ops.rs exp: e^x in f64, rounded once.
DSV4_INLINE float ref_exp(float x) { return (float)exp((double)x); }

// ops.rs sigmoid: 1 / (1 + e^-x) in f64, rounded once.
DSV4_INLINE float ref_sigmoid(float x) { return (float)__ddiv_rn(1.0, __dadd_rn(1.0, exp(-(double)x))); }

// ops.rs rsqrt: 1 / sqrt(x) in f64 (correctly rounded sqrt and division), rounded once.
DSV4_INLINE float ref_rsqrt(float x) { return (float)__ddiv_rn(1.0, __dsqrt_rn((double)x)); }

// rope.rs apply on one interleaved pair (a, b) at position p (as f32) with inverse frequency
// inv_freq: θ = f32(p * inv_freq), c = f32(cos(f64 θ)), s = sign * f32(sin(f64 θ)), a' = a*c -
// b*s, b' = a*s + b*c (every product rounded), then bf16 when round_out. In two steps, the angle's
// cosine and sine (ref_rope_cs) and the rotation (ref_rope_rotate), so that the pairs of one position
// and frequency (every head's) share one f64 cos / sin.
DSV4_INLINE void ref_rope_cs(float p, float inv_freq, float sign, float& c, float& s) {
  const float theta = __fmul_rn(p, inv_freq);
  const double td = (double)theta;
  c = (float)cos(td);
  s = __fmul_rn(sign, (float)sin(td));
}
DSV4_INLINE void ref_rope_rotate(float& a, float& b, float c, float s, int round_out) {
  float a2 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  float b2 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  if (round_out) {
    a2 = round_bf16(a2);
    b2 = round_bf16(b2);
  }
  a = a2;
  b = b2;
}
DSV4_INLINE void ref_rope_pair(float& a, float& b, float p, float inv_freq, float sign, int round_out) {
  float c, s;
  ref_rope_cs(p, inv_freq, sign, c, s);
  ref_rope_rotate(a, b, c, s, round_out);
}

// Rust's f32::clamp: NaN passes through.
DSV4_INLINE float ref_clamp(float v, float lo, float hi) {
  if (v < lo) v = lo;
  if (v > hi) v = hi;
  return v;
}

// ---------------------------------------------------------------- FP8 / FP4 simulation

// quant.rs fp8_sim / fp4_sim of one value `v` of a block whose UE8M0 scale is `s`:
// e4m3(clamp(v / s, ±448)) * s and e2m1(clamp(v / s, ±6)) * s. (The scale of a block: fp8,
// ue8m0_scale(max(amax, 1e-4), DSV4_E4M3_MAX); fp4, ue8m0_scale(max(amax, 6 * 2^-126),
// DSV4_E2M1_MAX); amax is a max, so how the block reduces it is immaterial.)
DSV4_INLINE float ref_fp8_sim_value(float v, float s) {
  return __fmul_rn(e4m3_round(ref_clamp(__fdiv_rn(v, s), -DSV4_E4M3_MAX, DSV4_E4M3_MAX)), s);
}

DSV4_INLINE float ref_fp4_sim_value(float v, float s) {
  return __fmul_rn(e2m1_round(ref_clamp(__fdiv_rn(v, s), -DSV4_E2M1_MAX, DSV4_E2M1_MAX)), s);
}

// --------------------------------------------------------------------------- Hadamard

// Unnormalised Sylvester Walsh–Hadamard transform of y[0 .. n) in place (n a power of two), f64
// butterflies in the same network as precision.rs hadamard, so every output is computed by the
// same operations. Block-wide: every thread calls, after a barrier that made y visible; ends
// with a barrier.
DSV4_INLINE void ref_hadamard_f64(double* y, int n) {
  for (int h = 1; h < n; h <<= 1) {
    for (int p = threadIdx.x; p < n / 2; p += blockDim.x) {
      const int j = (p / h) * 2 * h + (p % h);
      const double a = y[j], b = y[j + h];
      y[j] = __dadd_rn(a, b);
      y[j + h] = __dsub_rn(a, b);
    }
    __syncthreads();
  }
}
