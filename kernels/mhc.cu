// mhc.cu — manifold-constrained hyper-connections (MODEL.md §5; kernels/SPEC.md "mhc.cu"):
// hc_pre (flat RMS scale, mixing projection, sigmoid gates, Sinkhorn, collapse), hc_post and
// hc_head, bit for bit as src/reference/mhc.rs:
//   - every f32 operation is an explicit round-to-nearest intrinsic (no FMA contraction: the
//     reference rounds every product);
//   - the long reductions (mean of squares, mixing dot products) accumulate in f64 and round
//     once; the short ones over the N streams (Sinkhorn sums, collapse, post mix) run in the
//     reference's sequential order, starting from -0.0 like Rust's `Sum for f64`;
//   - exp / sigmoid / rsqrt in double precision, rounded once to f32.
#include "common.cuh"
#include "ref_math.cuh"

// HC_MAX_N (dsv4_consts.cuh): most residual streams (hc_mult) the kernels support; the wrappers
// check it.
#define HC_MAX_MIX ((2 + HC_MAX_N) * HC_MAX_N)
// Mixing logits accumulated per pass over a token's streams (registers per thread).
#define HC_CHUNK 24

// --------------------------------------------------------------------------------- helpers

// One block's f64 sums over columns [c0, c1) of one token's flattened streams xt (P rows of
// `cols`): out[j] = Σ_i proj[j, i]·xt[i] for j < mix, out[mix] = Σ_i xt[i]² (products in f64;
// per thread in column order, then warp butterflies, then the warps in order from 0.0). Every
// thread must call; out (shared or global) is written by threads 0..mix, visible after the
// caller's barrier. red: __shared__ double[32 * HC_CHUNK]; scratch: __shared__ double[32]. P is
// float (a site's stored projection) or double (layer 0's stream-folded projection, see
// hc_pre_kernel): the products are formed in f64 either way.
template <typename P>
DSV4_INLINE void hc_block_sums(const float* xt, long long c0, long long c1, long long cols, const P* proj, int mix,
                               double* out, double* red, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  double sq = 0.0;
  for (int j0 = 0; j0 < mix; j0 += HC_CHUNK) {
    const int cnt = min(HC_CHUNK, mix - j0);
    double acc[HC_CHUNK];
#pragma unroll
    for (int j = 0; j < HC_CHUNK; ++j) acc[j] = 0.0;
    const P* pj = proj + (long long)j0 * cols;
    for (long long i = c0 + threadIdx.x; i < c1; i += blockDim.x) {
      const double xv = (double)xt[i];
      if (j0 == 0) sq = __dadd_rn(sq, __dmul_rn(xv, xv));
#pragma unroll
      for (int j = 0; j < HC_CHUNK; ++j)
        if (j < cnt) acc[j] = __dadd_rn(acc[j], __dmul_rn((double)pj[(long long)j * cols + i], xv));
    }
#pragma unroll
    for (int j = 0; j < HC_CHUNK; ++j)
      if (j < cnt) {
        const double w = ref_warp_sum_f64(acc[j]);
        if (lane == 0) red[warp * HC_CHUNK + j] = w;
      }
    __syncthreads();
    if (threadIdx.x < cnt) {
      double s = 0.0;
      for (int w = 0; w < nwarps; ++w) s = __dadd_rn(s, red[w * HC_CHUNK + threadIdx.x]);
      out[j0 + threadIdx.x] = s;
    }
    __syncthreads();
  }
  const double ss = ref_block_sum_f64(sq, scratch);
  if (threadIdx.x == 0) out[mix] = ss;
}

// m[j] = f32(sums[j]) * rho for j < mix, rho = rsqrt(f32(sums[mix] / cols) + eps), from the
// f64 sums of hc_block_sums (shared, written before a barrier). Every thread calls; m shared.
DSV4_INLINE void hc_scale_logits(const double* sums, int mix, long long cols, float rms_eps, float* m) {
  const float ms = (float)__ddiv_rn(sums[mix], (double)cols);
  const float rho = ref_rsqrt(__fadd_rn(ms, rms_eps));
  for (int j = threadIdx.x; j < mix; j += blockDim.x) m[j] = __fmul_rn((float)sums[j], rho);
  __syncthreads();
}

// mhc.rs mix_logits for one token's flattened streams xt[nd]: m[j] = f32(Σ f64 proj[j]·xt) * rho
// for j < mix, rho = rsqrt(f32(Σ f64 xt² / nd) + eps), one block. sums: __shared__
// double[HC_MAX_MIX + 1]; red, scratch as hc_block_sums.
template <typename P>
DSV4_INLINE void hc_mix_logits(const float* xt, long long nd, const P* proj, int mix, float rms_eps, float* m,
                               double* sums, double* red, double* scratch) {
  hc_block_sums(xt, 0, nd, nd, proj, mix, sums, red, scratch);
  __syncthreads();
  hc_scale_logits(sums, mix, nd, rms_eps, m);
}

// Σ_j v_j in f64 in order, from -0.0 (Rust's `Sum for f64`), rounded once: ops.rs sum.
// The N x N matrix c (shared), lane `me` owns row / column `me` (me < n).
DSV4_INLINE float hc_row_sum(const float* c, int n, int row) {
  double s = -0.0;
  for (int k = 0; k < n; ++k) s = __dadd_rn(s, (double)c[row * n + k]);
  return (float)s;
}

DSV4_INLINE float hc_col_sum(const float* c, int n, int col) {
  double s = -0.0;
  for (int j = 0; j < n; ++j) s = __dadd_rn(s, (double)c[j * n + col]);
  return (float)s;
}

// mhc.rs sinkhorn on the n x n logits c (shared memory), run by the lanes of ONE warp (all 32
// lanes call; lane i < n owns row i in row phases and column i in column phases). Every
// value is computed by exactly the reference's operations in its order.
DSV4_INLINE void hc_sinkhorn_warp(float* c, int n, int iters, float eps) {
  const int me = threadIdx.x & 31;
  // Row softmax + eps.
  if (me < n) {
    float* row = c + me * n;
    float mx = -DSV4_F32_INF;
    for (int k = 0; k < n; ++k) mx = fmaxf(mx, row[k]);
    for (int k = 0; k < n; ++k) row[k] = ref_exp(__fsub_rn(row[k], mx));
    const float s = hc_row_sum(c, n, me);
    for (int k = 0; k < n; ++k) row[k] = __fadd_rn(__fdiv_rn(row[k], s), eps);
  }
  __syncwarp();
  for (int it = 0; it < iters; ++it) {
    if (it > 0) {  // row normalisation of rounds 1 .. iters-1
      if (me < n) {
        const float s = __fadd_rn(hc_row_sum(c, n, me), eps);
        for (int k = 0; k < n; ++k) c[me * n + k] = __fdiv_rn(c[me * n + k], s);
      }
      __syncwarp();
    }
    // Column normalisation.
    if (me < n) {
      const float s = __fadd_rn(hc_col_sum(c, n, me), eps);
      for (int j = 0; j < n; ++j) c[j * n + me] = __fdiv_rn(c[j * n + me], s);
    }
    __syncwarp();
  }
  if (iters <= 0) {
    // The reference still normalises the columns once (its loop over 1..iters is empty).
    if (me < n) {
      const float s = __fadd_rn(hc_col_sum(c, n, me), eps);
      for (int j = 0; j < n; ++j) c[j * n + me] = __fdiv_rn(c[j * n + me], s);
    }
    __syncwarp();
  }
}

// -------------------------------------------------------------------------------- hc_pre

// The gates of one token from its logits m (shared, already scaled by rho), run by the lanes of
// ONE warp: pre_i = sigmoid(a0*m_i + base_i) + hc_eps into `pre` (shared); post_i =
// 2*sigmoid(a1*m_{N+i} + base_{N+i}) and the Sinkhorn of the comb logits a2*m_{2N+i} +
// base_{2N+i} (in `c`, shared) into post_out / comb_out unless they are NULL.
DSV4_INLINE void hc_gates(const float* m, int N, const float* base, const float* scale, int iters, float hc_eps,
                          float* pre, float* c, float* post_out, float* comb_out) {
  const int me = threadIdx.x & 31;
  const float a0 = scale[0], a1 = scale[1], a2 = scale[2];
  if (me < N) {
    pre[me] = __fadd_rn(ref_sigmoid(__fadd_rn(__fmul_rn(a0, m[me]), base[me])), hc_eps);
    const float p = __fmul_rn(2.0f, ref_sigmoid(__fadd_rn(__fmul_rn(a1, m[N + me]), base[N + me])));
    if (post_out != nullptr) post_out[me] = p;
  }
  for (int i = me; i < N * N; i += 32) c[i] = __fadd_rn(__fmul_rn(a2, m[2 * N + i]), base[2 * N + i]);
  __syncwarp();
  hc_sinkhorn_warp(c, N, iters, hc_eps);
  if (comb_out != nullptr)
    for (int i = me; i < N * N; i += 32) comb_out[i] = c[i];
}

// out[i] = f32(Σ_n f64(w_n * xt[n, i])) (products in f32, the sum in stream order from -0.0),
// bf16 if round_out, for columns i0 <= i < i1 of one token's streams xt [N, D] (block-strided).
// The N stream values of a column are loaded before they are summed (N <= HC_MAX_N): a loop that
// adds each as it loads waits a memory round trip per stream.
DSV4_INLINE void hc_collapse(const float* xt, const float* w, int N, int D, int i0, int i1, int round_out,
                             float* out) {
  for (int i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    float xs[HC_MAX_N];
#pragma unroll
    for (int n = 0; n < HC_MAX_N; ++n) xs[n] = n < N ? xt[(long long)n * D + i] : 0.0f;
    double s = -0.0;
#pragma unroll
    for (int n = 0; n < HC_MAX_N; ++n)
      if (n < N) s = __dadd_rn(s, (double)__fmul_rn(w[n], xs[n]));
    float v = (float)s;
    if (round_out) v = round_bf16(v);
    out[i] = v;
  }
}

// One block per token t (grid-stride) of x [T, N, D]: mixing logits m = rho * (Φ x̄) over the
// flattened streams; pre_i = sigmoid(a0*m_i + base_i) + hc_eps, post_i = 2*sigmoid(a1*m_{N+i} +
// base_{N+i}), comb logits a2*m_{2N+i} + base_{2N+i} -> Sinkhorn (iters rounds); u[t, i] =
// f32(Σ_n f64(pre_n * x[t, n, i])) (products in f32), bf16 if round_u. Outputs u [T, D],
// post [T, N], comb [T, N, N]. proj [(2+N)*N, N*D], base [(2+N)*N], scale [3]. N <= HC_MAX_N.
// fold: NULL, or (layer 0, where every stream holds the same embedding) the f64 projection
// [(2+N)*N, D] with fold[j, i] = Σ_n proj[j, n*D + i]: the logits then read stream 0 only
// (D instead of N*D columns) and equal the unfolded ones (f64 products and sums; see mhc.rs).
extern "C" __global__ void hc_pre_kernel(const float* x, int T, int N, int D, const float* proj, const float* base,
                                         const float* scale, const double* fold, int iters, float hc_eps,
                                         float rms_eps, int round_u, float* u, float* post, float* comb) {
  dsv4_pdl_begin();
  __shared__ float m[HC_MAX_MIX];
  __shared__ float c[HC_MAX_N * HC_MAX_N];
  __shared__ float pre[HC_MAX_N];
  __shared__ double sums[HC_MAX_MIX + 1];
  __shared__ double red[32 * HC_CHUNK];
  __shared__ double scratch[32];
  const long long nd = (long long)N * D;
  const int mix = (2 + N) * N;
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    const float* xt = x + (long long)t * nd;
    if (fold != nullptr)
      hc_mix_logits(xt, (long long)D, fold, mix, rms_eps, m, sums, red, scratch);
    else
      hc_mix_logits(xt, nd, proj, mix, rms_eps, m, sums, red, scratch);
    if (threadIdx.x < 32)
      hc_gates(m, N, base, scale, iters, hc_eps, pre, c, post + (long long)t * N, comb + (long long)t * N * N);
    __syncthreads();
    hc_collapse(xt, pre, N, D, 0, D, round_u, u + (long long)t * D);
    __syncthreads();  // shared m / c / pre are reused by the next token
  }
}

// ------------------------------------------------------------------------------- hc_post

// In place over x [T, N, D]: x'[t, k, i] = post[t, k] * a[t, i] + f32(Σ_j f64(C[t, j, k]) *
// f64(x[t, j, i])) (the sum in order j = 0..N, from -0.0), bf16 if round_out. One thread per
// (t, i): it reads all N streams before writing any, so in place is safe. round_in: a holds a
// projection's unrounded f32 outputs whose official values are their bf16 roundings (the attention's
// wo_b: its many-token GEMM then needs no rounding pass over its output), rounded here as read.
extern "C" __global__ void hc_post_kernel(float* x, const float* a, const float* post, const float* comb, int T, int N,
                                          int D, int round_in, int round_out) {
  dsv4_pdl_begin();
  const long long total = (long long)T * D;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long t = e / D, i = e - t * D;
    float* xt = x + t * N * D + i;
    const float* ct = comb + t * N * N;
    float xs[HC_MAX_N];
#pragma unroll
    for (int j = 0; j < HC_MAX_N; ++j) xs[j] = j < N ? xt[(long long)j * D] : 0.0f;
    const float av = round_in ? round_bf16(a[t * D + i]) : a[t * D + i];
#pragma unroll
    for (int k = 0; k < HC_MAX_N; ++k) {
      if (k >= N) break;
      double s = -0.0;
#pragma unroll
      for (int j = 0; j < HC_MAX_N; ++j)
        if (j < N) s = __dadd_rn(s, __dmul_rn((double)ct[j * N + k], (double)xs[j]));
      float v = __fadd_rn(__fmul_rn(post[t * N + k], av), (float)s);
      if (round_out) v = round_bf16(v);
      xt[(long long)k * D] = v;
    }
  }
}

// ------------------------------------------------------------------------------- hc_head

// One block per row r (grid-stride) of x [R, N, D]: m = rho * (Φ x̄) with proj [N, N*D];
// w_n = sigmoid(m_n*scale0 + base_n) + hc_eps; y[r, i] = f32(Σ_n f64(w_n * x[r, n, i]))
// (products in f32, sum in order from -0.0), bf16 if round_out. y [R, D].
extern "C" __global__ void hc_head_kernel(const float* x, int R, int N, int D, const float* proj, const float* base,
                                          const float* scale, float hc_eps, float rms_eps, int round_out, float* y) {
  dsv4_pdl_begin();
  __shared__ float m[HC_MAX_N];
  __shared__ float w[HC_MAX_N];
  __shared__ double sums[HC_MAX_N + 1];
  __shared__ double red[32 * HC_CHUNK];
  __shared__ double scratch[32];
  const long long nd = (long long)N * D;
  for (int r = blockIdx.x; r < R; r += gridDim.x) {
    const float* xr = x + (long long)r * nd;
    hc_mix_logits(xr, nd, proj, N, rms_eps, m, sums, red, scratch);
    if (threadIdx.x < N)
      w[threadIdx.x] = __fadd_rn(ref_sigmoid(__fadd_rn(__fmul_rn(m[threadIdx.x], scale[0]), base[threadIdx.x])), hc_eps);
    __syncthreads();
    hc_collapse(xr, w, N, D, 0, D, round_out, y + (long long)r * D);
    __syncthreads();
  }
}

// ------------------------------------------------------------ few tokens: split over blocks

// With few tokens one block per token leaves the GPU idle and waits on one SM's memory latency
// (a Flash-shaped hc_pre at T = 1 took ~270 µs). Instead hc_mix_partial_kernel splits each
// token's columns over S = gridDim.x blocks: block s writes its f64 partial sums of the `mix`
// logits' dot products and of x² into partials [T, S, mix + 1]; then hc_pre_finish_kernel /
// hc_head_finish_kernel add them in s order and do what the one-block kernels do after
// hc_mix_logits, each block for a slice of the D outputs. Only the grouping of the f64 sums
// changes (as any thread layout does): the f32 results are the reference's unless an f64 rounding
// error straddles an f32 rounding boundary (docs/numerics.md; tests/gpu_mhc.rs compares bit for bit).

// Grid (S, T): partials [T, S, mix + 1] of x [T, N, D] against proj [mix, N*D], or (fold not
// NULL: layer 0, hc_pre_kernel) against fold [mix, D] over stream 0's D columns.
extern "C" __global__ void hc_mix_partial_kernel(const float* x, int N, int D, const float* proj, const double* fold,
                                                 int mix, double* partials) {
  dsv4_pdl_begin();
  __shared__ double red[32 * HC_CHUNK];
  __shared__ double scratch[32];
  const long long nd = (long long)N * D;
  const int t = blockIdx.y;
  const float* xt = x + (long long)t * nd;
  double* out = partials + ((long long)t * gridDim.x + blockIdx.x) * (mix + 1);
  // Block s's slice of the columns.
  const long long cols = fold != nullptr ? (long long)D : nd;
  const long long len = (cols + gridDim.x - 1) / gridDim.x;
  const long long c0 = min((long long)blockIdx.x * len, cols), c1 = min(c0 + len, cols);
  if (fold != nullptr)
    hc_block_sums(xt, c0, c1, cols, fold, mix, out, red, scratch);
  else
    hc_block_sums(xt, c0, c1, cols, proj, mix, out, red, scratch);
}

// hc_mix_logits' m for token blockIdx.y from its S partial sums (hc_mix_partial_kernel), added in
// s order from 0.0 into sums (shared double[mix + 1]). Every thread calls; blockDim > mix.
// The partials are loaded HC_FINISH_LOADS at a time before they are added (the same order): a
// loop that adds each as it loads waits a memory round trip per split (32 at one token: most of a
// batch-1 hc_pre_finish's ~28 us).
#define HC_FINISH_LOADS 16
DSV4_INLINE void hc_finish_logits(const double* partials, int S, int mix, long long cols, float rms_eps, float* m,
                                  double* sums) {
  const double* p = partials + (long long)blockIdx.y * S * (mix + 1);
  if (threadIdx.x <= mix) {
    double s = 0.0;
    for (int k0 = 0; k0 < S; k0 += HC_FINISH_LOADS) {
      double v[HC_FINISH_LOADS];
#pragma unroll
      for (int j = 0; j < HC_FINISH_LOADS; ++j)
        v[j] = k0 + j < S ? p[(long long)(k0 + j) * (mix + 1) + threadIdx.x] : 0.0;
#pragma unroll
      for (int j = 0; j < HC_FINISH_LOADS; ++j)
        if (k0 + j < S) s = __dadd_rn(s, v[j]);
    }
    sums[threadIdx.x] = s;
  }
  __syncthreads();
  hc_scale_logits(sums, mix, cols, rms_eps, m);
}

// Grid (S2, T): hc_pre_kernel's outputs from S partials per token (hc_mix_partial_kernel); block
// (b, t) writes u for its slice of the D columns, block 0 post and comb. cols = N*D, or D with
// the layer-0 fold.
extern "C" __global__ void hc_pre_finish_kernel(const float* x, int N, int D, int cols, const float* base,
                                                const float* scale, int iters, float hc_eps, float rms_eps, int S,
                                                const double* partials, int round_u, float* u, float* post,
                                                float* comb) {
  dsv4_pdl_begin();
  __shared__ float m[HC_MAX_MIX];
  __shared__ float c[HC_MAX_N * HC_MAX_N];
  __shared__ float pre[HC_MAX_N];
  __shared__ double sums[HC_MAX_MIX + 1];
  const int t = blockIdx.y, mix = (2 + N) * N;
  hc_finish_logits(partials, S, mix, cols, rms_eps, m, sums);
  const bool first = blockIdx.x == 0;
  if (threadIdx.x < 32)
    hc_gates(m, N, base, scale, iters, hc_eps, pre, c, first ? post + (long long)t * N : nullptr,
             first ? comb + (long long)t * N * N : nullptr);
  __syncthreads();
  const int len = (D + gridDim.x - 1) / gridDim.x;
  const int i0 = min((int)blockIdx.x * len, D);
  hc_collapse(x + (long long)t * N * D, pre, N, D, i0, min(i0 + len, D), round_u, u + (long long)t * D);
}

// Grid (S2, R): hc_head_kernel's output from S partials per row, each block a slice of D.
extern "C" __global__ void hc_head_finish_kernel(const float* x, int N, int D, const float* base, const float* scale,
                                                 float hc_eps, float rms_eps, int S, const double* partials,
                                                 int round_out, float* y) {
  dsv4_pdl_begin();
  __shared__ float m[HC_MAX_N];
  __shared__ float w[HC_MAX_N];
  __shared__ double sums[HC_MAX_N + 1];
  const int r = blockIdx.y;
  hc_finish_logits(partials, S, N, (long long)N * D, rms_eps, m, sums);
  if (threadIdx.x < N)
    w[threadIdx.x] = __fadd_rn(ref_sigmoid(__fadd_rn(__fmul_rn(m[threadIdx.x], scale[0]), base[threadIdx.x])), hc_eps);
  __syncthreads();
  const int len = (D + gridDim.x - 1) / gridDim.x;
  const int i0 = min((int)blockIdx.x * len, D);
  hc_collapse(x + (long long)r * N * D, w, N, D, i0, min(i0 + len, D), round_out, y + (long long)r * D);
}

// ------------------------------------------------------------------- derived: layer-0 fold

// Layer 0's stream-folded hc_attn projection (src/model/hc_fold.rs fold_projection):
// fold[j, i] = Σ_s proj[j, s*D + i] over the N streams, in f64, summed in stream order from
// +0.0, so it is bit-identical to the host fold. `mix` = (2+N)*N rows; one thread per output.
// Rebuilt at finalize and after every refit, from the device copy of `proj`.
extern "C" __global__ void hc0_fold_kernel(const float* proj, int mix, int N, int D, double* fold) {
  const long long total = (long long)mix * D;
  for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < total;
       o += (long long)gridDim.x * blockDim.x) {
    const long long j = o / D, i = o % D;
    double acc = 0.0;
    for (int s = 0; s < N; ++s) acc = __dadd_rn(acc, (double)proj[j * N * D + (long long)s * D + i]);
    fold[o] = acc;
  }
}
