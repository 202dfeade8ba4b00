// linear kernel family: see kernels/SPEC.md (## linear.cu).
//
// linear_kernel: y = x · Wᵀ with W stored F32 / BF16 / FP8 (block scales) / FP4 (1x32 scales),
// dequantized on the fly while a stage is loaded into shared memory. Every output is accumulated
// in f64 in EXACTLY the order of the CPU reference's `ops::dot` (src/reference/ops.rs): four lane
// accumulators `acc[k % 4] += x[k] * w[k]` over the first `K & ~3` columns, combined as
// `(acc0 + acc2) + (acc1 + acc3)`, then the remaining `K % 4` columns added one by one, then one
// rounding to f32. Products of two f32 values are exact in f64, so the result is bit-identical to
// the reference for every input (not only up to the f64 rounding corner).
//
// Two paths, picked per launch from T (the wrapper sizes the grid the same way):
// - tiled (T > LIN_SKINNY_MAX_T): 32 rows x 64 outputs per block, f64 stages, 4 x 2 outputs and
//   their 4 lane accumulators per thread;
// - skinny (T <= LIN_SKINNY_MAX_T, decode): 8 rows x 16 outputs per block, stages of 256 columns
//   (one per thread), each output's four lane chains in four threads.
//
// act_quant_kernel: the official per-token activation quantisation (fp8sim, blocks of 128 along
// K) in front of FP8/FP4 GEMMs; bit-identical to quant.rs fp8_sim.
#include "common.cuh"

#include "gemm_core.cuh"
// LIN_SKINNY_MAX_T (the largest T that takes the skinny path), LIN_BN (outputs per block on the
// tiled path; GS_BN on the skinny path) and ACT_BLOCK (block of act_quant along K) come from
// dsv4_consts.cuh.
#define LIN_SMEM_DOUBLES                                                                        \
  (GT_SMEM_DOUBLES(1, 2) > (GS_SMEM_FLOATS(1) + 1) / 2 ? GT_SMEM_DOUBLES(1, 2) : (GS_SMEM_FLOATS(1) + 1) / 2)

template <int FMT>
DSV4_INLINE void linear_body(double* smem, int* srow_s, const long long* xoff, bool skinny, int t0, int mrows, const float* x,
                             int K, int N, const void* w, const float* scales, int br, int bc, int round_out,
                             float* y, int ldy) {
  if (skinny) {
    const int n0 = blockIdx.x * GS_BN;
    double res[1][GS_MAXR];
    gemm_skinny<FMT, 1>((float*)smem, srow_s, xoff, mrows, x, K, w, scales, w, scales, N, n0, br, bc, res);
    const int n = n0 + (threadIdx.x >> 2);
    if ((threadIdx.x & 3) == 0 && threadIdx.x < 4 * GS_BN && n < N) {
#pragma unroll
      for (int r = 0; r < GS_MAXR; ++r) {
        if (r < mrows) {
          float v = (float)res[0][r];
          if (round_out) v = round_bf16(v);
          y[(long long)(t0 + r) * ldy + n] = v;
        }
      }
    }
  } else {
    const int n0 = blockIdx.x * LIN_BN;
    double acc[GT_TM][2][4];
    gemm_tiled<FMT, 1, 2>(smem, srow_s, xoff, mrows, x, K, w, scales, w, scales, N, n0, br, bc, acc);
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < GT_TM; ++i) {
      const int m = ty + 8 * i;
      if (m >= mrows) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = n0 + tx + 32 * j;
        if (n >= N) continue;
        float v = (float)acc[i][j][0];
        if (round_out) v = round_bf16(v);
        y[(long long)(t0 + m) * ldy + n] = v;
      }
    }
  }
}

// y[t*ldy + n] = f32(Σ_k f64(x[t*ldx + k]) * f64(W[n,k])), then bf16 if round_out; t < T, n < N.
// GEMM_THREADS threads; grid (ceil(N / GS_BN), ceil(T / GS_MAXR)) when T <= LIN_SKINNY_MAX_T, else
// (ceil(N / LIN_BN), ceil(T / GT_BM)). `scales` is unused (may be NULL) for F32/BF16; `br`, `bc` are
// the FP8 scale block (rows, columns).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    linear_kernel(const float* x, int ldx, int T, int K, int N, int fmt, const void* w, const float* scales,
                  int br, int bc, int round_out, float* y, int ldy) {
  dsv4_pdl_begin();
  __shared__ double smem[LIN_SMEM_DOUBLES];
  __shared__ long long xoff[GT_BM];
  __shared__ int srow_s[LIN_BN > GS_BN ? LIN_BN : GS_BN];
  const bool skinny = T <= LIN_SKINNY_MAX_T;
  const int rows = skinny ? GS_MAXR : GT_BM;
  const int t0 = blockIdx.y * rows;
  const int mrows = min(rows, T - t0);
  if (mrows <= 0) return;  // uniform per block
  if (threadIdx.x < rows) xoff[threadIdx.x] = (long long)(t0 + (int)threadIdx.x) * ldx;
  __syncthreads();
  switch (fmt) {
    case WFMT_F32:
      linear_body<WFMT_F32>(smem, srow_s, xoff, skinny, t0, mrows, x, K, N, w, scales, br, bc, round_out, y, ldy);
      break;
    case WFMT_BF16:
      linear_body<WFMT_BF16>(smem, srow_s, xoff, skinny, t0, mrows, x, K, N, w, scales, br, bc, round_out, y, ldy);
      break;
    case WFMT_FP8:
      linear_body<WFMT_FP8>(smem, srow_s, xoff, skinny, t0, mrows, x, K, N, w, scales, br, bc, round_out, y, ldy);
      break;
    case WFMT_FP4:
      linear_body<WFMT_FP4>(smem, srow_s, xoff, skinny, t0, mrows, x, K, N, w, scales, br, bc, round_out, y, ldy);
      break;
    default:
      break;
  }
}

// Official activation quantisation, per row and block of ACT_BLOCK columns:
// amax = max(max|x|, 1e-4), s = ue8m0(amax / 448), xq = e4m3_round(clamp(x / s, ±448)) * s.
// xq is [rows, K] contiguous (may be x itself when ldx == K). Grid (rows, ceil(K / ACT_BLOCK)),
// ACT_BLOCK threads.
extern "C" __global__ void __launch_bounds__(ACT_BLOCK)
    act_quant_kernel(const float* x, int ldx, int rows, int K, float* xq) {
  dsv4_pdl_begin();
  __shared__ float scratch[32];
  const int r = blockIdx.x;
  const int k = blockIdx.y * ACT_BLOCK + threadIdx.x;
  if (r >= rows) return;  // uniform per block
  const float v = k < K ? x[(long long)r * ldx + k] : 0.0f;
  const float amax = fmaxf(block_max(fabsf(v), scratch), 1e-4f);
  const float s = ue8m0_scale(amax, DSV4_E4M3_MAX);
  if (k < K) {
    float q = v / s;
    // Rust's clamp: NaN stays NaN (fminf/fmaxf would drop it).
    q = q < -DSV4_E4M3_MAX ? -DSV4_E4M3_MAX : (q > DSV4_E4M3_MAX ? DSV4_E4M3_MAX : q);
    xq[(long long)r * K + k] = e4m3_round(q) * s;
  }
}
