// fast_dense kernel family: see kernels/SPEC.md (## fast_dense.cu).
//
// The fast set's dense projections at few tokens (decode): y[t, n] = Σ_k a[t, k] · W[n, k] for up
// to FD_TOKENS tokens a launch, bandwidth-bound. Each weight byte is read once, by a 16-byte load,
// straight into a tensor-core fragment: mma.sync m16n8k16 with f32 accumulators, f16 for FP8
// weights (an e4m3 code is exactly an f16) and bf16 for BF16 weights.
//
// 1. fd_act_kernel: the activations of one launch as 16-bit MMA operands plus an f32 scale per
//    (token, 128 of k), so that a[t, k] = act[t, k] · scale[t, k / 128] exactly (modes below).
// 2. fd_gemv_t{8,16,32,64}_kernel: a block of FD_WARPS warps owns FD_WARPS x 16 weight rows of one
//    slice of K (the split is a function of the weight's shape only, never of the tokens, so a
//    token's sums are the same in every batch). It first issues its warps' first weight loads (before
//    its programmatic-launch wait: they may overlap the previous kernel's tail), then stages the
//    slice's activations of every token in shared memory (copied from fd_act_kernel's
//    output, or, for a few tokens, made from x right there: the same operands), then streams the rest.
//    Warp w owns rows 16w..16w+15; lane (g = lane / 4, c = lane % 4) feeds the MMAs 16 bytes of rows
//    g and g + 8 at byte 16c of each 64 bytes of the row (BF16: loaded so, half of 8 rows' lines a
//    warp load; FP8: loaded as whole lines, four rows a warp load, see fd_line_row), and reads the
//    matching 16-bit activations of token g of each tile of 8 tokens. Within those 64 bytes k is
//    permuted (lane c's k feed the fragment positions 2c, 2c+1, 2c+8, 2c+9 in order), the same for W
//    and a, so the dot product is unchanged. A 128-block of k accumulates in the tensor core from
//    zero (FP8: k 64-127 first, then k 0-63 onto them, a shuffle between) and is promoted:
//    acc += blk · (s_w · s_a) (s_w: the FP8 block scale, 1 for BF16). With one slice, a block writes
//    y; with several, either the slices of a row tile are one thread-block cluster (each block
//    puts its partial sums in its shared memory, and after a cluster barrier block r adds its
//    share of the outputs over every block's shared memory in slice order), or, where the launch
//    passes a split workspace (fast_dense.rs split_by_counter), each block writes its partial sums
//    to global memory and counts itself in on its row tile's counter, and the block that arrives
//    last adds every slice's partials, in slice order: the same sums as the cluster's, without
//    its barriers (a cluster of 8 cost wo_b 25% of its time at one token).
//
// Activation modes (FD_ACT_*), per (token, 128-block) with amax its largest |x|:
// - QUANT (FP8 weights, official act_quant): s = ue8m0(max(amax, 1e-4) / 448), the f16 value of
//   e4m3(clamp(x / s, ±448)): bit for bit linear.cu act_quant_kernel's value / s.
// - F16 (FP8 weights, no act quant: the dequantized-BF16 einsum of wo_a): s = 2^(floor(log2 amax) -
//   14) (1 for amax 0 or not finite), f16(x / s): exact for BF16 values whose ratio to amax is at least
//   2^-24, and off by at most amax · 2^-39 below that (f16 subnormals).
// - BF16 (BF16 weights): s = 1, bf16(x): exact for BF16 values (docs/numerics.md: every such input is).
#include "common.cuh"
#include "fp8_mma.cuh"  // cp.async, clusters
#include "norm_row.cuh"  // fd_norm_operands_kernel

// FD_WARPS, FD_LT_ITEMS, FD_TOKENS, FD_MAX_SLICES, FD_MAX_SLICE, FD_ACT_QUANT / FD_ACT_F16 / FD_ACT_BF16 come from dsv4_consts.cuh.
#define FD_THREADS (32 * FD_WARPS)
#define FD_ROWS (16 * FD_WARPS)
// Most activation scales a thread stages: FD_TOKENS tokens x FD_MAX_SLICE / 128 blocks.
#define FD_SCALE_LOADS ((FD_TOKENS * (FD_MAX_SLICE / 128) + FD_THREADS - 1) / FD_THREADS)
// Most blocks of a launch whose warps also prefetch their rows into L2 (fd_gemv): one an SM of an H200.
#define FD_PREFETCH_MAX_GRID 132u
// 128-blocks past the register prologue that a warp of a larger launch asks L2 for before its wait
// (fd_gemv). Measured, bench dense, H200, one device call, best of 2 (µs at T = 1 / 8): none wq_b
// 10.78 / 12.47, wo_b 12.15 / 16.22, wo_a 11.28 / 15.45; 2 blocks 10.47 / 12.20, 11.95 / 15.89,
// 11.20 / 15.12; 4 blocks 11.68 / 13.08, 13.03 / 16.18, 12.63 / 16.26; all of the slice 12.11 / 13.56
// (wq_b).
#define FD_PREFETCH_AFTER 2

DSV4_INLINE unsigned short fd_f16_rn(float f) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
  return h;
}

// Two e4m3 codes (byte 0 low) -> two f16 values (low half from byte 0), exactly.
DSV4_INLINE unsigned fd_e4m3x2_to_f16x2(unsigned short v) {
  unsigned r;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(v));
  return r;
}

// A streamed 16-byte weight load: read once, so not kept in L1 (the activations live there). L2 fetches
// the whole 128-byte line: a warp load covers half of each of 8 rows' lines and the next load the other
// halves, and without the hint each half was its own fetch (measured, one token: wq_b 11.1 -> 10.6 us,
// the head 284 -> 245 us; read_probe_rows_kernel, the same addresses without the arithmetic: 12.0 ->
// 10.1 us, L2::256B 9.4 us but slower in the gemv, whole lines a load 8.1 us).
DSV4_INLINE uint4 fd_ld_stream(const unsigned char* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p));
  return r;
}

// Asks L2 to fetch `bytes` (a multiple of 16) at p (16-byte aligned) from HBM now, without waiting and
// without registers: a hint the memory system may drop (the later loads then go to HBM themselves).
DSV4_INLINE void fd_prefetch_l2(const unsigned char* p, unsigned bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
}

template <bool F16>
DSV4_INLINE void fd_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  if (F16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// The official act_quant of one lane's four values of a (token, 128-block) whose largest |x| is amax:
// the block's scale s = ue8m0(max(amax, 1e-4) / 448) and the e4m3 codes of clamp(x / s, ±448), byte i
// for value i. The hardware's conversions give act_quant_kernel's values with fewer instructions (a
// 4096-token prefill's operands took ~60 a value with the division and e4m3_round in software):
// - x · 2^-e is x / 2^e: s is a power of two whose reciprocal is a float (e <= 127), so both are the
//   correctly rounded value of the same real number.
// - cvt.rn.satfinite.e4m3x2.f32 rounds to the nearest e4m3fn value, ties to even, subnormals
//   included, and gives ±0 with x's sign below half the smallest subnormal: e4m3_round's grid; the
//   clamp before it leaves nothing to saturate. NaN stays NaN (code 0x7f).
// The block's scale exponent e (s = 2^e) for its largest |x|, amax.
DSV4_INLINE int fd_quant_exponent(float amax) { return ue8m0_exponent(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX); }
// x · 2^-e (inv = 2^-e) clamped to ±448 as Rust's clamp, act_quant_kernel's: NaN stays NaN.
DSV4_INLINE float fd_quant_clamped(float x, float inv) {
  const float q = x * inv;
  return q < -DSV4_E4M3_MAX ? -DSV4_E4M3_MAX : (q > DSV4_E4M3_MAX ? DSV4_E4M3_MAX : q);
}
DSV4_INLINE unsigned fd_quant_codes(float4 v4, float amax, float& s) {
  const int e = fd_quant_exponent(amax);
  s = dsv4_pow2(e);
  const float inv = dsv4_pow2(-e);
  const float v[4] = {v4.x, v4.y, v4.z, v4.w};
  float q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = fd_quant_clamped(v[i], inv);
  unsigned short lo, hi;
  // The first source operand goes to the upper byte (PTX: a's value in d's upper 8 bits, b's in the lower).
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(q[1]), "f"(q[0]));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(q[3]), "f"(q[2]));
  return (unsigned)lo | ((unsigned)hi << 16);
}

// One value's code of the same act_quant (inv = 2^-e of its block's scale): fd_quant_codes' byte for it (the
// conversion rounds each of its two sources alone).
DSV4_INLINE unsigned char fd_quant_code(float x, float inv) {
  unsigned short c;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(c) : "f"(0.0f), "f"(fd_quant_clamped(x, inv)));
  return (unsigned char)(c & 0xffu);
}

// The largest |x| of a warp's 128 values, four a lane: every lane of the warp must call.
DSV4_INLINE float fd_warp_amax(float4 v) {
  return warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
}

// The operands of one lane's four values of a (token, 128-block) in `mode` (module comment), and the
// block's scale: every lane of the warp must call (the block's amax is a warp reduction).
DSV4_INLINE void fd_operands(float4 v4, int mode, float& s, unsigned short (&h)[4]) {
  const float v[4] = {v4.x, v4.y, v4.z, v4.w};
  const float amax = fd_warp_amax(v4);
  s = 1.0f;
  if (mode == FD_ACT_QUANT) {
    // An e4m3 value is an f16 value: the conversion is exact.
    const unsigned codes = fd_quant_codes(v4, amax, s);
    const unsigned h01 = fd_e4m3x2_to_f16x2((unsigned short)(codes & 0xffffu));
    const unsigned h23 = fd_e4m3x2_to_f16x2((unsigned short)(codes >> 16));
    h[0] = (unsigned short)(h01 & 0xffffu);
    h[1] = (unsigned short)(h01 >> 16);
    h[2] = (unsigned short)(h23 & 0xffffu);
    h[3] = (unsigned short)(h23 >> 16);
  } else if (mode == FD_ACT_F16) {
    if (amax > 0.0f && amax <= 3.0e38f) s = dsv4_pow2(max(dsv4_floor_log2(amax) - 14, -126));
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = fd_f16_rn(v[i] / s);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = f32_to_bf16(v[i]);
  }
}

// The (token t, 128-block b) item of this warp (one per warp of the grid) of x [T, ldx] (16-byte
// aligned rows, K columns): false past the last item (uniform per warp), else the lane's four
// operands h and the block's scale s (fd_operands).
DSV4_INLINE bool fd_item_operands(const float* x, int ldx, int T, int K, int mode, int& t, int& b, float& s,
                                  unsigned short (&h)[4]) {
  const int nb = K / 128;
  const int item = blockIdx.x * FD_WARPS + (threadIdx.x >> 5);
  if (item >= T * nb) return false;
  t = item / nb;
  b = item - t * nb;
  const float4 v4 = *reinterpret_cast<const float4*>(x + (long long)t * ldx + b * 128 + 4 * (threadIdx.x & 31));
  fd_operands(v4, mode, s, h);
  return true;
}

// x [T, ldx] f32 (16-byte aligned rows) -> act [T, K] (f16 or bf16 bits) and scale [T, K / 128], one warp
// per (token, 128-block), FD_THREADS threads a block: grid ceil(T * K / 128 / FD_WARPS).
extern "C" __global__ void __launch_bounds__(FD_THREADS)
    fd_act_kernel(const float* x, int ldx, int T, int K, int mode, unsigned short* act, float* scale) {
  dsv4_pdl_begin();
  int t, b;
  float s;
  unsigned short h[4];
  if (!fd_item_operands(x, ldx, T, K, mode, t, b, s, h)) return;
  const int lane = threadIdx.x & 31, nb = K / 128;
  uint2 packed;
  packed.x = (unsigned)h[0] | ((unsigned)h[1] << 16);
  packed.y = (unsigned)h[2] | ((unsigned)h[3] << 16);
  *reinterpret_cast<uint2*>(act + (long long)t * K + b * 128 + 4 * lane) = packed;
  if (lane == 0) scale[(long long)t * nb + b] = s;
}

// The activation operand of a cuBLASLt GEMM (many tokens; src/cuda/blockscaled_gemm.rs), a warp per
// FD_LT_ITEMS consecutive (token, 128-block) items: QUANT: the e4m3 codes of the official act_quant
// (fd_quant_codes: fd_operands' values, as bytes) into codes [T, K] and its scale into scale [K / 128, T]
// (token-fastest, cuBLASLt's VEC128_32F layout); BF16: bf16(x) (exact for BF16 values) into codes as
// [T, K] 16-bit. A warp issues all of its items' loads before the first item's reduction. With one item a
// warp, the division and e4m3_round in software, the kernel moved ~1.2 TB/s (QUANT) and ~2.6 TB/s (BF16)
// of x and codes (ncu, a 4096-token prefill); wo_b's whole call at 4096 tokens went 350 -> 312 us with
// both changes (bench dense, one call; four items alone did not move it: the QUANT math was the cost).
// round_in (QUANT only): x holds a projection's unrounded f32 sums whose official values are their bf16
// roundings (wo_a's, for wo_b: fast_dense_gemm.rs run_gemm_chain); each value is rounded first, so the
// codes and scales are those of the rounded x, bit for bit, and the rounding pass over x is not needed.
// (round_bf16_nonnan: a NaN stays a NaN, whose e4m3 code does not depend on its payload.)
// Grid ceil(T * K / 128 / (FD_WARPS * FD_LT_ITEMS)), FD_THREADS threads.
extern "C" __global__ void __launch_bounds__(FD_THREADS)
    fd_lt_operand_kernel(const float* x, int ldx, int T, int K, int mode, int round_in, unsigned char* codes,
                         float* scale) {
  dsv4_pdl_begin();
  const int nb = K / 128, lane = threadIdx.x & 31;
  const long long items = (long long)T * nb;
  const long long first = ((long long)blockIdx.x * FD_WARPS + (threadIdx.x >> 5)) * FD_LT_ITEMS;
  float4 v[FD_LT_ITEMS];
#pragma unroll
  for (int i = 0; i < FD_LT_ITEMS; ++i) {
    const long long item = first + i;
    if (item < items) {
      const int t = (int)(item / nb), b = (int)(item - (long long)t * nb);
      v[i] = *reinterpret_cast<const float4*>(x + (long long)t * ldx + b * 128 + 4 * lane);
    }
  }
#pragma unroll
  for (int i = 0; i < FD_LT_ITEMS; ++i) {
    const long long item = first + i;
    if (item >= items) break;  // uniform per warp: the amax reduction needs every lane
    const int t = (int)(item / nb), b = (int)(item - (long long)t * nb);
    if (mode == FD_ACT_QUANT) {
      if (round_in) {
        v[i].x = round_bf16_nonnan(v[i].x);
        v[i].y = round_bf16_nonnan(v[i].y);
        v[i].z = round_bf16_nonnan(v[i].z);
        v[i].w = round_bf16_nonnan(v[i].w);
      }
      float s;
      const unsigned q = fd_quant_codes(v[i], fd_warp_amax(v[i]), s);
      *reinterpret_cast<unsigned*>(codes + (long long)t * K + b * 128 + 4 * lane) = q;
      if (lane == 0) scale[(long long)b * T + t] = s;
    } else {
      // fd_operands' BF16 values, without its amax (a BF16 operand has no scale).
      uint2 packed;
      packed.x = (unsigned)f32_to_bf16(v[i].x) | ((unsigned)f32_to_bf16(v[i].y) << 16);
      packed.y = (unsigned)f32_to_bf16(v[i].z) | ((unsigned)f32_to_bf16(v[i].w) << 16);
      *reinterpret_cast<uint2*>(codes + ((long long)t * K + b * 128 + 4 * lane) * 2) = packed;
    }
  }
}

// RMSNorm of `rows` rows in place, NormRope::rmsnorm's operation, bits and block (norm_row.cuh's row code:
// rmsnorm_rows_kernel's block for a prefill's rows, VALS = RN_ROWS_VALS; rmsnorm_kernel's registers path for
// fewer, VALS = RN_VALS) and, from the normed values still in registers, the operands of the first m rows that
// the projections reading them would make otherwise:
// - for cuBLASLt (fd_lt_operand_kernel's bytes): with `codes`, the official act_quant's e4m3 codes [m][dim] and
//   scales [dim / 128][m] (token-fastest); with `bf16`, bf16(x) [m][dim];
// - for the gemv (fd_act_kernel's QUANT operand): with `act`, the f16 value of each e4m3 code [m][dim] and the
//   scales [m][dim / 128] in `act_scale`.
// So a group's input needs no operand pass over it (a 4096-token prefill's u: two passes, ~70 + ~39 us a layer,
// ncu; q_lora's: one) and a decode step's q_lora no fd_act_kernel launch (or in-block quantisation) before each
// of wq_b and the indexer's wq_b. Value i = tid + j * nthreads of a row sits in thread tid (norm_row.cuh's
// order), so a 128-block of k is one j across four warps (nthreads % 128 == 0): each warp's largest |x| goes
// through shared memory, and the block's is the largest of its four (a maximum, so in any order fd_warp_amax's
// value: fmaxf skips NaNs alike). Each value's code is then fd_quant_codes' byte (fd_quant_code), stored a byte a
// lane: a warp's 32 consecutive bytes. Requires dim % 128 == 0 and dim <= VALS * nthreads (the wrapper checks).
// Grid-stride over rows.
static_assert(RN_ROWS_THREADS % 128 == 0, "fd_norm_operands: a 128-block is four whole warps of one j");
template <int VALS, int THREADS>
DSV4_INLINE void fd_norm_operands(float* x, int rows, int dim, int ld, const float* weight, float eps, int round_out,
                                  int m, unsigned char* codes, float* scale, unsigned short* bf16,
                                  unsigned short* act, float* act_scale) {
  __shared__ double scratch[32];
  __shared__ float warp_amax[NORM_ROW_AMAX];
  // THREADS: the block's threads where a compile-time constant (the rows kernel's), else 0 (blockDim.x).
  const int nthreads = THREADS > 0 ? THREADS : (int)blockDim.x;
  const int tid = threadIdx.x;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float o[VALS];
    rmsnorm_row_in_registers<VALS>(x + (long long)r * ld, dim, weight, eps, round_out, scratch, o);
    if (r >= m) continue;  // uniform over the block
    const long long row0 = (long long)r * dim;
    if (bf16 != nullptr) {
#pragma unroll
      for (int j = 0; j < VALS; ++j) {
        const int i = tid + j * nthreads;
        if (i < dim) bf16[row0 + i] = f32_to_bf16(o[j]);
      }
    }
    if (codes == nullptr && act == nullptr) continue;  // uniform
    norm_row_warp_amax<VALS>(o, dim, nthreads, warp_amax);
#pragma unroll
    for (int j = 0; j < VALS; ++j) {
      const int i = tid + j * nthreads;
      if (i >= dim) break;  // whole 128-blocks: dim % 128 == 0
      const int e = fd_quant_exponent(norm_row_block_amax(warp_amax, j, nthreads));
      const unsigned char code = fd_quant_code(o[j], dsv4_pow2(-e));
      const bool first = (tid & 127) == 0;  // a block's scale by its first thread
      if (codes != nullptr) {
        codes[row0 + i] = code;
        if (first) scale[(long long)(i >> 7) * m + r] = dsv4_pow2(e);
      }
      if (act != nullptr) {
        // An e4m3 value is an f16 value: the conversion is exact (fd_operands' f16 of the code).
        act[row0 + i] = (unsigned short)(fd_e4m3x2_to_f16x2(code) & 0xffffu);
        if (first) act_scale[(long long)r * (dim >> 7) + (i >> 7)] = dsv4_pow2(e);
      }
    }
    __syncthreads();  // warp_amax is the next row's
  }
}

// fd_norm_operands for a prefill's rows: rmsnorm_rows_kernel's block.
extern "C" __global__ void __launch_bounds__(RN_ROWS_THREADS)
    fd_norm_operands_kernel(float* x, int rows, int dim, int ld, const float* weight, float eps, int round_out,
                            int m, unsigned char* codes, float* scale, unsigned short* bf16, unsigned short* act,
                            float* act_scale) {
  dsv4_pdl_begin();
  fd_norm_operands<RN_ROWS_VALS, RN_ROWS_THREADS>(x, rows, dim, ld, weight, eps, round_out, m, codes, scale, bf16,
                                                  act, act_scale);
}

// fd_norm_operands for fewer rows: rmsnorm_kernel's block (its registers path; blockDim % 128 == 0).
extern "C" __global__ void __launch_bounds__(1024)
    fd_norm_operands_row_kernel(float* x, int rows, int dim, int ld, const float* weight, float eps, int round_out,
                                int m, unsigned char* codes, float* scale, unsigned short* bf16, unsigned short* act,
                                float* act_scale) {
  dsv4_pdl_begin();
  fd_norm_operands<RN_VALS, 0>(x, rows, dim, ld, weight, eps, round_out, m, codes, scale, bf16, act, act_scale);
}

// out[j, c] = bf16(e4m3(w[j, c]) * wscale[j / 128, c / 128]) for j < N, c < K (K a multiple of 128): an FP8
// weight with 128 x 128 f32 block scales dequantized to BF16 for a cuBLASLt BF16 GEMM (wo_a's einsum at
// many tokens, fast_dense_gemm.rs), as the official model dequantizes it. Exact where the scales are
// powers of two (UE8M0): an e4m3 value times 2^e is a BF16 value. A thread converts 16 codes. Grid
// ceil(N * K / 16 / 256), 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    fd_dequant_bf16_kernel(const unsigned char* w, const float* wscale, int N, int K, unsigned short* out) {
  dsv4_pdl_begin();
  const long long i = (long long)blockIdx.x * 256 + threadIdx.x, first = 16 * i;
  if (first >= (long long)N * K) return;
  const int row = (int)(first / K), col = (int)(first - (long long)row * K);
  const float s = wscale[(long long)(row / 128) * (K / 128) + col / 128];
  const uint4 codes = *reinterpret_cast<const uint4*>(w + first);
  const unsigned cw[4] = {codes.x, codes.y, codes.z, codes.w};
  unsigned packed[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const unsigned h2 = fd_e4m3x2_to_f16x2((unsigned short)(cw[q >> 1] >> (16 * (q & 1))));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(lo) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(hi) : "h"((unsigned short)(h2 >> 16)));
    lo = __fmul_rn(lo, s);
    hi = __fmul_rn(hi, s);
    packed[q] = (unsigned)f32_to_bf16(lo) | ((unsigned)f32_to_bf16(hi) << 16);
  }
  uint4* o = reinterpret_cast<uint4*>(out + first);
  o[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  o[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
}

// y[t, j] = bf16(y[t, j]) in place for t < T, j < N (row stride ldy): the official BF16 output of a
// cuBLASLt GEMM that wrote f32. A thread rounds 4 consecutive values (one 16-byte access where the
// row allows it). Grid (ceil(N / 1024), T), 256 threads.
extern "C" __global__ void __launch_bounds__(256) fd_round_bf16_kernel(float* y, int ldy, int T, int N) {
  dsv4_pdl_begin();
  const int j = (blockIdx.x * 256 + threadIdx.x) * 4;
  if (j >= N) return;
  float* p = y + (long long)blockIdx.y * ldy + j;
  if (j + 4 <= N && (reinterpret_cast<unsigned long long>(p) & 15) == 0) {
    float4 v = *reinterpret_cast<float4*>(p);
    v.x = round_bf16(v.x);
    v.y = round_bf16(v.y);
    v.z = round_bf16(v.z);
    v.w = round_bf16(v.w);
    *reinterpret_cast<float4*>(p) = v;
  } else {
    for (int i = 0; i < 4 && j + i < N; ++i) p[i] = round_bf16(p[i]);
  }
}

// One weight kind's geometry: bytes per element, 64-byte chunks per 128-block of k, blocks kept in
// flight per warp, and the padding of a shared-memory activation row (16 bytes for FP8's 32-byte
// lane reads, 64 for BF16's 16-byte ones: either way the 8 lanes of a 16-byte access phase hit
// distinct banks).
template <bool FP8>
struct FdKind {
  static constexpr int ESIZE = FP8 ? 1 : 2;
  static constexpr int CHUNKS = 2 * ESIZE;     // 128 k = 128 (FP8) or 256 (BF16) bytes of a row
  static constexpr int K_PER_CHUNK = 64 / ESIZE;
  static constexpr int PAD = FP8 ? 8 : 32;     // halves after each activation row
};

// Dynamic shared memory of a gemv block (fd_smem_bytes in fast_dense.rs computes the same): the
// activations [8 NT][S + PAD] (16-bit), their scales [8 NT][S / 128], and with several slices the
// partial sums [8 NT][FD_ROWS] f32.
DSV4_INLINE int fd_act_stride(bool fp8, int S) { return S + (fp8 ? 8 : 32); }

// FP8 weights are read in whole 128-byte lines: each warp load covers four rows' lines (32 lanes x
// 16 bytes), where the MMA fragment wants four lanes a row (g = lane / 4): read in that order, a load
// covered half of eight rows' lines and the gemv streamed 73% of HBM against 95% for the same bytes in
// whole lines (read_probe_rows_kernel). So a 128-block of the warp's 16 rows is two MMA row sets of
// four k16 steps each: half 0 (k 0-63) of rows 0-15 on MMA rows 0-15, and half 1 (k 64-127) of row
// m ^ 4 on MMA row m. Load j (0-3) of lane (g, c) reads row fd_line_row(j, g) at byte 64 h + 16c, h =
// fd_line_half(j, g): load 0 rows 0-3 (lanes g < 4 half 0, g >= 4 half 1), load 1 rows 4-7, loads 2
// and 3 rows 8-11 and 12-15 alike. Each lane then holds exactly its fragments of both row sets
// (fd_line_fragments); half 1's sums of row g are lane (g ^ 4)'s, moved by a shuffle into the
// accumulator that half 0's MMAs continue: as many MMAs as before, the same activation operands.
DSV4_INLINE int fd_line_row(int j, int g) { return 4 * (j & 1) + 8 * (j >> 1) + (g & 3); }
DSV4_INLINE int fd_line_half(int j, int g) { return (g >> 2) ^ (j & 1); }

// Lane (g, c)'s fragments of row set `half` (rows g and g + 8 of it) out of its four loads of a
// 128-block (w[j >> 1][j & 1] = load j): a select per register, no data moves between lanes.
// (The BF16 instantiation of fd_gemv names this too, with four chunks, and never runs it.)
template <int CHUNKS>
DSV4_INLINE void fd_line_fragments(const uint4 (&w)[CHUNKS][2], int g, int half, uint4& r0, uint4& r1) {
  // Load j holds half (g >> 2) ^ (j & 1): for g < 4 the even loads are half 0, for g >= 4 the odd ones.
  const bool even = ((g >> 2) ^ half) == 0;
  r0 = even ? w[0][0] : w[0][1];
  r1 = even ? w[1][0] : w[1][1];
}

// The MMAs of one 64-byte chunk: w0 / w1 the lane's 16 bytes of rows g / g + 8, b the lane's 16-bit
// activations of token g of each tile (FP8: 16 values, two uint4; BF16: 8 values, one uint4).
template <bool FP8, int NT>
DSV4_INLINE void fd_chunk(float (&blk)[NT][4], uint4 w0, uint4 w1, const uint4 (&b)[NT][2]) {
  const unsigned r0[4] = {w0.x, w0.y, w0.z, w0.w};
  const unsigned r1[4] = {w1.x, w1.y, w1.z, w1.w};
  if (FP8) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned a0 = fd_e4m3x2_to_f16x2((unsigned short)(r0[j] & 0xffffu));
      const unsigned a2 = fd_e4m3x2_to_f16x2((unsigned short)(r0[j] >> 16));
      const unsigned a1 = fd_e4m3x2_to_f16x2((unsigned short)(r1[j] & 0xffffu));
      const unsigned a3 = fd_e4m3x2_to_f16x2((unsigned short)(r1[j] >> 16));
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 q = b[nt][j >> 1];
        const unsigned b0 = (j & 1) ? q.z : q.x, b1 = (j & 1) ? q.w : q.y;
        fd_mma<true>(blk[nt], a0, a1, a2, a3, b0, b1);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 q = b[nt][0];
        const unsigned b0 = j ? q.z : q.x, b1 = j ? q.w : q.y;
        fd_mma<false>(blk[nt], r0[2 * j], r1[2 * j], r0[2 * j + 1], r1[2 * j + 1], b0, b1);
      }
    }
  }
}

// Stages the block's activations: rows t < T of the slice, from `act` / `ascale` (fused = 0) or made
// from x as fd_act_kernel makes them (fused = 1); operand rows T .. act_rows - 1 and scale rows T ..
// 8 NT - 1 are zeros (a warp-split block has only T operand rows and reads no others).
template <int NT>
DSV4_INLINE void fd_stage(unsigned short* act_s, float* sc_s, int stride, int S, int col0, int T, int act_rows, int fused,
                          const float* __restrict__ x, int ldx, int mode, const unsigned short* __restrict__ act,
                          const float* __restrict__ ascale, int width) {
  const int nb = S / 128;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (fused) {
    // One warp per (token, 128-block), four at a time so their loads are in flight together.
    const int items = T * nb;
    for (int i0 = warp; i0 < items; i0 += 4 * FD_WARPS) {
      float4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = i0 + u * FD_WARPS;
        if (it < items) {
          const int t = it / nb, b = it - t * nb;
          v[u] = *reinterpret_cast<const float4*>(x + (long long)t * ldx + col0 + b * 128 + 4 * lane);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int it = i0 + u * FD_WARPS;
        if (it < items) {  // uniform per warp
          const int t = it / nb, b = it - t * nb;
          float s;
          unsigned short h[4];
          fd_operands(v[u], mode, s, h);
          uint2 packed;
          packed.x = (unsigned)h[0] | ((unsigned)h[1] << 16);
          packed.y = (unsigned)h[2] | ((unsigned)h[3] << 16);
          *reinterpret_cast<uint2*>(act_s + t * stride + b * 128 + 4 * lane) = packed;
          if (lane == 0) sc_s[t * nb + b] = s;
        }
      }
    }
  } else {
    // The activation scales' loads first (FD_SCALE_LOADS a thread at most), so that they are in
    // flight with the rows' instead of a round trip after them.
    float sv[FD_SCALE_LOADS];
#pragma unroll
    for (int u = 0; u < FD_SCALE_LOADS; ++u) {
      const int i = threadIdx.x + u * FD_THREADS;
      sv[u] = i < T * nb ? __ldg(ascale + (long long)(i / nb) * (width / 128) + col0 / 128 + i % nb) : 0.0f;
    }
    // 16-byte pieces of the rows, all loads of a thread issued before their stores.
    const int per_row = S / 8, pieces = T * per_row;
    for (int p0 = threadIdx.x; p0 < pieces; p0 += 4 * FD_THREADS) {
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int p = p0 + u * FD_THREADS;
        if (p < pieces) {
          const int t = p / per_row, q = p - t * per_row;
          v[u] = __ldg(reinterpret_cast<const uint4*>(act + (long long)t * width + col0 + 8 * q));
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int p = p0 + u * FD_THREADS;
        if (p < pieces) {
          const int t = p / per_row, q = p - t * per_row;
          *reinterpret_cast<uint4*>(act_s + t * stride + 8 * q) = v[u];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < FD_SCALE_LOADS; ++u) {
      const int i = threadIdx.x + u * FD_THREADS;
      if (i < T * nb) sc_s[i] = sv[u];
    }
  }
  // Token rows past T: zero operands and scales (their sums are dropped).
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  for (int p = T * (S / 8) + threadIdx.x; p < act_rows * (S / 8); p += FD_THREADS) {
    const int t = p / (S / 8), q = p - t * (S / 8);
    *reinterpret_cast<uint4*>(act_s + t * stride + 8 * q) = zero;
  }
  for (int i = T * nb + threadIdx.x; i < 8 * NT * nb; i += FD_THREADS) sc_s[i] = 0.0f;
}

// A warp's partial sums into part_s [8 NT][FD_ROWS] f32: fragment (nt, i) is row 16 warp + g + 8 (i >> 1)
// of the block's, token 8 nt + 2c + (i & 1) (the cluster's and the warp split's exchange).
template <int NT>
DSV4_INLINE void fd_store_partials(float* part_s, const float (&acc)[NT][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = warp * 16 + g + 8 * (i >> 1), t = 8 * nt + 2 * c + (i & 1);
      part_s[t * FD_ROWS + r] = acc[nt][i];
    }
  }
}

// The K split's end without a cluster (split_part given): the block's partial sums of tokens < T go
// to its slot of split_part, [launch row tile][slice][8 NT tokens][FD_ROWS] f32, where the launch's
// row tile is blockIdx.z * gridDim.x + blockIdx.x (both gemv and group grids); after a fence the
// block adds one to the row tile's split_count. The block that brings it to `slices` (the last of
// the row tile's slices to finish, whichever that is) reads every slice's partials in slice order
// (sum = p_0 + p_1 + ...: the cluster path's sums exactly), writes y and puts the counter back to 0
// for the next launch (the arena starts zeroed; no block of a later launch counts before this
// launch has finished: fd_gemv counts after its programmatic-launch wait).
template <int NT>
DSV4_INLINE void fd_split_finish(const float (&acc)[NT][4], float* __restrict__ split_part, unsigned* split_count,
                                 int T, int N, int tile0, int slice, int slices, int round_out,
                                 float* __restrict__ y, int ldy, long long y_col) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const long long row_tile = (long long)blockIdx.z * gridDim.x + blockIdx.x;
  const int per_slice = 8 * NT * FD_ROWS;
  float* slot = split_part + (row_tile * slices + slice) * per_slice;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = warp * 16 + g + 8 * (i >> 1), t = 8 * nt + 2 * c + (i & 1);
      if (t < T) __stcg(slot + t * FD_ROWS + r, acc[nt][i]);
    }
  }
  __shared__ int fd_last;
  // Release: every thread's partials are visible device-wide before the block counts itself in.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) fd_last = atomicAdd(split_count + row_tile, 1u) == (unsigned)(slices - 1);
  __syncthreads();
  if (!fd_last) return;
  // Acquire: the other slices' partials, read from L2 (__ldcg: never a stale L1 line).
  __threadfence();
  const float* tile_part = split_part + row_tile * slices * per_slice;
  for (int idx = threadIdx.x; idx < T * FD_ROWS; idx += FD_THREADS) {
    const int t = idx / FD_ROWS, n = tile0 + idx - t * FD_ROWS;
    float v[FD_MAX_SLICES];
#pragma unroll
    for (int s = 0; s < FD_MAX_SLICES; ++s)
      if (s < slices) v[s] = __ldcg(tile_part + s * per_slice + idx);
    float sum = v[0];
#pragma unroll
    for (int s = 1; s < FD_MAX_SLICES; ++s)
      if (s < slices) sum += v[s];
    if (n < N) y[(long long)t * ldy + y_col + n] = round_out ? round_bf16(sum) : sum;
  }
  if (threadIdx.x == 0) split_count[row_tile] = 0u;
}

// One block's share of a projection: row tile `tile` (FD_ROWS rows) of group gz (of `groups`), slice
// `slice` of `slices` of K. With several slices and no `split_part`, the slices of a row tile are
// one cluster (1, slices, 1) of the launch; with `split_part` they meet through fd_split_finish.
// With warp_slices > 1 (a grid of one slice) the split is inside the block instead ("warp split"):
// warp w sums slice w % warp_slices of row group w / warp_slices (16 rows), the block's tile is
// 16 FD_WARPS / warp_slices rows, and the block adds its warps' partial sums in slice order through
// shared memory: the same sums as the cluster's and the workspace's, with no other block to wait
// for. The block stages all of K for T tokens (T (K + pad) halves), so it is for few tokens.
// prefetch_after: the 128-blocks past the register prologue its warps ask L2 for before the wait
// (FD_PREFETCH_AFTER, or 0; see there).
template <bool FP8, int NT>
DSV4_INLINE void fd_gemv(const unsigned char* __restrict__ w, const float* __restrict__ wscale, int N, int K,
                         const float* __restrict__ x, int ldx, int mode, int fused,
                         const unsigned short* __restrict__ act, const float* __restrict__ ascale, int T,
                         int round_out, float* __restrict__ y, int ldy, float* __restrict__ split_part,
                         unsigned* __restrict__ split_count, int tile, int slice, int slices, int gz, int groups,
                         int warp_slices, int prefetch_after) {
  typedef FdKind<FP8> KD;
  // 128-blocks loaded ahead, 4 loads of 16 bytes a lane each (FP8; BF16 8). FP8: at one token tile 3
  // (measured, bench dense, H200, T = 1: wq_b 10.7 / 10.4 / 11.8 us at 2 / 3 / 4, the last bound to
  // 128 registers with spills), at two 2 (at 16 tokens 3 spilled and lost: wo_b 23.0 against 24.0),
  // from four 4 (those kernels take one block an SM whatever AHEAD: 2 lost 3-7% at 32-64 tokens).
  constexpr int AHEAD = FP8 ? (NT == 1 ? 3 : (NT == 2 ? 2 : 4)) : 2;
  extern __shared__ __align__(16) unsigned char fd_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const bool wsplit = NT == 1 && warp_slices > 1;  // (only fd_gemv_t8_kernel takes it)
  if (wsplit) {
    slices = warp_slices;
    slice = warp % warp_slices;
  }
  const int tile_rows = wsplit ? 16 * (FD_WARPS / warp_slices) : FD_ROWS;
  const int S = K / slices, k0 = slice * S, blocks = S / 128;
  const int n0 = tile * tile_rows + (wsplit ? warp / warp_slices : warp) * 16;
  const long long row_bytes = (long long)K * KD::ESIZE;
  // The lane's weight loads of a 128-block: wr[.][ch][i] reads 16 bytes at pw[ch][i] + the block's
  // offset (+ 64 ch for BF16). Rows past N read row N - 1 (their sums are dropped).
  // - FP8 (whole lines): load j = 2 ch + i reads row n0 + fd_line_row(j, g) at byte 64 fd_line_half(j, g)
  //   + 16c: the 32 lanes of a load read four rows' whole 128-byte lines (fd_line_fragments).
  // - BF16: ch's 64-byte chunk at 16c of rows g (i = 0) and g + 8 (i = 1): 8 rows' halves a load.
  const unsigned char* pw[2][2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int row = FP8 ? fd_line_row(j, g) : g + 8 * (j & 1);
    const int byte = FP8 ? 64 * fd_line_half(j, g) + 16 * c : 16 * c;
    pw[j >> 1][j & 1] = w + ((long long)gz * N + min(n0 + row, N - 1)) * row_bytes + (long long)k0 * KD::ESIZE + byte;
  }
  // The FP8 block scales of the warp's 16 rows (one 128-row block: n0 is a multiple of 16).
  const float* sw_row = FP8 ? wscale + ((long long)gz * N + min(n0, N - 1)) / 128 * (K / 128) + k0 / 128 : nullptr;

  // The first weight loads go out before the activations are staged.
  uint4 wr[AHEAD][KD::CHUNKS][2];
#pragma unroll
  for (int p = 0; p < AHEAD; ++p) {
    if (p < blocks) {
#pragma unroll
      for (int ch = 0; ch < KD::CHUNKS; ++ch) {
        const long long off = (long long)p * 128 * KD::ESIZE + (FP8 ? 0 : 64 * ch);
        wr[p][ch][0] = fd_ld_stream(pw[FP8 ? ch : 0][0] + off);
        wr[p][ch][1] = fd_ld_stream(pw[FP8 ? ch : 0][1] + off);
      }
    }
  }
  // A launch of few blocks (at most FD_PREFETCH_MAX_GRID) also asks L2 for its warps' whole rows of the
  // slice now, a lane a row: its register loads alone keep too few bytes in flight (measured, one
  // token: compressor.wkv, 64 blocks, 7.3 -> 5.3 us). A launch that fills the SMs has enough in flight
  // for the loop, and there whole rows cost time (wq_b 11.1 -> 12.4 us); but while the block stages
  // its activations below, only the AHEAD blocks above are moving, so an FP8 launch of up to 8 tokens
  // without the warp split asks for the next `prefetch_after` blocks (FD_PREFETCH_AFTER; wq_b 10.6 ->
  // 10.45 us at one token). Elsewhere it lost: the head (BF16, warp split) 236 -> 242 us, the grouped
  // u projections at 8 slices 9.8 -> 11.0 us (they pass 0), 16-64 tokens -1% to +1.5%.
  if (lane < 16 && n0 + lane < N) {
    const bool few = gridDim.x * gridDim.y * gridDim.z <= FD_PREFETCH_MAX_GRID;
    const int after = FP8 && NT == 1 && !wsplit ? prefetch_after : 0;
    const int first = few ? 0 : AHEAD, last = few ? blocks : min(blocks, AHEAD + after);
    if (last > first)
      fd_prefetch_l2(w + ((long long)gz * N + n0 + lane) * row_bytes + (long long)(k0 + 128 * first) * KD::ESIZE,
                     (unsigned)((last - first) * 128 * KD::ESIZE));
  }
  // The warp's FP8 block scales of the slice, copied to shared memory asynchronously before the wait
  // (they are weights) and read by the loop from there. Loaded in the loop, each was an L2 round
  // trip on its critical path once the weights ahead were in flight.
  __shared__ float fd_sw[FD_WARPS][FD_MAX_SLICE / 128];
  if (FP8 && lane < blocks) cp_async_4(smem_addr(&fd_sw[warp][lane]), sw_row + lane);
  // Everything below reads what earlier kernels wrote (common.cuh: only weights before the wait).
  dsv4_pdl_wait();
  // Staged: the slice's columns (S_st = S), or all of K for T operand rows (warp split), whose warp
  // reads from column k_st on.
  const int S_st = wsplit ? K : S, k_st = wsplit ? k0 : 0, act_rows = wsplit ? T : 8 * NT;
  const int nb_st = S_st / 128;
  const int stride = fd_act_stride(FP8, S_st);
  unsigned short* act_s = reinterpret_cast<unsigned short*>(fd_smem);
  float* sc_s = reinterpret_cast<float*>(fd_smem + 2 * act_rows * stride);
  float* part_s = sc_s + 8 * NT * nb_st;
  // Activations: [T, groups * K]; group gz's columns start at gz * K.
  fd_stage<NT>(act_s, sc_s, stride, S_st, gz * K + (wsplit ? 0 : k0), T, act_rows, fused, x, ldx, mode, act, ascale,
               groups * K);
  if (FP8) cp_async_wait_all();  // the scales, before the barrier publishes them
  __syncthreads();

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  for (int kb0 = 0; kb0 < blocks; kb0 += AHEAD) {
#pragma unroll
    for (int p = 0; p < AHEAD; ++p) {
      const int kb = kb0 + p;
      if (kb < blocks) {
        float blk[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) blk[nt][0] = blk[nt][1] = blk[nt][2] = blk[nt][3] = 0.0f;
        // FP8 takes half 1 first (its sums land on rows g ^ 4 and (g + 8) ^ 4, fd_line_fragments),
        // moves them to their rows' lanes and adds half 0's MMAs onto them.
#pragma unroll
        for (int step = 0; step < KD::CHUNKS; ++step) {
          const int ch = FP8 ? KD::CHUNKS - 1 - step : step;
          uint4 b[NT][2];
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (!wsplit || 8 * nt + g < T) {
              const unsigned short* q =
                  act_s + (8 * nt + g) * stride + k_st + kb * 128 + ch * KD::K_PER_CHUNK + (16 / KD::ESIZE) * c;
              b[nt][0] = *reinterpret_cast<const uint4*>(q);
              b[nt][1] = FP8 ? *reinterpret_cast<const uint4*>(q + 8) : b[nt][0];
            } else {
              b[nt][0] = b[nt][1] = make_uint4(0u, 0u, 0u, 0u);
            }
          }
          if (FP8) {
            uint4 r0, r1;
            fd_line_fragments(wr[p], g, ch, r0, r1);
            if (ch == 0) {
              // Row g's half-1 sums are lane (g ^ 4, c)'s: they become the accumulator half 0's
              // MMAs start from, so the tensor core sums the 128-block in 8 steps as before.
#pragma unroll
              for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int i = 0; i < 4; ++i) blk[nt][i] = __shfl_xor_sync(0xffffffffu, blk[nt][i], 16);
            }
            fd_chunk<FP8, NT>(blk, r0, r1, b);
          } else {
            fd_chunk<FP8, NT>(blk, wr[p][ch][0], wr[p][ch][1], b);
          }
        }
        if (kb + AHEAD < blocks) {
#pragma unroll
          for (int ch = 0; ch < KD::CHUNKS; ++ch) {
            const long long off = (long long)(kb + AHEAD) * 128 * KD::ESIZE + (FP8 ? 0 : 64 * ch);
            wr[p][ch][0] = fd_ld_stream(pw[FP8 ? ch : 0][0] + off);
            wr[p][ch][1] = fd_ld_stream(pw[FP8 ? ch : 0][1] + off);
          }
        }
        const float sw = FP8 ? fd_sw[warp][kb] : 1.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float s0 = sw * sc_s[(8 * nt + 2 * c) * nb_st + k_st / 128 + kb];
          const float s1 = sw * sc_s[(8 * nt + 2 * c + 1) * nb_st + k_st / 128 + kb];
          acc[nt][0] += blk[nt][0] * s0;
          acc[nt][1] += blk[nt][1] * s1;
          acc[nt][2] += blk[nt][2] * s0;
          acc[nt][3] += blk[nt][3] * s1;
        }
      }
    }
  }

  // Fragment (nt, i): row n0 + g + 8 (i >> 1), token 8 nt + 2c + (i & 1).
  const long long y_col = (long long)gz * N;
  if (wsplit) {
    // Partial sums [8 NT][FD_ROWS] (warp w's at columns 16w..16w+15), then a thread an output: its
    // row group's slices in order.
    fd_store_partials<NT>(part_s, acc);
    __syncthreads();
    for (int idx = threadIdx.x; idx < T * tile_rows; idx += FD_THREADS) {
      const int t = idx / tile_rows, rl = idx - t * tile_rows, n = tile * tile_rows + rl;
      const float* v = part_s + t * FD_ROWS + (rl >> 4) * warp_slices * 16 + (rl & 15);
      float sum = v[0];
      for (int s = 1; s < warp_slices; ++s) sum += v[16 * s];
      if (n < N) y[(long long)t * ldy + y_col + n] = round_out ? round_bf16(sum) : sum;
    }
    return;
  }
  if (slices == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = n0 + g + 8 * (i >> 1), t = 8 * nt + 2 * c + (i & 1);
        if (n < N && t < T) y[(long long)t * ldy + y_col + n] = round_out ? round_bf16(acc[nt][i]) : acc[nt][i];
      }
    }
    return;
  }
  if (split_part != nullptr) {
    fd_split_finish<NT>(acc, split_part, split_count, T, N, tile * FD_ROWS, slice, slices, round_out, y, ldy, y_col);
    return;
  }
  // Partial sums [8 NT][FD_ROWS] in shared memory; then block `slice` of the cluster (the row tile's
  // slices) sums its share of the outputs over every block's partials, in slice order.
  fd_store_partials<NT>(part_s, acc);
  cluster_sync();
  const int outputs = T * FD_ROWS, share = (outputs + slices - 1) / slices;
  const int tile0 = tile * FD_ROWS;
  const unsigned base = smem_addr(part_s);
  for (int idx = slice * share + threadIdx.x; idx < min(outputs, (slice + 1) * share); idx += FD_THREADS) {
    const int t = idx / FD_ROWS, r = idx - t * FD_ROWS, n = tile0 + r;
    float v[FD_MAX_SLICES];
#pragma unroll
    for (int s = 0; s < FD_MAX_SLICES; ++s)
      if (s < slices) v[s] = ld_cluster_f32(cluster_map(base + 4u * idx, (unsigned)s));
    float sum = v[0];
#pragma unroll
    for (int s = 1; s < FD_MAX_SLICES; ++s)
      if (s < slices) sum += v[s];
    if (n < N) y[(long long)t * ldy + y_col + n] = round_out ? round_bf16(sum) : sum;
  }
  // No block leaves while another may still read its shared memory.
  cluster_sync();
}

// The share of a block of a fd_gemv_t*_kernel launch: tile blockIdx.x, slice blockIdx.y, group blockIdx.z.
#define FD_GRID_SHARE blockIdx.x, blockIdx.y, gridDim.y, blockIdx.z, gridDim.z

// y[t, gz * N + n] (row stride ldy) = Σ_k a[t, gz * K + k] · W[gz * N + n, k] for t < T <= 8 · NT,
// n < N, group gz = blockIdx.z; W is [groups * N, K] FP8 codes with f32 128 x 128 block scales `wscale`
// (`fp8` = 1) or BF16 (`fp8` = 0, wscale unused). The activations come from fd_act_kernel's `act` /
// `ascale` ([T, groups * K]; fused = 0) or from x ([T, ldx] f32, 16-byte aligned rows) in `mode`
// (fused = 1). Grid (ceil(N / FD_ROWS), slices, groups), FD_THREADS threads; when slices > 1 (at
// most FD_MAX_SLICES) either clusters of (1, slices, 1) blocks (split_part null) or the split
// workspace split_part / split_count (fd_split_finish); K a multiple of 128 * slices, K / slices at
// most FD_MAX_SLICE; dynamic shared memory fd_smem_bytes (fast_dense.rs). warp_slices > 1 (a power of
// two, at most FD_WARPS; T <= 8, t8 only) splits K inside each block instead: grid (ceil(N / (16
// FD_WARPS / warp_slices)), 1, groups), no cluster, no workspace (fd_gemv).
// One entry point per token tile count NT (tokens <= 8 NT), so each is compiled for its own registers.
// t8 and t16 are bound to two blocks an SM: with the FP8 whole-line loads' selects ptxas gave t8 150
// registers (one block an SM); bound, both take 128 with at most 8 bytes of spills. t32 / t64 run one
// block an SM either way.
extern "C" __global__ void __launch_bounds__(FD_THREADS, 2)
    fd_gemv_t8_kernel(const unsigned char* w, const float* wscale, int N, int K, int fp8, const float* x, int ldx, int mode,
        int fused, const unsigned short* act, const float* ascale, int T, int round_out, float* y, int ldy,
        float* split_part, unsigned* split_count, int warp_slices) {
  dsv4_pdl_trigger();  // fd_gemv waits after its first weight loads
  if (fp8) fd_gemv<true, 1>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
  else fd_gemv<false, 1>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
}

extern "C" __global__ void __launch_bounds__(FD_THREADS, 2)
    fd_gemv_t16_kernel(const unsigned char* w, const float* wscale, int N, int K, int fp8, const float* x, int ldx, int mode,
        int fused, const unsigned short* act, const float* ascale, int T, int round_out, float* y, int ldy,
        float* split_part, unsigned* split_count, int warp_slices) {
  dsv4_pdl_trigger();  // fd_gemv waits after its first weight loads
  if (fp8) fd_gemv<true, 2>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
  else fd_gemv<false, 2>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
}

extern "C" __global__ void __launch_bounds__(FD_THREADS)
    fd_gemv_t32_kernel(const unsigned char* w, const float* wscale, int N, int K, int fp8, const float* x, int ldx, int mode,
        int fused, const unsigned short* act, const float* ascale, int T, int round_out, float* y, int ldy,
        float* split_part, unsigned* split_count, int warp_slices) {
  dsv4_pdl_trigger();  // fd_gemv waits after its first weight loads
  if (fp8) fd_gemv<true, 4>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
  else fd_gemv<false, 4>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
}

extern "C" __global__ void __launch_bounds__(FD_THREADS)
    fd_gemv_t64_kernel(const unsigned char* w, const float* wscale, int N, int K, int fp8, const float* x, int ldx, int mode,
        int fused, const unsigned short* act, const float* ascale, int T, int round_out, float* y, int ldy,
        float* split_part, unsigned* split_count, int warp_slices) {
  dsv4_pdl_trigger();  // fd_gemv waits after its first weight loads
  if (fp8) fd_gemv<true, 8>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
  else fd_gemv<false, 8>(w, wscale, N, K, x, ldx, mode, fused, act, ascale, T, round_out, y, ldy, split_part, split_count, FD_GRID_SHARE, warp_slices, FD_PREFETCH_AFTER);
}

// ---- Grouped launches: several projections of the same input in one launch ----
//
// A decode step's attention sub-block runs up to seven projections of its input u (wq_a, wkv, both
// compressors' wkv / wgate, the indexer's weights_proj) and two of q_lora (wq_b, the indexer's wq_b).
// One launch each costs ~4.5 µs however small the weight (BENCHMARKS.md), more than streaming most of
// them takes; a grouped launch streams them all at once. Its members share x, T and K and one K split
// (`slices`, chosen from the members' shapes together); each brings its weight, output and mode.
// Block (tile, slice) runs row tile `tile` of the group's members' row tiles in order (member 0's
// first), with its member's weight, mode and output: the fd_gemv above, operands made from x in the
// block (fused). Unused members have N = 0 (no tiles).

// A member: weight (FP8 codes with f32 128 x 128 scales, or BF16), output, and its packed geometry
// (fast_dense.rs member_meta packs the same): N in bits 0-23, ldy in bits 24-47, the weight is FP8
// (bit 48), the output is BF16-rounded (bit 49), the activation mode FD_ACT_* (bits 50-51).
#if FD_GROUP_MAX != 7
#error "fd_group_t*_kernel take exactly seven members"
#endif
struct FdMember {
  const unsigned char* w;
  const float* wscale;
  float* y;
  long long meta;
};

DSV4_INLINE int fd_member_n(long long meta) { return (int)(meta & 0xffffff); }
DSV4_INLINE int fd_member_tiles(long long meta) { return (fd_member_n(meta) + FD_ROWS - 1) / FD_ROWS; }

// Row tile blockIdx.x of the group: block (x, y) runs slice y of its member's row tile; the member is
// picked with static indices (no local-memory array).
template <int NT>
DSV4_INLINE void fd_group(const float* __restrict__ x, int ldx, int T, int K, const FdMember (&m)[FD_GROUP_MAX],
                          float* split_part, unsigned* split_count) {
  FdMember pick = m[0];
  int tile = blockIdx.x;
  bool found = false;
#pragma unroll
  for (int j = 0; j < FD_GROUP_MAX; ++j) {
    const int tiles = fd_member_tiles(m[j].meta);
    if (!found) {
      if (tile < tiles) {
        pick = m[j];
        found = true;
      } else {
        tile -= tiles;
      }
    }
  }
  // The wrapper sizes the grid to the members' tiles; a whole cluster shares blockIdx.x, so a
  // cluster leaves together.
  if (!found) return;
  const long long meta = pick.meta;
  const int N = fd_member_n(meta), ldy = (int)((meta >> 24) & 0xffffff);
  const int fp8 = (int)((meta >> 48) & 1), round_out = (int)((meta >> 49) & 1), mode = (int)((meta >> 50) & 3);
  // No L2 prefetch after the register prologue (fd_gemv): it cost the u group 12% at 8 slices.
  if (fp8)
    fd_gemv<true, NT>(pick.w, pick.wscale, N, K, x, ldx, mode, 1, nullptr, nullptr, T, round_out, pick.y, ldy, split_part,
                      split_count, tile, blockIdx.y, gridDim.y, 0, 1, 1, 0);
  else
    fd_gemv<false, NT>(pick.w, nullptr, N, K, x, ldx, mode, 1, nullptr, nullptr, T, round_out, pick.y, ldy, split_part,
                       split_count, tile, blockIdx.y, gridDim.y, 0, 1, 1, 0);
}

// y_i[t, n] (row stride ldy_i) = Σ_k a[t, k] · W_i[n, k] for every member i (FdMember; FD_GROUP_MAX of
// them, unused ones with N = 0), t < T <= 8 (t8) or 16 (t16), K shared; x [T, ldx] f32 (16-byte aligned
// rows), operands made in the blocks from x in each member's mode. Grid (Σ_i ceil(N_i / FD_ROWS),
// slices), FD_THREADS threads; when slices > 1 clusters of (1, slices, 1) or the split workspace (as
// fd_gemv_t*_kernel); K a multiple of 128 * slices,
// K / slices at most FD_MAX_SLICE; dynamic shared memory fd_smem_bytes (fast_dense.rs, BF16 layout).
// Two blocks an SM, said explicitly: left to itself ptxas gave t16 164 registers (one block an SM)
// once fd_gemv prefetched into L2; with the bound both take 128 and spill less than they did before
// (28 and 36 bytes a thread, were 44 and 52).
extern "C" __global__ void __launch_bounds__(FD_THREADS, 2)
    fd_group_t8_kernel(const float* x, int ldx, int T, int K,
        const unsigned char* w0, const float* s0, float* y0, long long m0,
        const unsigned char* w1, const float* s1, float* y1, long long m1,
        const unsigned char* w2, const float* s2, float* y2, long long m2,
        const unsigned char* w3, const float* s3, float* y3, long long m3,
        const unsigned char* w4, const float* s4, float* y4, long long m4,
        const unsigned char* w5, const float* s5, float* y5, long long m5,
        const unsigned char* w6, const float* s6, float* y6, long long m6, float* split_part, unsigned* split_count) {
  dsv4_pdl_trigger();  // fd_gemv waits after its first weight loads
  const FdMember m[FD_GROUP_MAX] = {{w0, s0, y0, m0}, {w1, s1, y1, m1}, {w2, s2, y2, m2}, {w3, s3, y3, m3},
                                    {w4, s4, y4, m4}, {w5, s5, y5, m5}, {w6, s6, y6, m6}};
  fd_group<1>(x, ldx, T, K, m, split_part, split_count);
}

extern "C" __global__ void __launch_bounds__(FD_THREADS, 2)
    fd_group_t16_kernel(const float* x, int ldx, int T, int K,
        const unsigned char* w0, const float* s0, float* y0, long long m0,
        const unsigned char* w1, const float* s1, float* y1, long long m1,
        const unsigned char* w2, const float* s2, float* y2, long long m2,
        const unsigned char* w3, const float* s3, float* y3, long long m3,
        const unsigned char* w4, const float* s4, float* y4, long long m4,
        const unsigned char* w5, const float* s5, float* y5, long long m5,
        const unsigned char* w6, const float* s6, float* y6, long long m6, float* split_part, unsigned* split_count) {
  dsv4_pdl_trigger();  // fd_gemv waits after its first weight loads
  const FdMember m[FD_GROUP_MAX] = {{w0, s0, y0, m0}, {w1, s1, y1, m1}, {w2, s2, y2, m2}, {w3, s3, y3, m3},
                                    {w4, s4, y4, m4}, {w5, s5, y5, m5}, {w6, s6, y6, m6}};
  fd_group<2>(x, ldx, T, K, m, split_part, split_count);
}
