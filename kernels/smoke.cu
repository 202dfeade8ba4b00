// smoke.cu — the runtime's own tiny kernel family, used only by tests: it proves that NVRTC
// compilation, the CUBIN cache, module loading, parameter passing and launches on a borrowed
// stream work, and that every helper of common.cuh matches the CPU reference bit for bit (silu_newton
// matches silu_div_rn, on the device).
// No model code may depend on it.
#include "common.cuh"

// The mixing function of smoke_fill (also in src/cuda/smoke.rs: fill_u32_ref).
DSV4_INLINE unsigned smoke_mix(unsigned long long i, int seed) {
  unsigned x = (unsigned)i * 2654435761u ^ (unsigned)seed;
  x ^= x >> 15;
  x *= 0x2c1b3c6du;
  x ^= x >> 12;
  return x;
}

// out_u32[i] = smoke_mix(i, seed); out_f32[i] = float(i) * scale, for i < n.
// Exercises pointer, u64, i32 and f32 parameters.
extern "C" __global__ void smoke_fill(unsigned* out_u32, float* out_f32, unsigned long long n, int seed,
                                      float scale) {
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    out_u32[i] = smoke_mix(i, seed);
    out_f32[i] = (float)i * scale;
  }
}

// SMOKE_COLS (dsv4_consts.cuh): number of output columns of smoke_roundtrip; the column order
// is ROUNDTRIP_COLUMNS in src/cuda/smoke.rs.

// Applies every number-format helper of common.cuh to element i: xf[i] is a float input,
// xu[i] supplies bit patterns (low 16 bits: bf16; low 8: e4m3 / ue8m0 codes; low 4: e2m1).
// Writes SMOKE_COLS u32 bit patterns per element to out[i * SMOKE_COLS + col].
extern "C" __global__ void smoke_roundtrip(const float* xf, const unsigned* xu, unsigned* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float x = xf[i];
  unsigned u = xu[i];
  float ax = fabsf(x);
  unsigned* o = out + (unsigned long long)i * SMOKE_COLS;
  o[0] = __float_as_uint(bf16_to_f32((bf16_t)(u & 0xffffu)));
  o[1] = (unsigned)f32_to_bf16(x);
  o[2] = __float_as_uint(round_bf16(x));
  o[3] = __float_as_uint(e4m3_to_f32((fp8_t)(u & 0xffu)));
  o[4] = __float_as_uint(e4m3_round(x));
  o[5] = (unsigned)e4m3_encode(x);
  o[6] = __float_as_uint(e2m1_to_f32(u & 0xfu));
  o[7] = __float_as_uint(e2m1_round(x));
  o[8] = x != x ? 0xffffffffu : e2m1_encode(x);
  o[9] = (unsigned)ue8m0_code(ax, DSV4_E4M3_MAX);
  o[10] = __float_as_uint(ue8m0_scale(ax, DSV4_E4M3_MAX));
  o[11] = (unsigned)ue8m0_code(ax, DSV4_E2M1_MAX);
  o[12] = __float_as_uint(ue8m0_scale(ax, DSV4_E2M1_MAX));
  o[13] = __float_as_uint(e8m0_to_f32((ue8m0_t)(u & 0xffu)));
  o[14] = (unsigned)ue8m0_exponent(x, 1.0f);  // signed exponent as bits; x itself (any sign)
  o[15] = __float_as_uint(round_bf16_nonnan(x));
  o[16] = e4m3x2_code_hw(x, -x);               // both bytes: the high one is -x's code
  o[17] = pack_bf16x2(x, -x);                  // the high half: -x's code
  o[18] = 0x5a5a5a5au;                         // canary: proves the row was written
}

// One block per row of blockDim.x (a multiple of 32) inputs: sums[b], maxs[b] = block_sum /
// block_max of the row; warp_sums[b * (blockDim.x / 32) + w] = warp_sum of warp w's inputs.
// Every thread checks that it received the same result and flags mismatches in `agree`.
extern "C" __global__ void smoke_reduce(const float* x, float* sums, float* maxs, float* warp_sums,
                                        unsigned* agree) {
  __shared__ float scratch[32];
  const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
  const float ws = warp_sum(v);
  const float s = block_sum(v, scratch);
  const float m = block_max(v, scratch);
  if ((threadIdx.x & 31) == 0) warp_sums[blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)] = ws;
  if (threadIdx.x == 0) {
    sums[blockIdx.x] = s;
    maxs[blockIdx.x] = m;
  }
  __syncthreads();
  const float s0 = sums[blockIdx.x], m0 = maxs[blockIdx.x];
  if (__float_as_uint(s0) != __float_as_uint(s) || __float_as_uint(m0) != __float_as_uint(m))
    atomicOr(agree + blockIdx.x, 1u);
}

// silu_newton (common.cuh) against silu_div_rn on the f32 bit patterns first + i·step (mod 2^32), i < n:
// counts[0] += the patterns where silu_newton set ok, counts[1] += those of them where the two results'
// bits differ, counts[2] = the smallest such pattern (stays 2^64 - 1 when none; integer atomics: the
// counts do not depend on the order).
extern "C" __global__ void smoke_silu_exhaustive(unsigned long long first, unsigned long long step,
                                                 unsigned long long n, unsigned long long* counts) {
  unsigned long long ok_n = 0, bad_n = 0, bad_min = ~0ull;
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const unsigned bits = (unsigned)(first + i * step);
    const float x = __uint_as_float(bits);
    bool ok = true;
    const float fast = silu_newton(x, ok);
    if (!ok) continue;
    ++ok_n;
    if (__float_as_uint(fast) != __float_as_uint(silu_div_rn(x))) {
      ++bad_n;
      bad_min = bits < bad_min ? bits : bad_min;
    }
  }
  atomicAdd(counts, ok_n);
  atomicAdd(counts + 1, bad_n);
  if (bad_n != 0) atomicMin(counts + 2, bad_min);
}
