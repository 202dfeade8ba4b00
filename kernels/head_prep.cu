// head_prep.cu — a query or KV head row's preparation in one launch (kernels/SPEC.md
// "head_prep.cu"): RMSNorm of the head row, RoPE of its last 2 * half_rope channels and, for the
// window KV in official numerics, the FP8 simulation of its nope channels. That is norm.cu's
// rmsnorm_kernel, rope.cu's rope_kernel and quant_sim.cu's kv_sim_kernel in sequence, each value
// computed by the same operations in the same order (only the f64 sum of squares is grouped by
// lanes, as any thread layout groups it: docs/numerics.md), so the outputs are theirs bit for bit
// and one launch replaces two or three (decode runs this twice a layer).
#include "common.cuh"
#include "ref_math.cuh"

// HP_WARPS, HP_MAX_PAIRS (dsv4_consts.cuh): warps a block, most channel pairs a lane holds
// (head_dim <= 64 * HP_MAX_PAIRS).

// One warp per head row h of row r: x[r * ld + h * head_dim + c] for c < head_dim (head_dim even).
// Lane l holds the channel pairs p = l + 32 j (channels 2p, 2p + 1), j < HP_MAX_PAIRS.
// 1. RMSNorm (rmsnorm_kernel): ms = f32(Σ f64 x² / head_dim), rr = rsqrt(ms + eps) (f32 add, f64
//    rsqrt), x = x * rr * weight[c] (f32, that order; no weight: x * rr), bf16 if round_out.
// 2. RoPE (rope_kernel, sign +1): pair p at or past the nope channels (2p >= nope, nope =
//    head_dim - 2 * half_rope) rotates by pos[r] * inv_freq[p - nope / 2], bf16 if round_out.
// 3. KV sim (kv_sim_kernel) when sim_nope > 0: channels [0, sim_nope) in blocks of 64 (pairs 32j ..
//    32j + 31: the warp's iteration j), amax = max(max |x|, 1e-4), s = ue8m0(amax / 448),
//    x = e4m3(clamp(x / s, ±448)) * s.
// Grid ceil(rows * heads / HP_WARPS), 32 * HP_WARPS threads.
extern "C" __global__ void __launch_bounds__(32 * HP_WARPS)
    head_prep_kernel(float* x, int rows, int ld, int heads, int head_dim, const float* weight, float eps,
                     const int* pos, const float* inv_freq, int half_rope, int sim_nope, int round_out) {
  dsv4_pdl_begin();
  const int lane = threadIdx.x & 31;
  const long long item = (long long)blockIdx.x * HP_WARPS + (threadIdx.x >> 5);
  if (item >= (long long)rows * heads) return;  // uniform per warp
  const int r = (int)(item / heads), h = (int)(item - (long long)r * heads);
  float* hx = x + (long long)r * ld + (long long)h * head_dim;
  const int pairs = head_dim / 2, nope = head_dim - 2 * half_rope;

  float2 v[HP_MAX_PAIRS];
  double sq = 0.0;
#pragma unroll
  for (int j = 0; j < HP_MAX_PAIRS; ++j) {
    const int p = lane + 32 * j;
    v[j] = make_float2(0.0f, 0.0f);
    if (p < pairs) {
      v[j] = make_float2(hx[2 * p], hx[2 * p + 1]);
      const double a = (double)v[j].x, b = (double)v[j].y;
      sq = __dadd_rn(sq, __dmul_rn(a, a));
      sq = __dadd_rn(sq, __dmul_rn(b, b));
    }
  }
  const double s = ref_warp_sum_f64(sq);
  const float ms = (float)__ddiv_rn(s, (double)head_dim);
  const float rr = ref_rsqrt(__fadd_rn(ms, eps));
  const float pf = __int2float_rn(pos[r]);

#pragma unroll
  for (int j = 0; j < HP_MAX_PAIRS; ++j) {
    const int p = lane + 32 * j;
    if (p < pairs) {
      float a = __fmul_rn(v[j].x, rr), b = __fmul_rn(v[j].y, rr);
      if (weight != nullptr) {
        a = __fmul_rn(a, weight[2 * p]);
        b = __fmul_rn(b, weight[2 * p + 1]);
      }
      if (round_out) {
        a = round_bf16(a);
        b = round_bf16(b);
      }
      // rope_kernel re-rounds the nope channels with round_out: they are bf16 already here.
      if (2 * p >= nope) ref_rope_pair(a, b, pf, inv_freq[p - nope / 2], 1.0f, round_out);
      v[j] = make_float2(a, b);
    }
  }

#pragma unroll
  for (int j = 0; j < HP_MAX_PAIRS; ++j) {
    if (64 * j < sim_nope) {  // uniform per warp: every lane joins the block's max
      const int c0 = 2 * (lane + 32 * j);
      const bool h0 = c0 < sim_nope, h1 = c0 + 1 < sim_nope;
      float amax = warp_max(fmaxf(h0 ? fabsf(v[j].x) : 0.0f, h1 ? fabsf(v[j].y) : 0.0f));
      amax = fmaxf(amax, 1e-4f);
      const float sc = ue8m0_scale(amax, DSV4_E4M3_MAX);
      if (h0) v[j].x = ref_fp8_sim_value(v[j].x, sc);
      if (h1) v[j].y = ref_fp8_sim_value(v[j].y, sc);
    }
  }

#pragma unroll
  for (int j = 0; j < HP_MAX_PAIRS; ++j) {
    const int p = lane + 32 * j;
    if (p < pairs) {
      hx[2 * p] = v[j].x;
      hx[2 * p + 1] = v[j].y;
    }
  }
}
