// fast_moe_gemm kernel family: the fast set's grouped expert GEMMs (kernels/SPEC.md ## fast_moe_gemm.cu,
// ../shared/KERNELS.md §3 "Decode").
//
// fmoe_up_kernel:   hq, hs = act_quant(bf16(silu(min(bf16(W1 x), L)) · clamp(bf16(W3 x), ±L) · w))
// fmoe_down_kernel: y = bf16(W2 hq)
//
// Work items. The plan (moe_plan_kernel, tile_rows = FMOE_TOKENS) lists (expert, start, count) tiles of at
// most FMOE_TOKENS routed assignments; the shared expert adds ceil(T / FMOE_TOKENS) tiles of consecutive
// tokens after them. Each tile is cut into row blocks: for up, FMOE_UP_J = 128 j (gate row j and up row j,
// so SwiGLU and the per-128 FP8 quantisation of h stay inside the block); for down, FMOE_DOWN_ROWS rows.
// Blocks are persistent and take items blockIdx.x, + gridDim.x, ... in order; an item's outputs depend only
// on the item, so they are deterministic bit for bit whichever block computes them.
//
// Inside an item. The weights are streamed in their stored layout in stages of FMOE_STAGE_ROWS = 16 rows
// by up to FMOE_STAGE_ROW_BYTES bytes of each (a whole FP4 row of K = 4096; FP8 rows of 4096 take two
// stages): every stage is one or two contiguous runs of memory, read with 16-byte cp.async into a ring of
// FMOE_STAGES stages (up: rows 0-7 are gate rows j..j+7, rows 8-15 the up rows j..j+7). Warp w owns the
// stage's 128-blocks w, w + FMOE_WARPS, ... (the same k for every row group), so it loads the tokens'
// activations for those blocks into registers once per item: f16 in MMA order (fp8_mma.cuh), written so by
// the quantising kernels. Per k32 group it decodes its A fragments (FP4 -> e4m3 bit move -> f16, exact),
// runs two chained f16 m16n8k16 MMAs per 8 tokens (f32 accumulators, exact products) from zero and adds
// the result times s_w(row, group) (per-32 promotion: exact for the per-32 FP4 scales, KERNELS.md §2
// "simple, exact"); each 128-block's sum is then added times s_a(token, block). After a row group's last
// stage the warps' partial sums are added in warp order through shared memory.
#include "common.cuh"
#include "fp8_mma.cuh"

// FMOE_TOKENS, FMOE_WARPS, FMOE_STAGES, FMOE_STAGE_ROWS, FMOE_STAGE_ROW_BYTES, FMOE_UP_J, FMOE_DOWN_ROWS and
// FMOE_MAX_K come from dsv4_consts.cuh (src/cuda/kernels/fast_moe_gemm.rs).
#define FMOE_THREADS (FMOE_WARPS * 32)
#define FMOE_NT (FMOE_TOKENS / 8)
#define FMOE_ROW_THREADS (FMOE_THREADS / FMOE_STAGE_ROWS)  // threads loading one stage row
// Shared-memory row strides, padded so a warp's fragment loads hit distinct banks: FP4 rows (4-byte
// loads) by 16 bytes, FP8 rows (8-byte loads) by 32; the per-32 scales of a row (2 per FP4 byte / 32) by
// 4 floats.
#define FMOE_W_STRIDE_FP4 (FMOE_STAGE_ROW_BYTES + 16)
#define FMOE_W_STRIDE_FP8 (FMOE_STAGE_ROW_BYTES + 32)
#define FMOE_S_STRIDE (FMOE_STAGE_ROW_BYTES / 16 + 4)
// 128-blocks of K a warp owns per item: FMOE_MAX_K / 128 blocks over FMOE_WARPS warps.
#define FMOE_SLOTS ((FMOE_MAX_K / 128 + FMOE_WARPS - 1) / FMOE_WARPS)
#define FMOE_STAGE_BYTES (FMOE_STAGE_ROWS * FMOE_W_STRIDE_FP8 + FMOE_STAGE_ROWS * FMOE_S_STRIDE * 4)
#define FMOE_MAX_BLOCK_ROWS (FMOE_UP_J > FMOE_DOWN_ROWS ? FMOE_UP_J : FMOE_DOWN_ROWS)

// Rust's f32::clamp(v, -l, l): NaN stays NaN.
DSV4_INLINE float fmoe_clamp_sym(float v, float l) { return v < -l ? -l : (v > l ? l : v); }

// x · sigmoid(x) in f32 (IEEE expf and division: no fast math).
DSV4_INLINE float fmoe_silu(float x) { return x / (1.0f + expf(-x)); }

// One work item as the block sees it.
struct FmoeItem {
  bool shared;              // the shared expert's tile
  bool fp4;                 // FP4 (per-32 scales) or FP8 (128x128 scales)
  int n;                    // tokens (assignments) in the tile, 1..FMOE_TOKENS
  int row0;                 // first row of the row block (up: first j)
  const unsigned char* wa;  // up: W1, down: W2
  const unsigned char* wb;  // up: W3, down: W2
  const float* sa;          // scales of wa / wb (FP4: [rows][K/32]; FP8: [rows/128][K/128])
  const float* sb;
};

// The block's shared memory, carved once.
struct FmoeSmem {
  unsigned char* ring;  // FMOE_STAGES x FMOE_STAGE_BYTES
  float* red;           // [FMOE_WARPS][16 rows][FMOE_TOKENS] partial sums
  float* h;             // up: [FMOE_UP_J j][FMOE_TOKENS] h of the item
  int* act_row;         // [FMOE_TOKENS] activation row of each token column
  int* out_row;         // [FMOE_TOKENS] output row
  float* w;             // [FMOE_TOKENS] routing weight (1 for the shared expert)
};

// A warp's activations for its 128-blocks (slots): B fragments and scales of the item's tokens.
struct FmoeAct {
  uint4 b[FMOE_SLOTS][4][FMOE_NT];   // f16 MMA-order k32 chunks: slot, group, 8-token tile
  float s[FMOE_SLOTS][FMOE_NT][2];   // scales of tokens (nt*8 + 2t, + 1)
  int kb[FMOE_SLOTS];                // global 128-block of the slot, -1 when none
};

// Geometry of an item's stages: kv k per stage (nks stages per row group).
struct FmoeStages {
  int ks;     // k per stage
  int nks;    // stages per row group
  int ngroups;  // row groups per item
};

DSV4_INLINE FmoeStages fmoe_stages(bool up, bool fp4, int K) {
  FmoeStages g;
  const int per_stage = fp4 ? 2 * FMOE_STAGE_ROW_BYTES : FMOE_STAGE_ROW_BYTES;
  g.ks = K < per_stage ? K : per_stage;
  g.nks = (K + g.ks - 1) / g.ks;
  g.ngroups = up ? FMOE_UP_J / 8 : FMOE_DOWN_ROWS / FMOE_STAGE_ROWS;
  return g;
}

// Global row of stage row r (0..15) in row group rg, and which matrix it is in (up: rows 8..15 are W3).
template <bool UP>
DSV4_INLINE int fmoe_row(const FmoeItem& it, int rg, int r, int rows_valid, bool& second) {
  if (UP) {
    second = r >= 8;
    return it.row0 + rg * 8 + (r & 7);
  }
  second = false;
  const int g = it.row0 + rg * FMOE_STAGE_ROWS + r;
  return g < rows_valid ? g : rows_valid - 1;  // rows past D: loaded, never stored
}

// Issues the cp.async loads of stage s (row group s / nks, k part s % nks) into `st`.
template <bool UP>
DSV4_INLINE void fmoe_load_stage(unsigned char* st, const FmoeItem& it, const FmoeStages& gs, int s, int rows_valid,
                                 int K) {
  const int tid = threadIdx.x;
  const int rg = s / gs.nks, kp = s - rg * gs.nks;
  const int k0 = kp * gs.ks, kv = min(gs.ks, K - k0);
  const int row_bytes = it.fp4 ? K / 2 : K;
  const int cpr = it.fp4 ? kv / 32 : kv / 16;  // 16-byte chunks per row
  const int kbyte0 = it.fp4 ? k0 / 2 : k0;
  const int wstride = it.fp4 ? FMOE_W_STRIDE_FP4 : FMOE_W_STRIDE_FP8;
  // Thread (r, c) = (tid / FMOE_ROW_THREADS, tid % FMOE_ROW_THREADS) copies chunks c, c + FMOE_ROW_THREADS, ...
  // of stage row r: no division, consecutive threads on consecutive 16 bytes.
  const int r = tid / FMOE_ROW_THREADS, c0 = tid % FMOE_ROW_THREADS;
  bool second;
  const int grow = fmoe_row<UP>(it, rg, r, rows_valid, second);
  {
    const unsigned char* src = (second ? it.wb : it.wa) + (long long)grow * row_bytes + kbyte0;
    unsigned char* dst = st + r * wstride;
    for (int p = c0; p < cpr; p += FMOE_ROW_THREADS) cp_async_16(dst + p * 16, src + p * 16);
  }
  if (it.fp4) {
    float* ss = reinterpret_cast<float*>(st + FMOE_STAGE_ROWS * FMOE_W_STRIDE_FP8) + r * FMOE_S_STRIDE;
    const float* src = (second ? it.sb : it.sa) + (long long)grow * (K / 32) + k0 / 32;
    const int spr = kv / 128;  // 16-byte chunks of four per-32 scales
    for (int p = c0; p < spr; p += FMOE_ROW_THREADS) cp_async_16(ss + p * 4, src + p * 4);
  }
}

// part[nt][.] += the warp's slots of stage s (see the file comment).
template <bool UP, bool FP4>
DSV4_INLINE void fmoe_compute_stage(const unsigned char* st, const FmoeItem& it, int s, int rows_valid, int K,
                                    int ntu, const FmoeAct& act, float (&part)[FMOE_NT][4]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const FmoeStages gf = fmoe_stages(UP, FP4, K);  // constant when K is (fmoe_gemm's KT)
  const int rg = s / gf.nks, kp = s - rg * gf.nks;
  const int kb0 = kp * gf.ks / 128;  // first global 128-block of the stage
  const int kblocks = K / 128;
  const int wstride = FP4 ? FMOE_W_STRIDE_FP4 : FMOE_W_STRIDE_FP8;
  const float* ss = reinterpret_cast<const float*>(st + FMOE_STAGE_ROWS * FMOE_W_STRIDE_FP8);
  // FP8: the 128x128 block rows of rows g and g + 8.
  const float* s8a = nullptr;
  const float* s8b = nullptr;
  if (!FP4) {
    bool second;
    const int r0 = fmoe_row<UP>(it, rg, 0, rows_valid, second);
    const int r8 = fmoe_row<UP>(it, rg, 8, rows_valid, second);
    s8a = it.sa + (long long)(r0 / 128) * kblocks;
    s8b = (UP ? it.sb : it.sa) + (long long)(r8 / 128) * kblocks;
  }
#pragma unroll
  for (int sl = 0; sl < FMOE_SLOTS; ++sl) {
    const int qb = act.kb[sl] - kb0;  // the slot's block within this stage
    if (act.kb[sl] < 0 || qb < 0 || qb >= gf.ks / 128) continue;
    float blk[FMOE_NT][4];
#pragma unroll
    for (int nt = 0; nt < FMOE_NT; ++nt)
#pragma unroll
      for (int v = 0; v < 4; ++v) blk[nt][v] = 0.0f;
#pragma unroll
    for (int qq = 0; qq < 4; ++qq) {
      const int q = 4 * qb + qq;
      unsigned ev0, od0, ev1, od1;  // e4m3 of rows g, g+8: even and odd elements of the thread's 8 k
      float sw0, sw1;
      if (FP4) {
        e2m1x8_to_e4m3_eo(lds_u32(st + g * wstride + 16 * q + 4 * t), ev0, od0);
        e2m1x8_to_e4m3_eo(lds_u32(st + (g + 8) * wstride + 16 * q + 4 * t), ev1, od1);
        sw0 = ss[g * FMOE_S_STRIDE + q] * 64.0f;  // the bit move's 2^-6, folded back
        sw1 = ss[(g + 8) * FMOE_S_STRIDE + q] * 64.0f;
      } else {
        const uint2 u0 = lds_u64(st + g * wstride + 32 * q + 8 * t);
        const uint2 u1 = lds_u64(st + (g + 8) * wstride + 32 * q + 8 * t);
        ev0 = __byte_perm(u0.x, u0.y, 0x6420);
        od0 = __byte_perm(u0.x, u0.y, 0x7531);
        ev1 = __byte_perm(u1.x, u1.y, 0x6420);
        od1 = __byte_perm(u1.x, u1.y, 0x7531);
        sw0 = s8a[kb0 + qb];
        sw1 = s8b[kb0 + qb];
      }
      unsigned ae0, ae2, ae1, ae3, ao0, ao2, ao1, ao3;
      e4m3x4_to_f16x4(ev0, ae0, ae2);
      e4m3x4_to_f16x4(ev1, ae1, ae3);
      e4m3x4_to_f16x4(od0, ao0, ao2);
      e4m3x4_to_f16x4(od1, ao1, ao3);
#pragma unroll
      for (int nt = 0; nt < FMOE_NT; ++nt) {
        if (nt < ntu) {
          const uint4 b = act.b[sl][qq][nt];
          float c[4];
          mma_f16_m16n8k16_zero(c, ae0, ae1, ae2, ae3, b.x, b.y);
          mma_f16_m16n8k16(c, ao0, ao1, ao2, ao3, b.z, b.w);
          blk[nt][0] = fmaf(c[0], sw0, blk[nt][0]);
          blk[nt][1] = fmaf(c[1], sw0, blk[nt][1]);
          blk[nt][2] = fmaf(c[2], sw1, blk[nt][2]);
          blk[nt][3] = fmaf(c[3], sw1, blk[nt][3]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < FMOE_NT; ++nt) {
      if (nt < ntu) {
        part[nt][0] = fmaf(blk[nt][0], act.s[sl][nt][0], part[nt][0]);
        part[nt][1] = fmaf(blk[nt][1], act.s[sl][nt][1], part[nt][1]);
        part[nt][2] = fmaf(blk[nt][2], act.s[sl][nt][0], part[nt][2]);
        part[nt][3] = fmaf(blk[nt][3], act.s[sl][nt][1], part[nt][3]);
      }
    }
  }
}

// A row group's sums: every warp's partials into sm.red, then (after the barrier) the fixed-order sum
// over warps of (row, token) = (tid & 15, tid >> 4) for the caller's epilogue.
DSV4_INLINE float fmoe_reduce(const FmoeSmem& sm, float (&part)[FMOE_NT][4], int& row, int& tok) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  float* red = sm.red + warp * 16 * FMOE_TOKENS;
#pragma unroll
  for (int nt = 0; nt < FMOE_NT; ++nt) {
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      red[(g + 8 * (v >> 1)) * FMOE_TOKENS + nt * 8 + 2 * t + (v & 1)] = part[nt][v];
      part[nt][v] = 0.0f;
    }
  }
  __syncthreads();
  row = threadIdx.x & 15;
  tok = threadIdx.x >> 4;
  float sum = 0.0f;
  if (tok < FMOE_TOKENS) {
    for (int w = 0; w < FMOE_WARPS; ++w) sum += sm.red[(w * 16 + row) * FMOE_TOKENS + tok];
  }
  return sum;
}

// Shared body of both kernels. UP: K = D, weight rows j of W1/W3 (N = I of them), act = xq [T][D] with xs;
// out hq [T*k + T][I] (e4m3 values as f16 in MMA order) and hs [T*k + T][I/128] scales. DOWN: K = I, rows of W2 (N = D), act = hq
// with hs; out y [T*k + T][D] bf16.
// KT: K as a compile-time constant (0: the runtime `k_rt`), so that the stage loops unroll and their
// address arithmetic folds for the shapes that matter (V4-Flash: 4096 for up, 2048 for down).
template <bool UP, int KT>
DSV4_INLINE void fmoe_gemm(const unsigned short* act, const float* act_scales, int T, int k_rt, int N, int k,
                           const int* rows, const int* tiles, const int* ntiles, int e_begin, int e_end,
                           const unsigned long long* wa, const unsigned long long* wb, const unsigned long long* sa,
                           const unsigned long long* sb, int fmt, const void* shared_wa, const void* shared_wb,
                           const float* shared_sa, const float* shared_sb, int shared_fmt, const float* route_w,
                           float limit, unsigned short* out_q, float* out_s, bf16_t* out_y) {
  extern __shared__ __align__(16) unsigned char fmoe_smem[];
  const int K = KT ? KT : k_rt;
  const int kblocks = K / 128;
  FmoeSmem sm;
  sm.ring = fmoe_smem;
  sm.red = reinterpret_cast<float*>(sm.ring + FMOE_STAGES * FMOE_STAGE_BYTES);
  sm.h = sm.red + FMOE_WARPS * 16 * FMOE_TOKENS;
  sm.act_row = reinterpret_cast<int*>(sm.h + FMOE_UP_J * FMOE_TOKENS);
  sm.out_row = sm.act_row + FMOE_TOKENS;
  sm.w = reinterpret_cast<float*>(sm.out_row + FMOE_TOKENS);

  const int tid = threadIdx.x;
  const int nrt = *ntiles;
  const int nsh = shared_wa != nullptr ? (T + FMOE_TOKENS - 1) / FMOE_TOKENS : 0;
  const int block_rows = UP ? FMOE_UP_J : FMOE_DOWN_ROWS;
  const int rblocks = (N + block_rows - 1) / block_rows;
  const long long total = (long long)(nrt + nsh) * rblocks;

  for (long long wi = blockIdx.x; wi < total; wi += gridDim.x) {
    const int tile = (int)(wi / rblocks), rb = (int)(wi - (long long)tile * rblocks);
    FmoeItem it;
    int start;
    if (tile < nrt) {
      const int e = tiles[3 * tile];
      if (e < e_begin || e >= e_end) continue;  // another rank's expert (uniform over the block)
      start = tiles[3 * tile + 1];
      it.n = tiles[3 * tile + 2];
      it.shared = false;
      it.fp4 = fmt == WFMT_FP4;
      const int le = e - e_begin;
      it.wa = reinterpret_cast<const unsigned char*>(wa[le]);
      it.wb = reinterpret_cast<const unsigned char*>(wb[le]);
      it.sa = reinterpret_cast<const float*>(sa[le]);
      it.sb = reinterpret_cast<const float*>(sb[le]);
    } else {
      start = (tile - nrt) * FMOE_TOKENS;
      it.n = min(FMOE_TOKENS, T - start);
      it.shared = true;
      it.fp4 = shared_fmt == WFMT_FP4;
      it.wa = reinterpret_cast<const unsigned char*>(shared_wa);
      it.wb = reinterpret_cast<const unsigned char*>(shared_wb);
      it.sa = shared_sa;
      it.sb = shared_sb;
    }
    it.row0 = rb * block_rows;
    if (tid < FMOE_TOKENS) {
      // Columns past n (padding of the last 8-token MMA tile) are never stored.
      const int i = tid < it.n ? tid : 0;
      int a_row, o_row;
      float wt = 1.0f;
      if (it.shared) {
        o_row = T * k + start + i;
        a_row = UP ? start + i : o_row;
      } else {
        const int a = rows[start + i];
        o_row = a;
        a_row = UP ? a / k : a;
        wt = route_w != nullptr ? route_w[a] : 1.0f;
      }
      sm.act_row[tid] = a_row;
      sm.out_row[tid] = o_row;
      sm.w[tid] = wt;
    }
    __syncthreads();
    const FmoeStages gs = fmoe_stages(UP, it.fp4, K);
    const int nstages = gs.ngroups * gs.nks;
    const int ntu = (it.n + 7) / 8;
    // The warp's activations: blocks warp, warp + FMOE_WARPS, ... of each k part, loaded from L2 once.
    FmoeAct av;
    {
      const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
      const int bps = gs.ks / 128;
      const int per_part = (bps + FMOE_WARPS - 1) / FMOE_WARPS;
#pragma unroll
      for (int sl = 0; sl < FMOE_SLOTS; ++sl) {
        const int kp = sl / per_part, i = sl - kp * per_part;
        const int qb = warp + FMOE_WARPS * i;
        av.kb[sl] = (kp < gs.nks && qb < min(bps, kblocks - kp * bps)) ? kp * bps + qb : -1;
        const int kb = av.kb[sl] < 0 ? 0 : av.kb[sl];
#pragma unroll
        for (int nt = 0; nt < FMOE_NT; ++nt) {
          const long long row = sm.act_row[nt * 8 + g];
#pragma unroll
          for (int qq = 0; qq < 4; ++qq)
            av.b[sl][qq][nt] =
                *reinterpret_cast<const uint4*>(act + row * K + kb * 128 + 32 * qq + 8 * t);
          av.s[sl][nt][0] = act_scales[(long long)sm.act_row[nt * 8 + 2 * t] * kblocks + kb];
          av.s[sl][nt][1] = act_scales[(long long)sm.act_row[nt * 8 + 2 * t + 1] * kblocks + kb];
        }
      }
    }
    float part[FMOE_NT][4];
#pragma unroll
    for (int nt = 0; nt < FMOE_NT; ++nt)
#pragma unroll
      for (int v = 0; v < 4; ++v) part[nt][v] = 0.0f;

#pragma unroll
    for (int s = 0; s < FMOE_STAGES - 1; ++s) {
      if (s < nstages) fmoe_load_stage<UP>(sm.ring + s * FMOE_STAGE_BYTES, it, gs, s, N, K);
      cp_async_commit();
    }
    for (int s = 0; s < nstages; ++s) {
      cp_async_wait<FMOE_STAGES - 2>();
      __syncthreads();  // stage s landed for every thread; stage s-1 is no longer read
      const int nx = s + FMOE_STAGES - 1;
      if (nx < nstages) fmoe_load_stage<UP>(sm.ring + (nx % FMOE_STAGES) * FMOE_STAGE_BYTES, it, gs, nx, N, K);
      cp_async_commit();
      const unsigned char* st = sm.ring + (s % FMOE_STAGES) * FMOE_STAGE_BYTES;
      if (it.fp4)
        fmoe_compute_stage<UP, true>(st, it, s, N, K, ntu, av, part);
      else
        fmoe_compute_stage<UP, false>(st, it, s, N, K, ntu, av, part);
      const int rg = s / gs.nks;
      if (s - rg * gs.nks == gs.nks - 1) {
        int row, tok;
        const float v = fmoe_reduce(sm, part, row, tok);
        if (UP) {
          // Rows 0-7 hold gate j = rg*8 + row, rows 8-15 the matching up values (8 lanes up).
          const float up = __shfl_down_sync(0xffffffffu, v, 8, 16);
          if (row < 8 && tok < it.n) {
            float gv = round_bf16(v), uv = round_bf16(up);
            if (limit > 0.0f) {
              gv = fminf(gv, limit);
              uv = fmoe_clamp_sym(uv, limit);
            }
            float h = fmoe_silu(gv) * uv;
            if (!it.shared) h = h * sm.w[tok];
            sm.h[(rg * 8 + row) * FMOE_TOKENS + tok] = round_bf16(h);
          }
        } else {
          const int grow = it.row0 + rg * FMOE_STAGE_ROWS + row;
          if (tok < it.n && grow < N) out_y[(long long)sm.out_row[tok] * N + grow] = f32_to_bf16(v);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring, red and h are complete
    if (UP) {
      // act_quant of h over the item's 128 j: thread (token tid / 16, j 8·(tid % 16) .. + 8).
      const int i = tid >> 4, j8 = (tid & 15) * 8;
      float hv[8];
      float m = 0.0f;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        hv[c] = i < FMOE_TOKENS ? sm.h[(j8 + c) * FMOE_TOKENS + i] : 0.0f;
        m = fmaxf(m, fabsf(hv[c]));
      }
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o, 16));
      if (i < it.n) {
        const float s = ue8m0_scale(fmaxf(m, 1e-4f), DSV4_E4M3_MAX);
        unsigned codes[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) codes[c] = e4m3_code_rn(fmoe_clamp_sym(hv[c] / s, DSV4_E4M3_MAX));
        const long long orow = sm.out_row[i];
        *reinterpret_cast<uint4*>(out_q + orow * N + it.row0 + j8) = e4m3x8_to_f16_mma_order(codes);
        if ((tid & 15) == 0) out_s[orow * (N / 128) + it.row0 / 128] = s;
      }
      __syncthreads();  // sm.h and the row tables are rewritten by the next item
    }
  }
}

// GEMM1 of every routed tile and of the shared expert (see fmoe_gemm). xq [T][D] e4m3 values as f16 in MMA
// order (fp8_mma.cuh) with their scales xs [T][D/128];
// w1/w3/s1/s3: device arrays of the local experts' addresses ([e_end - e_begin]); shared_* NULL when the
// layer has no shared expert. Requires D % 128 == 0, D <= FMOE_MAX_K, I % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_THREADS, 1)
    fmoe_up_kernel(const unsigned short* xq, const float* xs, int T, int D, int I, int k, const int* rows,
                   const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned long long* w1,
                   const unsigned long long* w3, const unsigned long long* s1, const unsigned long long* s3,
                   int fmt, const void* shared_w1, const void* shared_w3, const float* shared_s1,
                   const float* shared_s3, int shared_fmt, const float* route_w, float limit, unsigned short* hq,
                   float* hs) {
#define FMOE_UP_ARGS                                                                                         \
  xq, xs, T, D, I, k, rows, tiles, ntiles, e_begin, e_end, w1, w3, s1, s3, fmt, shared_w1, shared_w3, shared_s1, \
      shared_s3, shared_fmt, route_w, limit, hq, hs, nullptr
  if (D == 4096)
    fmoe_gemm<true, 4096>(FMOE_UP_ARGS);
  else
    fmoe_gemm<true, 0>(FMOE_UP_ARGS);
#undef FMOE_UP_ARGS
}

// GEMM2 (see fmoe_gemm): hq [T*k + T][I] (f16 MMA order) with hs -> y [T*k + T][D] bf16. Requires I % 128 == 0,
// I <= FMOE_MAX_K.
extern "C" __global__ void __launch_bounds__(FMOE_THREADS, 1)
    fmoe_down_kernel(const unsigned short* hq, const float* hs, int T, int I, int D, int k, const int* rows,
                     const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned long long* w2,
                     const unsigned long long* s2, int fmt, const void* shared_w2, const float* shared_s2,
                     int shared_fmt, unsigned short* y) {
#define FMOE_DOWN_ARGS                                                                                         \
  hq, hs, T, I, D, k, rows, tiles, ntiles, e_begin, e_end, w2, w2, s2, s2, fmt, shared_w2, shared_w2, shared_s2, \
      shared_s2, shared_fmt, nullptr, 0.0f, nullptr, nullptr, y
  if (I == 2048)
    fmoe_gemm<false, 2048>(FMOE_DOWN_ARGS);
  else
    fmoe_gemm<false, 0>(FMOE_DOWN_ARGS);
#undef FMOE_DOWN_ARGS
}
