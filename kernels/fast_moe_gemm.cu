// fast_moe_gemm kernel family: the fast set's grouped expert GEMMs on Hopper's FP8 tensor cores (wgmma),
// kernels/SPEC.md ## fast_moe_gemm.cu, ../shared/KERNELS.md §1-3.
//
// fmoe_up_kernel:   hq, hs = act_quant(bf16(silu(min(bf16(W1 x), L)) · clamp(bf16(W3 x), ±L) · w))
// fmoe_down_kernel: y = bf16(W2 hq)
//
// Work items. The plan (moe_plan_kernel, tile_rows = FMOE_TOKENS) lists (expert, start, count) tiles of at
// most FMOE_TOKENS routed assignments; the shared expert adds ceil(T / FMOE_TOKENS) tiles of consecutive
// tokens after them. Each tile is cut into row blocks of FMOE_ROWS = 256 weight rows: for up, FMOE_UP_J =
// 128 j as gate rows j.. then up rows j.. (so SwiGLU and the per-128 FP8 quantisation of h stay inside the
// block); for down, FMOE_DOWN_ROWS = 256 output rows. Blocks are persistent and take items blockIdx.x,
// + gridDim.x, ... in order; an item's outputs depend only on the item, so they are deterministic bit for
// bit whichever block computes them.
//
// The pipeline. A block streams its items' stages back to back through a ring of FMOE_STAGES shared-memory
// slots, filled with 16-byte cp.async by all threads (fmoe_load: addresses set up once per item), so the
// next item's first stages load while the current item finishes. A stage is 128 bytes of each of the 256
// weight rows in their stored layout (FP4: 256 k, two 128-blocks; FP8: 128 k), FP4's per-32 scales or
// FP8's block scales, and the item's FMOE_TOKENS activation rows over the same k (e4m3 codes, laid out as
// wgmma's K-major B operand: 16-byte core-matrix rows) with their per-128 scales.
//
// The math. Warpgroup w owns weight rows 64w .. 64w + 63 of the stage (one m64 wgmma tile). Per k32 step a
// thread loads its A fragment with ldmatrix (FP4) or 8-byte loads (FP8), re-encodes FP4 as e4m3 by the
// exact bit move (fp8_mma.cuh; the 2^-6 it leaves is folded into the scale) and issues
// wgmma.mma_async m64nNk32 e4m3 x e4m3 -> f32 (N = 8 or 16 tokens) with A from registers and the tokens
// from shared memory. Each step's product starts from zero and is added to the thread's f32 sums times the
// weight scale of its row and 32-block (promotion every k32: exact for the per-32 FP4 scales, and it keeps
// the tensor core's reduced-precision accumulation to one 32-term sum, ../shared/KERNELS.md §1); two step
// products alternate so one wgmma runs while the previous one is promoted. After each 128-block the sums
// are added times the tokens' activation scales.
//
// Activations are stored in "fragment order" (fp8_mma.cuh): within each 32 of K the codes are permuted so
// that the B rows a wgmma reads match the k of the A fragments the FP4 bit move produces.
#include "common.cuh"
#include "fp8_mma.cuh"

// FMOE_TOKENS, FMOE_WARPGROUPS, FMOE_STAGES, FMOE_UP_J, FMOE_DOWN_ROWS and FMOE_SMEM_BYTES come from
// dsv4_consts.cuh (src/cuda/kernels/fast_moe_gemm.rs).
#define FMOE_THREADS (FMOE_WARPGROUPS * 128)
#define FMOE_ROWS (FMOE_WARPGROUPS * 64)  // weight rows of an item (and of a stage)
// A stage holds FMOE_RB = 128 bytes of each of the item's 256 weight rows: 256 k of FP4 (two 128-blocks)
// or 128 k of FP8 (one). Row strides are padded so fragment loads hit distinct banks: FP4 rows
// (ldmatrix of 8 rows x 16 bytes) by 16 bytes, FP8 rows (8-byte loads) by 32.
#define FMOE_RB 128
#define FMOE_WS_FP4 144
#define FMOE_WS_FP8 160
#define FMOE_SLOT_W (FMOE_ROWS * FMOE_WS_FP8)
#define FMOE_SLOT_S (FMOE_ROWS * 8 * 4)        // FP4: 8 per-32 scales a row; FP8: the two 128x128 block scales
#define FMOE_SLOT_A (16 * FMOE_TOKENS * 16)    // activation codes: 16 k16 chunks x FMOE_TOKENS x 16 bytes
#define FMOE_SLOT_AS 128                       // activation scales: 2 blocks x FMOE_TOKENS floats
#define FMOE_SLOT (FMOE_SLOT_W + FMOE_SLOT_S + FMOE_SLOT_A + FMOE_SLOT_AS)
#define FMOE_SMEM_USED (FMOE_STAGES * FMOE_SLOT + 2 * FMOE_UP_J * FMOE_TOKENS * 4)
static_assert(FMOE_SMEM_USED <= FMOE_SMEM_BYTES, "fast_moe_gemm: shared memory layout exceeds FMOE_SMEM_BYTES");
static_assert(FMOE_TOKENS == 16, "fast_moe_gemm: the B operand layout assumes 16-token tiles");
static_assert(FMOE_ROWS == 2 * FMOE_UP_J && FMOE_ROWS == FMOE_DOWN_ROWS && FMOE_THREADS == 512,
              "fast_moe_gemm: the loader's thread mapping assumes 4 warpgroups and 256-row items");

// Rust's f32::clamp(v, -l, l): NaN stays NaN.
DSV4_INLINE float fmoe_clamp_sym(float v, float l) { return v < -l ? -l : (v > l ? l : v); }

// x · sigmoid(x) in f32 (IEEE expf and division: no fast math).
DSV4_INLINE float fmoe_silu(float x) { return x / (1.0f + expf(-x)); }

// One work item.
struct FmoeItem {
  bool skip;                // another rank's expert: nothing to load or compute (uniform over the block)
  bool shared;              // the shared expert's tile
  bool fp4;                 // FP4 (per-32 scales) or FP8 (128x128 scales)
  int n;                    // tokens (assignments) in the tile, 1..FMOE_TOKENS
  int start;                // first plan row (routed) or first token (shared)
  int row0;                 // first weight row of the block (up: first j)
  const unsigned char* wa;  // up: W1, down: W2
  const unsigned char* wb;  // up: W3, down: W2
  const float* sa;          // scales of wa / wb (FP4: [rows][K/32]; FP8: [rows/128][K/128])
  const float* sb;
};

// The kernels' common arguments.
struct FmoeArgs {
  const unsigned char* act;  // [rows][K] e4m3 codes in fragment order
  const float* act_s;        // [rows][K/128]
  int T, K, N, k;
  const int* rows;
  const int* tiles;
  int nrt;  // routed tiles (*ntiles)
  int e_begin, e_end;
  const unsigned long long *wa, *wb, *sa, *sb;
  int fmt;
  const void *shared_wa, *shared_wb;
  const float *shared_sa, *shared_sb;
  int shared_fmt;
};

DSV4_INLINE int fmoe_rblocks(bool up, int N) { return up ? N / FMOE_UP_J : (N + FMOE_DOWN_ROWS - 1) / FMOE_DOWN_ROWS; }

template <bool UP>
DSV4_INLINE FmoeItem fmoe_item(const FmoeArgs& a, int wi) {
  const int rb_n = fmoe_rblocks(UP, a.N);
  const int tile = wi / rb_n, rb = wi - tile * rb_n;
  FmoeItem it;
  it.skip = false;
  it.row0 = rb * (UP ? FMOE_UP_J : FMOE_DOWN_ROWS);
  if (tile < a.nrt) {
    const int e = a.tiles[3 * tile];
    it.skip = e < a.e_begin || e >= a.e_end;
    it.start = a.tiles[3 * tile + 1];
    it.n = a.tiles[3 * tile + 2];
    it.shared = false;
    it.fp4 = a.fmt == WFMT_FP4;
    // The address tables hold the local experts only (possibly none): read them for those.
    const int le = e - a.e_begin;
    it.wa = it.skip ? nullptr : reinterpret_cast<const unsigned char*>(a.wa[le]);
    it.wb = it.skip ? nullptr : reinterpret_cast<const unsigned char*>(a.wb[le]);
    it.sa = it.skip ? nullptr : reinterpret_cast<const float*>(a.sa[le]);
    it.sb = it.skip ? nullptr : reinterpret_cast<const float*>(a.sb[le]);
  } else {
    it.start = (tile - a.nrt) * FMOE_TOKENS;
    it.n = min(FMOE_TOKENS, a.T - it.start);
    it.shared = true;
    it.fp4 = a.shared_fmt == WFMT_FP4;
    it.wa = reinterpret_cast<const unsigned char*>(a.shared_wa);
    it.wb = reinterpret_cast<const unsigned char*>(a.shared_wb);
    it.sa = a.shared_sa;
    it.sb = a.shared_sb;
  }
  return it;
}

// Activation row of token column c (columns past n repeat column 0: computed, never stored). Up reads x
// rows (one per token), down reads h rows (one per (token, slot), the output row of the assignment).
template <bool UP>
DSV4_INLINE int fmoe_act_row(const FmoeArgs& a, const FmoeItem& it, int c) {
  const int i = c < it.n ? c : 0;
  if (it.shared) return UP ? it.start + i : a.T * a.k + it.start + i;
  const int r = a.rows[it.start + i];
  return UP ? r / a.k : r;
}

// Output row (of hq / y) of token column c < n.
DSV4_INLINE int fmoe_out_row(const FmoeArgs& a, const FmoeItem& it, int c) {
  return it.shared ? a.T * a.k + it.start + c : a.rows[it.start + c];
}

// Stages of an item: FP4 256 k each (the last one 128 when K % 256 == 128), FP8 128 k each.
DSV4_INLINE int fmoe_stages(bool fp4, int K) { return fp4 ? (K + 255) / 256 : K / 128; }

// 128-blocks of K in stage kb.
DSV4_INLINE int fmoe_stage_blocks(bool fp4, int K, int kb) { return fp4 ? min(2, K / 128 - 2 * kb) : 1; }

// What one thread loads for every stage of an item, set up once per item (stage kb adds kb's offsets).
// Thread tid copies:
// - weights: 16-byte chunk p = tid % 8 of stage rows r = tid / 8 + 64 i (i = 0..3); rows 0..127 come from
//   matrix A (up: W1 j = row0 + r; down: W2 row row0 + r), rows 128..255 from matrix B (up: W3 j = row0 +
//   r - 128; down: W2 row row0 + r, skipped past N);
// - FP4 scales: 16 bytes (4 per-32 scales) half tid % 2 of row tid / 2's 8; FP8 (threads 288, 289): the
//   128x128 block scale of rows 0..127 / 128..255;
// - tokens (tid < 256): k16 chunk tid / 16 of token column tid % 16; their scales (256 <= tid < 288):
//   block (tid - 256) / 16 of token column tid % 16.
struct FmoeLoad {
  const unsigned char* wa;  // row tid / 8 of matrix A's part, + 16 · (tid % 8)
  const unsigned char* wb;  // the same row of matrix B's part
  long long step64;         // 64 rows, in bytes
  const float* s;           // FP4: this thread's scale chunk at k 0; FP8: its block scale row (or NULL)
  const unsigned char* act; // token row + chunk offset at k 0
  const float* as;          // token scale row + block offset
  int nks;                  // stages of the item
  bool fp4, skip, b_valid;  // b_valid: rows 128..255 exist (down: row0 + 128 < N)
};

template <bool UP>
DSV4_INLINE FmoeLoad fmoe_load_setup(const FmoeArgs& a, const FmoeItem& it) {
  const int tid = threadIdx.x, K = a.K;
  FmoeLoad l;
  l.fp4 = it.fp4;
  l.skip = it.skip;
  l.nks = fmoe_stages(it.fp4, K);
  l.b_valid = UP || it.row0 + 128 < a.N;
  l.s = nullptr;
  l.act = nullptr;
  l.as = nullptr;
  if (it.skip) {  // nothing is loaded (fmoe_load)
    l.wa = l.wb = nullptr;
    l.step64 = 0;
    return l;
  }
  const long long rb = it.fp4 ? K / 2 : K;  // bytes of a stored row
  l.step64 = 64 * rb;
  const int r = tid >> 3, p = tid & 7;
  const int rowa = it.row0 + r, rowb = UP ? it.row0 + r : it.row0 + 128 + r;
  l.wa = it.wa + rowa * rb + 16 * p;
  l.wb = (UP ? it.wb : it.wa) + (long long)(l.b_valid ? rowb : rowa) * rb + 16 * p;
  if (it.fp4) {
    const int sr = tid >> 1;  // stage row of the scale chunk
    const float* base = (UP && sr >= 128) ? it.sb : it.sa;
    const int grow = UP ? it.row0 + (sr & 127) : it.row0 + sr;
    l.s = base + (long long)min(grow, a.N - 1) * (K / 32) + 4 * (tid & 1);
  } else if (tid == 288 || tid == 289) {
    const bool second = tid == 289;
    const float* base = (UP && second) ? it.sb : it.sa;
    const int grow = UP ? it.row0 : min(it.row0 + (second ? 128 : 0), a.N - 1);
    l.s = base + (long long)(grow / 128) * (K / 128);
  }
  if (tid < 288) {
    const long long row = fmoe_act_row<UP>(a, it, tid & (FMOE_TOKENS - 1));
    if (tid < 256)
      l.act = a.act + row * K + 16 * (tid >> 4);
    else
      l.as = a.act_s + row * (K / 128) + ((tid - 256) >> 4);
  }
  return l;
}

// Issues the cp.async loads of stage kb of the item `l` describes into the slot at shared-space address
// `st`.
DSV4_INLINE void fmoe_load(unsigned st, const FmoeLoad& l, int K, int kb) {
  if (l.skip) return;
  const int tid = threadIdx.x;
  const int blocks = fmoe_stage_blocks(l.fp4, K, kb);
  const unsigned ws = l.fp4 ? FMOE_WS_FP4 : FMOE_WS_FP8;
  const unsigned r = tid >> 3, p = tid & 7;
  // A half stage (FP4, K % 256 == 128) holds the first 64 bytes of each row.
  if (blocks == 2 || !l.fp4 || p < 4) {
    const long long off = (long long)kb * FMOE_RB;
    const unsigned dst = st + r * ws + 16 * p;
    cp_async_16(dst, l.wa + off);
    cp_async_16(dst + 64 * ws, l.wa + l.step64 + off);
    if (l.b_valid) {
      cp_async_16(dst + 128 * ws, l.wb + off);
      cp_async_16(dst + 192 * ws, l.wb + l.step64 + off);
    }
  }
  const unsigned sdst = st + FMOE_SLOT_W;
  if (l.fp4) {
    if ((tid & 1) < blocks && (l.b_valid || tid < 256)) cp_async_16(sdst + tid * 16, l.s + kb * 8);
  } else if (l.s != nullptr) {
    cp_async_4(sdst + (tid - 288) * 4, l.s + kb);
  }
  const int kbytes = l.fp4 ? 256 : 128;  // k of a full stage
  if (tid < 256) {
    if ((tid >> 4) < 8 * blocks)
      cp_async_16(st + FMOE_SLOT_W + FMOE_SLOT_S + (tid >> 4) * (FMOE_TOKENS * 16) + (tid & 15) * 16,
                  l.act + (long long)kb * kbytes);
  } else if (tid < 288) {
    const int b = (tid - 256) >> 4;
    if (b < blocks)
      cp_async_4(st + FMOE_SLOT_W + FMOE_SLOT_S + FMOE_SLOT_A + (tid - 256) * 4, l.as + kb * (kbytes / 128));
  }
}

// One m64nNk32 step: d = A · B (from zero), A = the thread's e4m3 fragment registers, B = 8·NT8 tokens at
// `desc`.
template <int NT8>
DSV4_INLINE void fmoe_wgmma(float (&d)[8], const unsigned (&a)[4], unsigned long long desc) {
  if (NT8 == 1) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1; }\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
  } else {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, "
        "1, 1; }\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
  }
}

// blk += d · (s0 for row g, s8 for row g + 8) over the thread's 4·NT8 values (layout: fmoe_gemm).
template <int NT8>
DSV4_INLINE void fmoe_promote(float (&blk)[8], const float (&d)[8], float s0, float s8) {
#pragma unroll
  for (int j = 0; j < NT8; ++j) {
    blk[4 * j + 0] = fmaf(d[4 * j + 0], s0, blk[4 * j + 0]);
    blk[4 * j + 1] = fmaf(d[4 * j + 1], s0, blk[4 * j + 1]);
    blk[4 * j + 2] = fmaf(d[4 * j + 2], s8, blk[4 * j + 2]);
    blk[4 * j + 3] = fmaf(d[4 * j + 3], s8, blk[4 * j + 3]);
  }
}

// The thread's A fragment of k32 step q of its warp's 16 rows (stage rows `r16` ..), e4m3 codes in the
// order fmoe's activations use. FP4: `frag` holds the ldmatrix words of steps q & ~1 and q | 1.
template <bool FP4>
DSV4_INLINE void fmoe_a_frag(const unsigned char* wrows, const unsigned (&frag)[4], int q, unsigned (&a)[4]) {
  if (FP4) {
    const int h = (q & 1) * 2;
    e2m1x8_to_e4m3_eo(frag[h], a[0], a[2]);      // row g: k 4t.. (even elements), 16 + 4t.. (odd)
    e2m1x8_to_e4m3_eo(frag[h + 1], a[1], a[3]);  // row g + 8
  } else {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const uint2 u0 = lds_u64(wrows + g * FMOE_WS_FP8 + 32 * q + 8 * t);
    const uint2 u8 = lds_u64(wrows + (g + 8) * FMOE_WS_FP8 + 32 * q + 8 * t);
    a[0] = __byte_perm(u0.x, u0.y, 0x6420);
    a[2] = __byte_perm(u0.x, u0.y, 0x7531);
    a[1] = __byte_perm(u8.x, u8.y, 0x6420);
    a[3] = __byte_perm(u8.x, u8.y, 0x7531);
  }
}

// acc += one 128-block of the stage (see the file comment). The thread is (warpgroup w, warp q of it,
// g, t); d[4j + c]: row 16q + g + 8·(c >> 1) of the warpgroup's tile, token 8j + 2t + (c & 1). `wrows`:
// the warp's 16 rows at the block's first byte; `lm`: this lane's ldmatrix address there (FP4);
// `s0`/`s8`: the per-32 multipliers of rows g, g + 8; `act`/`as`: the block's tokens and their scales.
template <bool FP4, int NT8>
DSV4_INLINE void fmoe_block(const unsigned char* wrows, unsigned lm, const float (&s0)[4], const float (&s8)[4],
                            const unsigned char* act, const float* as, float (&acc)[8]) {
  const int t = threadIdx.x & 3;
  // The descriptor's address field counts 16-byte units: the steps add constant offsets.
  const unsigned long long desc0 = wgmma_desc_noswizzle(act, FMOE_TOKENS * 16, 128);
  unsigned frag[4] = {0u, 0u, 0u, 0u};
  // The step products start from zero in the wgmma (scale-d = 0), but ptxas serialises wgmmas whose
  // accumulator registers hold no defined value, or live across the stage loop (C7511): defined here.
  float d[2][8];
#pragma unroll
  for (int v = 0; v < 8; ++v) d[0][v] = d[1][v] = 0.0f;
  float blk[8];
#pragma unroll
  for (int v = 0; v < 8; ++v) blk[v] = 0.0f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (FP4 && (q & 1) == 0) ldmatrix_x4(lm + 16 * q, frag);
    unsigned af[4];
    fmoe_a_frag<FP4>(wrows, frag, q, af);
    // Only the low word changes: its address field (bits 0-13) cannot carry into the LBO field, as shared
    // addresses stay below 256 KiB.
    const unsigned long long desc = ((unsigned long long)(unsigned)(desc0 >> 32) << 32) |
                                    ((unsigned)desc0 + (unsigned)(q * 2 * (FMOE_TOKENS * 16) / 16));
    wgmma_fence();
    fmoe_wgmma<NT8>(d[q & 1], af, desc);
    wgmma_commit();
    if (q > 0) {
      wgmma_wait<1>();  // step q - 1 is done
      wgmma_fence_operand(d[(q - 1) & 1]);
      fmoe_promote<NT8>(blk, d[(q - 1) & 1], s0[q - 1], s8[q - 1]);
    }
  }
  wgmma_wait<0>();
  wgmma_fence_operand(d[1]);
  fmoe_promote<NT8>(blk, d[1], s0[3], s8[3]);
  // Activation scales of the thread's tokens (FP4: times 2^6, the bit move's 2^-6).
  const float fold = FP4 ? 64.0f : 1.0f;
#pragma unroll
  for (int j = 0; j < NT8; ++j) {
    const float sa0 = as[8 * j + 2 * t] * fold, sa1 = as[8 * j + 2 * t + 1] * fold;
    acc[4 * j + 0] = fmaf(blk[4 * j + 0], sa0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(blk[4 * j + 1], sa1, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(blk[4 * j + 2], sa0, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(blk[4 * j + 3], sa1, acc[4 * j + 3]);
  }
}

// acc += stage kb of item `it` in slot `st` (its one or two 128-blocks).
template <bool FP4, int NT8>
DSV4_INLINE void fmoe_compute_stage(const unsigned char* st, int K, int kb, float (&acc)[8]) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2;
  const int r16 = (tid >> 5) * 16;  // the warp's first stage row
  constexpr int WS = FP4 ? FMOE_WS_FP4 : FMOE_WS_FP8;
  const unsigned char* wrows = st + r16 * WS;
  const unsigned char* act = st + FMOE_SLOT_W + FMOE_SLOT_S;
  const float* as = reinterpret_cast<const float*>(act + FMOE_SLOT_A);
  const float* sc = reinterpret_cast<const float*>(st + FMOE_SLOT_W);
  if (FP4) {
    // ldmatrix x4 of two k32 steps: lane L addresses row (L & 7) + 8·((L >> 3) & 1), 16-byte block L >> 4.
    const unsigned lm = smem_addr(wrows + ((lane & 7) + 8 * ((lane >> 3) & 1)) * FMOE_WS_FP4 + 16 * (lane >> 4));
    const int blocks = fmoe_stage_blocks(true, K, kb);
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      if (b < blocks) {
        float s0[4], s8[4];
        const float4 v0 = *reinterpret_cast<const float4*>(sc + (r16 + g) * 8 + 4 * b);
        const float4 v8 = *reinterpret_cast<const float4*>(sc + (r16 + g + 8) * 8 + 4 * b);
        s0[0] = v0.x, s0[1] = v0.y, s0[2] = v0.z, s0[3] = v0.w;
        s8[0] = v8.x, s8[1] = v8.y, s8[2] = v8.z, s8[3] = v8.w;
        fmoe_block<true, NT8>(wrows + 64 * b, lm + 64 * b, s0, s8, act + b * (8 * FMOE_TOKENS * 16),
                              as + b * FMOE_TOKENS, acc);
      }
    }
  } else {
    const float sw = sc[r16 >= 128 ? 1 : 0];  // the 128x128 block scale of the warp's rows
    const float s0[4] = {sw, sw, sw, sw};
    fmoe_block<false, NT8>(wrows, 0u, s0, s0, act, as, acc);
  }
}

DSV4_INLINE void fmoe_compute(const unsigned char* st, const FmoeItem& it, int K, int kb, float (&acc)[8]) {
  if (it.skip) return;
  const bool two = it.n > 8;  // uniform over the block
  if (it.fp4) {
    if (two)
      fmoe_compute_stage<true, 2>(st, K, kb, acc);
    else
      fmoe_compute_stage<true, 1>(st, K, kb, acc);
  } else {
    if (two)
      fmoe_compute_stage<false, 2>(st, K, kb, acc);
    else
      fmoe_compute_stage<false, 1>(st, K, kb, acc);
  }
}

// Up epilogue, part 1: the thread's bf16-rounded gate or up values into gv / uv [j][token].
DSV4_INLINE void fmoe_up_stash(const FmoeItem& it, const float (&acc)[8], float* gv, float* uv) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r = (tid >> 5) * 16 + g;  // stage row of d[0]
  float* dst = r < FMOE_UP_J ? gv : uv;
  const int j0 = r & (FMOE_UP_J - 1);
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int j = j0 + 8 * ((c >> 1) & 1), tok = 8 * (c >> 2) + 2 * t + (c & 1);
    dst[j * FMOE_TOKENS + tok] = round_bf16(acc[c]);
  }
}

// Up epilogue, part 2 (threads 0..255, after a barrier): h of token tid / 16, j 8·(tid % 16) .. + 7, its
// per-128 act_quant (amax over the 16 threads of the token) and the codes in fragment order.
DSV4_INLINE void fmoe_up_quant(const FmoeArgs& a, const FmoeItem& it, const float* gv, const float* uv,
                               const float* route_w, float limit, unsigned char* out_q, float* out_s) {
  const int tid = threadIdx.x;
  if (tid >= FMOE_TOKENS * 16) return;  // whole warps
  const int i = tid >> 4, c16 = tid & 15;
  const float wt = (!it.shared && route_w != nullptr && i < it.n) ? route_w[fmoe_out_row(a, it, i)] : 1.0f;
  float hv[8];
  float m = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int j = 8 * c16 + c;
    float gg = gv[j * FMOE_TOKENS + i], uu = uv[j * FMOE_TOKENS + i];
    if (limit > 0.0f) {
      gg = fminf(gg, limit);
      uu = fmoe_clamp_sym(uu, limit);
    }
    float h = fmoe_silu(gg) * uu;
    if (!it.shared) h = h * wt;
    hv[c] = round_bf16(h);
    m = fmaxf(m, fabsf(hv[c]));
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o, 16));
  if (i < it.n) {
    const float s = ue8m0_scale(fmaxf(m, 1e-4f), DSV4_E4M3_MAX);
    unsigned codes[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) codes[c] = e4m3_code_rn(fmoe_clamp_sym(hv[c] / s, DSV4_E4M3_MAX));
    const long long orow = fmoe_out_row(a, it, i);
    unsigned char* dst = out_q + orow * a.N + it.row0 + 32 * (c16 >> 2);
    store_fragment_order8(dst, c16 & 3, codes);
    if (c16 == 0) out_s[orow * (a.N / 128) + it.row0 / 128] = s;
  }
}

// Down epilogue: y[out row][weight row] = bf16(acc).
DSV4_INLINE void fmoe_down_store(const FmoeArgs& a, const FmoeItem& it, const float (&acc)[8], bf16_t* y) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r = it.row0 + (tid >> 5) * 16 + g;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int row = r + 8 * ((c >> 1) & 1), tok = 8 * (c >> 2) + 2 * t + (c & 1);
    if (tok < it.n && row < a.N) y[(long long)fmoe_out_row(a, it, tok) * a.N + row] = f32_to_bf16(acc[c]);
  }
}

// Shared body of both kernels. UP: K = D, weight rows j of W1/W3 (N = I of them), act = xq [T][D] with xs;
// out hq [T*k + T][I] codes in fragment order and hs [T*k + T][I/128]. DOWN: K = I, rows of W2 (N = D),
// act = hq with hs; out y [T*k + T][D] bf16.
template <bool UP>
DSV4_INLINE void fmoe_gemm(const FmoeArgs& a, const float* route_w, float limit, unsigned char* out_q, float* out_s,
                           bf16_t* out_y) {
  extern __shared__ __align__(128) unsigned char fmoe_smem[];
  float* gv = reinterpret_cast<float*>(fmoe_smem + FMOE_STAGES * FMOE_SLOT);
  float* uv = gv + FMOE_UP_J * FMOE_TOKENS;
  const int nsh = a.shared_wa != nullptr ? (a.T + FMOE_TOKENS - 1) / FMOE_TOKENS : 0;
  const int total = (a.nrt + nsh) * fmoe_rblocks(UP, a.N);
  const int my_items = blockIdx.x < total ? (total - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  // Two cursors walk this block's (item, stage) sequence: item blockIdx.x + n · gridDim.x, stage kb. The
  // load cursor runs FMOE_STAGES - 1 stages ahead of the compute cursor; both advance by increments and
  // set an item up once.
  int ln = 0, lkb = 0;
  FmoeLoad ld;
  if (my_items > 0) ld = fmoe_load_setup<UP>(a, fmoe_item<UP>(a, blockIdx.x));
  const unsigned ring = smem_addr(fmoe_smem);
  auto load_next = [&](unsigned st) {
    fmoe_load(st, ld, a.K, lkb);
    if (++lkb == ld.nks) {
      lkb = 0;
      if (++ln < my_items) ld = fmoe_load_setup<UP>(a, fmoe_item<UP>(a, blockIdx.x + ln * gridDim.x));
    }
  };
#pragma unroll
  for (int s = 0; s < FMOE_STAGES - 1; ++s) {
    if (ln < my_items) load_next(ring + s * FMOE_SLOT);
    cp_async_commit();
  }
  float acc[8];
  int slot = 0;
  for (int n = 0; n < my_items; ++n) {
    const FmoeItem it = fmoe_item<UP>(a, blockIdx.x + n * gridDim.x);
    const int nks = fmoe_stages(it.fp4, a.K);
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
    for (int kb = 0; kb < nks; ++kb) {
      cp_async_wait<FMOE_STAGES - 2>();
      // cp.async wrote with the generic proxy; wgmma reads with the async proxy.
      fence_proxy_async_shared();
      __syncthreads();  // this stage landed for every thread; the previous stage's slot is no longer read
      if (ln < my_items) load_next(ring + (slot == 0 ? FMOE_STAGES - 1 : slot - 1) * FMOE_SLOT);
      cp_async_commit();
      fmoe_compute(fmoe_smem + slot * FMOE_SLOT, it, a.K, kb, acc);
      slot = slot == FMOE_STAGES - 1 ? 0 : slot + 1;
    }
    if (!it.skip) {
      if (UP) {
        fmoe_up_stash(it, acc, gv, uv);
        __syncthreads();
        fmoe_up_quant(a, it, gv, uv, route_w, limit, out_q, out_s);
        // gv / uv are next written after at least one more stage barrier.
      } else {
        fmoe_down_store(a, it, acc, out_y);
      }
    }
  }
  cp_async_wait<0>();
}

// GEMM1 of every routed tile and of the shared expert (see fmoe_gemm). xq [T][D] e4m3 codes in fragment
// order (fp8_mma.cuh) with their scales xs [T][D/128]; w1/w3/s1/s3: device arrays of the local experts'
// addresses ([e_end - e_begin]); shared_* NULL when the layer has no shared expert. Requires D % 128 == 0,
// I % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_THREADS, 1)
    fmoe_up_kernel(const unsigned char* xq, const float* xs, int T, int D, int I, int k, const int* rows,
                   const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned long long* w1,
                   const unsigned long long* w3, const unsigned long long* s1, const unsigned long long* s3,
                   int fmt, const void* shared_w1, const void* shared_w3, const float* shared_s1,
                   const float* shared_s3, int shared_fmt, const float* route_w, float limit, unsigned char* hq,
                   float* hs) {
  const FmoeArgs a = {xq,  xs,        T,         D,         I,         k,         rows,       tiles, *ntiles,
                      e_begin, e_end, w1,        w3,        s1,        s3,        fmt,        shared_w1,
                      shared_w3, shared_s1, shared_s3, shared_fmt};
  fmoe_gemm<true>(a, route_w, limit, hq, hs, nullptr);
}

// GEMM2 (see fmoe_gemm): hq [T*k + T][I] (fragment order) with hs -> y [T*k + T][D] bf16. Requires
// I % 128 == 0, D % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_THREADS, 1)
    fmoe_down_kernel(const unsigned char* hq, const float* hs, int T, int I, int D, int k, const int* rows,
                     const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned long long* w2,
                     const unsigned long long* s2, int fmt, const void* shared_w2, const float* shared_s2,
                     int shared_fmt, unsigned short* y) {
  const FmoeArgs a = {hq,      hs,    T,  I,  D,  k,   rows,      tiles,     *ntiles,   e_begin, e_end,
                      w2,      w2,    s2, s2, fmt, shared_w2, shared_w2, shared_s2, shared_s2, shared_fmt};
  fmoe_gemm<false>(a, nullptr, 0.0f, nullptr, nullptr, y);
}
