// norm_row.cuh — one RMSNorm row held in registers, shared by norm.cu (rmsnorm_kernel's registers path,
// rmsnorm_rows_kernel), fast_dense.cu (fd_norm_operands_kernel: GEMM operands from the same values) and
// fast_moe.cu (fmoe_norm_x_kernel: x's codes for the experts): one copy of the operation, so every caller on the
// same block writes the same bits (`#include "norm_row.cuh"` after common.cuh; injected by the registry like it).
#pragma once
#include "common.cuh"
#include "ref_math.cuh"

// One row of a row-per-block RMSNorm: a row of at most VALS * blockDim.x values, thread values
// i = threadIdx.x + j * blockDim.x (the strided loop's order), all loads issued before the first use; every
// thread of the block must call (the f64 sum is a block reduction). Writes the row in place and leaves the
// written values in `out` (out[j] for value i; 0 past dim) for callers that use them again. `src`, if given,
// holds the row's values to read (a copy in shared memory: fmoe_norm_x's prefetch), else `row` itself.
template <int VALS>
DSV4_INLINE void rmsnorm_row_in_registers(float* row, int dim, const float* weight, float eps, int round_out,
                                          double* scratch, float (&out)[VALS], const float* src = nullptr) {
  const float* in = src != nullptr ? src : row;
  float v[VALS], w[VALS];
#pragma unroll
  for (int j = 0; j < VALS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    v[j] = i < dim ? in[i] : 0.0f;
    w[j] = weight != nullptr && i < dim ? weight[i] : 1.0f;
  }
  double acc = 0.0;  // the strided loop's per-thread order: i, i + blockDim.x, ...
#pragma unroll
  for (int j = 0; j < VALS; ++j) {
    if (threadIdx.x + j * blockDim.x < dim) acc = __dadd_rn(acc, __dmul_rn((double)v[j], (double)v[j]));
  }
  const double s = ref_block_sum_f64(acc, scratch);
  const float ms = (float)__ddiv_rn(s, (double)dim);
  const float rr = ref_rsqrt(__fadd_rn(ms, eps));
#pragma unroll
  for (int j = 0; j < VALS; ++j) {
    const int i = threadIdx.x + j * blockDim.x;
    out[j] = 0.0f;
    if (i < dim) {
      float o = __fmul_rn(v[j], rr);
      if (weight != nullptr) o = __fmul_rn(o, w[j]);
      if (round_out) o = round_bf16(o);
      row[i] = o;
      out[j] = o;
    }
  }
}

// The largest |x| of each 128-block of a row that rmsnorm_row_in_registers left in `o` (value i = threadIdx.x +
// j * nthreads; nthreads, the block's threads, a multiple of 128, so a 128-block is one j across four warps):
// each warp's largest goes to `warp_amax` (shared, VALS * nthreads / 32 floats, j-major), then a barrier. Every
// thread of the block must call. norm_row_block_amax then reads a block's.
// The warps' maxima a block keeps for norm_row_warp_amax (VALS x warps), enough for either rmsnorm block shape.
#define NORM_ROW_AMAX 128
static_assert(RN_VALS * 32 <= NORM_ROW_AMAX && RN_ROWS_VALS * (RN_ROWS_THREADS / 32) <= NORM_ROW_AMAX,
              "norm_row_warp_amax: the warps' maxima of a row");
template <int VALS>
DSV4_INLINE void norm_row_warp_amax(const float (&o)[VALS], int dim, int nthreads, float* warp_amax) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = nthreads >> 5;
#pragma unroll
  for (int j = 0; j < VALS; ++j) {
    if (j * nthreads >= dim) break;  // uniform; o[j] is 0 past dim, its block never read
    const float a = warp_max(fabsf(o[j]));
    if (lane == 0) warp_amax[j * nwarps + warp] = a;
  }
  __syncthreads();
}

// The largest |x| of the 128-block of this thread's value j (after norm_row_warp_amax): the fmaxf of its four
// warps' (a maximum, so in any order the warp-wide reductions' value; fmaxf skips NaNs as warp_max does).
DSV4_INLINE float norm_row_block_amax(const float* warp_amax, int j, int nthreads) {
  const float* wa = warp_amax + j * (nthreads >> 5) + ((threadIdx.x >> 5) & ~3);
  return fmaxf(fmaxf(wa[0], wa[1]), fmaxf(wa[2], wa[3]));
}
