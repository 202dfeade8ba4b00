// fast_moe kernel family: the fast set's MoE routing and combine (kernels/SPEC.md ## fast_moe.cu).
//
// fmoe_logits_kernel (+ FP8 quantisation of x) -> fmoe_select_kernel -> moe_plan_kernel (moe.cu, with
// tile_rows = FMOE_TOKENS) -> fmoe_up_kernel -> fmoe_down_kernel (fast_moe_gemm.cu) -> fmoe_combine_kernel.
// f32 arithmetic in a fixed order (no atomics): deterministic bit for bit, not bit-identical to the f64
// reference kernels.
#include "common.cuh"
#include "fp8_mma.cuh"

// FMOE_LOGIT_WARPS, FMOE_LOGIT_EXPERTS, FMOE_LOGIT_SPLIT, FMOE_LOGIT_TOKENS, FMOE_SELECT_WARPS, FMOE_MAX_EPL and
// SCORE_* come from
// dsv4_consts.cuh (src/cuda/kernels/fast_moe.rs, moe.rs).

// x's official act_quant of 128-block b of tokens t0 .. t0 + nt - 1, by one warp: the e4m3 codes in fragment
// order (fp8_mma.cuh) into xq[t][d], the block's scale into xs[t][b] (value x scale bit-identical to
// act_quant_kernel).
DSV4_INLINE void fmoe_quant_x_block(const float* x, int t0, int nt, int D, int b, unsigned char* xq, float* xs) {
  const int lane = threadIdx.x & 31;
  // Eight rows' loads in flight at a time: one at a time, the wide router's 64-row blocks waited on memory
  // for each row in turn.
  for (int r0 = 0; r0 < nt; r0 += 8) {
    float4 v8[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (r0 + i < nt) v8[i] = reinterpret_cast<const float4*>(x + (long long)(t0 + r0 + i) * D + b * 128)[lane];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (r0 + i >= nt) break;  // uniform over the warp
      const long long t = t0 + r0 + i;
      const float4 v = v8[i];
      const float amax = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
      const float s = ue8m0_scale(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX);
      // s is a power of two, so v · (1 / s) is v / s exactly (one rounding either way).
      const float inv = 1.0f / s;
      const float vv[4] = {v.x, v.y, v.z, v.w};
      unsigned code[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float q = vv[c] * inv;
        q = q < -DSV4_E4M3_MAX ? -DSV4_E4M3_MAX : (q > DSV4_E4M3_MAX ? DSV4_E4M3_MAX : q);
        code[c] = e4m3_code_rn(q);
      }
      // Fragment order (fp8_mma.cuh): this lane holds physical k 8·t8 + 4·(lane % 2) + c of the lane / 8-th
      // 32-block (t8 = lane % 8 / 2); c = 0, 2 are even elements (positions 4·t8 + 2·(lane % 2) + 0, 1),
      // c = 1, 3 odd ones (the same + 16).
      unsigned char* blk = xq + t * D + b * 128 + 32 * (lane >> 3) + 4 * ((lane & 7) >> 1) + 2 * (lane & 1);
      *reinterpret_cast<unsigned short*>(blk) = (unsigned short)(code[0] | (code[2] << 8));
      *reinterpret_cast<unsigned short*>(blk + 16) = (unsigned short)(code[1] | (code[3] << 8));
      if (lane == 0) xs[t * (D / 128) + b] = s;
    }
  }
}

// The router score of logit l: sqrt(softplus(l)) (linear above 20) or sigmoid(l), or l itself for softmax
// scoring (fmoe_select_kernel normalises over the experts).
DSV4_INLINE float fmoe_score(float l, int scoring) {
  if (scoring == SCORE_SQRTSOFTPLUS) return sqrtf(l > 20.0f ? l : log1pf(expf(l)));
  if (scoring == SCORE_SIGMOID) return 1.0f / (1.0f + expf(-l));
  return l;
}

// Router scores in f32, and x's act_quant, for few tokens. Block (bx, by) takes token group by *
// FMOE_LOGIT_TOKENS + [0, FMOE_LOGIT_TOKENS); its FMOE_LOGIT_WARPS warps are FMOE_LOGIT_EXPERTS experts x
// FMOE_LOGIT_SPLIT parts of D, so many warps stream the gate at once:
// - warp w: expert e = bx * FMOE_LOGIT_EXPERTS + w / FMOE_LOGIT_SPLIT, its part w % FMOE_LOGIT_SPLIT of the
//   dot products with 16-byte loads, per-lane sums in k order, a fixed butterfly, then the parts summed in
//   order: the logit l, scores[t][e] = fmoe_score(l);
// - warp w of blocks with b = bx * FMOE_LOGIT_WARPS + w < D / 128: fmoe_quant_x_block of block b.
// Requires D % (4 * FMOE_LOGIT_SPLIT) == 0 and D % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_LOGIT_WARPS * 32)
    fmoe_logits_kernel(const float* x, int T, int D, int E, const float* gate, int scoring, float* scores,
                       unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  __shared__ float part_sum[FMOE_LOGIT_WARPS][FMOE_LOGIT_TOKENS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.y * FMOE_LOGIT_TOKENS;
  const int nt = min(FMOE_LOGIT_TOKENS, T - t0);
  if (nt <= 0) return;  // whole block
  const int b = blockIdx.x * FMOE_LOGIT_WARPS + warp;
  if (b < D / 128) fmoe_quant_x_block(x, t0, nt, D, b, xq, xs);
  const int e = blockIdx.x * FMOE_LOGIT_EXPERTS + warp / FMOE_LOGIT_SPLIT;
  const int part = warp % FMOE_LOGIT_SPLIT;
  const int c_begin = part * (D / 4 / FMOE_LOGIT_SPLIT), c_end = c_begin + D / 4 / FMOE_LOGIT_SPLIT;
  float acc[FMOE_LOGIT_TOKENS];
#pragma unroll
  for (int r = 0; r < FMOE_LOGIT_TOKENS; ++r) acc[r] = 0.0f;
  if (e < E) {
    const float4* g4 = reinterpret_cast<const float4*>(gate + (long long)e * D);
#pragma unroll 4
    for (int c = c_begin + lane; c < c_end; c += 32) {
      const float4 gv = g4[c];
#pragma unroll
      for (int r = 0; r < FMOE_LOGIT_TOKENS; ++r) {
        if (r < nt) {
          const float4 xv = reinterpret_cast<const float4*>(x + (long long)(t0 + r) * D)[c];
          acc[r] = fmaf(xv.x, gv.x, acc[r]);
          acc[r] = fmaf(xv.y, gv.y, acc[r]);
          acc[r] = fmaf(xv.z, gv.z, acc[r]);
          acc[r] = fmaf(xv.w, gv.w, acc[r]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < FMOE_LOGIT_TOKENS; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == 0) part_sum[warp][r] = s;
  }
  __syncthreads();
  // Thread (expert slot, token) = (tid / FMOE_LOGIT_TOKENS, tid % FMOE_LOGIT_TOKENS) finishes one logit.
  const int slot = threadIdx.x / FMOE_LOGIT_TOKENS, r = threadIdx.x % FMOE_LOGIT_TOKENS;
  const int ex = blockIdx.x * FMOE_LOGIT_EXPERTS + slot;
  if (slot < FMOE_LOGIT_EXPERTS && ex < E && r < nt) {
    float l = 0.0f;
    for (int p = 0; p < FMOE_LOGIT_SPLIT; ++p) l += part_sum[slot * FMOE_LOGIT_SPLIT + p][r];
    scores[(long long)(t0 + r) * E + ex] = fmoe_score(l, scoring);
  }
}

// The same scores and quantisation for many tokens, as a register-tiled f32 GEMM: block (bx, by) computes the
// logits of FMOE_WIDE_TOKENS tokens t0 = by * FMOE_WIDE_TOKENS .. and FMOE_WIDE_EXPERTS experts e0 = bx *
// FMOE_WIDE_EXPERTS ..; thread (ty, tx) = (tid / 16, tid % 16) owns tokens t0 + ty + 16i (i < 4) and
// experts e0 + tx + 16j (j < 8). x's and the gate's rows pass through shared memory FMOE_WIDE_KC k at a time
// ([row][k], rows padded to FMOE_WIDE_KC + 4 floats, so the 16-byte reads of a warp's 2 consecutive token
// rows, or 16 consecutive expert rows, take the fewest wavefronts), in a ring of FMOE_WIDE_STAGES stages
// filled by cp.async. The order of each logit's sum, fixed (so a token's logits do not depend on the batch
// or the tile): per 128-block of k an FMA chain from zero in k order, then the blocks' sums added in order
// to the logit: an f32 error ≤ (128 + D / 128) · 2^-24 · Σ_d |x_d g_ed| (gpu_fast_moe's bound). Warps
// w of blocks with b = bx * FMOE_WIDE_WARPS + w (+ the grid's x extent's warps, ...) < D / 128 also run
// fmoe_quant_x_block of block b for the block's tokens, first (the GEMM's x reads then hit L2).
// At B = 4096 it takes 0.49 ms (ncu; ~18 TFLOP/s, under half the FP32 pipe's peak: 8 warps an SM, issue
// slots 55% busy), where the kernel it replaced, a warp per 4 experts with per-lane partial sums over D / 32
// k, took 1.0 ms of the layer's 5.3. Requires D % 128 == 0.
#define FMOE_WIDE_ROW (FMOE_WIDE_KC + 4)  // floats per shared row
#define FMOE_WIDE_STAGE ((FMOE_WIDE_TOKENS + FMOE_WIDE_EXPERTS) * FMOE_WIDE_ROW)
static_assert(FMOE_WIDE_WARPS * 32 == 256 && FMOE_WIDE_TOKENS == 64 && FMOE_WIDE_EXPERTS == 128,
              "fmoe_logits_wide_kernel: 16 x 16 threads of 4 tokens x 8 experts");
static_assert(128 % FMOE_WIDE_KC == 0 && FMOE_WIDE_KC % 4 == 0, "fmoe_logits_wide_kernel: k stages tile a 128-block");
static_assert(FMOE_WIDE_STAGES * FMOE_WIDE_STAGE * 4 <= 48 * 1024, "fmoe_logits_wide_kernel: static shared memory");

// Copies stage kb (k = kb · FMOE_WIDE_KC ..) of the block's x and gate rows into ring slot `dst`: 16 bytes a
// copy, rows past T or E repeat the last row (computed, never stored).
DSV4_INLINE void fmoe_wide_fill(const float* x, int T, int D, int E, const float* gate, int t0, int e0, int kb,
                                float* dst) {
  constexpr int kChunks = FMOE_WIDE_KC / 4;  // 16-byte chunks of a row
  for (int c = threadIdx.x; c < (FMOE_WIDE_TOKENS + FMOE_WIDE_EXPERTS) * kChunks; c += FMOE_WIDE_WARPS * 32) {
    const int r = c / kChunks, q = c % kChunks;
    const float* src = r < FMOE_WIDE_TOKENS ? x + (long long)min(t0 + r, T - 1) * D
                                             : gate + (long long)min(e0 + r - FMOE_WIDE_TOKENS, E - 1) * D;
    cp_async_16(smem_addr(dst + r * FMOE_WIDE_ROW + 4 * q), src + kb * FMOE_WIDE_KC + 4 * q);
  }
}

// The thread's 4 token rows and 8 expert rows at k .. k + 3 of a stage.
DSV4_INLINE void fmoe_wide_operands(const float* xr, const float* gr, int k, float4 (&xv)[4], float4 (&gv)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) xv[i] = *reinterpret_cast<const float4*>(xr + 16 * i * FMOE_WIDE_ROW + k);
#pragma unroll
  for (int j = 0; j < 8; ++j) gv[j] = *reinterpret_cast<const float4*>(gr + 16 * j * FMOE_WIDE_ROW + k);
}

extern "C" __global__ void __launch_bounds__(FMOE_WIDE_WARPS * 32, 1)
    fmoe_logits_wide_kernel(const float* x, int T, int D, int E, const float* gate, int scoring, float* scores,
                            unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  __shared__ __align__(16) float ring[FMOE_WIDE_STAGES * FMOE_WIDE_STAGE];
  const int warp = threadIdx.x >> 5;
  const int t0 = blockIdx.y * FMOE_WIDE_TOKENS, e0 = blockIdx.x * FMOE_WIDE_EXPERTS;
  const int nt = min(FMOE_WIDE_TOKENS, T - t0);
  for (int b = blockIdx.x * FMOE_WIDE_WARPS + warp; b < D / 128; b += gridDim.x * FMOE_WIDE_WARPS)
    fmoe_quant_x_block(x, t0, nt, D, b, xq, xs);
  const int ty = threadIdx.x >> 4, tx = threadIdx.x & 15;
  const int nkb = D / FMOE_WIDE_KC;
#pragma unroll
  for (int s = 0; s < FMOE_WIDE_STAGES - 1; ++s) {
    if (s < nkb) fmoe_wide_fill(x, T, D, E, gate, t0, e0, s, ring + s * FMOE_WIDE_STAGE);
    cp_async_commit();
  }
  float acc[4][8], logit[4][8];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.0f, logit[i][j] = 0.0f;
#pragma unroll 1
  for (int kb = 0; kb < nkb; ++kb) {
    cp_async_wait<FMOE_WIDE_STAGES - 2>();
    __syncthreads();  // stage kb has landed for every thread, and stage kb - 1's slot is no longer read
    if (kb + FMOE_WIDE_STAGES - 1 < nkb)
      fmoe_wide_fill(x, T, D, E, gate, t0, e0, kb + FMOE_WIDE_STAGES - 1,
                     ring + (kb + FMOE_WIDE_STAGES - 1) % FMOE_WIDE_STAGES * FMOE_WIDE_STAGE);
    cp_async_commit();
    const float* st = ring + kb % FMOE_WIDE_STAGES * FMOE_WIDE_STAGE;
    const float* xr = st + ty * FMOE_WIDE_ROW;
    const float* gr = st + (FMOE_WIDE_TOKENS + tx) * FMOE_WIDE_ROW;
    // Operands of 4 k at a time, the next 4 loaded while these are used (two register sets: with one,
    // every group waited for its loads; 8 warps an SM hid too little of that).
    float4 xv[2][4], gv[2][8];
    fmoe_wide_operands(xr, gr, 0, xv[0], gv[0]);
#pragma unroll
    for (int q = 0; q < FMOE_WIDE_KC / 4; ++q) {
      if (q + 1 < FMOE_WIDE_KC / 4) fmoe_wide_operands(xr, gr, 4 * (q + 1), xv[(q + 1) & 1], gv[(q + 1) & 1]);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float4 a = xv[q & 1][i], g = gv[q & 1][j];
          acc[i][j] = fmaf(a.x, g.x, acc[i][j]);
          acc[i][j] = fmaf(a.y, g.y, acc[i][j]);
          acc[i][j] = fmaf(a.z, g.z, acc[i][j]);
          acc[i][j] = fmaf(a.w, g.w, acc[i][j]);
        }
    }
    if ((kb + 1) % (128 / FMOE_WIDE_KC) == 0) {  // a 128-block's sums join the logits
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) logit[i][j] += acc[i][j], acc[i][j] = 0.0f;
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = t0 + ty + 16 * i;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int e = e0 + tx + 16 * j;
      if (t < T && e < E) scores[(long long)t * E + e] = fmoe_score(logit[i][j], scoring);
    }
  }
}

// One warp per token t:
// 1. the scores of fmoe_logits_kernel (softmax scoring: the softmax of its logits over the experts);
// 2. selection: the hash row tid2eid[tokens[t]] when tid2eid is given, else the top-k of score + bias
//    (bias may be NULL; NaN ranks below everything; ties to the lower index);
// 3. weights: the selected scores, divided by their f32 sum (in selection order) when `renorm`, times
//    route_scale -> ids[t][j], weights[t][j].
// Requires E <= 32 * FMOE_MAX_EPL, k <= 32.
extern "C" __global__ void __launch_bounds__(FMOE_SELECT_WARPS * 32)
    fmoe_select_kernel(const float* scores, int T, int E, int k, const float* bias, const int* tid2eid,
                       const int* tokens, int scoring, int renorm, float route_scale, int* ids, float* weights) {
  dsv4_pdl_begin();
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * FMOE_SELECT_WARPS + (threadIdx.x >> 5);
  if (t >= T) return;  // whole warp

  float sc[FMOE_MAX_EPL], key[FMOE_MAX_EPL];
  const float* lt = scores + (long long)t * E;
  float m = -DSV4_F32_INF;
#pragma unroll
  for (int i = 0; i < FMOE_MAX_EPL; ++i) {
    const int e = lane + 32 * i;
    sc[i] = e < E ? lt[e] : -DSV4_F32_INF;
    m = fmaxf(m, sc[i]);
  }
  if (scoring == SCORE_SOFTMAX) {
    m = warp_max(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < FMOE_MAX_EPL; ++i) {
      sc[i] = lane + 32 * i < E ? expf(sc[i] - m) : 0.0f;
      s += sc[i];
    }
    s = warp_sum(s);
#pragma unroll
    for (int i = 0; i < FMOE_MAX_EPL; ++i) sc[i] = sc[i] / s;
  }
#pragma unroll
  for (int i = 0; i < FMOE_MAX_EPL; ++i) {
    const int e = lane + 32 * i;
    float v = sc[i];
    if (bias != nullptr && e < E) v = v + bias[e];
    key[i] = v != v ? -DSV4_F32_INF : v;
  }

  unsigned taken = 0u;  // bit i: entry lane + 32 i is selected (or past E)
#pragma unroll
  for (int i = 0; i < FMOE_MAX_EPL; ++i)
    if (lane + 32 * i >= E) taken |= 1u << i;
  int my_id = -1;
  float my_w = 0.0f, wsum = 0.0f;
  for (int j = 0; j < k; ++j) {
    int sel;
    if (tid2eid != nullptr) {
      sel = tid2eid[(long long)tokens[t] * k + j];
    } else {
      float bv = -DSV4_F32_INF;
      int bi = -1;
#pragma unroll
      for (int i = 0; i < FMOE_MAX_EPL; ++i) {  // ascending index: strict > keeps the lower one
        if (!(taken & (1u << i)) && (bi < 0 || key[i] > bv)) {
          bv = key[i];
          bi = lane + 32 * i;
        }
      }
      warp_argmax(bv, bi);
      sel = bi;
      if (sel >= 0 && (sel & 31) == lane) taken |= 1u << (sel >> 5);
    }
    // The selected score, from the lane that holds it.
    float mine = 0.0f;
#pragma unroll
    for (int i = 0; i < FMOE_MAX_EPL; ++i)
      if (sel >= 0 && sel < E && (sel >> 5) == i) mine = sc[i];
    const float s = __shfl_sync(0xffffffffu, mine, sel >= 0 ? (sel & 31) : 0);
    const float ws = (sel >= 0 && sel < E) ? s : 0.0f;
    wsum += ws;
    if (lane == j) {
      my_id = sel;
      my_w = ws;
    }
  }
  if (lane < k) {
    const float w = renorm ? my_w / wsum : my_w;
    ids[(long long)t * k + lane] = my_id;
    weights[(long long)t * k + lane] = w * route_scale;
  }
}

// out[t][d] = bf16(Σ_j y[t*k + j][d] + y[T*k + t][d]) accumulated in f32 in that order (routed slots in
// selection order, then the shared expert when has_shared), stored as f32. Slots whose id is outside
// [0, E) are skipped. Thread (blockIdx.x * 128 + threadIdx.x) of row blockIdx.y sums 8 columns.
// Requires D % 8 == 0.
extern "C" __global__ void __launch_bounds__(128)
    fmoe_combine_kernel(const unsigned short* y, const int* ids, int T, int k, int E, int D, int has_shared,
                        float* out) {
  dsv4_pdl_begin();
  const int t = blockIdx.y;
  const int d0 = (blockIdx.x * 128 + threadIdx.x) * 8;
  if (d0 >= D) return;
  float acc[8];
#pragma unroll
  for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
  const int nslots = k + (has_shared ? 1 : 0);
  // Rows are loaded whatever the slot's id (every row index is in range) so the loads can be in flight
  // together; an invalid slot's row (never written) is then left out.
#pragma unroll 4
  for (int j = 0; j < nslots; ++j) {
    bool valid = true;
    long long row = (long long)T * k + t;
    if (j < k) {
      const int e = ids[(long long)t * k + j];
      valid = e >= 0 && e < E;
      row = (long long)t * k + j;
    }
    const uint4 v = *reinterpret_cast<const uint4*>(y + row * D + d0);
    if (valid) {
      const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[2 * c] += bf16_to_f32((bf16_t)(w[c] & 0xffffu));
        acc[2 * c + 1] += bf16_to_f32((bf16_t)(w[c] >> 16));
      }
    }
  }
  float4* o = reinterpret_cast<float4*>(out + (long long)t * D + d0);
  o[0] = make_float4(round_bf16(acc[0]), round_bf16(acc[1]), round_bf16(acc[2]), round_bf16(acc[3]));
  o[1] = make_float4(round_bf16(acc[4]), round_bf16(acc[5]), round_bf16(acc[6]), round_bf16(acc[7]));
}
