// moe kernel family: see kernels/SPEC.md (## moe.cu) and src/reference/moe.rs.
//
// router_kernel -> moe_plan_kernel -> (act_quant) -> moe_up_kernel -> (act_quant) -> moe_down_kernel
// -> moe_combine_kernel, plus swiglu_kernel for the shared expert (whose GEMMs are linear_kernel).
// Every dot product is accumulated in f64 in exactly the order of the CPU reference's `ops::dot`
// (four lane accumulators over the first K & ~3 columns, combined (a0 + a2) + (a1 + a3), then the
// K % 4 tail in order), so logits and expert GEMMs are bit-identical to the reference. No atomics:
// the plan is built with warp-ordered counting and scans, so every output is deterministic.
//
// The expert GEMMs share linear.cu's GEMM core (pasted below): a tile with at most GS_MAXR rows
// takes the skinny path (decode), larger tiles the tiled path.
#include "common.cuh"

#define FULL_MASK 0xffffffffu

// Router score functions (`scoring`), src/cuda/kernels/moe.rs scoring_code.
#define SCORE_SQRTSOFTPLUS 0
#define SCORE_SOFTMAX 1
#define SCORE_SIGMOID 2
// Largest experts_per_tok the router supports; tokens per router block.
#define ROUTER_MAX_K 32
#define ROUTER_TOKENS 4

// Plan: one block of PLAN_THREADS threads (PLAN_WARPS warps, each owning a contiguous segment of
// the assignments).
#define PLAN_THREADS 512
#define PLAN_WARPS 16

// ==================================================================== GEMM core (shared text)
// The same core is pasted into linear.cu and moe.cu (kernels are header-free apart from
// common.cuh); keep the two copies identical.
//
// Order of every sum (the CPU reference's `ops::dot`): lane accumulators acc[k % 4] over the
// columns below K4 = K & ~3, in increasing k; then s = (acc0 + acc2) + (acc1 + acc3); then the
// columns K4..K-1 added to s in order; one rounding to f32. Products of two f32 values are exact
// in f64, so fma(a, b, c) == c + a*b here.

// Weight formats (`fmt`), as in SPEC.md and src/cuda/kernels/linear.rs WFormat.
#define WFMT_F32 0
#define WFMT_BF16 1
#define WFMT_FP8 2
#define WFMT_FP4 3
// Block of the FP4 scales along K (qmatrix.rs FP4_BLOCK).
#define FP4_SCALE_BLOCK 32

#define GEMM_THREADS 256
// Tiled path: GT_BM gathered rows x (32 * TN) outputs per matrix, GT_BK columns per stage; thread
// (tx = lane, ty = warp) owns rows ty + 8 i (i < 4) and outputs tx + 32 j.
#define GT_BM 32
#define GT_BK 32
#define GT_TM 4
// Skinny path (at most GS_MAXR rows, decode): GS_BN / NMAT outputs of each of NMAT matrices,
// GS_BK columns per stage (one column per thread when loading, so a stage is GS_BN * GS_BK weights
// in flight per block); compute thread (n = tid / 4, l = tid % 4) owns lane l of output n for every
// row. Stages are held as f32.
#define GS_MAXR 8
#define GS_BN 16
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

// ------------------------------------------------------------------------ elementwise helpers

// x * sigmoid(x) evaluated in f64, rounded once (ops.rs silu).
DSV4_INLINE float silu_f64(float x) {
  const double d = (double)x;
  return (float)(d / (1.0 + exp(-d)));
}

// Rust's f32::clamp(v, -l, l): NaN stays NaN.
DSV4_INLINE float clamp_sym(float v, float l) { return v < -l ? -l : (v > l ? l : v); }

// ------------------------------------------------------------------------------- router

// Logits of NT tokens (rows of xt) for every expert: thread (e, l) runs lane chain l of expert e
// for all NT tokens (each gate value read once), then the four lanes are combined as ops::dot does;
// logit[r][e] goes to rsm[r * 2E + e].
template <int NT>
DSV4_INLINE void router_logits(const float* xt, int D, int E, const float* gate, float* rsm) {
  const int tid = threadIdx.x, lane = tid & 31;
  const int D4 = D & ~3;
  for (int base = 0; base < 4 * E; base += blockDim.x) {
    const int idx = base + tid, e = idx >> 2, l = idx & 3;
    const float* g = gate + (long long)(e < E ? e : 0) * D;
    double a[NT];
#pragma unroll
    for (int r = 0; r < NT; ++r) a[r] = 0.0;
    if (e < E) {
#pragma unroll 8
      for (int kk = l; kk < D4; kk += 4) {
        const double gv = (double)g[kk];
#pragma unroll
        for (int r = 0; r < NT; ++r) a[r] = fma((double)xt[(long long)r * D + kk], gv, a[r]);
      }
    }
    const int q = lane & ~3;
#pragma unroll
    for (int r = 0; r < NT; ++r) {
      const double a0 = __shfl_sync(FULL_MASK, a[r], q), a1 = __shfl_sync(FULL_MASK, a[r], q + 1);
      const double a2 = __shfl_sync(FULL_MASK, a[r], q + 2), a3 = __shfl_sync(FULL_MASK, a[r], q + 3);
      if (l == 0 && e < E) {
        double s = (a0 + a2) + (a1 + a3);
        for (int kk = D4; kk < D; ++kk) s = fma((double)xt[(long long)r * D + kk], (double)g[kk], s);
        rsm[r * 2 * E + e] = (float)s;
      }
    }
  }
}

// ROUTER_TOKENS tokens per block; blockDim a multiple of 32, at least 32 * ROUTER_TOKENS; dynamic
// shared memory ROUTER_TOKENS * 2 * E floats. Logits l_e = f32(Σ f64 x·gate_e) (four threads per
// expert, one per ops::dot lane, each gate row read once for the block's tokens); scores per
// `scoring` (sqrtsoftplus: sqrt(softplus(l)), softplus in f64, sqrt in f32); selection: the hash
// table row `tid2eid[tokens[t]]` when tid2eid is given, else top-k of score + bias (bias may be
// NULL) with ties to the lower index; weights = selected scores (not biased), divided by their
// f32(Σ f64) when `renorm`, times route_scale.
extern "C" __global__ void __launch_bounds__(1024)
    router_kernel(const float* x, int T, int D, int E, int k, const float* gate, const float* bias,
                  const int* tid2eid, const int* tokens, int scoring, int renorm, float route_scale, int* ids,
                  float* weights) {
  extern __shared__ float rsm[];  // [ROUTER_TOKENS][2][E]: scores (logits first), keys (NaN = taken)
  __shared__ int chosen[ROUTER_TOKENS][ROUTER_MAX_K];
  __shared__ float wsel[ROUTER_TOKENS][ROUTER_MAX_K];
  const int t0 = blockIdx.x * ROUTER_TOKENS;
  const int nt = min(ROUTER_TOKENS, T - t0);
  if (nt <= 0) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* xt = x + (long long)t0 * D;

  switch (nt) {
    case 1:
      router_logits<1>(xt, D, E, gate, rsm);
      break;
    case 2:
      router_logits<2>(xt, D, E, gate, rsm);
      break;
    case 3:
      router_logits<3>(xt, D, E, gate, rsm);
      break;
    default:
      router_logits<ROUTER_TOKENS>(xt, D, E, gate, rsm);
      break;
  }
  __syncthreads();

  if (scoring == SCORE_SOFTMAX) {
    if (tid < nt) {
      float* score = rsm + tid * 2 * E;
      float* tmp = score + E;
      float m = -DSV4_F32_INF;
      for (int e = 0; e < E; ++e) m = fmaxf(m, score[e]);
      double s = 0.0;
      for (int e = 0; e < E; ++e) {
        tmp[e] = (float)exp((double)(score[e] - m));
        s += (double)tmp[e];
      }
      const float sf = (float)s;
      for (int e = 0; e < E; ++e) score[e] = tmp[e] / sf;
    }
  } else {
    for (int i = tid; i < nt * E; i += blockDim.x) {
      const int r = i / E, e = i - r * E;
      float* score = rsm + r * 2 * E;
      const float l = score[e];
      float s;
      if (scoring == SCORE_SIGMOID) {
        s = (float)(1.0 / (1.0 + exp(-(double)l)));
      } else {
        const float sp = l > 20.0f ? l : (float)log1p(exp((double)l));
        s = sqrtf(sp);
      }
      score[e] = s;
    }
  }
  __syncthreads();
  if (tid2eid == nullptr) {
    for (int i = tid; i < nt * E; i += blockDim.x) {
      const int r = i / E, e = i - r * E;
      float v = rsm[r * 2 * E + e];
      if (bias != nullptr) v = v + bias[e];
      rsm[r * 2 * E + E + e] = v != v ? -DSV4_F32_INF : v;  // NaN ranks below everything (ops::top_k)
    }
  }
  __syncthreads();

  // Warp r selects for token t0 + r.
  if (warp < nt) {
    const int r = warp, t = t0 + r;
    const float* score = rsm + r * 2 * E;
    float* key = rsm + r * 2 * E + E;
    for (int j = 0; j < k; ++j) {
      int sel;
      if (tid2eid != nullptr) {
        sel = tid2eid[(long long)tokens[t] * k + j];
      } else {
        float bv = -DSV4_F32_INF;
        int bi = -1;
        for (int e = lane; e < E; e += 32) {  // ascending: strict > keeps the lower index on ties
          const float v = key[e];
          if (v != v) continue;  // taken
          if (bi < 0 || v > bv) {
            bv = v;
            bi = e;
          }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
          const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
          if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) {
            bv = ov;
            bi = oi;
          }
        }
        sel = bi;
        __syncwarp();
        if (lane == 0 && sel >= 0) key[sel] = DSV4_F32_NAN;
        __syncwarp();
      }
      if (lane == 0) chosen[r][j] = sel;
    }
    if (lane == 0) {
      for (int j = 0; j < k; ++j) {
        const int c = chosen[r][j];
        wsel[r][j] = (c >= 0 && c < E) ? score[c] : 0.0f;
      }
      if (renorm) {
        double s = 0.0;
        for (int j = 0; j < k; ++j) s += (double)wsel[r][j];
        const float sf = (float)s;
        for (int j = 0; j < k; ++j) wsel[r][j] = wsel[r][j] / sf;
      }
      for (int j = 0; j < k; ++j) {
        ids[(long long)t * k + j] = chosen[r][j];
        weights[(long long)t * k + j] = wsel[r][j] * route_scale;
      }
    }
  }
}

// --------------------------------------------------------------------------------- plan

// Exclusive prefix sum of v over the block (blockDim a multiple of 32); *total gets the sum.
// Every thread must call; ends with a barrier. wsum: __shared__ int[32].
DSV4_INLINE int block_excl_scan(int v, int* wsum, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int s = lane < nw ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(FULL_MASK, s, o);
      if (lane >= o) s += y;
    }
    wsum[lane] = s;
  }
  __syncthreads();
  const int base = warp > 0 ? wsum[warp - 1] : 0;
  *total = wsum[nw - 1];
  __syncthreads();
  return base + inc - v;
}

// One block of PLAN_THREADS threads; dynamic shared memory (PLAN_WARPS + 1) * E + 1 ints.
// Groups the assignments a = t*k + j by expert, stable in a: offsets[e] .. offsets[e+1] is expert
// e's range of `rows`, rows[r] the assignment; tiles (expert, start, count) cover every expert's
// range with at most tile_rows rows each, in expert order; *ntiles their number. Ids outside
// [0, E) are left out.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
    moe_plan_kernel(const int* ids, int T, int k, int E, int tile_rows, int* offsets, int* rows, int* tiles,
                    int* ntiles) {
  extern __shared__ int psm[];
  int* cnt = psm;                   // [PLAN_WARPS][E]: per-warp counts, then bases
  int* eoff = psm + PLAN_WARPS * E;  // [E + 1]: totals, then offsets
  __shared__ int wsum[32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = T * k;
  const int seg = (n + PLAN_WARPS - 1) / PLAN_WARPS;
  const int a_begin = min(n, warp * seg), a_end = min(n, a_begin + seg);
  const unsigned lt_mask = (1u << lane) - 1u;

  for (int i = tid; i < PLAN_WARPS * E; i += blockDim.x) cnt[i] = 0;
  __syncthreads();
  // Pass 1: each warp counts its segment per expert (only a group's leader lane writes).
  for (int a0 = a_begin; a0 < a_end; a0 += 32) {
    const int a = a0 + lane;
    int e = a < a_end ? ids[a] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    if (e >= 0 && (peers & lt_mask) == 0u) cnt[warp * E + e] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  // Per expert: warp bases (exclusive over warps) and the expert's total.
  for (int e = tid; e < E; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < PLAN_WARPS; ++w) {
      const int c = cnt[w * E + e];
      cnt[w * E + e] = run;
      run += c;
    }
    eoff[e] = run;
  }
  __syncthreads();
  // Offsets and tiles: thread tid owns experts [tid*C, tid*C + C).
  const int C = (E + blockDim.x - 1) / blockDim.x;
  const int e0 = tid * C;
  int tot_local = 0, tiles_local = 0;
  for (int c = 0; c < C; ++c) {
    const int e = e0 + c;
    if (e < E) {
      tot_local += eoff[e];
      tiles_local += (eoff[e] + tile_rows - 1) / tile_rows;
    }
  }
  int tot_all, tiles_all;
  const int tot_pre = block_excl_scan(tot_local, wsum, &tot_all);
  const int tiles_pre = block_excl_scan(tiles_local, wsum, &tiles_all);
  {
    int run = tot_pre, trun = tiles_pre;
    for (int c = 0; c < C; ++c) {
      const int e = e0 + c;
      if (e >= E) break;
      const int ce = eoff[e];
      eoff[e] = run;
      const int nt = (ce + tile_rows - 1) / tile_rows;
      for (int i = 0; i < nt; ++i) {
        const int tl = trun + i;
        tiles[3 * tl + 0] = e;
        tiles[3 * tl + 1] = run + i * tile_rows;
        tiles[3 * tl + 2] = min(tile_rows, ce - i * tile_rows);
      }
      run += ce;
      trun += nt;
    }
  }
  if (tid == 0) {
    eoff[E] = tot_all;
    *ntiles = tiles_all;
  }
  __syncthreads();
  for (int e = tid; e <= E; e += blockDim.x) offsets[e] = eoff[e];
  // Pass 2: place every assignment at offset + warp base + rank among earlier peers.
  for (int a0 = a_begin; a0 < a_end; a0 += 32) {
    const int a = a0 + lane;
    int e = a < a_end ? ids[a] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned peers = __match_any_sync(FULL_MASK, e);
    if (e >= 0) rows[eoff[e] + cnt[warp * E + e] + __popc(peers & lt_mask)] = a;
    __syncwarp();
    if (e >= 0 && (peers & lt_mask) == 0u) cnt[warp * E + e] += __popc(peers);
    __syncwarp();
  }
}

// ------------------------------------------------------------------------- expert GEMMs

// Outputs per expert-GEMM block on the tiled path (both projections). The grid has one block row
// per skinny block (GS_BN / 2 outputs for the up projection's two matrices, GS_BN for the down
// projection), so only every MOE_BN / that -th block row works on a tile of the tiled path.
// Shared memory of the two paths.
#define MOE_BN 64
#define MOE_UP_BNS (GS_BN / 2)
#define MOE_DOWN_BNS GS_BN
#define MOE_UP_SMEM_DOUBLES                                                                      \
  (GT_SMEM_DOUBLES(2, 1) > (GS_SMEM_FLOATS(2) + 1) / 2 ? GT_SMEM_DOUBLES(2, 1) : (GS_SMEM_FLOATS(2) + 1) / 2)
#define MOE_DOWN_SMEM_DOUBLES                                                                    \
  (GT_SMEM_DOUBLES(1, 2) > (GS_SMEM_FLOATS(1) + 1) / 2 ? GT_SMEM_DOUBLES(1, 2) : (GS_SMEM_FLOATS(1) + 1) / 2)

// Gathered-row bookkeeping of one row block of a tile: arow[m] = assignment, xoff[m] = offset of
// its input row ((a / div) * ld). Ends with a barrier.
DSV4_INLINE void moe_rows(const int* rows, int start, int r0, int mrows, int div, long long ld, int* arow,
                          long long* xoff) {
  if (threadIdx.x < GT_BM) {
    const int m = threadIdx.x;
    const int a = m < mrows ? rows[start + r0 + m] : 0;
    arow[m] = a;
    xoff[m] = (long long)(a / div) * ld;
  }
  __syncthreads();
}

// The up-projection epilogue of one assignment a and output n (see moe_up_kernel).
DSV4_INLINE void moe_up_out(double accg, double accv, int a, int n, int I, const float* weights, float limit,
                            int official, float* h) {
  float g = (float)accg, v = (float)accv;
  if (official) {
    g = round_bf16(g);
    v = round_bf16(v);
  }
  if (limit > 0.0f) {
    g = fminf(g, limit);
    v = clamp_sym(v, limit);
  }
  float r = silu_f64(g) * v;
  r = r * weights[a];
  if (official) r = round_bf16(r);
  h[(long long)a * I + n] = r;
}

template <int FMT>
DSV4_INLINE void moe_up_body(double* smem, int* srow_s, int* arow, long long* xoff, const float* xq, int D, int I,
                             const int* rows, int e, int start, int count, int k, const unsigned long long* w1,
                             const unsigned long long* w3, const unsigned long long* s1,
                             const unsigned long long* s3, int br, int bc, const float* weights, float limit,
                             int official, float* h) {
  const void* W1 = (const void*)w1[e];
  const void* W3 = (const void*)w3[e];
  const float* S1 = s1 != nullptr ? (const float*)s1[e] : nullptr;
  const float* S3 = s3 != nullptr ? (const float*)s3[e] : nullptr;
  if (count <= GS_MAXR) {
    const int nb = blockIdx.y * MOE_UP_BNS;
    moe_rows(rows, start, 0, count, k, D, arow, xoff);
    double acc[2][GS_MAXR];
    gemm_skinny<FMT, 2>((float*)smem, srow_s, xoff, count, xq, D, W1, S1, W3, S3, I, nb, br, bc, acc);
    const int n = nb + (threadIdx.x >> 2);
    if ((threadIdx.x & 3) == 0 && threadIdx.x < 4 * MOE_UP_BNS && n < I) {
#pragma unroll
      for (int r = 0; r < GS_MAXR; ++r)
        if (r < count) moe_up_out(acc[0][r], acc[1][r], arow[r], n, I, weights, limit, official, h);
    }
    return;
  }
  if (blockIdx.y % (MOE_BN / MOE_UP_BNS) != 0) return;  // uniform per block
  const int nb = blockIdx.y / (MOE_BN / MOE_UP_BNS) * MOE_BN;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (int r0 = 0; r0 < count; r0 += GT_BM) {
    const int mrows = min(GT_BM, count - r0);
    moe_rows(rows, start, r0, mrows, k, D, arow, xoff);
    for (int half = 0; half < MOE_BN / 32; ++half) {
      const int n0 = nb + 32 * half;
      double acc[GT_TM][2][4];
      gemm_tiled<FMT, 2, 1>(smem, srow_s, xoff, mrows, xq, D, W1, S1, W3, S3, I, n0, br, bc, acc);
      const int n = n0 + tx;
#pragma unroll
      for (int i = 0; i < GT_TM; ++i) {
        const int m = ty + 8 * i;
        if (m < mrows && n < I) moe_up_out(acc[i][0][0], acc[i][1][0], arow[m], n, I, weights, limit, official, h);
      }
    }
    __syncthreads();  // arow/xoff are rewritten by the next row block
  }
}

// Grid (min(max_tiles, T*k), ceil(I / MOE_UP_BNS)) (at most T*k tiles exist), GEMM_THREADS
// threads. Per assignment a of the block's tile (token a / k): g = f32(Σ W1_e·xq), v = f32(Σ W3_e·xq)
// (bf16 if official), g = min(g, limit), v = clamp(v, ±limit) when limit > 0,
// h = silu(g) * v * weights[a] (f32), bf16 if official. w1/w3/s1/s3: device arrays of per-expert
// addresses (s1/s3 may be NULL for F32/BF16).
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_up_kernel(const float* xq, int D, int I, const int* rows, const int* tiles, const int* ntiles, int k,
                  const unsigned long long* w1, const unsigned long long* w3, const unsigned long long* s1,
                  const unsigned long long* s3, int fmt, int br, int bc, const float* weights, float limit,
                  int official, float* h) {
  __shared__ double smem[MOE_UP_SMEM_DOUBLES];
  __shared__ int srow_s[MOE_BN > GS_BN ? MOE_BN : GS_BN];
  __shared__ int arow[GT_BM];
  __shared__ long long xoff[GT_BM];
  const int tile = blockIdx.x;
  if (tile >= *ntiles) return;
  const int e = tiles[3 * tile], start = tiles[3 * tile + 1], count = tiles[3 * tile + 2];
  switch (fmt) {
    case WFMT_F32:
      moe_up_body<WFMT_F32>(smem, srow_s, arow, xoff, xq, D, I, rows, e, start, count, k, w1, w3, s1, s3, br,
                            bc, weights, limit, official, h);
      break;
    case WFMT_BF16:
      moe_up_body<WFMT_BF16>(smem, srow_s, arow, xoff, xq, D, I, rows, e, start, count, k, w1, w3, s1, s3, br,
                             bc, weights, limit, official, h);
      break;
    case WFMT_FP8:
      moe_up_body<WFMT_FP8>(smem, srow_s, arow, xoff, xq, D, I, rows, e, start, count, k, w1, w3, s1, s3, br,
                            bc, weights, limit, official, h);
      break;
    case WFMT_FP4:
      moe_up_body<WFMT_FP4>(smem, srow_s, arow, xoff, xq, D, I, rows, e, start, count, k, w1, w3, s1, s3, br,
                            bc, weights, limit, official, h);
      break;
    default:
      break;
  }
}

template <int FMT>
DSV4_INLINE void moe_down_body(double* smem, int* srow_s, int* arow, long long* xoff, const float* hq, int D,
                               int I, const int* rows, int e, int start, int count, const unsigned long long* w2,
                               const unsigned long long* s2, int br, int bc, int official, float* ya) {
  const void* W2 = (const void*)w2[e];
  const float* S2 = s2 != nullptr ? (const float*)s2[e] : nullptr;
  if (count <= GS_MAXR) {
    const int nb = blockIdx.y * MOE_DOWN_BNS;
    moe_rows(rows, start, 0, count, 1, I, arow, xoff);
    double acc[1][GS_MAXR];
    gemm_skinny<FMT, 1>((float*)smem, srow_s, xoff, count, hq, I, W2, S2, W2, S2, D, nb, br, bc, acc);
    const int n = nb + (threadIdx.x >> 2);
    if ((threadIdx.x & 3) == 0 && threadIdx.x < 4 * MOE_DOWN_BNS && n < D) {
#pragma unroll
      for (int r = 0; r < GS_MAXR; ++r) {
        if (r < count) {
          float v = (float)acc[0][r];
          if (official) v = round_bf16(v);
          ya[(long long)arow[r] * D + n] = v;
        }
      }
    }
    return;
  }
  if (blockIdx.y % (MOE_BN / MOE_DOWN_BNS) != 0) return;  // uniform per block
  const int nb = blockIdx.y / (MOE_BN / MOE_DOWN_BNS) * MOE_BN;
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  for (int r0 = 0; r0 < count; r0 += GT_BM) {
    const int mrows = min(GT_BM, count - r0);
    moe_rows(rows, start, r0, mrows, 1, I, arow, xoff);
    double acc[GT_TM][2][4];
    gemm_tiled<FMT, 1, 2>(smem, srow_s, xoff, mrows, hq, I, W2, S2, W2, S2, D, nb, br, bc, acc);
#pragma unroll
    for (int i = 0; i < GT_TM; ++i) {
      const int m = ty + 8 * i;
      if (m >= mrows) continue;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int n = nb + tx + 32 * j;
        if (n >= D) continue;
        float v = (float)acc[i][j][0];
        if (official) v = round_bf16(v);
        ya[(long long)arow[m] * D + n] = v;
      }
    }
    __syncthreads();
  }
}

// Grid (min(max_tiles, T*k), ceil(D / MOE_DOWN_BNS)), GEMM_THREADS threads: ya[a] = f32(Σ W2_e·hq[a]),
// bf16 if official.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 2)
    moe_down_kernel(const float* hq, int D, int I, const int* rows, const int* tiles, const int* ntiles,
                    const unsigned long long* w2, const unsigned long long* s2, int fmt, int br, int bc,
                    int official, float* ya) {
  __shared__ double smem[MOE_DOWN_SMEM_DOUBLES];
  __shared__ int srow_s[MOE_BN > GS_BN ? MOE_BN : GS_BN];
  __shared__ int arow[GT_BM];
  __shared__ long long xoff[GT_BM];
  const int tile = blockIdx.x;
  if (tile >= *ntiles) return;
  const int e = tiles[3 * tile], start = tiles[3 * tile + 1], count = tiles[3 * tile + 2];
  switch (fmt) {
    case WFMT_F32:
      moe_down_body<WFMT_F32>(smem, srow_s, arow, xoff, hq, D, I, rows, e, start, count, w2, s2, br, bc, official,
                              ya);
      break;
    case WFMT_BF16:
      moe_down_body<WFMT_BF16>(smem, srow_s, arow, xoff, hq, D, I, rows, e, start, count, w2, s2, br, bc,
                               official, ya);
      break;
    case WFMT_FP8:
      moe_down_body<WFMT_FP8>(smem, srow_s, arow, xoff, hq, D, I, rows, e, start, count, w2, s2, br, bc, official,
                              ya);
      break;
    case WFMT_FP4:
      moe_down_body<WFMT_FP4>(smem, srow_s, arow, xoff, hq, D, I, rows, e, start, count, w2, s2, br, bc, official,
                              ya);
      break;
    default:
      break;
  }
}

// ---------------------------------------------------------------------- shared expert, sum

// Shared expert activation: h = silu(min(g, L)) * clamp(v, ±L) (clamps only when L > 0), bf16 if
// official. Grid-stride.
extern "C" __global__ void swiglu_kernel(const float* g, const float* v, long long n, float limit, int official,
                                         float* h) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float gv = g[i], vv = v[i];
    if (limit > 0.0f) {
      gv = fminf(gv, limit);
      vv = clamp_sym(vv, limit);
    }
    float r = silu_f64(gv) * vv;
    if (official) r = round_bf16(r);
    h[i] = r;
  }
}

// out[t, i] = f32(f64 ys[t, i] + Σ_j f64 ya[t*k + j, i]) (ys may be NULL), bf16 if round_out.
// Grid-stride over T*D.
extern "C" __global__ void moe_combine_kernel(const float* ya, const float* ys, int T, int k, int D, int round_out,
                                              float* out) {
  const long long n = (long long)T * D;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    const long long t = i / D, c = i - t * D;
    double s = ys != nullptr ? (double)ys[i] : 0.0;
    for (int j = 0; j < k; ++j) s += (double)ya[(t * k + j) * D + c];
    float r = (float)s;
    if (round_out) r = round_bf16(r);
    out[i] = r;
  }
}
