// gemm_core.cuh: the f64-accumulating GEMM tile code shared by the linear and moe families.
#pragma once
#include "common.cuh"

// ==================================================================== GEMM core
// Shared by linear.cu and moe.cu (injected by the registry as an NVRTC header, like common.cuh).
//
// Order of every sum (the CPU reference's `ops::dot`): lane accumulators acc[k % 4] over the
// columns below K4 = K & ~3, in increasing k; then s = (acc0 + acc2) + (acc1 + acc3); then the
// columns K4..K-1 added to s in order; one rounding to f32. Products of two f32 values are exact
// in f64, so fma(a, b, c) == c + a*b here.

// From dsv4_consts.cuh (src/cuda/consts.rs): the weight formats WFMT_* (`fmt`, linear.rs
// WFormat), FP4_SCALE_BLOCK (FP4 scales along K), GEMM_THREADS, GT_BM, GS_MAXR and GS_BN.
//
// Tiled path: GT_BM gathered rows x (32 * TN) outputs per matrix, GT_BK columns per stage; thread
// (tx = lane, ty = warp) owns rows ty + 8 i (i < 4) and outputs tx + 32 j.
#define GT_BK 32
#define GT_TM 4
// Skinny path (at most GS_MAXR rows, decode): GS_BN / NMAT outputs of each of NMAT matrices,
// GS_BK columns per stage (one column per thread when loading, so a stage is GS_BN * GS_BK weights
// in flight per block); compute thread (n = tid / 4, l = tid % 4) owns lane l of output n for every
// row. Stages are held as f32.
#define GS_BK 256
#define GS_LD (GS_BK + 4)  // padded row stride (floats): conflict-free lane reads
// Shared memory (doubles) of each path.
#define GT_SMEM_DOUBLES(NMAT, TN) (GT_BK * (GT_BM + 1) + (NMAT) * GT_BK * (32 * (TN) + 1))
#define GS_SMEM_FLOATS(NMAT) (GS_MAXR * GS_LD + GS_BN * GS_LD)

// Raw stored element n, k (bits; FP4: the whole byte, the nibble is picked when decoding).
template <int FMT>
DSV4_INLINE unsigned g_raw(const void* w, long long n, int k, int K) {
  if (FMT == WFMT_F32) return __float_as_uint(((const float*)w)[n * K + k]);
  if (FMT == WFMT_BF16) return (unsigned)((const bf16_t*)w)[n * K + k];
  if (FMT == WFMT_FP8) return (unsigned)((const fp8_t*)w)[n * K + k];
  return (unsigned)((const unsigned char*)w)[n * (long long)((K + 1) >> 1) + (k >> 1)];
}

// Index of the scale row of weight row n (FP8: (n / br) * scols; FP4: n * scols).
template <int FMT>
DSV4_INLINE int g_srow(int n, int br, int scols) {
  if (FMT == WFMT_FP8) return (n / br) * scols;
  if (FMT == WFMT_FP4) return n * scols;
  return 0;
}

// The dequantized value, exactly as the CPU store's MatRef::row_into (the product in f32).
template <int FMT>
DSV4_INLINE float g_deq(unsigned raw, float scale, int k) {
  if (FMT == WFMT_F32) return __uint_as_float(raw);
  if (FMT == WFMT_BF16) return bf16_to_f32((bf16_t)raw);
  if (FMT == WFMT_FP8) return e4m3_to_f32((fp8_t)raw) * scale;
  return e2m1_to_f32((k & 1) ? (raw >> 4) : (raw & 15u)) * scale;
}

template <int FMT>
DSV4_INLINE int g_scols(int K, int bc) {
  return FMT == WFMT_FP8 ? (K + bc - 1) / bc : (K + FP4_SCALE_BLOCK - 1) / FP4_SCALE_BLOCK;
}

// Scale-column index of column k (k < K).
template <int FMT>
DSV4_INLINE int g_scol(int k, int bc) {
  return FMT == WFMT_FP8 ? k / bc : k / FP4_SCALE_BLOCK;
}

// Fills srow_s[0 .. rows) with the scale-row index of weight rows n0 .. n0 + rows (0 past N) and
// waits for it. Every thread must call.
template <int FMT>
DSV4_INLINE void g_fill_srow(int* srow_s, int rows, int n0, int N, int br, int scols) {
  for (int i = threadIdx.x; i < rows; i += blockDim.x) srow_s[i] = n0 + i < N ? g_srow<FMT>(n0 + i, br, scols) : 0;
  __syncthreads();
}

// ---------------------------------------------------------------------------- tiled path

// acc[i][mat * TN + j][0] = Σ_k x[row ty + 8 i, k] * W_mat[n0 + tx + 32 j, k] in ops::dot order,
// for gathered rows m < mrows (row m at xsrc + xoff[m], xoff in shared memory). smem:
// GT_SMEM_DOUBLES(NMAT, TN) doubles; srow_s: shared int[32 * TN]. Raw global loads (values and
// scales) of stage s + 1 are issued before stage s is computed (register prefetch) and dequantized
// when the stage is stored. Ends with a barrier.
template <int FMT, int NMAT, int TN>
DSV4_INLINE void gemm_tiled(double* smem, int* srow_s, const long long* xoff, int mrows, const float* xsrc, int K,
                            const void* wa, const float* sa, const void* wb, const float* sb, int N, int n0,
                            int br, int bc, double (&acc)[GT_TM][NMAT * TN][4]) {
  constexpr int BN = 32 * TN, XS = GT_BM + 1, WS = BN + 1, WP = BN / 8;
  double* xs = smem;
  double* ws = smem + GT_BK * XS;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int K4 = K & ~3;
  const int scols = g_scols<FMT>(K, bc);
  g_fill_srow<FMT>(srow_s, BN, n0, N, br, scols);
#pragma unroll
  for (int i = 0; i < GT_TM; ++i)
#pragma unroll
    for (int c = 0; c < NMAT * TN; ++c)
#pragma unroll
      for (int l = 0; l < 4; ++l) acc[i][c][l] = 0.0;

  constexpr bool QUANT = FMT == WFMT_FP8 || FMT == WFMT_FP4;
  float px[GT_TM];
  unsigned pw[NMAT][WP];
  float ps[NMAT][QUANT ? WP : 1];
  auto fetch = [&](int k0) {
    const int k = k0 + tx;
    const bool kin = k < K;
    const int sc = kin ? g_scol<FMT>(k, bc) : 0;
#pragma unroll
    for (int p = 0; p < GT_TM; ++p) {
      const int m = ty + 8 * p;
      px[p] = (kin && m < mrows) ? xsrc[xoff[m] + k] : 0.0f;
    }
#pragma unroll
    for (int mat = 0; mat < NMAT; ++mat) {
      const void* w = mat == 0 ? wa : wb;
      const float* s = mat == 0 ? sa : sb;
#pragma unroll
      for (int p = 0; p < WP; ++p) {
        const int n = n0 + ty + 8 * p;
        const bool ok = kin && n < N;
        pw[mat][p] = ok ? g_raw<FMT>(w, n, k, K) : 0u;
        if (QUANT) ps[mat][QUANT ? p : 0] = ok ? s[srow_s[ty + 8 * p] + sc] : 0.0f;
      }
    }
  };
  if (K > 0) fetch(0);
  for (int k0 = 0; k0 < K; k0 += GT_BK) {
    {
      const int k = k0 + tx;
#pragma unroll
      for (int p = 0; p < GT_TM; ++p) xs[tx * XS + ty + 8 * p] = (double)px[p];
#pragma unroll
      for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
        for (int p = 0; p < WP; ++p) {
          const int nl = ty + 8 * p;
          const float v = (k < K && n0 + nl < N) ? g_deq<FMT>(pw[mat][p], QUANT ? ps[mat][QUANT ? p : 0] : 0.0f, k) : 0.0f;
          ws[(mat * GT_BK + tx) * WS + nl] = (double)v;
        }
      }
    }
    __syncthreads();
    if (k0 + GT_BK < K) fetch(k0 + GT_BK);

    const int lane_end = min(GT_BK, K4 - k0);
    for (int kk = 0; kk < lane_end; kk += 4) {
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        double a[GT_TM], b[NMAT * TN];
#pragma unroll
        for (int i = 0; i < GT_TM; ++i) a[i] = xs[(kk + l) * XS + ty + 8 * i];
#pragma unroll
        for (int mat = 0; mat < NMAT; ++mat)
#pragma unroll
          for (int j = 0; j < TN; ++j) b[mat * TN + j] = ws[(mat * GT_BK + kk + l) * WS + tx + 32 * j];
#pragma unroll
        for (int i = 0; i < GT_TM; ++i)
#pragma unroll
          for (int c = 0; c < NMAT * TN; ++c) acc[i][c][l] = fma(a[i], b[c], acc[i][c][l]);
      }
    }
    if (k0 + GT_BK >= K) {
#pragma unroll
      for (int i = 0; i < GT_TM; ++i)
#pragma unroll
        for (int c = 0; c < NMAT * TN; ++c)
          acc[i][c][0] = (acc[i][c][0] + acc[i][c][2]) + (acc[i][c][1] + acc[i][c][3]);
      for (int kk = K4 - k0; kk < K - k0; ++kk) {
#pragma unroll
        for (int i = 0; i < GT_TM; ++i)
#pragma unroll
          for (int mat = 0; mat < NMAT; ++mat)
#pragma unroll
            for (int j = 0; j < TN; ++j)
              acc[i][mat * TN + j][0] = fma(xs[kk * XS + ty + 8 * i], ws[(mat * GT_BK + kk) * WS + tx + 32 * j],
                                            acc[i][mat * TN + j][0]);
      }
    }
    __syncthreads();
  }
}

// --------------------------------------------------------------------------- skinny path

// For at most GS_MAXR gathered rows (R <= NR <= GS_MAXR): acc[mat][r] = Σ_k x[row r, k] *
// W_mat[n0 + tid/4, k] in ops::dot order for GS_BN / NMAT outputs, valid in the threads with
// tid % 4 == 0 and tid < 4 * GS_BN / NMAT (the four lanes of an output live in four consecutive
// threads and are combined with shuffles). smem:
// GS_SMEM_FLOATS(NMAT) floats; srow_s: shared int[GS_BN]. Register prefetch as in gemm_tiled.
// Ends with a barrier.
template <int FMT, int NMAT, int NR>
DSV4_INLINE void gemm_skinny_nr(float* smem, int* srow_s, const long long* xoff, int R, const float* xsrc, int K,
                                const void* wa, const float* sa, const void* wb, const float* sb, int N, int n0,
                                int br, int bc, double (&acc)[NMAT][GS_MAXR]) {
  static_assert(GS_BK == GEMM_THREADS, "one stage column per thread");
  constexpr int BNS = GS_BN / NMAT;    // outputs per matrix (the raw prefetch is GS_BN values)
  float* xs = smem;                    // [GS_MAXR][GS_LD]
  float* ws = smem + GS_MAXR * GS_LD;  // [NMAT][BNS][GS_LD]
  const int tid = threadIdx.x;
  const int nl = tid >> 2, l = tid & 3;  // compute mapping: lane l of output nl (tid < 4 * BNS)
  const bool computes = tid < 4 * BNS;   // warp-uniform
  const int K4 = K & ~3;
  const int scols = g_scols<FMT>(K, bc);
  g_fill_srow<FMT>(srow_s, BNS, n0, N, br, scols);
#pragma unroll
  for (int mat = 0; mat < NMAT; ++mat)
#pragma unroll
    for (int r = 0; r < GS_MAXR; ++r) acc[mat][r] = 0.0;

  constexpr bool QUANT = FMT == WFMT_FP8 || FMT == WFMT_FP4;
  float px[NR];
  unsigned pw[NMAT][BNS];
  float ps[NMAT][QUANT ? BNS : 1];
  auto fetch = [&](int k0) {
    const int k = k0 + tid;
    const bool kin = k < K;
    const int sc = kin ? g_scol<FMT>(k, bc) : 0;
#pragma unroll
    for (int r = 0; r < NR; ++r) px[r] = (kin && r < R) ? xsrc[xoff[r] + k] : 0.0f;
#pragma unroll
    for (int mat = 0; mat < NMAT; ++mat) {
      const void* w = mat == 0 ? wa : wb;
      const float* s = mat == 0 ? sa : sb;
#pragma unroll
      for (int p = 0; p < BNS; ++p) {
        const bool ok = kin && n0 + p < N;
        pw[mat][p] = ok ? g_raw<FMT>(w, n0 + p, k, K) : 0u;
        if (QUANT) ps[mat][QUANT ? p : 0] = ok ? s[srow_s[p] + sc] : 0.0f;
      }
    }
  };
  if (K > 0) fetch(0);
  for (int k0 = 0; k0 < K; k0 += GS_BK) {
    {
      const int k = k0 + tid;
#pragma unroll
      for (int r = 0; r < NR; ++r) xs[r * GS_LD + tid] = px[r];
#pragma unroll
      for (int mat = 0; mat < NMAT; ++mat) {
#pragma unroll
        for (int p = 0; p < BNS; ++p)
          ws[(mat * BNS + p) * GS_LD + tid] =
              (k < K && n0 + p < N) ? g_deq<FMT>(pw[mat][p], QUANT ? ps[mat][QUANT ? p : 0] : 0.0f, k) : 0.0f;
      }
    }
    __syncthreads();
    if (k0 + GS_BK < K) fetch(k0 + GS_BK);

    if (computes) {
      // Lane phase: this thread's columns kk = l + 4 s below K4 (the same count for every l), in
      // batches of B steps: shared loads first, then each chain's FMAs in increasing s. Rows
      // R..NR-1 hold zeros and their accumulators are never read.
      constexpr int B = NR <= 2 ? 8 : 4;
      const int steps = max(0, min(GS_BK, K4 - k0)) / 4;
      int st = 0;
      for (; st + B <= steps; st += B) {
        float wf[NMAT][B], xf[NR][B];
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const int kk = l + 4 * (st + b);
#pragma unroll
          for (int mat = 0; mat < NMAT; ++mat) wf[mat][b] = ws[(mat * BNS + nl) * GS_LD + kk];
#pragma unroll
          for (int r = 0; r < NR; ++r) xf[r][b] = xs[r * GS_LD + kk];
        }
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
          for (int r = 0; r < NR; ++r)
#pragma unroll
            for (int mat = 0; mat < NMAT; ++mat)
              acc[mat][r] = fma((double)xf[r][b], (double)wf[mat][b], acc[mat][r]);
      }
      for (; st < steps; ++st) {
        const int kk = l + 4 * st;
#pragma unroll
        for (int r = 0; r < NR; ++r)
#pragma unroll
          for (int mat = 0; mat < NMAT; ++mat)
            acc[mat][r] = fma((double)xs[r * GS_LD + kk], (double)ws[(mat * BNS + nl) * GS_LD + kk], acc[mat][r]);
      }
      if (k0 + GS_BK >= K) {
        // Combine the lanes of each output (threads 4q .. 4q + 3 of a warp), then the tail.
        const int q = (tid & 31) & ~3;
#pragma unroll
        for (int mat = 0; mat < NMAT; ++mat)
#pragma unroll
          for (int r = 0; r < NR; ++r) {
            if (r < R) {
              const double a = acc[mat][r];
              const double a0 = __shfl_sync(0xffffffffu, a, q), a1 = __shfl_sync(0xffffffffu, a, q + 1);
              const double a2 = __shfl_sync(0xffffffffu, a, q + 2), a3 = __shfl_sync(0xffffffffu, a, q + 3);
              double s = (a0 + a2) + (a1 + a3);
              if (l == 0)
                for (int kk = K4 - k0; kk < K - k0; ++kk)
                  s = fma((double)xs[r * GS_LD + kk], (double)ws[(mat * BNS + nl) * GS_LD + kk], s);
              acc[mat][r] = s;
            }
          }
      }
    }
    __syncthreads();
  }
}
// gemm_skinny_nr compiled for the row count: R <= NR, with NR in {1, 2, 4, 8} (no work issued
// for rows that do not exist).
template <int FMT, int NMAT>
DSV4_INLINE void gemm_skinny(float* smem, int* srow_s, const long long* xoff, int R, const float* xsrc, int K,
                             const void* wa, const float* sa, const void* wb, const float* sb, int N, int n0,
                             int br, int bc, double (&acc)[NMAT][GS_MAXR]) {
  if (R <= 1)
    gemm_skinny_nr<FMT, NMAT, 1>(smem, srow_s, xoff, R, xsrc, K, wa, sa, wb, sb, N, n0, br, bc, acc);
  else if (R <= 2)
    gemm_skinny_nr<FMT, NMAT, 2>(smem, srow_s, xoff, R, xsrc, K, wa, sa, wb, sb, N, n0, br, bc, acc);
  else if (R <= 4)
    gemm_skinny_nr<FMT, NMAT, 4>(smem, srow_s, xoff, R, xsrc, K, wa, sa, wb, sb, N, n0, br, bc, acc);
  else
    gemm_skinny_nr<FMT, NMAT, GS_MAXR>(smem, srow_s, xoff, R, xsrc, K, wa, sa, wb, sb, N, n0, br, bc, acc);
}
// ================================================================ end of GEMM core

