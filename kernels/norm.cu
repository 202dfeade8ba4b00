// norm.cu — RMSNorm (kernels/SPEC.md "norm.cu"), bit for bit as src/reference/ops.rs rms_norm:
//   - every f32 operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...)
//     so the compiler can never contract a multiply and an add into an FMA (the reference
//     rounds every product);
//   - the sum of squares accumulates in f64 (products of two f32 are exact in f64) and rounds
//     once; rsqrt is evaluated in double precision and rounded once (ref_math.cuh).
#include "common.cuh"
#include "ref_math.cuh"

// ---------------------------------------------------------------------------------- RMSNorm

// In place over `rows` rows of `dim` values at stride `ld`: ms = f32(Σ f64 x² / dim),
// r = rsqrt(ms + eps) (f32 add, f64 rsqrt), x = x * r * w (f32, that order; x * r without a
// weight), then bf16 if round_out. One block per row (grid-stride over rows).
extern "C" __global__ void rmsnorm_kernel(float* x, int rows, int dim, int ld, const float* weight, float eps,
                                          int round_out) {
  dsv4_pdl_begin();
  __shared__ double scratch[32];
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    double acc = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
      const double v = (double)row[i];
      acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
    const double s = ref_block_sum_f64(acc, scratch);
    const float ms = (float)__ddiv_rn(s, (double)dim);
    const float rr = ref_rsqrt(__fadd_rn(ms, eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
      float v = __fmul_rn(row[i], rr);
      if (weight != nullptr) v = __fmul_rn(v, weight[i]);
      if (round_out) v = round_bf16(v);
      row[i] = v;
    }
  }
}
