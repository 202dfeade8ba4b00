// fast_fp8_gemm kernel family: the fast set's own FP8 block-scaled GEMM for projections of many tokens
// (issue 12), kernels/SPEC.md ## fast_fp8_gemm.cu, ../shared/KERNELS.md §2.
//
// ffg_gemm_kernel, ffg_gemm_n256_kernel, ffg_gemm_m192_kernel, ffg_gemm_pair_kernel:
//   y[t, j] = Σ_b (Σ_{c in block b} a[t, c] · W[j, c]) · sa[b, t] · sw[j / 128, b]
// stored as f32, as f32 rounded to bf16 values, or as bf16 (`out`: FFG_OUT_F32, _F32_ROUNDED, _BF16)
// for t < M, j < N, 128-blocks b of K; tiles of 128 x 128, 128 x 256 and 192 x 128 (tokens x outputs), and
// 128 x 256 in clusters of two blocks that share the weight tile (the pair's tiles are 256 x 256).
//
// The operands are cuBLASLt's (src/cuda/blockscaled_gemm.rs), so either GEMM runs from the same
// fd_lt_operand_kernel output: a = [M, K] e4m3 codes (the official act_quant), sa = [K / 128, M] f32 token-
// fastest; W = [N, K] e4m3 codes with sw = [N / 128, K / 128] f32 block scales; y = [M, ldy] f32.
//
// Why our own. cuBLASLt's one block-scaled algorithm reaches 54-62% of the FP8 peak on the K = 1024 shapes
// (wq_b, the indexer's wq_b) and 70-76% on K >= 4096 (BENCHMARKS.md, issue 12 eighteenth part): with K = 1024 a
// 128 x 128 tile has 8 k-blocks, and a kernel that fills its pipeline and writes its tile before it starts the
// next leaves the tensor cores idle for a large share of each tile. Here blocks are persistent and the
// producer runs ahead across tiles, so the next tile's stages are in shared memory when a tile ends, and the
// consumers store a tile's outputs (from registers) while the next tile's first wgmmas run; and the bf16
// rounding of the outputs, a separate pass after cuBLASLt (2.1 GB of traffic for wq_b at 8192 tokens), is done
// in the epilogue.
//
// Tiles (FfgCfg<BM, BN>). BM = 64 · WGS tokens (WGS consumer warpgroups of 64) x BN outputs, numbered with the
// token tiles fastest: tile i is token tile i % mt of output tile i / mt, so the ~132 tiles in flight share a few
// weight tiles and all of the (small) activation operand stays in L2. Block b takes tiles b, b + gridDim.x, ...;
// a tile's outputs depend only on the tile: deterministic, run to run and for any grid. Which shape is fastest
// is measured (`dsv4 bench dense`): 128 x 256 and 192 x 128 move fewer bytes through L2 and shared memory an
// output than 128 x 128; 192 x 128 also keeps three warpgroups' wgmmas queued while one promotes, at 160
// registers a consumer thread.
//
// Pairs (PAIR: ffg_gemm_pair_kernel). At ~1000 TFLOP/s a 128 x 256 tile reads ~6 TB/s from L2, a 128 x 128 one
// ~8: near what Hopper's L2 is reported to give. A cluster of two blocks takes token tiles 2i and 2i + 1 of the
// same 256 outputs, and each block's producer loads half of the weight tile (128 rows) by a TMA multicast into
// both blocks' slot: the weight tile crosses L2 once for the two, a third less L2 traffic an output. A slot is
// then free only when both blocks' consumers have released it (each consumer warp arrives on its own block's
// empty barrier and on the other's), the full barrier counts the other block's half among its bytes, and both
// blocks leave together (a cluster barrier), so that neither's shared memory is written or its barriers
// arrived on after it exits. The last pair of an odd count of token tiles has a block whose tokens are all past
// M: it loads zeros (TMA's out-of-range fill) and stores nothing, but takes its part in the multicasts.
//
// The pipeline (as fast_moe_wide.cu): the consumer warpgroups and a producer warpgroup share a ring of STAGES
// slots with full / empty mbarriers; one producer thread issues every copy, and its warpgroup hands most of its
// registers to the consumers (setmaxnreg). A stage is one 128-block of K: the tile's BM token rows (one TMA box
// in the 128-byte swizzle), its BN weight rows (likewise), the tokens' BM scales of the block (one bulk copy)
// and the weight tile's block scales (4-byte cp.asyncs, whose arrival the full barrier also counts).
//
// The math. Warpgroup w owns the tile's tokens 64w .. 64w + 63; per 128 outputs, four wgmma m64n128k32 e4m3 (A =
// its 64 token rows, B = 128 weight rows, both K-major from shared memory in the 128-byte swizzle) sum the block
// in the tensor core under one fence and commit; then the sums are added to f32 accumulators times sa · sw (one
// FFMA each: the DeepGEMM recipe, promoted every 128 of K as the issue asks). The weight scale is one value a
// stage and 128 outputs, the token scales one per accumulator row. Thread (warp q of the warpgroup, g = lane / 4,
// t = lane % 4) holds d[4j + c] = token 64w + 16q + g + 8·(c >> 1), output 8j + 2t + (c & 1) of the 128.
#include "common.cuh"
#include "fp8_mma.cuh"

// FFG_STAGES_M128_N128, FFG_STAGES_M128_N256, FFG_STAGES_M192_N128 and FFG_SMEM_BYTES come from dsv4_consts.cuh
// (src/cuda/kernels/fast_fp8_gemm.rs).
#define FFG_BK 128  // k a stage: one scale block

// A tile shape's block and ring. A slot: the tokens' codes, the weight rows' codes (HALVES boxes of 128 rows),
// the tokens' BM scales of the block, the block scales of the tile's HALVES 128-row weight blocks. BN = 256 runs
// its two 128-output halves one after the other on the same 64 wgmma sums (both at once would need 64 more
// registers than a consumer has).
template <int BM, int BN, bool PAIR = false>
struct FfgCfg {
  static_assert((BM == 128 && (BN == 128 || BN == 256)) || (BM == 192 && BN == 128), "fast_fp8_gemm: tile shape");
  static_assert(!PAIR || (BM == 128 && BN == 256), "fast_fp8_gemm: pairs of 128 x 256 tiles");
  static constexpr int WGS = BM / 64;  // consumer warpgroups
  static constexpr int CONSUMERS = 128 * WGS;
  static constexpr int THREADS = CONSUMERS + 128;  // then the producer warpgroup
  // Registers after setmaxnreg (of 64 K a block): two consumer warpgroups hold 64 wgmma sums and BN / 2
  // accumulators at 232 each (256 · 232 + 128 · 40 = 64512); three hold 64 + 64 at 160 (384 · 160 + 128 · 24).
  static constexpr int CONSUMER_REGS = WGS == 2 ? 232 : 160;
  static constexpr int PRODUCER_REGS = WGS == 2 ? 40 : 24;
  static constexpr int HALVES = BN / 128;
  static constexpr int SLOT_A = BM * FFG_BK;
  static constexpr int SLOT_B = BN * FFG_BK;
  static constexpr int SA = SLOT_A + SLOT_B;
  static constexpr int SW = SA + BM * 4;
  static constexpr int SLOT = (SW + 16 + 1023) / 1024 * 1024;
  static constexpr int STAGES = BM == 192 ? FFG_STAGES_M192_N128 : BN == 256 ? FFG_STAGES_M128_N256 : FFG_STAGES_M128_N128;
  // Arrivals a phase of an empty barrier: every consumer warp of the block, and of the other block of a pair.
  static constexpr int EMPTY_ARRIVALS = (PAIR ? 2 : 1) * CONSUMERS / 32;
  static constexpr int BARS = STAGES * SLOT;
  static constexpr int USED = BARS + 2 * STAGES * 8;
  static_assert(SLOT_A % 1024 == 0, "fast_fp8_gemm: the B tile needs the swizzle's 1024-byte alignment");
  static_assert(USED <= FFG_SMEM_BYTES, "fast_fp8_gemm: shared memory layout exceeds FFG_SMEM_BYTES");
  static_assert(WGS * 128 * CONSUMER_REGS + 128 * PRODUCER_REGS <= 65536, "fast_fp8_gemm: registers");
};

// A CUtensorMap as the host encoded it (cuTensorMapEncodeTiled), passed by value as a __grid_constant__
// parameter: its address in the parameter space is what TMA reads (no copy to global memory, so a map made
// for this call's operand needs no device write before the launch, and a captured graph keeps it).
struct __align__(64) DsvTmaMap {
  unsigned long long words[16];
};

// The ring's barriers: full[s] then empty[s], 8 bytes each, after the slots.
template <class C>
DSV4_INLINE unsigned ffg_full(unsigned smem, int s) {
  return smem + C::BARS + 8 * s;
}
template <class C>
DSV4_INLINE unsigned ffg_empty(unsigned smem, int s) {
  return smem + C::BARS + 8 * (C::STAGES + s);
}

template <class C>
DSV4_INLINE void ffg_advance(int& slot, unsigned& phase) {
  if (++slot == C::STAGES) {
    slot = 0;
    phase ^= 1;
  }
}

struct FfgTile {
  int m0, n0;  // first token, first output
};

template <int BM, int BN>
DSV4_INLINE FfgTile ffg_tile(int i, int mt) {
  const int nb = i / mt;
  return {(i - nb * mt) * BM, nb * BN};
}

// The work a block walks: tiles blockIdx.x, + gridDim.x, ... of `tiles`; or, in pairs, the cluster's pair
// index c, + clusters, ... of `tiles` pairs (token tiles 2i, 2i + 1 of an output tile), this block's tile of each
// (`rank`). Both blocks of a pair walk the same sequence.
struct FfgWalk {
  int first, step, count, mpairs, rank;
};

template <bool PAIR>
DSV4_INLINE FfgWalk ffg_walk(int mt, int nt) {
  if (!PAIR) return {(int)blockIdx.x, (int)gridDim.x, mt * nt, 0, 0};
  const int mpairs = (mt + 1) / 2;
  return {(int)blockIdx.x >> 1, (int)gridDim.x >> 1, mpairs * nt, mpairs, (int)cluster_rank()};
}

template <int BM, int BN, bool PAIR>
DSV4_INLINE FfgTile ffg_walk_tile(const FfgWalk& wk, int i, int mt) {
  if (!PAIR) return ffg_tile<BM, BN>(i, mt);
  const int nb = i / wk.mpairs;
  return {(2 * (i - nb * wk.mpairs) + wk.rank) * BM, nb * BN};
}

// The producer: one thread walks the same tiles and stages as the consumers. Per stage: the token box and the
// weight box by TMA (rows past M read as zeros and are counted in the transaction bytes), the tokens' scales of
// the block by one bulk copy of their rows rounded up to 4 (M is a multiple of 4, so the copy never passes the
// block's M floats), the weight's block scales by cp.async (whose arrival is the full barrier's second).
template <int BM, int BN, bool PAIR>
DSV4_INLINE void ffg_produce(const DsvTmaMap* a_map, const DsvTmaMap* w_map, const float* sa, const float* sw,
                             int M, int N, int K, unsigned smem) {
  using C = FfgCfg<BM, BN, PAIR>;
  if (threadIdx.x != C::CONSUMERS) return;
  const int mt = (M + BM - 1) / BM;
  const FfgWalk wk = ffg_walk<PAIR>(mt, N / BN);
  // The maps into the cache before the first copies need them.
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(a_map) : "memory");
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(w_map) : "memory");
  const int kbs = K / FFG_BK;
  int slot = 0;
  unsigned phase = 0;
  for (int i = wk.first; i < wk.count; i += wk.step) {
    const FfgTile tl = ffg_walk_tile<BM, BN, PAIR>(wk, i, mt);
    const int rows = max(0, min(BM, M - tl.m0));  // 0: a pair's block past M
    const unsigned sa_bytes = (unsigned)((rows + 3) / 4) * 16u;
    for (int kb = 0; kb < kbs; ++kb) {
      mbar_wait<PAIR>(ffg_empty<C>(smem, slot), phase ^ 1);
      const unsigned st = smem + slot * C::SLOT, full = ffg_full<C>(smem, slot);
      mbar_arrive_expect_tx(full, C::SLOT_A + C::SLOT_B + sa_bytes);
      tma_load_2d(st, a_map, kb * FFG_BK, tl.m0, full);
      if (PAIR)  // this block's 128 weight rows into both blocks' slot (w_map's boxes are 128 rows here)
        tma_load_2d_multicast(st + C::SLOT_A + wk.rank * 128 * FFG_BK, w_map, kb * FFG_BK, tl.n0 + 128 * wk.rank, full,
                          (unsigned short)3);
      else
        tma_load_2d(st + C::SLOT_A, w_map, kb * FFG_BK, tl.n0, full);
      if (sa_bytes != 0) bulk_load(st + C::SA, sa + (long long)kb * M + tl.m0, sa_bytes, full);
#pragma unroll
      for (int h = 0; h < C::HALVES; ++h) cp_async_4(st + C::SW + 4 * h, sw + (long long)(tl.n0 / 128 + h) * kbs + kb);
      cp_async_mbar_arrive(full);
      ffg_advance<C>(slot, phase);
    }
  }
  cp_async_wait_all();  // the copies land before the thread exits
}

// "+f" operands d[o] .. d[o + 7] of the accumulator list: WGMMA_ACC8 (fp8_mma.cuh).
// One wgmma m64n128k32 e4m3 with both operands from shared memory (descriptors); `accumulate` 0 overwrites d.
DSV4_INLINE void ffg_wgmma(float (&d)[64], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1; }\n"
      : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24), WGMMA_ACC8(d, 32),
        WGMMA_ACC8(d, 40), WGMMA_ACC8(d, 48), WGMMA_ACC8(d, 56)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// The outputs of the thread's two token rows in `out`'s form: f32, or rounded to bf16 values (as
// fd_round_bf16_kernel makes them) and stored as f32 or as their bf16 bits (the top half of the rounded f32),
// an output pair at a time (a warp's store covers 8 rows x 32 or 16 contiguous bytes). acc[64h + 4j + c]: row
// row0 + 8·(c >> 1), output col0 + 128h + 8j + (c & 1). Rows past M are not stored (N is a multiple of BN).
template <int BN>
DSV4_INLINE void ffg_store(const float (&acc)[BN / 2], void* y, int ldy, int row0, int M, int col0, int out) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + 8 * r;
    if (row >= M) continue;
    const long long at = (long long)row * ldy + col0;
    const bool rounded = out == FFG_OUT_F32_ROUNDED || out == FFG_OUT_BF16;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
      float2 v = make_float2(acc[4 * j + 2 * r], acc[4 * j + 2 * r + 1]);
      if (rounded) v = round_bf16x2(v);  // (fd_round_bf16_kernel's values, bit for bit)
      if (out == FFG_OUT_BF16)
        *reinterpret_cast<unsigned*>(static_cast<unsigned short*>(y) + at + 8 * j) =
            (__float_as_uint(v.x) >> 16) | (__float_as_uint(v.y) & 0xffff0000u);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(y) + at + 8 * j) = v;
    }
  }
}

// The consumers: warpgroup w, for each tile, each stage: wait for the slot; per 128-output half, four chained
// wgmmas over the block, the half's scales read while they run, wait, promote (the slot released after the
// last half's wait). A tile's outputs are stored while the NEXT tile's first wgmmas run: after those are
// issued and before their wait, so the tensor core works through the epilogue (each warpgroup's rounding and
// stores, ~100-150 instructions a thread, would otherwise leave it idle once a tile: at K = 1024 a tile has
// only 8 stages). The first stage's promotion then starts its sums from +0 (fmaf(d, s, 0), the bits the
// zeroed accumulators gave) rather than from accumulators the epilogue may still be reading. The last tile's
// outputs are stored after the loop.
template <int BM, int BN, bool PAIR>
DSV4_INLINE void ffg_consume(void* y, int ldy, int M, int N, int K, int out, unsigned char* smem_base,
                             unsigned smem) {
  using C = FfgCfg<BM, BN, PAIR>;
  const int mt = (M + BM - 1) / BM;
  const FfgWalk wk = ffg_walk<PAIR>(mt, N / BN);
  const int w = threadIdx.x >> 7, q = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = 64 * w + 16 * q + g;  // the thread's first token row in the tile; the second is r0 + 8
  const int kbs = K / FFG_BK;
  int slot = 0;
  unsigned phase = 0;
  float d[64], acc[BN / 2];
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.0f;  // defined before the first wgmma (ptxas C7511)
#pragma unroll
  for (int v = 0; v < BN / 2; ++v) acc[v] = 0.0f;
  FfgTile prev = {-1, 0};  // the tile whose outputs acc holds, not yet stored (m0 < 0: none)
  for (int i = wk.first; i < wk.count; i += wk.step) {
    const FfgTile tl = ffg_walk_tile<BM, BN, PAIR>(wk, i, mt);
#pragma unroll 1
    for (int kb = 0; kb < kbs; ++kb) {
      mbar_wait(ffg_full<C>(smem, slot), phase);
      const unsigned char* st = smem_base + slot * C::SLOT;
      const unsigned long long da = wgmma_desc_sw128(st + 64 * w * FFG_BK);
      const float* sas = reinterpret_cast<const float*>(st + C::SA);
#pragma unroll
      for (int h = 0; h < C::HALVES; ++h) {
        const unsigned long long db = wgmma_desc_sw128(st + C::SLOT_A + h * 128 * FFG_BK);
        wgmma_fence();
#pragma unroll
        for (int k32 = 0; k32 < 4; ++k32) ffg_wgmma(d, da + 2 * k32, db + 2 * k32, k32);
        wgmma_commit();
        // The previous tile's outputs, while this tile's first wgmmas run (acc is not theirs).
        if (kb == 0 && h == 0 && prev.m0 >= 0) ffg_store<BN>(acc, y, ldy, prev.m0 + r0, M, prev.n0 + 2 * t, out);
        const float swv = reinterpret_cast<const float*>(st + C::SW)[h];
        const float s0 = sas[r0] * swv, s8 = sas[r0 + 8] * swv;
        wgmma_wait<0>();
        wgmma_fence_operand(d);
        if (h == C::HALVES - 1) {
          __syncwarp();
          if (lane == 0) mbar_arrive(ffg_empty<C>(smem, slot));
          if (PAIR && lane == 1) mbar_arrive_cluster(ffg_empty<C>(smem, slot), (unsigned)wk.rank ^ 1u);
        }
        if (kb == 0) {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            acc[64 * h + 4 * j + 0] = fmaf(d[4 * j + 0], s0, 0.0f);
            acc[64 * h + 4 * j + 1] = fmaf(d[4 * j + 1], s0, 0.0f);
            acc[64 * h + 4 * j + 2] = fmaf(d[4 * j + 2], s8, 0.0f);
            acc[64 * h + 4 * j + 3] = fmaf(d[4 * j + 3], s8, 0.0f);
          }
        } else {
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            acc[64 * h + 4 * j + 0] = fmaf(d[4 * j + 0], s0, acc[64 * h + 4 * j + 0]);
            acc[64 * h + 4 * j + 1] = fmaf(d[4 * j + 1], s0, acc[64 * h + 4 * j + 1]);
            acc[64 * h + 4 * j + 2] = fmaf(d[4 * j + 2], s8, acc[64 * h + 4 * j + 2]);
            acc[64 * h + 4 * j + 3] = fmaf(d[4 * j + 3], s8, acc[64 * h + 4 * j + 3]);
          }
        }
      }
      ffg_advance<C>(slot, phase);
    }
    prev = tl;
  }
  if (prev.m0 >= 0) ffg_store<BN>(acc, y, ldy, prev.m0 + r0, M, prev.n0 + 2 * t, out);
}

// The kernels' shared body: barriers, the warpgroups' roles and registers.
template <int BM, int BN, bool PAIR = false>
DSV4_INLINE void ffg_gemm(const DsvTmaMap* a_map, const DsvTmaMap* w_map, const float* sa, const float* sw, int M,
                          int N, int K, int out, void* y, int ldy) {
  using C = FfgCfg<BM, BN, PAIR>;
  extern __shared__ __align__(1024) unsigned char ffg_smem[];
  const unsigned smem = smem_addr(ffg_smem);
  if ((smem & 1023u) != 0) __trap();  // the swizzle addressing needs 1024-byte aligned slots
  // (Each role works out its tiles after its setmaxnreg: values live across it are spilled.)
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::STAGES; ++s) {
      mbar_init(ffg_full<C>(smem, s), 2);                    // the expect_tx arrival and the cp.async one
      mbar_init(ffg_empty<C>(smem, s), C::EMPTY_ARRIVALS);  // the consumer warps (of both blocks of a pair)
    }
    fence_mbar_init();
  }
  // A pair's barriers are initialised in both blocks before either block's copies or arrivals reach them.
  if (PAIR)
    cluster_sync();
  else
    __syncthreads();
  if (threadIdx.x >= C::CONSUMERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(C::PRODUCER_REGS));
    ffg_produce<BM, BN, PAIR>(a_map, w_map, sa, sw, M, N, K, smem);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(C::CONSUMER_REGS));
    ffg_consume<BM, BN, PAIR>(y, ldy, M, N, K, out, ffg_smem, smem);
  }
  // A pair's blocks leave together: the other block's multicasts into this one's slots and its consumers'
  // arrivals on this one's barriers are all done (each precedes the other block's arrival here).
  if (PAIR) {
    __syncwarp();
    cluster_sync();
  }
}

// y = the block-scaled product above; grid: up to one block per SM (persistent; the pair kernel in clusters
// of 2, an even grid), FfgCfg::THREADS threads (384, 384, 512, 384), FFG_SMEM_BYTES of dynamic shared memory.
// a_map: the codes [M, K] as a 2-D byte tensor in boxes of 128 bytes x BM rows, 128-byte swizzle; w_map: W's
// [N, K] likewise in boxes of 128 bytes x BN rows (the pair kernel: 128 rows, each block's half). M a multiple
// of 4, N of BN, K of 128; y [M, ldy] in `out`'s element type (f32, or bf16 for FFG_OUT_BF16), ldy even, 8-byte
// aligned.
extern "C" __global__ void __launch_bounds__(FfgCfg<128, 128>::THREADS, 1)
    ffg_gemm_kernel(const __grid_constant__ DsvTmaMap a_map, const __grid_constant__ DsvTmaMap w_map,
                    const float* sa, const float* sw, int M, int N, int K, int out, void* y, int ldy) {
  dsv4_pdl_begin();
  ffg_gemm<128, 128>(&a_map, &w_map, sa, sw, M, N, K, out, y, ldy);
}

extern "C" __global__ void __launch_bounds__(FfgCfg<128, 256>::THREADS, 1)
    ffg_gemm_n256_kernel(const __grid_constant__ DsvTmaMap a_map, const __grid_constant__ DsvTmaMap w_map,
                         const float* sa, const float* sw, int M, int N, int K, int out, void* y, int ldy) {
  dsv4_pdl_begin();
  ffg_gemm<128, 256>(&a_map, &w_map, sa, sw, M, N, K, out, y, ldy);
}

extern "C" __global__ void __launch_bounds__(FfgCfg<192, 128>::THREADS, 1)
    ffg_gemm_m192_kernel(const __grid_constant__ DsvTmaMap a_map, const __grid_constant__ DsvTmaMap w_map,
                         const float* sa, const float* sw, int M, int N, int K, int out, void* y, int ldy) {
  dsv4_pdl_begin();
  ffg_gemm<192, 128>(&a_map, &w_map, sa, sw, M, N, K, out, y, ldy);
}

extern "C" __global__ void __launch_bounds__(FfgCfg<128, 256, true>::THREADS, 1)
    ffg_gemm_pair_kernel(const __grid_constant__ DsvTmaMap a_map, const __grid_constant__ DsvTmaMap w_map,
                         const float* sa, const float* sw, int M, int N, int K, int out, void* y, int ldy) {
  dsv4_pdl_begin();
  ffg_gemm<128, 256, true>(&a_map, &w_map, sa, sw, M, N, K, out, y, ldy);
}
