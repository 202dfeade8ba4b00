// fast_moe_route.cuh — the fast set's router steps as device functions: x's FP8 quantisation, one tile of the
// f32 router logits, one token's selection. fast_moe.cu's router kernels run them a block (a warp) at a time;
// fast_moe_gemm.cu's fmoe_route_experts_kernel runs the same functions inside the one-launch layer, so both
// make the same bits. kernels/SPEC.md ## fast_moe.cu.
#pragma once

// FMOE_LOGIT_WARPS, FMOE_LOGIT_EXPERTS, FMOE_LOGIT_SPLIT, FMOE_LOGIT_TOKENS, FMOE_MAX_EPL and SCORE_* come from
// dsv4_consts.cuh (src/cuda/kernels/fast_moe.rs, moe.rs).

// x's block scale s for the block's largest |x|, amax: the official act_quant's.
DSV4_INLINE float fmoe_x_scale(float amax) { return ue8m0_scale(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX); }

// Value v of a block whose scale's reciprocal is inv = 1 / s, as its e4m3 code rounds it: s is a power of two, so
// v · (1 / s) is v / s exactly (one rounding either way); clamped as Rust's clamp (NaN stays NaN).
DSV4_INLINE float fmoe_x_clamped(float v, float inv) {
  const float q = v * inv;
  return q < -DSV4_E4M3_MAX ? -DSV4_E4M3_MAX : (q > DSV4_E4M3_MAX ? DSV4_E4M3_MAX : q);
}

// The e4m3 codes of a and b (a's in the low byte, b's in the next) by the hardware's conversion:
// cvt.rn.satfinite.e4m3x2.f32 rounds to the nearest e4m3fn value, ties to even, subnormals and signed zeros
// included (e4m3_code_rn's grid: kernels/fast_dense.cu fd_quant_codes, checked against act_quant_kernel bit for
// bit), the clamp before it leaves nothing to saturate, and a NaN takes e4m3_code_rn's 0x7f whatever its sign.
// Two values a conversion, a tenth of the software rounding's instructions (fmoe_select_kernel, issue-bound on
// this encoding, spent 55.6% of its issue slots at 4096 tokens with e4m3_code_rn: BENCHMARKS.md, issue 11
// fifty-first session).
DSV4_INLINE unsigned fmoe_x_codes2(float a, float b, float inv) {
  const float qa = fmoe_x_clamped(a, inv), qb = fmoe_x_clamped(b, inv);
  unsigned short c;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(c) : "f"(qb), "f"(qa));
  unsigned r = c;
  if (qa != qa) r = (r & 0xff00u) | 0x7fu;
  if (qb != qb) r = (r & 0x00ffu) | 0x7f00u;
  return r;
}

// One value's code: fmoe_x_codes2's low byte, its NaN case first (fmoe_norm_x_kernel's per-thread codes; as
// fmoe_x_codes2(v, 0, inv) & 0xff it measured 4% slower in that kernel at 4096 tokens, H100).
DSV4_INLINE unsigned fmoe_x_code(float v, float inv) {
  const float q = fmoe_x_clamped(v, inv);
  if (q != q) return 0x7fu;
  unsigned short c;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(c) : "f"(0.0f), "f"(q));  // q's code in the low byte
  return c & 0xffu;
}

// x's official act_quant of 128-block b of token t, by one warp whose lane holds the block's values 4·lane ..
// 4·lane + 3 in v: the e4m3 codes into xq[t][d] in the order of the GEMMs that read them (fp8_mma.cuh: the
// halves order for the prefill path's, `halves`, else the fragment order), the block's scale into xs[t][b]
// (value x scale bit-identical to act_quant_kernel).
DSV4_INLINE void fmoe_quant_x_store(float4 v, long long t, int D, int b, bool halves, unsigned char* xq, float* xs) {
  const int lane = threadIdx.x & 31;
  const float amax = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
  const float s = fmoe_x_scale(amax);
  const float inv = 1.0f / s;
  // Codes c = 0..3 of the lane's values as bytes 0..3 of one word.
  const unsigned codes = fmoe_x_codes2(v.x, v.y, inv) | (fmoe_x_codes2(v.z, v.w, inv) << 16);
  // This lane holds physical k 8·t8 + 4·(lane % 2) + c of the lane / 8-th 32-block (t8 = lane % 8 / 2).
  unsigned char* blk = xq + t * D + b * 128 + 32 * (lane >> 3) + 4 * ((lane & 7) >> 1);
  if (halves) {  // positions 4·t8 + 16·(lane % 2) + c: one word
    *reinterpret_cast<unsigned*>(blk + 16 * (lane & 1)) = codes;
  } else {  // c = 0, 2 are even elements (positions 4·t8 + 2·(lane % 2) + 0, 1), c = 1, 3 odd ones (+ 16)
    *reinterpret_cast<unsigned short*>(blk + 2 * (lane & 1)) = (unsigned short)__byte_perm(codes, 0u, 0x0020u);
    *reinterpret_cast<unsigned short*>(blk + 2 * (lane & 1) + 16) = (unsigned short)__byte_perm(codes, 0u, 0x0031u);
  }
  if (lane == 0) xs[t * (D / 128) + b] = s;
}

// x's act_quant (fmoe_quant_x_store) of 128-block b of tokens t0 .. t0 + nt - 1, by one warp.
DSV4_INLINE void fmoe_quant_x_block(const float* x, int t0, int nt, int D, int b, bool halves, unsigned char* xq,
                                   float* xs) {
  const int lane = threadIdx.x & 31;
  // Eight rows' loads in flight at a time: one at a time, a 64-row block waited on memory for each row in
  // turn.
  for (int r0 = 0; r0 < nt; r0 += 8) {
    float4 v8[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (r0 + i < nt) v8[i] = reinterpret_cast<const float4*>(x + (long long)(t0 + r0 + i) * D + b * 128)[lane];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (r0 + i >= nt) break;  // uniform over the warp
      fmoe_quant_x_store(v8[i], t0 + r0 + i, D, b, halves, xq, xs);
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

// Gate words (float4) a lane loads at once in fmoe_logits_tile.
#define FMOE_LOGIT_CHUNK 8

// One tile of the router's f32 logits: fmoe_logits_kernel's block (bx, by), by FMOE_LOGIT_WARPS warps whose
// threads are gtid = 0 .. 32·FMOE_LOGIT_WARPS - 1 (warp gtid / 32 of the group): tokens t0 = by ·
// FMOE_LOGIT_TOKENS .. (at least one), experts bx · FMOE_LOGIT_EXPERTS · GROUP ..; warp w takes the GROUP experts
// bx · FMOE_LOGIT_EXPERTS · GROUP + (w / FMOE_LOGIT_SPLIT) · GROUP + j (slot s = (w / FMOE_LOGIT_SPLIT) · GROUP +
// j) and its part w % FMOE_LOGIT_SPLIT of their dot products with 16-byte loads, per-lane sums in k order, a
// fixed butterfly, then the parts summed in order: the logit l, scores[t][e] = fmoe_score(l). Each x word a lane
// loads serves its GROUP experts: the tile reads x once per FMOE_LOGIT_EXPERTS · GROUP experts (at 256 tokens and
// 256 experts, GROUP 1 read 512 MB of x from L2 in a ~80 us router chain). Every logit takes the same sums in
// the same order whatever GROUP is, so every GROUP gives the same bits. part_sum: the group's [FMOE_LOGIT_WARPS ·
// GROUP][FMOE_LOGIT_TOKENS] floats of shared memory (row w · GROUP + j); `sync()` is a barrier of
// the group's threads (the parts are written, then read). Requires D % (4 · FMOE_LOGIT_SPLIT) == 0 and
// FMOE_LOGIT_CHUNK % GROUP == 0.
template <int GROUP, typename Sync>
DSV4_INLINE void fmoe_logits_tile(const float* x, int T, int D, int E, const float* gate, int scoring,
                                  float* scores, int bx, int by, int gtid, float (*part_sum)[FMOE_LOGIT_TOKENS],
                                  Sync sync) {
  static_assert(FMOE_LOGIT_CHUNK % GROUP == 0, "fmoe_logits_tile: a chunk's gate words split over the group");
  constexpr int GC = FMOE_LOGIT_CHUNK / GROUP;  // gate words a lane loads at once per expert
  const int lane = gtid & 31, warp = gtid >> 5;
  const int t0 = by * FMOE_LOGIT_TOKENS;
  const int nt = min(FMOE_LOGIT_TOKENS, T - t0);
  const int e0 = (bx * FMOE_LOGIT_EXPERTS + warp / FMOE_LOGIT_SPLIT) * GROUP;  // the warp's first expert
  const int part = warp % FMOE_LOGIT_SPLIT;
  const int c_begin = part * (D / 4 / FMOE_LOGIT_SPLIT), c_end = c_begin + D / 4 / FMOE_LOGIT_SPLIT;
  float acc[GROUP * FMOE_LOGIT_TOKENS];  // acc[j · FMOE_LOGIT_TOKENS + r]: expert j of the group, token r
#pragma unroll
  for (int i = 0; i < GROUP * FMOE_LOGIT_TOKENS; ++i) acc[i] = 0.0f;
  if (e0 < E) {
    // The lane's gate words FMOE_LOGIT_CHUNK at a time (GC per expert), all loaded before the first is used: one
    // HBM round trip a chunk (D = 4096: one in all at GROUP 1). Loaded as they were used, a word, then the
    // tokens' x, then its FMAs, the compiler kept one gate load in flight where registers were short
    // (fmoe_route_experts_kernel's 96: eight round trips, ~8 us a router job, FMOE_TRACE at B = 1). Each
    // logit's acc takes the same FMAs in the same order either way (c ascending, then x, y, z, w). A group's
    // experts past E read the last one's row (their sums are not stored).
    const float4* g4 = reinterpret_cast<const float4*>(gate + (long long)e0 * D);
    for (int c0 = c_begin + lane; c0 < c_end; c0 += 32 * GC) {
      float4 gv[GROUP * GC];  // gv[j · GC + u]
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        const long long row = j == 0 ? 0 : (long long)min(j, E - 1 - e0) * (D / 4);
#pragma unroll
        for (int u = 0; u < GC; ++u)
          if (c0 + 32 * u < c_end) gv[j * GC + u] = __ldg(g4 + row + c0 + 32 * u);
      }
#pragma unroll
      for (int r = 0; r < FMOE_LOGIT_TOKENS; ++r) {
        if (r < nt) {
          const float4* x4 = reinterpret_cast<const float4*>(x + (long long)(t0 + r) * D);
#pragma unroll
          for (int u = 0; u < GC; ++u) {
            if (c0 + 32 * u < c_end) {
              const float4 xv = x4[c0 + 32 * u];
#pragma unroll
              for (int j = 0; j < GROUP; ++j) {
                float& a = acc[j * FMOE_LOGIT_TOKENS + r];
                const float4 g = gv[j * GC + u];
                a = fmaf(xv.x, g.x, a);
                a = fmaf(xv.y, g.y, a);
                a = fmaf(xv.z, g.z, a);
                a = fmaf(xv.w, g.w, a);
              }
            }
          }
        }
      }
    }
  }
  // Warp w's sums of expert j of its group in part_sum row w · GROUP + j.
#pragma unroll
  for (int j = 0; j < GROUP; ++j)
#pragma unroll
    for (int r = 0; r < FMOE_LOGIT_TOKENS; ++r) {
      const float s = warp_sum(acc[j * FMOE_LOGIT_TOKENS + r]);
      if (lane == 0) part_sum[warp * GROUP + j][r] = s;
    }
  sync();
  // Thread (expert slot, token) = (gtid / FMOE_LOGIT_TOKENS, gtid % FMOE_LOGIT_TOKENS) finishes one logit.
  static_assert(FMOE_LOGIT_EXPERTS * GROUP * FMOE_LOGIT_TOKENS <= FMOE_LOGIT_WARPS * 32,
                "fmoe_logits_tile: a thread a logit of the tile");
  const int slot = gtid / FMOE_LOGIT_TOKENS, r = gtid % FMOE_LOGIT_TOKENS;
  const int ex = bx * FMOE_LOGIT_EXPERTS * GROUP + slot;
  if (slot < FMOE_LOGIT_EXPERTS * GROUP && ex < E && r < nt) {
    // The slot's parts: warps (slot / GROUP) · FMOE_LOGIT_SPLIT + p, their group's expert slot % GROUP.
    const int w0 = slot / GROUP * FMOE_LOGIT_SPLIT, j = slot % GROUP;
    float l = 0.0f;
    for (int p = 0; p < FMOE_LOGIT_SPLIT; ++p) l += part_sum[(w0 + p) * GROUP + j][r];
    scores[(long long)(t0 + r) * E + ex] = fmoe_score(l, scoring);
  }
}

// Steps 1-3 of fmoe_select_kernel (below) for token t, by one warp: the scores' softmax (softmax scoring), the
// selection and the weights into ids[t][j], weights[t][j]. Requires E <= 32 * FMOE_MAX_EPL, k <= 32.
DSV4_INLINE void fmoe_select_token(const float* scores, int t, int E, int k, const float* bias, const int* tid2eid,
                                  const int* tokens, int scoring, int renorm, float route_scale, int* ids,
                                  float* weights) {
  const int lane = threadIdx.x & 31;
  float sc[FMOE_MAX_EPL], key[FMOE_MAX_EPL];
  const float* lt = scores + (long long)t * E;
  float m = -DSV4_F32_INF;
  // The bias words (key, until the keys replace them) are loaded with the scores: asked for after the
  // softmax's branch, they were a second memory round trip (a weight, so likely from HBM) on the router's chain.
#pragma unroll
  for (int i = 0; i < FMOE_MAX_EPL; ++i) {
    const int e = lane + 32 * i;
    sc[i] = e < E ? lt[e] : -DSV4_F32_INF;
    key[i] = (bias != nullptr && e < E) ? bias[e] : 0.0f;
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
    if (bias != nullptr && e < E) v = v + key[i];
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
    // The selected score, from the lane that holds it: a shuffle of each entry (sel is the warp's), not the
    // holder's sc[sel >> 5], which the compiler makes an indexed load and so keeps sc in local memory (in
    // fmoe_route_experts_kernel, whose shared memory leaves little L1, those loads missed).
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < FMOE_MAX_EPL; ++i) {
      const float v = __shfl_sync(0xffffffffu, sc[i], sel >= 0 ? (sel & 31) : 0);
      if (sel >= 0 && sel < E && (sel >> 5) == i) s = v;
    }
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
