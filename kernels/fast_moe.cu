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
  for (int r = 0; r < nt; ++r) {
    const long long t = t0 + r;
    const float4 v = reinterpret_cast<const float4*>(x + t * D + b * 128)[lane];
    const float amax = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    const float s = ue8m0_scale(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX);
    const float vv[4] = {v.x, v.y, v.z, v.w};
    unsigned code[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      float q = vv[c] / s;
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

// The same scores and quantisation for many tokens, with fewer reads of x and the gate per token: block
// (bx, by) takes FMOE_WIDE_TOKENS tokens t0 = by * FMOE_WIDE_TOKENS .. and FMOE_WIDE_WARPS *
// FMOE_WIDE_EPW experts; x's rows pass through shared memory in chunks of FMOE_WIDE_KC k, and warp w computes
// the logits of experts bx * FMOE_WIDE_WARPS * FMOE_WIDE_EPW + w * FMOE_WIDE_EPW + [0, FMOE_WIDE_EPW) for
// all the block's tokens over the whole of D: lane L's per-lane sums run over k 4·L + 128·i + [0, 4) in k
// order (D / 32 terms), then a fixed butterfly. Warps of blocks with b = bx * FMOE_WIDE_WARPS + w (+ the
// grid's warps, ...) < D / 128 also run fmoe_quant_x_block of block b for the block's tokens.
// Requires D % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_WIDE_WARPS * 32)
    fmoe_logits_wide_kernel(const float* x, int T, int D, int E, const float* gate, int scoring, float* scores,
                            unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  __shared__ float4 xs_chunk[FMOE_WIDE_TOKENS][FMOE_WIDE_KC / 4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int t0 = blockIdx.y * FMOE_WIDE_TOKENS;
  const int nt = min(FMOE_WIDE_TOKENS, T - t0);
  for (int b = blockIdx.x * FMOE_WIDE_WARPS + warp; b < D / 128; b += gridDim.x * FMOE_WIDE_WARPS)
    fmoe_quant_x_block(x, t0, nt, D, b, xq, xs);
  const int e0 = (blockIdx.x * FMOE_WIDE_WARPS + warp) * FMOE_WIDE_EPW;
  float acc[FMOE_WIDE_EPW][FMOE_WIDE_TOKENS];
#pragma unroll
  for (int j = 0; j < FMOE_WIDE_EPW; ++j)
#pragma unroll
    for (int r = 0; r < FMOE_WIDE_TOKENS; ++r) acc[j][r] = 0.0f;
  for (int k0 = 0; k0 < D; k0 += FMOE_WIDE_KC) {
    const int c_end = min(FMOE_WIDE_KC, D - k0) / 4;  // float4s of this chunk (the last may be shorter)
    __syncthreads();  // the previous chunk is no longer read
    // Tokens past T load as zeros (their logits are not stored).
    for (int v = threadIdx.x; v < FMOE_WIDE_TOKENS * (FMOE_WIDE_KC / 4); v += FMOE_WIDE_WARPS * 32) {
      const int r = v / (FMOE_WIDE_KC / 4), c = v % (FMOE_WIDE_KC / 4);
      xs_chunk[r][c] = r < nt && c < c_end ? reinterpret_cast<const float4*>(x + (long long)(t0 + r) * D + k0)[c]
                                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    __syncthreads();
#pragma unroll 2
    for (int c = lane; c < c_end; c += 32) {
      float4 gv[FMOE_WIDE_EPW];
#pragma unroll
      for (int j = 0; j < FMOE_WIDE_EPW; ++j)
        gv[j] = e0 + j < E ? reinterpret_cast<const float4*>(gate + (long long)(e0 + j) * D + k0)[c]
                           : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int r = 0; r < FMOE_WIDE_TOKENS; ++r) {
        const float4 xv = xs_chunk[r][c];
#pragma unroll
        for (int j = 0; j < FMOE_WIDE_EPW; ++j) {
          acc[j][r] = fmaf(xv.x, gv[j].x, acc[j][r]);
          acc[j][r] = fmaf(xv.y, gv[j].y, acc[j][r]);
          acc[j][r] = fmaf(xv.z, gv[j].z, acc[j][r]);
          acc[j][r] = fmaf(xv.w, gv[j].w, acc[j][r]);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < FMOE_WIDE_EPW; ++j)
#pragma unroll
    for (int r = 0; r < FMOE_WIDE_TOKENS; ++r) {
      const float l = warp_sum(acc[j][r]);
      if (lane == ((j * FMOE_WIDE_TOKENS + r) & 31) && r < nt && e0 + j < E)
        scores[(long long)(t0 + r) * E + e0 + j] = fmoe_score(l, scoring);
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
