// moe_plan.cuh — the MoE routing plan of one block (moe_plan_kernel, moe.cu) and its scans, as device functions
// over a chosen set of threads: moe_plan_kernel runs them on its whole block, fast_moe_gemm.cu's
// fmoe_route_experts_kernel on some warps of one of its blocks, so both make the same plan. kernels/SPEC.md
// ## moe.cu.
#pragma once

// The threads a plan runs on: threads 0 .. n - 1 of the block, joined by barrier `bar` (0: the whole block,
// __syncthreads; else the named barrier bar over those n threads).
struct PlanSync {
  unsigned bar, n;
};
DSV4_INLINE void plan_sync(PlanSync ps) {
  if (ps.bar == 0)
    __syncthreads();
  else
    asm volatile("bar.sync %0, %1;\n" ::"r"(ps.bar), "r"(ps.n) : "memory");
}

// Exclusive prefix sum of v over the plan's threads (ps.n, a multiple of 32); *total gets the sum.
// Every one of them must call; ends with a barrier. wsum: __shared__ int[32].
DSV4_INLINE int block_excl_scan(int v, int* wsum, int* total, PlanSync ps) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (int)(ps.n >> 5);
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) wsum[warp] = inc;
  plan_sync(ps);
  if (warp == 0) {
    int s = lane < nw ? wsum[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    wsum[lane] = s;
  }
  plan_sync(ps);
  const int base = warp > 0 ? wsum[warp - 1] : 0;
  *total = wsum[nw - 1];
  plan_sync(ps);
  return base + inc - v;
}

// Tiles of at most tile_rows rows that `count` rows take (the plan's tiles of one expert).
DSV4_INLINE int plan_tiles_of(int count, int tile_rows) { return (count + tile_rows - 1) / tile_rows; }

// Assignment a's index within its expert e's range of rows in the wide plan (moe.cu: its row is offsets[e] plus
// this): the count kernel's rank among its block's earlier assignments of e (ranks[a] >= 0), plus the scan's count
// of e's assignments in the blocks before (counts[a / PLAN_CHUNK][e]).
DSV4_INLINE int plan_wide_within(int a, int e, int E, const int* counts, const int* ranks) {
  return counts[(long long)(a / PLAN_CHUNK) * E + e] + ranks[a];
}

// From the per-expert totals eoff[0 .. E) (shared memory, all the plan's threads): eoff[e] becomes expert e's
// offset (exclusive sum in expert order) and eoff[E] the total; tiles (expert, start, count) cover every
// expert's range with at most tile_rows rows each, in expert order; *ntiles their number. Every one of the
// plan's threads must call; ends with a barrier. Thread tid owns experts [tid*C, tid*C + C).
DSV4_INLINE void plan_offsets_and_tiles(int* eoff, int E, int tile_rows, int* wsum, int* tiles, int* ntiles,
                                        PlanSync ps) {
  const int tid = threadIdx.x;
  const int C = (E + (int)ps.n - 1) / (int)ps.n;
  const int e0 = tid * C;
  int tot_local = 0, tiles_local = 0;
  for (int c = 0; c < C; ++c) {
    const int e = e0 + c;
    if (e < E) {
      tot_local += eoff[e];
      tiles_local += plan_tiles_of(eoff[e], tile_rows);
    }
  }
  int tot_all, tiles_all;
  const int tot_pre = block_excl_scan(tot_local, wsum, &tot_all, ps);
  const int tiles_pre = block_excl_scan(tiles_local, wsum, &tiles_all, ps);
  {
    int run = tot_pre, trun = tiles_pre;
    for (int c = 0; c < C; ++c) {
      const int e = e0 + c;
      if (e >= E) break;
      const int ce = eoff[e];
      eoff[e] = run;
      const int nt = plan_tiles_of(ce, tile_rows);
      for (int i = 0; i < nt; ++i) {
        const int tl = trun + i;
        tiles[3 * tl + 0] = e;
        tiles[3 * tl + 1] = run + i * tile_rows;
        tiles[3 * tl + 2] = min(tile_rows, ce - i * tile_rows);
      }
      run += ce;
      trun += nt;
    }
  }
  if (tid == 0) {
    eoff[E] = tot_all;
    *ntiles = tiles_all;
  }
  plan_sync(ps);
}

// The plan by the ps.n = 32 · WARPS threads of `ps`, each warp owning a contiguous segment of the
// assignments (the result does not depend on WARPS: every expert's rows are in assignment order).
// Groups the assignments a = t*k + j by expert, stable in a: offsets[e] .. offsets[e+1] is expert
// e's range of `rows`, rows[r] the assignment; tiles (expert, start, count) cover every expert's
// range with at most tile_rows rows each, in expert order; *ntiles their number. Ids outside
// [0, E) are left out. psm: (WARPS + 1) * E + 1 ints of shared memory; wsum: __shared__ int[32].
template <int WARPS>
DSV4_INLINE void moe_plan_block(const int* ids, int T, int k, int E, int tile_rows, int* offsets, int* rows,
                                int* tiles, int* ntiles, int* psm, int* wsum, PlanSync ps) {
  int* cnt = psm;          // [WARPS][E]: per-warp counts, then bases
  int* eoff = psm + WARPS * E;  // [E + 1]: totals, then offsets
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int n = T * k;
  const int seg = (n + WARPS - 1) / WARPS;
  const int a_begin = min(n, warp * seg), a_end = min(n, a_begin + seg);
  const unsigned lt_mask = (1u << lane) - 1u;

  for (int i = tid; i < WARPS * E; i += (int)ps.n) cnt[i] = 0;
  plan_sync(ps);
  // Pass 1: each warp counts its segment per expert (only a group's leader lane writes).
  for (int a0 = a_begin; a0 < a_end; a0 += 32) {
    const int a = a0 + lane;
    int e = a < a_end ? ids[a] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0 && (peers & lt_mask) == 0u) cnt[warp * E + e] += __popc(peers);
    __syncwarp();
  }
  plan_sync(ps);
  // Per expert: warp bases (exclusive over warps) and the expert's total.
  for (int e = tid; e < E; e += (int)ps.n) {
    int run = 0;
    for (int w = 0; w < WARPS; ++w) {
      const int c = cnt[w * E + e];
      cnt[w * E + e] = run;
      run += c;
    }
    eoff[e] = run;
  }
  plan_sync(ps);
  plan_offsets_and_tiles(eoff, E, tile_rows, wsum, tiles, ntiles, ps);
  for (int e = tid; e <= E; e += (int)ps.n) offsets[e] = eoff[e];
  // Pass 2: place every assignment at offset + warp base + rank among earlier peers.
  for (int a0 = a_begin; a0 < a_end; a0 += 32) {
    const int a = a0 + lane;
    int e = a < a_end ? ids[a] : -1;
    if (e < 0 || e >= E) e = -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    if (e >= 0) rows[eoff[e] + cnt[warp * E + e] + __popc(peers & lt_mask)] = a;
    __syncwarp();
    if (e >= 0 && (peers & lt_mask) == 0u) cnt[warp * E + e] += __popc(peers);
    __syncwarp();
  }
}

