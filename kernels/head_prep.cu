// head_prep.cu — a query or KV head row's preparation in one launch (kernels/SPEC.md
// "head_prep.cu"): RMSNorm of the head row, RoPE of its last 2 * half_rope channels and, for the
// window KV in official numerics, the FP8 simulation of its nope channels. That is norm.cu's
// rmsnorm_kernel, rope.cu's rope_kernel and quant_sim.cu's kv_sim_kernel in sequence, each value
// computed by the same operations in the same order (only the f64 sum of squares is grouped by
// the block's threads, as any thread layout groups it: docs/numerics.md), so the outputs are
// theirs bit for bit and one launch replaces two or three (decode runs this twice a layer).
#include "common.cuh"
#include "ref_math.cuh"

// HP_MAX_PAIRS (dsv4_consts.cuh): most channel pairs of a head (one a thread, head_dim <= 2 x it).

// head_prep_kernel's step 1 (below) for channel pair p: x * rr * weight (f32, that order; no weight: x * rr), bf16
// if round_out.
DSV4_INLINE void hp_norm_pair(float& a, float& b, float rr, const float* weight, int p, int round_out) {
  a = __fmul_rn(a, rr);
  b = __fmul_rn(b, rr);
  if (weight != nullptr) {
    a = __fmul_rn(a, weight[2 * p]);
    b = __fmul_rn(b, weight[2 * p + 1]);
  }
  if (round_out) {
    a = round_bf16(a);
    b = round_bf16(b);
  }
}

// Its step 3 for channel pair p, whose 64-channel block the calling warp holds whole (every lane
// calls: the block's max is a warp max): channels below sim_nope FP8-simulated; a lane holding no
// pair (`held` false) only joins the max.
DSV4_INLINE void hp_sim_pair(float& a, float& b, int p, int sim_nope, bool held) {
  const bool h0 = held && 2 * p < sim_nope, h1 = held && 2 * p + 1 < sim_nope;
  float amax = warp_max(fmaxf(h0 ? fabsf(a) : 0.0f, h1 ? fabsf(b) : 0.0f));
  amax = fmaxf(amax, 1e-4f);
  const float sc = ue8m0_scale(amax, DSV4_E4M3_MAX);
  if (h0) a = ref_fp8_sim_value(a, sc);
  if (h1) b = ref_fp8_sim_value(b, sc);
}

// One block per head row h of row r: x[r * ld + h * head_dim + c] for c < head_dim (head_dim even),
// ceil(head_dim / 64) warps; thread p holds the channel pair p (channels 2p, 2p + 1), so warp w
// holds channels [64w, 64w + 64): one FP8 block. A thread a pair keeps every step's chain short (a
// decode step has 1 to 64 head rows: latency, not throughput) and the code straight-line (the f64
// sin / cos once).
// 1. RMSNorm (rmsnorm_kernel): ms = f32(Σ f64 x² / head_dim), rr = rsqrt(ms + eps) (f32 add, f64
//    rsqrt), x = x * rr * weight[c] (f32, that order; no weight: x * rr), bf16 if round_out.
// 2. RoPE (rope_kernel, sign +1): pair p at or past the nope channels (2p >= nope, nope =
//    head_dim - 2 * half_rope) rotates by pos[r] * inv_freq[p - nope / 2], bf16 if round_out.
//    (rope_kernel re-rounds the nope channels with round_out: they are bf16 already here.)
// 3. KV sim (kv_sim_kernel) when sim_nope > 0 (at most nope): channels [0, sim_nope) in blocks of
//    64, amax = max(max |x|, 1e-4), s = ue8m0(amax / 448), x = e4m3(clamp(x / s, ±448)) * s.
// With round_in, x is first rounded to bf16 as loaded: the projection that wrote x leaves its official bf16
// rounding to this kernel, its only reader (the rounding is the same function wherever it is applied, and
// a cuBLASLt projection then needs no rounding pass over its f32 output).
// With out_bf16 (not null) the results go there as bf16, [rows][heads][head_dim] (dense), instead of back
// into x: the fast attention's queries (exact where round_out has made them bf16 values).
// Grid rows * heads, 32 * ceil(head_dim / 64) threads.
extern "C" __global__ void __launch_bounds__(2 * HP_MAX_PAIRS)
    head_prep_kernel(float* x, int rows, int ld, int heads, int head_dim, const float* weight, float eps,
                     const int* pos, const float* inv_freq, int half_rope, int sim_nope, int round_out,
                     int round_in, unsigned short* out_bf16) {
  dsv4_pdl_begin();
  __shared__ double scratch[32];
  const long long item = blockIdx.x;
  const int r = (int)(item / heads), h = (int)(item - (long long)r * heads);
  float* hx = x + (long long)r * ld + (long long)h * head_dim;
  const int p = threadIdx.x, pairs = head_dim / 2, nope = head_dim - 2 * half_rope;
  const bool mine = p < pairs;

  float a = 0.0f, b = 0.0f;
  if (mine) {
    a = round_in ? round_bf16(hx[2 * p]) : hx[2 * p];
    b = round_in ? round_bf16(hx[2 * p + 1]) : hx[2 * p + 1];
  }
  const double da = (double)a, db = (double)b;
  const double sq = __dadd_rn(__dmul_rn(da, da), __dmul_rn(db, db));
  const double s = ref_block_sum_f64(sq, scratch);
  const float ms = (float)__ddiv_rn(s, (double)head_dim);
  const float rr = ref_rsqrt(__fadd_rn(ms, eps));

  if (mine) {
    hp_norm_pair(a, b, rr, weight, p, round_out);
    if (2 * p >= nope) ref_rope_pair(a, b, __int2float_rn(pos[r]), inv_freq[p - nope / 2], 1.0f, round_out);
  }
  if (64 * (p >> 5) < sim_nope) hp_sim_pair(a, b, p, sim_nope, true);  // uniform per warp
  if (mine && out_bf16 != nullptr) {
    *(unsigned*)(out_bf16 + item * head_dim + 2 * p) = pack_bf16x2(a, b);
  } else if (mine) {
    hx[2 * p] = a;
    hx[2 * p + 1] = b;
  }
}

// Lane `lane`'s pairs l + 32 i of the head at hx (zeros past `pairs`, and everywhere where !valid).
DSV4_INLINE void hp_rows_load(const float* hx, bool valid, int pairs, int lane, float2 (&v)[HP_ROWS_LANE_PAIRS]) {
#pragma unroll
  for (int i = 0; i < HP_ROWS_LANE_PAIRS; ++i) {
    const int p = lane + 32 * i;
    v[i] = valid && p < pairs ? *(const float2*)(hx + 2 * p) : make_float2(0.0f, 0.0f);
  }
}

// head_prep_kernel's operation for many rows of many heads (a prefill's queries): a block a row
// (grid-stride), a warp a head (looping over the row's heads), lane l holding the pairs l + 32 i
// (i < HP_ROWS_LANE_PAIRS: head_dim <= 64 HP_ROWS_LANE_PAIRS). The row's cos / sin are computed
// once into shared memory (head_prep_kernel: once per head), and a head's sum of squares is the
// lanes' f64 sums added by ref_warp_sum_f64 (another grouping of the same f64 terms, as any
// thread layout groups them: docs/numerics.md); every other value goes through the same
// operations as in head_prep_kernel (round_in and out_bf16 included). The KV sim's 64-channel block i is pair
// slot i of the warp. Grid rows (at most the device's limit), 32 * HP_ROWS_WARPS threads.
extern "C" __global__ void __launch_bounds__(32 * HP_ROWS_WARPS)
    head_prep_rows_kernel(float* x, int rows, int ld, int heads, int head_dim, const float* weight, float eps,
                          const int* pos, const float* inv_freq, int half_rope, int sim_nope, int round_out,
                          int round_in, unsigned short* out_bf16) {
  dsv4_pdl_begin();
  __shared__ float cs[2 * 32 * HP_ROWS_LANE_PAIRS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pairs = head_dim / 2, nope = head_dim - 2 * half_rope;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    __syncthreads();  // the previous row's cos / sin consumed
    for (int k = threadIdx.x; k < half_rope; k += blockDim.x) {
      float c, s;
      ref_rope_cs(__int2float_rn(pos[r]), inv_freq[k], 1.0f, c, s);
      cs[2 * k] = c;
      cs[2 * k + 1] = s;
    }
    __syncthreads();
    // The warp's next head is loaded while it works on this one (a head at a time, its loads then its
    // f64 sum, moved ~2.1 TB/s: a 4096-token prefill's queries took 500 us a layer, ncu).
    float2 next[HP_ROWS_LANE_PAIRS];
    hp_rows_load(x + (long long)r * ld + (long long)warp * head_dim, warp < heads, pairs, lane, next);
    for (int h = warp; h < heads; h += HP_ROWS_WARPS) {
      float* hx = x + (long long)r * ld + (long long)h * head_dim;
      float a[HP_ROWS_LANE_PAIRS], b[HP_ROWS_LANE_PAIRS];
#pragma unroll
      for (int i = 0; i < HP_ROWS_LANE_PAIRS; ++i) {
        a[i] = next[i].x;
        b[i] = next[i].y;
      }
      const int h2 = h + HP_ROWS_WARPS;
      hp_rows_load(hx + (long long)HP_ROWS_WARPS * head_dim, h2 < heads, pairs, lane, next);
      double sq = 0.0;
#pragma unroll
      for (int i = 0; i < HP_ROWS_LANE_PAIRS; ++i) {
        const int p = lane + 32 * i;
        if (p < pairs) {
          a[i] = round_in ? round_bf16(a[i]) : a[i];
          b[i] = round_in ? round_bf16(b[i]) : b[i];
        }
        const double da = (double)a[i], db = (double)b[i];
        sq = __dadd_rn(sq, __dadd_rn(__dmul_rn(da, da), __dmul_rn(db, db)));
      }
      const double s = ref_warp_sum_f64(sq);
      const float ms = (float)__ddiv_rn(s, (double)head_dim);
      const float rr = ref_rsqrt(__fadd_rn(ms, eps));
#pragma unroll
      for (int i = 0; i < HP_ROWS_LANE_PAIRS; ++i) {
        const int p = lane + 32 * i;
        if (p < pairs) {
          hp_norm_pair(a[i], b[i], rr, weight, p, round_out);
          if (2 * p >= nope) {
            const int k = p - nope / 2;
            ref_rope_rotate(a[i], b[i], cs[2 * k], cs[2 * k + 1], round_out);
          }
        }
        if (64 * i < sim_nope) hp_sim_pair(a[i], b[i], p, sim_nope, p < pairs);  // uniform per warp
        if (p < pairs && out_bf16 != nullptr)
          *(unsigned*)(out_bf16 + ((long long)r * heads + h) * head_dim + 2 * p) = pack_bf16x2(a[i], b[i]);
        else if (p < pairs)
          *(float2*)(hx + 2 * p) = make_float2(a[i], b[i]);
      }
    }
  }
}
