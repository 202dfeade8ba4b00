// quant_sim.cu — the official precision simulations applied in place to activations
// (kernels/SPEC.md "quant_sim.cu"): the KV nope FP8 sim, the indexer's Hadamard + FP4 sim, and
// bf16 rounding. Bit for bit as src/reference/precision.rs kv_nope_sim / index_sim / hadamard
// and src/weights/quant.rs fp8_sim / fp4_sim / round_bf16: explicit round-to-nearest f32
// intrinsics (no FMA contraction), f64 Hadamard butterflies, the shared helpers of
// ref_math.cuh.
#include "common.cuh"
#include "ref_math.cuh"

// ------------------------------------------------------------------------- KV nope FP8 sim

// Per row (stride ld): fp8sim(x[0:nope], 64) — per block of 64 (the last one may be shorter):
// amax = max(max|x|, 1e-4), s = ue8m0(amax / 448), x = e4m3(clamp(x / s, ±448)) * s.
// One block per row; each warp takes 64-blocks (two values per lane).
extern "C" __global__ void kv_sim_kernel(float* x, int rows, int ld, int nope) {
  dsv4_pdl_begin();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int nblk = (nope + 63) / 64;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    for (int b = warp; b < nblk; b += nwarps) {
      const int i0 = b * 64 + lane, i1 = i0 + 32;
      const bool h0 = i0 < nope, h1 = i1 < nope;
      const float v0 = h0 ? row[i0] : 0.0f;
      const float v1 = h1 ? row[i1] : 0.0f;
      float amax = warp_max(fmaxf(fabsf(v0), fabsf(v1)));
      amax = fmaxf(amax, 1e-4f);
      const float s = ue8m0_scale(amax, DSV4_E4M3_MAX);
      if (h0) row[i0] = ref_fp8_sim_value(v0, s);
      if (h1) row[i1] = ref_fp8_sim_value(v1, s);
    }
  }
}

// ----------------------------------------------------------------------- indexer Hadamard sim

// HADAMARD_MAX (dsv4_consts.cuh): largest row length of index_sim_kernel.

// Per row of `dim` values (a power of two <= 1024, rows contiguous): normalised Sylvester
// Walsh–Hadamard transform with f64 butterflies (the same butterfly network as
// precision.rs hadamard, so every output is computed by the same operations), each output
// f32(Σ) * f32(dim^-1/2); then fp4sim(·, 32) (amax floor 6 * 2^-126, ue8m0(amax / 6),
// e2m1(clamp(x / s, ±6)) * s); then bf16. One block per row.
extern "C" __global__ void index_sim_kernel(float* x, int rows, int dim) {
  dsv4_pdl_begin();
  __shared__ double y[HADAMARD_MAX];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  // f32(dim^-1/2): dim is a power of two, so the f64 value is 2^-k or 2^-k * sqrt(1/2) up to
  // one f64 rounding, which rounds to the same f32 as the reference's powf(-0.5).
  const float sc = ref_rsqrt((float)dim);
  const float floor4 = DSV4_E2M1_MAX * __int_as_float(0x00800000);  // 6 * 2^-126, exact
  const int nblk = (dim + 31) / 32;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) y[i] = (double)row[i];
    __syncthreads();
    ref_hadamard_f64(y, dim);
    for (int b = warp; b < nblk; b += nwarps) {
      const int i = b * 32 + lane;
      const bool have = i < dim;
      const float v = have ? __fmul_rn((float)y[i], sc) : 0.0f;
      float amax = warp_max(fabsf(v));
      amax = fmaxf(amax, floor4);
      const float s = ue8m0_scale(amax, DSV4_E2M1_MAX);
      if (have) {
        const float q = ref_fp4_sim_value(v, s);
        row[i] = round_bf16(q);
      }
    }
    __syncthreads();  // y is reused by the next row
  }
}

// -------------------------------------------------------------------------------- bf16 sim

// x = bf16(x) for n values.
extern "C" __global__ void round_bf16_kernel(float* x, long long n) {
  dsv4_pdl_begin();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    x[i] = round_bf16(x[i]);
}
