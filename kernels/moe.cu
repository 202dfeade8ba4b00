// moe kernel family: see kernels/SPEC.md (## moe.cu) and src/reference/moe.rs.
//
// router_kernel -> moe_plan_kernel -> (act_quant) -> moe_up_kernel -> (act_quant) -> moe_down_kernel
// -> moe_combine_kernel, plus swiglu_kernel for the shared expert (whose GEMMs are linear_kernel).
// Every dot product is accumulated in f64 in exactly the order of the CPU reference's `ops::dot`
// (four lane accumulators over the first K & ~3 columns, combined (a0 + a2) + (a1 + a3), then the
// K % 4 tail in order), so logits and expert GEMMs are bit-identical to the reference. No atomics:
// the plan is built with warp-ordered counting and scans, so every output is deterministic.
//
// The expert GEMMs share linear.cu's GEMM core (gemm_core.cuh): a tile with at most GS_MAXR rows
// takes the skinny path (decode), larger tiles the tiled path.
#include "common.cuh"

#define FULL_MASK 0xffffffffu

// From dsv4_consts.cuh (src/cuda/kernels/moe.rs): the router score functions SCORE_* (`scoring`,
// moe.rs scoring_code); ROUTER_MAX_K, the largest experts_per_tok the router supports;
// ROUTER_TOKENS, tokens per router block; the plan's single block of PLAN_THREADS threads
// (PLAN_WARPS warps, each owning a contiguous segment of the assignments).

#include "gemm_core.cuh"
#include "moe_plan.cuh"  // the plan's block and scans
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
  dsv4_pdl_begin();
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
      } else {  // SCORE_SQRTSOFTPLUS
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
        warp_argmax(bv, bi);
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

// One block of PLAN_THREADS threads (moe_plan_block, moe_plan.cuh); dynamic shared memory (PLAN_WARPS + 1) * E +
// 1 ints. Groups the assignments a = t*k + j by expert, stable in a: offsets[e] .. offsets[e+1] is expert
// e's range of `rows`, rows[r] the assignment; tiles (expert, start, count) cover every expert's
// range with at most tile_rows rows each, in expert order; *ntiles their number. Ids outside
// [0, E) are left out. `clear` (may be NULL): clear_words u32 zeroed as well, for the fast set's fused
// expert GEMMs that run next (their synchronisation words, fast_moe_gemm.cu).
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
    moe_plan_kernel(const int* ids, int T, int k, int E, int tile_rows, int* offsets, int* rows, int* tiles,
                    int* ntiles, unsigned* clear, int clear_words) {
  dsv4_pdl_begin();
  if (clear != 0)
    for (int i = threadIdx.x; i < clear_words; i += blockDim.x) clear[i] = 0u;
  extern __shared__ int psm[];
  __shared__ int wsum[32];
  moe_plan_block<PLAN_WARPS>(ids, T, k, E, tile_rows, offsets, rows, tiles, ntiles, psm, wsum,
                             PlanSync{0u, (unsigned)blockDim.x});
}

// The same plan over many blocks, for many assignments (the fast set from fast_moe::WIDE_PLAN_MIN_TOKENS tokens):
// moe_plan_kernel's one block walks 24 576 assignments at 4096 tokens x 6 in 16 warps, one dependent
// 32-assignment step after another (61 µs, H200). Three launches, each wide, with moe_plan_kernel's outputs
// bit for bit (the same stable order: blocks, then warps, then lanes, in a):
// 1. moe_plan_count_kernel: block b counts its PLAN_CHUNK assignments b·PLAN_CHUNK .. per expert into
//    counts[b][e], and gives each assignment its rank among the block's earlier ones of its expert (ranks[a];
//    -1 for an id outside [0, E)).
// 2. moe_plan_scan_kernel (one block): counts[b][e] becomes the number of expert e's assignments in blocks
//    before b; offsets, tiles and *ntiles as moe_plan_kernel makes them.
// 3. moe_plan_place_kernel: rows[offsets[e] + counts[a / PLAN_CHUNK][e] + ranks[a]] = a.

// Block b of PLAN_CHUNK threads (one assignment each); dynamic shared memory (PLAN_CHUNK / 32) * E ints.
extern "C" __global__ void __launch_bounds__(PLAN_CHUNK)
    moe_plan_count_kernel(const int* ids, int n, int E, int* counts, int* ranks) {
  dsv4_pdl_begin();
  extern __shared__ int wcnt[];  // [PLAN_CHUNK / 32][E]: per-warp counts, then bases
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int a = blockIdx.x * PLAN_CHUNK + tid;
  int e = a < n ? ids[a] : -1;
  if (e < 0 || e >= E) e = -1;
  for (int i = tid; i < (PLAN_CHUNK / 32) * E; i += PLAN_CHUNK) wcnt[i] = 0;
  __syncthreads();
  const unsigned peers = __match_any_sync(FULL_MASK, e), below = peers & ((1u << lane) - 1u);
  if (e >= 0 && below == 0u) wcnt[warp * E + e] = __popc(peers);
  __syncthreads();
  for (int x = tid; x < E; x += PLAN_CHUNK) {
    int run = 0;
    for (int w = 0; w < PLAN_CHUNK / 32; ++w) {
      const int c = wcnt[w * E + x];
      wcnt[w * E + x] = run;
      run += c;
    }
    counts[(long long)blockIdx.x * E + x] = run;
  }
  __syncthreads();
  if (a < n) ranks[a] = e >= 0 ? wcnt[warp * E + e] + __popc(below) : -1;
}

// One block of PLAN_CHUNK threads over nb count blocks, E <= PLAN_CHUNK; dynamic shared memory (E + 1 +
// PLAN_CHUNK) ints. Thread (part p, expert e) = (tid / E, tid % E) takes expert e's counts of the p-th of
// `parts` = PLAN_CHUNK / E runs of blocks (one thread an expert's whole run: 96 dependent steps at 16384
// tokens, 25 µs).
extern "C" __global__ void __launch_bounds__(PLAN_CHUNK)
    moe_plan_scan_kernel(int nb, int E, int tile_rows, int* counts, int* offsets, int* tiles, int* ntiles) {
  dsv4_pdl_begin();
  extern __shared__ int eoff[];  // [E + 1]: totals, then offsets
  int* part_base = eoff + E + 1;  // [parts][E]: a part's sum, then the counts before it
  __shared__ int wsum[32];
  const int parts = max(1, PLAN_CHUNK / E), per = (nb + parts - 1) / parts;
  const int p = threadIdx.x / E, e = threadIdx.x % E;
  const bool mine = p < parts;
  const int b0 = mine ? min(nb, p * per) : nb, b1 = mine ? min(nb, b0 + per) : nb;
  int sum = 0;
#pragma unroll 8
  for (int b = b0; b < b1; ++b) sum += counts[(long long)b * E + e];
  if (mine) part_base[p * E + e] = sum;
  __syncthreads();
  if (threadIdx.x < E) {
    int run = 0;
    for (int q = 0; q < parts; ++q) {
      const int c = part_base[q * E + threadIdx.x];
      part_base[q * E + threadIdx.x] = run;
      run += c;
    }
    eoff[threadIdx.x] = run;
  }
  __syncthreads();
  if (mine) {
    int run = part_base[p * E + e];
#pragma unroll 8
    for (int b = b0; b < b1; ++b) {
      const int c = counts[(long long)b * E + e];
      counts[(long long)b * E + e] = run;
      run += c;
    }
  }
  __syncthreads();
  plan_offsets_and_tiles(eoff, E, tile_rows, wsum, tiles, ntiles, PlanSync{0u, (unsigned)blockDim.x});
  for (int x = threadIdx.x; x <= E; x += blockDim.x) offsets[x] = eoff[x];
}

// One thread an assignment.
extern "C" __global__ void __launch_bounds__(256)
    moe_plan_place_kernel(const int* ids, int n, int E, const int* counts, const int* offsets, const int* ranks,
                          int* rows) {
  dsv4_pdl_begin();
  const int a = blockIdx.x * 256 + threadIdx.x;
  if (a >= n) return;
  if (ranks[a] < 0) return;
  const int e = ids[a];
  rows[offsets[e] + plan_wide_within(a, e, E, counts, ranks)] = a;
}

// ------------------------------------------------------------------------- expert GEMMs

// Outputs per expert-GEMM block on the tiled path (both projections). The grid has one block row
// per skinny block (GS_BN / 2 outputs for the up projection's two matrices, GS_BN for the down
// projection), so only every MOE_BN / that -th block row works on a tile of the tiled path.
// Shared memory of the two paths.
// MOE_UP_BNS (= GS_BN / 2) and MOE_DOWN_BNS (= GS_BN) come from dsv4_consts.cuh (moe.rs
// UP_GRID_N, DOWN_GRID_N).
#define MOE_BN 64
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
  dsv4_pdl_begin();
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
  dsv4_pdl_begin();
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
  dsv4_pdl_begin();
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
  dsv4_pdl_begin();
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
