// norm.cu — RMSNorm (kernels/SPEC.md "norm.cu"), bit for bit as src/reference/ops.rs rms_norm:
//   - every f32 operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...)
//     so the compiler can never contract a multiply and an add into an FMA (the reference
//     rounds every product);
//   - the sum of squares accumulates in f64 (products of two f32 are exact in f64) and rounds
//     once; rsqrt is evaluated in double precision and rounded once (ref_math.cuh).
#include "common.cuh"
#include "ref_math.cuh"
#include "norm_row.cuh"

// ---------------------------------------------------------------------------------- RMSNorm

// In place over `rows` rows of `dim` values at stride `ld`: ms = f32(Σ f64 x² / dim),
// r = rsqrt(ms + eps) (f32 add, f64 rsqrt), x = x * r * w (f32, that order; x * r without a
// weight), then bf16 if round_out. One block per row (grid-stride over rows).
// A decode step normalizes one row at a time, so a row's latency is the kernel's time. A row of at
// most RN_VALS * blockDim.x values (the launcher sizes blocks so that the model's rows fit) is read
// once into registers, its loads and its weights' loads all issued before the first use, and
// written from them: a strided loop waits a memory round trip per iteration (~14 us for 4096
// values at 256 threads in a batch-1 step's ncu timeline). RN_VALS: dsv4_consts.cuh.
extern "C" __global__ void rmsnorm_kernel(float* x, int rows, int dim, int ld, const float* weight, float eps,
                                          int round_out) {
  dsv4_pdl_begin();
  __shared__ double scratch[32];
  const bool in_registers = dim <= RN_VALS * (int)blockDim.x;  // uniform
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    if (in_registers) {
      float out[RN_VALS];
      rmsnorm_row_in_registers<RN_VALS>(row, dim, weight, eps, round_out, scratch, out);
      continue;
    }
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

// rmsnorm_kernel for many rows (a prefill's, RN_ROWS_MIN or more) of at most RN_ROWS_VALS * RN_ROWS_THREADS
// values: the registers path with RN_ROWS_THREADS threads a block, so that more rows are in flight on an
// SM. rmsnorm_kernel gives a 4096-value row a block of 1024 threads: the u norm of a 4096-token prefill took
// ~95 us for 134 MB (ncu), waiting on each row's load, block sum and f64 rsqrt in turn. By the thread limit
// eight such blocks fit an SM where two of rmsnorm_kernel's would; by registers (ptxas: 88 a thread here, 59
// there) two, where one of rmsnorm_kernel's fills the register file. The f64 sum of squares is grouped by this
// block's threads (another grouping of the same f64 terms, as any thread layout groups them: docs/numerics.md).
extern "C" __global__ void __launch_bounds__(RN_ROWS_THREADS)
    rmsnorm_rows_kernel(float* x, int rows, int dim, int ld, const float* weight, float eps, int round_out) {
  dsv4_pdl_begin();
  __shared__ double scratch[32];
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float out[RN_ROWS_VALS];
    rmsnorm_row_in_registers<RN_ROWS_VALS>(x + (long long)r * ld, dim, weight, eps, round_out, scratch, out);
  }
}
