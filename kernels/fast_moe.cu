// fast_moe kernel family: the fast set's MoE routing and combine (kernels/SPEC.md ## fast_moe.cu).
//
// [fmoe_norm_x_kernel: the input's norm with x's FP8 quantisation, where the fast set runs the norm here] ->
// fmoe_logits_kernel or fmoe_logits_grouped_kernel (+ FP8 quantisation of x, if not made), or
// fmoe_logits_tc_split_kernel from fast_moe::TC_MIN_TOKENS (its stages split over a cluster), fmoe_logits_tc_kernel
// from 2049 tokens (and from 160 where D/64 is odd) ->
// fmoe_select_kernel (+ x's quantisation after the latter, if not made) -> moe_plan_kernel or the wide plan
// (moe.cu, with tile_rows = the GEMM path's tokens per item) -> the expert GEMMs (fast_moe_gemm.cu,
// fast_moe_wide.cu) -> fmoe_combine_kernel. f32 arithmetic (and
// the tensor core's) in a fixed order (no atomics): deterministic bit for bit, not bit-identical to the f64
// reference kernels. fmoe_gate_planes_kernel builds the tensor-core router's derived gate planes (finalize, refit).
#include "common.cuh"
#include "fp8_mma.cuh"
#include "norm_row.cuh"        // fmoe_norm_x_kernel
#include "fast_moe_route.cuh"  // x's quantisation, the logits' tiles, a token's selection

// FMOE_LOGIT_WARPS, FMOE_LOGIT_EXPERTS, FMOE_LOGIT_SPLIT, FMOE_LOGIT_TOKENS, FMOE_LOGIT_GROUP, FMOE_SELECT_WARPS,
// FMOE_MAX_EPL and SCORE_* come from dsv4_consts.cuh (src/cuda/kernels/fast_moe.rs, moe.rs).

// The byte of value k (0..127) of a 128-block in xq, where fmoe_quant_x_store puts it: lane k / 4, c = k % 4.
DSV4_INLINE int fmoe_x_pos(int k, bool halves) {
  const int lane = k >> 2, c = k & 3;
  const int base = 32 * (lane >> 3) + 4 * ((lane & 7) >> 1);
  return halves ? base + 16 * (lane & 1) + c : base + 2 * (lane & 1) + (c >> 1) + 16 * (c & 1);
}

// The MoE's input norm and x's act_quant in one launch: an RMSNorm of `rows` rows in place, with the row code and
// block shape NormRope::rmsnorm gives those rows (norm_row.cuh: the registers path of rmsnorm_kernel, VALS =
// RN_VALS, or rmsnorm_rows_kernel, VALS = RN_ROWS_VALS; the same bits), then, from the normed values in
// registers, fmoe_quant_x_store's codes and scales of every row, in the order of the GEMMs that read them
// (`halves`). A 128-block of a row is one j of the strided layout across four warps (blockDim % 128 == 0): each
// warp's largest |x| through shared memory, the block's the fmaxf of the four (any order: the same maximum, NaNs
// skipped as warp_max skips them), then each value's code (fmoe_x_code, fast_moe_route.cuh) stored a byte a
// thread at its place (fmoe_x_pos). The router kernels then leave x's quantisation out (fmoe_logits_kernel's xq
// NULL, fmoe_select_kernel's x NULL): a decode step's first four router blocks no longer quantise x before their
// gate rows, and a prefill's selection no longer reads x. Requires dim % 128 == 0 and dim <= VALS * blockDim (the
// wrapper checks). Grid-stride over rows. (128 registers on the rows kernel's block, two blocks an SM as
// rmsnorm_rows_kernel; with a code's address made at each j it took 157.)
//
// The rows kernel (THREADS > 0, a prefill's rows, grid-stride) reads each row from a copy in shared memory that
// 16-byte cp.async made while the block worked on the row before (`ahead`, two rows): its rows' loads no longer
// wait on DRAM at the start of each row, which left a block's row chain (loads, the f64 sum's barrier, the amax
// barrier, the codes) latency-bound at two blocks an SM. The same values, so the same bits. (Requires x's rows
// 16-byte aligned: dim % 128 == 0, and x's address, which the wrapper checks.)
template <int VALS, int THREADS>
DSV4_INLINE void fmoe_norm_x(float* x, int rows, int dim, const float* weight, float eps, int round_out, int halves,
                             unsigned char* xq, float* xs) {
  __shared__ double scratch[32];
  __shared__ float warp_amax[NORM_ROW_AMAX];
  // THREADS: the block's threads where a compile-time constant (the rows kernel's), else 0 (blockDim.x).
  const int nthreads = THREADS > 0 ? THREADS : (int)blockDim.x;
  const int tid = threadIdx.x;
  constexpr bool AHEAD = THREADS > 0;
  __shared__ __align__(16) float ahead[AHEAD ? 2 : 1][AHEAD ? VALS * THREADS : 4];
  // Copies row r (its 16-byte units, a thread's every nthreads-th) into ahead[buf], one commit group.
  auto fetch = [&](int r, int buf) {
    if (r < rows)
      for (int c = tid; c < dim / 4; c += nthreads)
        cp_async_16(smem_addr(&ahead[buf][4 * c]), x + (long long)r * dim + 4 * c);
    cp_async_commit();  // (empty past the last row: the groups stay one a row)
  };
  if (AHEAD) fetch(blockIdx.x, 0);
  int buf = 0;
  for (int r = blockIdx.x; r < rows; r += gridDim.x, buf ^= 1) {
    if (AHEAD) {
      fetch(r + gridDim.x, buf ^ 1);  // ahead[buf ^ 1] was last read before the previous row's final barrier
      cp_async_wait<1>();              // this thread's copies of row r have landed
      __syncthreads();                 // and every thread's
    }
    float o[VALS];
    rmsnorm_row_in_registers<VALS>(x + (long long)r * dim, dim, weight, eps, round_out, scratch, o,
                                   AHEAD ? ahead[buf] : nullptr);
    norm_row_warp_amax<VALS>(o, dim, nthreads, warp_amax);
    // Value i = tid + j * nthreads is k = tid % 128 of block i / 128 = tid / 128 + j * nthreads / 128 (nthreads %
    // 128 == 0): the same place in its block at every j, so a row's two bases, then a constant step a j.
    unsigned char* q_at = xq + (long long)r * dim + 128 * (tid >> 7) + fmoe_x_pos(tid & 127, halves != 0);
    float* s_at = xs + (long long)r * (dim >> 7) + (tid >> 7);
#pragma unroll
    for (int j = 0; j < VALS; ++j) {
      if (tid + j * nthreads >= dim) break;  // whole 128-blocks: dim % 128 == 0
      // fmoe_x_scale's s = 2^e, and 1 / s as 2^-e (the same float: no division a value).
      const float amax = norm_row_block_amax(warp_amax, j, nthreads);
      const int e = ue8m0_exponent(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX);
      q_at[j * nthreads] = (unsigned char)fmoe_x_code(o[j], dsv4_pow2(-e));
      if ((tid & 127) == 0) s_at[j * (nthreads >> 7)] = dsv4_pow2(e);
    }
    __syncthreads();  // warp_amax is the next row's
  }
}

// fmoe_norm_x for few rows, rmsnorm_kernel's block (a row of up to RN_VALS values a thread).
extern "C" __global__ void __launch_bounds__(1024)
    fmoe_norm_x_kernel(float* x, int rows, int dim, const float* weight, float eps, int round_out, int halves,
                       unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  fmoe_norm_x<RN_VALS, 0>(x, rows, dim, weight, eps, round_out, halves, xq, xs);
}

// fmoe_norm_x for a prefill's rows, rmsnorm_rows_kernel's block (RN_ROWS_THREADS threads, RN_ROWS_VALS a thread).
extern "C" __global__ void __launch_bounds__(RN_ROWS_THREADS)
    fmoe_norm_x_rows_kernel(float* x, int rows, int dim, const float* weight, float eps, int round_out, int halves,
                            unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  fmoe_norm_x<RN_ROWS_VALS, RN_ROWS_THREADS>(x, rows, dim, weight, eps, round_out, halves, xq, xs);
}

// x's act_quant of every 128-block of token t, by one warp: eight blocks' loads in flight at a time.
DSV4_INLINE void fmoe_quant_x_row(const float* x, long long t, int D, bool halves, unsigned char* xq, float* xs) {
  const int lane = threadIdx.x & 31, nb = D / 128;
  const float4* row = reinterpret_cast<const float4*>(x + t * D);
  for (int b0 = 0; b0 < nb; b0 += 8) {
    float4 v8[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (b0 + i < nb) v8[i] = row[(b0 + i) * 32 + lane];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (b0 + i >= nb) break;  // uniform over the warp
      fmoe_quant_x_store(v8[i], t, D, b0 + i, halves, xq, xs);
    }
  }
}

// Router scores in f32, and x's act_quant, for few tokens. Block (bx, by) takes token group by *
// FMOE_LOGIT_TOKENS + [0, FMOE_LOGIT_TOKENS); its FMOE_LOGIT_WARPS warps are FMOE_LOGIT_EXPERTS x GROUP experts x
// FMOE_LOGIT_SPLIT parts of D, so many warps stream the gate at once:
// - the tile (bx, by) of the logits (fmoe_logits_tile, fast_moe_route.cuh), each warp on GROUP experts;
// - warp w of blocks with b = bx * FMOE_LOGIT_WARPS + w < D / 128: fmoe_quant_x_block of block b (unless xq is
//   NULL: the norm made them).
// Requires D % (4 * FMOE_LOGIT_SPLIT) == 0 and D % 128 == 0. The kernels below begin with dsv4_pdl_begin().
template <int GROUP>
DSV4_INLINE void fmoe_logits_block(const float* x, int T, int D, int E, const float* gate, int scoring,
                                   float* scores, int halves, unsigned char* xq, float* xs) {
  __shared__ float part_sum[FMOE_LOGIT_WARPS * GROUP][FMOE_LOGIT_TOKENS];
  const int warp = threadIdx.x >> 5;
  const int t0 = blockIdx.y * FMOE_LOGIT_TOKENS;
  const int nt = min(FMOE_LOGIT_TOKENS, T - t0);
  if (nt <= 0) return;  // whole block
  const int b = blockIdx.x * FMOE_LOGIT_WARPS + warp;
  // (xq NULL: the input's norm made x's codes already, fmoe_norm_x_kernel.)
  if (xq != nullptr && b < D / 128) fmoe_quant_x_block(x, t0, nt, D, b, halves != 0, xq, xs);
  fmoe_logits_tile<GROUP>(x, T, D, E, gate, scoring, scores, blockIdx.x, blockIdx.y, threadIdx.x, part_sum,
                          [] { __syncthreads(); });
}

// fmoe_logits_block with a warp an expert (below fast_moe::LOGIT_GROUP_MIN_TOKENS tokens).
extern "C" __global__ void __launch_bounds__(FMOE_LOGIT_WARPS * 32)
    fmoe_logits_kernel(const float* x, int T, int D, int E, const float* gate, int scoring, float* scores,
                       int halves, unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  fmoe_logits_block<1>(x, T, D, E, gate, scoring, scores, halves, xq, xs);
}

// fmoe_logits_block with a warp FMOE_LOGIT_GROUP experts (from fast_moe::LOGIT_GROUP_MIN_TOKENS tokens: the same
// bits, x read a quarter as often).
extern "C" __global__ void __launch_bounds__(FMOE_LOGIT_WARPS * 32)
    fmoe_logits_grouped_kernel(const float* x, int T, int D, int E, const float* gate, int scoring, float* scores,
                               int halves, unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  fmoe_logits_block<FMOE_LOGIT_GROUP>(x, T, D, E, gate, scoring, scores, halves, xq, xs);
}

// The router scores for many tokens, on the BF16 tensor cores: block (bx, by) computes the logits of
// FMOE_TC_TOKENS tokens t0 = by * FMOE_TC_TOKENS .. and FMOE_TC_BLOCK_EXPERTS experts e0 = bx *
// FMOE_TC_BLOCK_EXPERTS .., warpgroup w the experts e0 + w * FMOE_TC_WG_EXPERTS .. with wgmma m64nNk16 (N =
// FMOE_TC_WG_EXPERTS; f32 accumulators), x as the A operand from registers, the gate as the B operand from
// shared memory (K-major, 128-byte swizzle). Its products are exact, as an f32 GEMM's are before their
// rounding: x holds BF16 values (the fast set runs official numerics: the MoE input is the BF16 output of
// ffn_norm; a precondition), and every f32 gate value g splits exactly into three BF16 planes, g = hi + lo +
// lo2 (hi = bf16(g), lo = bf16(g - hi), lo2 = g - hi - lo, each difference exact in f32 and lo2
// BF16-representable for |g| >= 2^-110), so every product x·hi, x·lo, x·lo2 the tensor core forms is exact.
// The planes are a derived tensor (fmoe_gate_planes_kernel, at finalize and refit). The planes lo, lo2 of a
// BF16 gate (a released checkpoint's) are zero; a 64-k stage whose lo / lo2 are zero for every expert skips
// their loads and wgmmas: a decision made from the weights alone, so a token's logits still do not depend on
// the batch or the tile.
//
// Order and error. Per 64-k stage the warpgroup's wgmmas start from zero (lo2's four k16 steps, then lo's,
// then hi's: the small terms first), and the stage's sums are added to the f32 logits in k order. The tensor
// core forms each k16 step's 16 exact products and the incoming sum in one non-IEEE addition; modelled as
// aligning all 17 terms to the largest and truncating to f32's 24 bits, then truncating the sum (no guard
// bits assumed, the worst case), a step errs by < 68 · 2^-24 · (its largest term). Over a stage that is < 4 ·
// 68 · (1 + 2^-7) + 8 · 68 · 2^-7 < 280 units of 2^-24 · Σ_stage |x·g| (hi's steps; lo and lo2 are ≤ 2^-8
// and 2^-16 of hi), and the D/64 promotions add one f32 rounding each: |Δlogit| ≤ (280 + D/64) · 2^-24 · Σ_d
// |x_d g_ed| (gpu_fast_moe's bound for this kernel).
//
// The pipeline. Producer warps fill a ring of FMOE_TC_SLOTS slots, one slot per (stage, plane) item in the
// consumers' order: the plane's chunks of the block's experts by 1-D bulk copies (TMA without a tensor map),
// stored by fmoe_gate_planes_kernel exactly as the swizzled layout the descriptors read, and x's 64 rows of
// the stage as f32 (256 bytes a row, at a padded stride) by 16-byte cp.async (64 bulk copies of a row each
// took ~2.5 µs a slot: the TMA unit's rate for small copies, not the bytes). x's rows are read as loaded:
// each consumer thread converts its own A fragment to BF16 in registers (no shared-memory round trip, no
// barrier between the warpgroups), so neither the gate nor x is converted in the block's loop (the kernel
// before converted the f32 gate into its three planes in every token block, every stage: 127 µs at 4096
// tokens, ~8x its floor). x's act_quant is not made here but by fmoe_select_kernel. Requires D % 64 == 0,
// D / 64 <= FMOE_TC_MAX_STAGES.
// Two consumer warpgroups, then FMOE_TC_PRODUCERS producer warps (16 of x's rows each: with one producer warp
// its address arithmetic and copies, ~300 instructions an item, set the pace, ~1 µs an item).
// FMOE_TC_PROBE (a bench probe, wrong outputs: `dsv4 bench moe --defines FMOE_TC_PROBE=N`, read its
// moe_norm_route lines): bit 0 set, the producers copy no x rows (the ring's x is what shared memory held); bit 1,
// no gate chunks; bit 2, the consumers wait for each slot and release it without reading it (no fragments, no
// wgmmas). The same ring, barriers and items otherwise. Against the default, which of the x stream, the gate
// stream and the consumers' chain sets the ~1250 SM cycles a stage a block takes (fifty-first session, ncu at
// 2048 tokens; the same at 4096 with twice the blocks, so not L2's aggregate rate). The probed logits are
// garbage, so the selection routes every token to the lowest experts: the probed layer's own lines mean nothing.
// Measured once, on a build (reverted) whose consumers also made x's FP8 codes and whose x came by TMA: router
// chain at 4096 tokens 164.4 µs, without x copies 169.8, without the consumers' work 99.7, so there the
// consumers set the pace (H100, fifty-sixth session). On the banked loop below (fifty-seventh session, H100):
// chain 139.1 µs at 4096 tokens and 531.8 at 16384, without the consumers' work 140.0 and 518.4: they no longer
// set the pace (the one-bank loop: 140.9 and 539.7).
#ifndef FMOE_TC_PROBE
#define FMOE_TC_PROBE 0
#endif
// FMOE_TC_ONE_BANK=1 (a diagnostic variant, for gpu_fast_moe's bit test and A/B): every block runs the one-bank
// consumer loop, as every block did before the banked loop below.
#ifndef FMOE_TC_ONE_BANK
#define FMOE_TC_ONE_BANK 0
#endif
#define FMOE_TC_THREADS (256 + 32 * FMOE_TC_PRODUCERS)
static_assert(FMOE_TC_PRODUCERS * 16 == FMOE_TC_TOKENS, "fmoe_logits_tc_kernel: 16 rows of x a producer warp");
#define FMOE_TC_BLOCK_EXPERTS (2 * FMOE_TC_WG_EXPERTS)
#define FMOE_TC_CHUNKS (FMOE_TC_BLOCK_EXPERTS / FMOE_GATE_TILE)  // plane chunks a block's item loads
#define FMOE_GATE_CHUNK (FMOE_GATE_TILE * 128)                   // one plane, one stage, FMOE_GATE_TILE experts
// x's rows in a slot: 64 f32 and 32 bytes of padding, so the A fragments' 8-byte loads (rows g, k 2t of a
// half-warp: words 72g + 2t) meet no bank conflict.
#define FMOE_TC_X_ROW 288
#define FMOE_TC_X_BYTES (FMOE_TC_TOKENS * FMOE_TC_X_ROW)
#define FMOE_TC_SLOT (FMOE_TC_X_BYTES + FMOE_TC_CHUNKS * FMOE_GATE_CHUNK)
static_assert(FMOE_TC_TOKENS == 64, "fmoe_logits_tc_kernel: one m64 token tile a block");
// N = 64 (fmoe_tc_wgmma's m64n64k16; m64n128 measured slower at 1024-4096 tokens: fast_moe.rs TC_WG_EXPERTS).
static_assert(FMOE_TC_WG_EXPERTS == 64, "fmoe_logits_tc_kernel: N = 64");
static_assert(FMOE_TC_BLOCK_EXPERTS % FMOE_GATE_TILE == 0 && 256 % FMOE_TC_BLOCK_EXPERTS == 0,
              "fmoe_logits_tc_kernel: a block's experts are whole chunks of a 256-expert group");
static_assert(FMOE_TC_X_BYTES % 1024 == 0 && FMOE_TC_SLOT % 1024 == 0, "fmoe_logits_tc_kernel: 1024-byte aligned tiles");
static_assert(FMOE_TC_SLOTS * FMOE_TC_SLOT + 4 * FMOE_TC_MAX_STAGES + 16 * FMOE_TC_SLOTS <= FMOE_TC_SMEM_BYTES,
              "fmoe_logits_tc_kernel: shared memory layout exceeds FMOE_TC_SMEM_BYTES");

// The derived gate planes (fmoe_gate_planes_kernel): nt = 2 · ceil(E / 256) tiles of FMOE_GATE_TILE experts
// (rows past E are zero), S = D / 64 stages. Chunk (plane p, tile et, stage s) holds the tile's 128-byte rows of
// BF16 k 64s .. 64s + 63, 16-byte unit u of row r at u ^ (r % 8); chunks in (p, et, s) order, then the words
// low[et][s] (1: the tile's lo or lo2 is nonzero in stage s), at fmoe_gate_chunk_at(3, 0, 0, nt, S).
DSV4_INLINE int fmoe_gate_tiles(int E) { return 2 * ((E + 255) / 256); }
DSV4_INLINE long long fmoe_gate_chunk_at(int p, int et, int s, int nt, int S) {
  return (((long long)p * nt + et) * S + s) * FMOE_GATE_CHUNK;
}

// Eight f32 values as BF16 (round to nearest even), in order, one 16-byte unit.
DSV4_INLINE uint4 fmoe_tc_bf16x8(const float (&v)[8]) {
  return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                    pack_bf16x2(v[6], v[7]));
}

// v -= the unit's BF16 values (exact: v's f32 remainder below its BF16 rounding).
DSV4_INLINE void fmoe_tc_subtract(float (&v)[8], uint4 u) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] -= __uint_as_float(w[i] << 16);
    v[2 * i + 1] -= __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Builds the gate planes of f32 `gate` [E][D] (the layout above): block (et, s) makes the three chunks of tile
// et, stage s, and its low word. Launched with grid (fmoe_gate_tiles(E), D / 64) and 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    fmoe_gate_planes_kernel(const float* gate, int E, int D, unsigned char* planes) {
  const int et = blockIdx.x, s = blockIdx.y, nt = gridDim.x, S = gridDim.y;
  unsigned nz = 0u;
#pragma unroll
  for (int i = 0; i < FMOE_GATE_TILE * 8 / 256; ++i) {
    const int c = threadIdx.x + 256 * i, row = c >> 3, u = c & 7, e = et * FMOE_GATE_TILE + row;
    uint4 hi = make_uint4(0u, 0u, 0u, 0u), lo = hi, lo2 = hi;
    if (e < E) {
      const float4* src = reinterpret_cast<const float4*>(gate + (long long)e * D + 64 * s + 8 * u);
      const float4 a = src[0], b = src[1];
      float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
      hi = fmoe_tc_bf16x8(v);
      fmoe_tc_subtract(v, hi);
      lo = fmoe_tc_bf16x8(v);
      fmoe_tc_subtract(v, lo);
      lo2 = fmoe_tc_bf16x8(v);
      nz |= lo.x | lo.y | lo.z | lo.w | lo2.x | lo2.y | lo2.z | lo2.w;
    }
    const int at = row * 128 + ((u ^ (row & 7)) << 4);
    *reinterpret_cast<uint4*>(planes + fmoe_gate_chunk_at(0, et, s, nt, S) + at) = hi;
    *reinterpret_cast<uint4*>(planes + fmoe_gate_chunk_at(1, et, s, nt, S) + at) = lo;
    *reinterpret_cast<uint4*>(planes + fmoe_gate_chunk_at(2, et, s, nt, S) + at) = lo2;
  }
  const int low = __syncthreads_or(nz != 0u);
  if (threadIdx.x == 0)
    reinterpret_cast<unsigned*>(planes + fmoe_gate_chunk_at(3, 0, 0, nt, S))[et * S + s] = low ? 1u : 0u;
}

// d (64 tokens x FMOE_TC_WG_EXPERTS experts, f32) = (scale_d ? d : 0) + A B^T over one k16 step, A (x, BF16)
// from the registers a (the m64k16 fragment: rows g, g + 8 of the warp's 16, k 2t, 2t + 1 and + 8), B from the
// descriptor.
DSV4_INLINE void fmoe_tc_wgmma(float (&d)[FMOE_TC_WG_EXPERTS / 2], const unsigned (&a)[4], unsigned long long bdesc,
                               int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0; }\n"
      : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(scale_d));
}

// The scores of a consumer thread's logits (fmoe_logits_tc): logit[4j + c] is token tb + 8·(c >> 1), expert
// eb + 8j + (c & 1).
DSV4_INLINE void fmoe_tc_store_scores(const float (&logit)[FMOE_TC_WG_EXPERTS / 2], int T, int E, int tb, int eb,
                                      int scoring, float* scores) {
#pragma unroll
  for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) {
    const int tok = tb + 8 * ((v & 3) >> 1), e = eb + 8 * (v >> 2) + (v & 1);
    if (tok < T && e < E) scores[(long long)tok * E + e] = fmoe_score(logit[v], scoring);
  }
}

// Keeps a wgmma's A fragments live up to here (placed after its wait), so the compiler gives no value made
// before this point their registers while that wgmma may still read them (to the C++ an asm's inputs are dead
// once it is issued: the fifty-first session's FMOE_TC_OVERLAP wrote the next fragments into them).
DSV4_INLINE void fmoe_tc_keep(const unsigned (&a)[4][4]) {
#pragma unroll
  for (int q = 0; q < 4; ++q) asm volatile("" ::"r"(a[q][0]), "r"(a[q][1]), "r"(a[q][2]), "r"(a[q][3]) : "memory");
}

// The K split (fmoe_logits_tc_split_kernel): a cluster of ks = cluster_blocks() blocks shares one tile of tokens
// and experts, block r (its rank) taking stages r·S/ks .. (r+1)·S/ks - 1, so a few tokens' logits run on ks
// times the blocks. At 320-1023 tokens the unsplit kernel has 10-32 blocks of 64 stages each, ~45 µs whatever the
// tokens (its stages' latency, not its bytes). Each block's f32 sums over its stages (in k order) are its
// partial logits; rank r > 0 leaves them in its shared memory, and rank 0 adds them to its own in rank order,
// ((p0 + p1) + p2) + ..., then scores and stores the tile. ks is a constant of the launch for a range of token
// counts (fast_moe.rs: TC_KSPLIT = 4 at 160-1023, TC_PAIR_SPLIT = 2 at 1024-2048, where four a tile would
// outnumber the clusters the SMs hold at once), so within a range a token's logits do not depend on the batch;
// they are not the unsplit kernel's bits (the same products and stage sums, added in a different order).
// Error: the stage sums as above, and fewer f32 additions on any path through the sum than the unsplit kernel's
// D/64 - 1 (D/(64 ks) - 1 + ks - 1), so the bound above holds.
template <bool SPLIT>
DSV4_INLINE void fmoe_logits_tc(const float* x, int T, int D, int E, const unsigned char* planes, int scoring,
                                float* scores) {
  extern __shared__ __align__(1024) unsigned char fmoe_tc_smem[];
  if ((smem_addr(fmoe_tc_smem) & 1023u) != 0) __trap();  // the swizzle addressing needs 1024-byte aligned tiles
  const int S = D / 64, nt = fmoe_gate_tiles(E);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // SPLIT: this block's rank in its cluster, the cluster's blocks (the split), and its stages.
  const int ks = SPLIT ? (int)cluster_blocks() : 1, rank = SPLIT ? (int)cluster_rank() : 0;
  const int s_begin = rank * (S / ks), s_end = s_begin + S / ks;
  const int t0 = blockIdx.y * FMOE_TC_TOKENS, et0 = (SPLIT ? blockIdx.x / ks : blockIdx.x) * FMOE_TC_CHUNKS;
  // low[s]: stage s multiplies the lo planes (for any expert: the same items in every block).
  unsigned* low = reinterpret_cast<unsigned*>(fmoe_tc_smem + FMOE_TC_SLOTS * FMOE_TC_SLOT);
  const unsigned full0 = smem_addr(low + FMOE_TC_MAX_STAGES), empty0 = full0 + 8 * FMOE_TC_SLOTS;
  const unsigned* low_words = reinterpret_cast<const unsigned*>(planes + fmoe_gate_chunk_at(3, 0, 0, nt, S));
  unsigned any_low = 0u;  // some stage of this block multiplies lo planes
  for (int s = threadIdx.x; s < S; s += FMOE_TC_THREADS) {
    unsigned f = 0u;
    for (int et = 0; et < nt; ++et) f |= low_words[et * S + s];
    low[s] = f;
    if (s >= s_begin && s < s_end) any_low |= f;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < FMOE_TC_SLOTS; ++i) {
      mbar_init(full0 + 8 * i, 1 + 32 * FMOE_TC_PRODUCERS);  // the gate's arrive_expect_tx (then its bytes), x's lanes
      mbar_init(empty0 + 8 * i, 8);     // one arrival a consumer warp
    }
    fence_mbar_init();
  }
  // The banked consumer loop below takes a block whose stages are one item each (no lo planes: a BF16 gate) and
  // even in number; any other runs one bank, waited on each item. A choice from the weights and the shape.
  const bool banked = !__syncthreads_or(any_low != 0u) && ((s_end - s_begin) & 1) == 0 && !FMOE_TC_ONE_BANK;

  if (warp >= 8) {  // producer warp pw: item n = (stage, plane) into slot n % FMOE_TC_SLOTS
    // x's rows 16 pw .. 16 pw + 15 by 16-byte copies, half a warp a row: lane's row 16 pw + 2i + lane / 16 (rows
    // past T repeat the last row: computed, never stored), bytes 16 (lane % 16) .. of its 256 in the stage.
    const int pw = warp - 8;
    const float* src[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
      src[i] = x + (long long)min(t0 + 16 * pw + 2 * i + (lane >> 4), T - 1) * D + 4 * (lane & 15);
    const unsigned lane_at = (16 * pw + (lane >> 4)) * FMOE_TC_X_ROW + 16 * (lane & 15);
    int n = 0;
    for (int s = s_begin; s < s_end; ++s) {
      for (int p = low[s] ? 2 : 0; p >= 0; --p, ++n) {
        const int slot = n % FMOE_TC_SLOTS;
        const unsigned full = full0 + 8 * slot, dst = smem_addr(fmoe_tc_smem + slot * FMOE_TC_SLOT);
        mbar_wait(empty0 + 8 * slot, ((n / FMOE_TC_SLOTS) & 1) ^ 1);  // a fresh barrier's parity 1 is complete
        if (pw == 0 && lane == 0) {
          if (FMOE_TC_PROBE & 2) {
            mbar_arrive(full);
          } else {
            mbar_arrive_expect_tx(full, FMOE_TC_CHUNKS * FMOE_GATE_CHUNK);
            for (int c = 0; c < FMOE_TC_CHUNKS; ++c)
              bulk_load(dst + FMOE_TC_X_BYTES + c * FMOE_GATE_CHUNK, planes + fmoe_gate_chunk_at(p, et0 + c, s, nt, S),
                        FMOE_GATE_CHUNK, full);
          }
        }
        if (!(FMOE_TC_PROBE & 1)) {
#pragma unroll
          for (int i = 0; i < 8; ++i) cp_async_16(dst + lane_at + 2 * i * FMOE_TC_X_ROW, src[i] + 64 * s);
        }
        cp_async_mbar_arrive(full);  // once this lane's copies have landed
      }
    }
    // SPLIT: the cluster's two barriers below (every thread of every block arrives at each).
    if (SPLIT) {
      cluster_sync();
      cluster_sync();
    }
    return;
  }

  // Consumer warpgroup wg: rows r0 = 16 (warp % 4) + g and r0 + 8 of the tokens, its FMOE_TC_WG_EXPERTS experts.
  const int wg = warp >> 2, g = lane >> 2, t = lane & 3, r0 = 16 * (warp & 3) + g;
  const unsigned xa0 = smem_addr(fmoe_tc_smem) + r0 * FMOE_TC_X_ROW + 8 * t;
  const unsigned long long b0 = wgmma_desc_sw128(fmoe_tc_smem + FMOE_TC_X_BYTES + wg * FMOE_TC_WG_EXPERTS * 128);
  float logit[FMOE_TC_WG_EXPERTS / 2];
#pragma unroll
  for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) logit[v] = 0.0f;
  int n = 0;  // items taken
  // Waits for item n's slot, builds the A fragments of its four k16 steps from its x (a[q][2h + i] = x[r0 +
  // 8i][16q + 8h + 2t, + 1] as bf16x2) and issues its wgmmas into d (from zero at the stage's first plane),
  // one commit group. Returns the slot.
  auto issue = [&](float(&d)[FMOE_TC_WG_EXPERTS / 2], unsigned(&a)[4][4], bool first) {
    const int slot = n % FMOE_TC_SLOTS;
    mbar_wait(full0 + 8 * slot, (n / FMOE_TC_SLOTS) & 1);
    ++n;
    if (FMOE_TC_PROBE & 4) return slot;
    const unsigned xa = xa0 + slot * FMOE_TC_SLOT;
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint2 v = lds_u64(xa + (j & 1) * 8 * FMOE_TC_X_ROW + 4 * (16 * q + 8 * (j >> 1)));
        a[q][j] = pack_bf16x2(__uint_as_float(v.x), __uint_as_float(v.y));
      }
    const unsigned long long b = b0 + ((unsigned long long)(slot * FMOE_TC_SLOT) >> 4);
    wgmma_fence();
#pragma unroll
    for (int q = 0; q < 4; ++q) fmoe_tc_wgmma(d, a[q], b + 2 * q, first && q == 0 ? 0 : 1);
    wgmma_commit();
    return slot;
  };
  auto release = [&](int slot) {
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8 * slot);  // the slot's x and gate are read
  };
  if (banked) {
    // Stages in pairs, two banks: stage s's sums in d[0] from fragments a[0], stage s + 1's in d[1] from a[1].
    // Stage s + 1's fragments are built while stage s's wgmmas run, and stage s's sums join the logits (and its
    // slot is released) while stage s + 1's run. The same products, stage sums and k order as the one-bank loop:
    // the same bits. Each pair ends with nothing in flight: with a group left pending across the loop's back edge
    // ptxas could not tell which group a wait<1> leaves and serialised every wgmma (C7514; and C7518 where the
    // last stage's bank was picked by a branch).
    float d[2][FMOE_TC_WG_EXPERTS / 2];
    unsigned a[2][4][4];
#pragma unroll
    for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) d[0][v] = d[1][v] = 0.0f;
#pragma unroll 1
    for (int s = s_begin; s < s_end; s += 2) {
      const int slot0 = issue(d[0], a[0], true);
      const int slot1 = issue(d[1], a[1], true);
      wgmma_wait<1>();  // stage s's group done, s + 1's pending
      wgmma_fence_operand(d[0]);
      fmoe_tc_keep(a[0]);  // (a[1] was built after a[0]'s wgmmas were issued: other registers)
      release(slot0);
#pragma unroll
      for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) logit[v] += d[0][v];
      wgmma_wait<0>();
      wgmma_fence_operand(d[1]);
      release(slot1);
#pragma unroll
      for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) logit[v] += d[1][v];
    }
  } else {
    // One bank: each item's wgmmas waited on before the next (a stage's planes lo2, lo, hi chain in d).
    float d[FMOE_TC_WG_EXPERTS / 2];
    unsigned a[4][4];
#pragma unroll
    for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) d[v] = 0.0f;
#pragma unroll 1
    for (int s = s_begin; s < s_end; ++s) {
      const int top = low[s] ? 2 : 0;
#pragma unroll 1
      for (int p = top; p >= 0; --p) {
        const int slot = issue(d, a, p == top);
        wgmma_wait<0>();
        wgmma_fence_operand(d);
        release(slot);
        if (p == 0) {  // the stage's sums join the logits
#pragma unroll
          for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) logit[v] += d[v];
        }
      }
    }
  }
  if (SPLIT) {
    // The partials of rank r > 0 go to its first ring slot, [v][consumer thread] (every item consumed: the
    // producers' copies have all landed, and both warpgroups are past their last slot once the named barrier
    // opens); rank 0 adds them to its own in rank order.
    float* part = reinterpret_cast<float*>(fmoe_tc_smem);
    if (rank > 0) {
      named_barrier(1, 256);
#pragma unroll
      for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) part[v * 256 + threadIdx.x] = logit[v];
    }
    cluster_sync();  // the partials written
    if (rank == 0) {
      for (int r = 1; r < ks; ++r) {
        const unsigned remote = cluster_map(smem_addr(part + threadIdx.x), (unsigned)r);
        float p[FMOE_TC_WG_EXPERTS / 2];
#pragma unroll
        for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) p[v] = ld_cluster_f32(remote + 4u * 256u * v);
#pragma unroll
        for (int v = 0; v < FMOE_TC_WG_EXPERTS / 2; ++v) logit[v] += p[v];
      }
      fmoe_tc_store_scores(logit, T, E, t0 + r0, et0 * FMOE_GATE_TILE + wg * FMOE_TC_WG_EXPERTS + 2 * t, scoring,
                           scores);
    }
    cluster_sync();  // no block leaves while rank 0 may still read its shared memory
    return;
  }
  fmoe_tc_store_scores(logit, T, E, t0 + r0, et0 * FMOE_GATE_TILE + wg * FMOE_TC_WG_EXPERTS + 2 * t, scoring,
                       scores);
}

extern "C" __global__ void __launch_bounds__(FMOE_TC_THREADS, 1)
    fmoe_logits_tc_kernel(const float* x, int T, int D, int E, const unsigned char* planes, int scoring,
                          float* scores) {
  dsv4_pdl_begin();
  fmoe_logits_tc<false>(x, T, D, E, planes, scoring, scores);
}

// The K split above, launched in clusters of (ks, 1, 1) blocks along x (grid.x = ks · the expert blocks). Requires
// (D / 64) % ks == 0.
extern "C" __global__ void __launch_bounds__(FMOE_TC_THREADS, 1)
    fmoe_logits_tc_split_kernel(const float* x, int T, int D, int E, const unsigned char* planes, int scoring,
                                float* scores) {
  dsv4_pdl_begin();
  fmoe_logits_tc<true>(x, T, D, E, planes, scoring, scores);
}

// One warp per token t (steps 1-3: fmoe_select_token, fast_moe_route.cuh):
// 1. the scores of fmoe_logits_kernel (softmax scoring: the softmax of its logits over the experts);
// 2. selection: the hash row tid2eid[tokens[t]] when tid2eid is given, else the top-k of score + bias
//    (bias may be NULL; NaN ranks below everything; ties to the lower index);
// 3. weights: the selected scores, divided by their f32 sum (in selection order) when `renorm`, times
//    route_scale -> ids[t][j], weights[t][j];
// 4. when x is given (the router kernel did not), x's act_quant of token t (fmoe_quant_x_row) into xq, xs.
// Requires E <= 32 * FMOE_MAX_EPL, k <= 32.
extern "C" __global__ void __launch_bounds__(FMOE_SELECT_WARPS * 32)
    fmoe_select_kernel(const float* scores, int T, int E, int k, const float* bias, const int* tid2eid,
                       const int* tokens, int scoring, int renorm, float route_scale, int* ids, float* weights,
                       const float* x, int D, int halves, unsigned char* xq, float* xs) {
  dsv4_pdl_begin();
  const int t = blockIdx.x * FMOE_SELECT_WARPS + (threadIdx.x >> 5);
  if (t >= T) return;  // whole warp
  if (x != nullptr) fmoe_quant_x_row(x, t, D, halves != 0, xq, xs);
  fmoe_select_token(scores, t, E, k, bias, tid2eid, tokens, scoring, renorm, route_scale, ids, weights);
}

// out[t][d] = bf16(Σ_j y[t*k + j][d] + y[T*k + t][d]) accumulated in f32 in that order (routed slots in
// selection order, then the shared expert when has_shared), stored as f32. Slots whose id is outside
// [0, E) are skipped. Thread (blockIdx.x * 128 + threadIdx.x) of row blockIdx.y sums 8 columns.
// `clear` (may be NULL): clear_words u32 zeroed as well, the synchronisation words of the
// fmoe_route_experts_kernel launch before (fast_moe_gemm.cu), zero for the next one. Requires D % 8 == 0.
extern "C" __global__ void __launch_bounds__(128)
    fmoe_combine_kernel(const unsigned short* y, const int* ids, int T, int k, int E, int D, int has_shared,
                        float* out, unsigned* clear, int clear_words) {
  dsv4_pdl_begin();
  if (clear != nullptr && blockIdx.x == 0 && blockIdx.y == 0)
    for (int i = threadIdx.x; i < clear_words; i += blockDim.x) clear[i] = 0u;
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
