// fast_indexer kernel family: see kernels/SPEC.md (fast_indexer.cu) and MODEL.md §6.4.
//
// The fast set's lightning indexer: `indexer_kernel`'s operation (scores of every visible
// indexer key, then the top min(topk, visible): larger first, ties to the lower entry index, NaN
// lowest) in two launches, or one (fi_select_stream_kernel).
// - fi_score_kernel: per (token, chunk of keys), all heads of the token against a chunk of its
//   keys on FP8 tensor cores (wgmma): queries and keys are official FP4 values (e2m1 x 2^k, exact
//   in e4m3), so the products are exact; each 32-block's sum is the tensor core's, promoted into
//   f32. d_h = bf16(q_h . k), score = bf16(sum_h relu(d_h) * w_h) (f32 sums over heads in a fixed
//   tree order). Writes the scores (BF16 values) to the workspace row. fi_score_tc_kernel: the same
//   with the sum over the heads on the BF16 tensor core (other rounding; selectable). fi_score_fold_kernel,
//   fi_score_fold_tc_kernel: the 32-block scales folded into the codes ("the scale fold" below): one chain of
//   wgmmas a key tile and no promotion; several chunks a block. The fast set runs fi_score_fold_tc_kernel.
//   fi_score_stream_kernel: fi_score_fold_tc_kernel's operation as a stream of whole pages into per-warpgroup
//   rings, the keys decoded into the wgmmas' A registers (its own section below; selectable, SelectPlan::streamed).
// - fi_topk_kernel: a cluster of blocks per token, exact selection on the scores: a 16-bit order
//   key per BF16 score, two 8-bit radix histograms (warp-aggregated shared atomics, added over the
//   cluster through distributed shared memory) find the k-th key; the keys above it and the
//   lowest-index keys equal to it are written in index order (block, warp and ballot counts: no
//   atomics decide anything). The reference lists them in rank order; the set is the same.
// - fi_select_stream_kernel: both in one launch, a cluster a token: the streamed scoring of contiguous runs of
//   tiles into each block's shared memory, then fi_topk_kernel's selection on them there (the scores do not go
//   to memory; selectable, SelectPlan::fused_topk).
#include "common.cuh"
#include "fp8_mma.cuh"
#include "kv_pages.cuh"

// FI_THREADS, FI_TILE_KEYS, FI_CHUNK_KEYS, FI_MAX_HEADS, FI_MAX_DIM, FI_TOPK_THREADS,
// FI_TOPK_CLUSTER, FI_FOLD_DIM (dsv4_consts.cuh).

// Grid (T, ceil(maxe / chunk_keys)), chunk_keys <= FI_CHUNK_KEYS (fewer keys a block where few
// tokens would leave SMs idle; whole tiles in practice), FI_THREADS = 128 threads: one warpgroup,
// whose m64 wgmma rows are a tile's keys (warp w: keys 16w .. 16w + 15 of the tile, thread (g, t):
// keys 16w + g and 16w + g + 8) and whose n64 columns are the heads (thread (g, t): heads 8j + 2t,
// 8j + 2t + 1, j < 8). HI <= FI_MAX_HEADS = 64, DI % 32 == 0 and <= FI_MAX_DIM (the wrapper
// checks). ikeys: official indexer-key pages (kv_pages.cuh) through itable. scores: [T][maxe],
// entries < visible of real tokens written.
//
// The products on FP8 tensor cores, exactly: official queries and keys are FP4 values (e2m1 x a
// power of two per 32 of the dims), and so is every product's pair of factors in e4m3. Both
// operands in shared memory, K-major, [DI / 16 chunks][row][16 bytes] (no swizzle: 8 rows of a
// chunk are one core matrix), even dims of each 32-block in chunk 2b and odd ones in 2b + 1.
// - A (a tile of FI_TILE_KEYS keys): the FP4 bit move of each key's codes (e4m3 of value x 2^-6)
//   and the key factor 2^6 x the key's block scale.
// - B (the token's queries, built once a block, heads past HI zero): head h's 32-block b as e4m3
//   codes of q / 2^e, e = floor(log2 amax) - 7 (amax of the block's 32 values: every value then
//   lies in [2^3, 2^8) with at most two significant bits, exact in e4m3), and the head factor 2^e.
// - Per 32-block, one wgmma m64n64k32 from zero, then acc += d x (head factor x key factor) (the
//   block's 32-term sum is the tensor core's; promoting each keeps its reduced-precision
//   accumulator to 32 terms, ../shared/KERNELS.md §1), two blocks' wgmmas a commit group.
// Then d_h = bf16(acc), score = bf16(sum_h relu(d_h) * w_h): the f32 head sum in a fixed order, each
// thread's 16 heads of a key in order (8j + 2t + e by j, then e), then its quad's four sums by two
// shuffles. A key's heads sit in one quad, so a warp scores its own 16 keys. (With the heads as the
// m64 rows, as before, each value took three shuffles and a key's sum crossed the 4 warps through
// shared memory and a second barrier a tile.)
// Shared memory (dynamic): K tile [DI / 16][FI_TILE_KEYS][16] bytes, Q [DI / 16][FI_MAX_HEADS][16]
// bytes, the chunk's keys as stored [FI_CHUNK_KEYS][DI / 32][16] code bytes, key factors [DI / 32]
// [FI_TILE_KEYS] f32, head factors [DI / 32][FI_MAX_HEADS] f32, the chunk's scale bytes
// [FI_CHUNK_KEYS][DI / 32].
// Memory latency: the whole chunk's keys are asked for at the start (block-table lookup, cp.async of
// the codes, the scale bytes' loads), and the queries' loads go out before any is used.
#define FI_BLOCKS (FI_MAX_DIM / 32)
#define FI_DECODE_TASKS (FI_TILE_KEYS * FI_BLOCKS / FI_THREADS)
// The keys a thread copies in a chunk's prologue, and the query items whose loads go out together.
#define FI_PRO_KEYS (FI_CHUNK_KEYS / FI_THREADS)
#define FI_Q_BATCH 8

// The scale fold (fi_score_fold_kernel, fi_score_fold_tc_kernel; head dim FI_FOLD_DIM = 128 only, Flash's and
// Pro's, compiled for it: the host runs the other kernels at other dims): each key's 32-block scales folded into
// its e4m3 codes and each query head's into its codes, so that a key's dot with a head is ONE chain of four
// wgmmas over all 128 dims (promoted at least every 128 of K, DESIGN.md §4) with no promotion at all: the two
// factors left are powers of two, and
//   bf16(raw x 2^(qe_h + ke)) = bf16(raw) x 2^(qe_h + ke),   relu(x 2^a) = relu(x) x 2^a
// while nothing leaves the normal range, so 2^qe_h goes into the head's weight and 2^ke multiplies the
// key's finished score: score = bf16(2^ke x sum_h relu(bf16(raw_h)) x (w_h 2^qe_h)).
// - A key folds when its blocks' UE8M0 exponents lie within FI_FOLD_SPAN of their largest E (fp4_table_shifted's
//   exact range, t = s - E + 12 in [1, 12]) and FI_FOLD_E_MIN <= E <= FI_FOLD_E_MAX: codes e2m1 x 2^(s - E + 6),
//   key factor 2^ke, ke = E - 133 in [-37, 27].
// - A head folds when every nonzero block's amax is within FI_FOLD_SPAN octaves of the head's (official FP4
//   blocks: the smallest nonzero value is at least amax / 12, so every value then keeps its two significant
//   bits above e4m3's 2^-9 at the head's e = floor(log2 amax) - 7), |qe_h| <= FI_FOLD_QE and its weight is 0 or
//   within 2^+-FI_FOLD_QE. The token's queries fold when all its heads do (one decision a block).
// With these ranges every value on the way is normal: |raw| in [2^-18, 2^25), |w 2^qe| in [2^-64, 2^64], the
// score in [2^-119, 2^122]. A 64-key tile whose keys do not all fold (or a token whose queries do not) takes
// the per-32-block promotion instead, with 2^qe_h still in the weights (its query factors are then 1).
#define FI_FOLD_BLOCKS (FI_FOLD_DIM / 32)  // FI_FOLD_DIM: dsv4_consts.cuh (fast_indexer::FOLD_DIM)
#define FI_FOLD_SPAN 11
#define FI_FOLD_E_MIN 96
#define FI_FOLD_E_MAX 160
#define FI_FOLD_QE 32

// One wgmma m64n64k32 e4m3 x e4m3 -> f32: d = A B^T (scale_d 0) or d += A B^T (A: the keys' tile, B: the
// queries', both shared-memory descriptors).
DSV4_INLINE void fi_wgmma_acc(float (&d)[32], unsigned long long adesc, unsigned long long bdesc, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1; }\n"
      : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24)
      : "l"(adesc), "l"(bdesc), "r"(scale_d));
}

// fi_chain in two chains of FI_FOLD_BLOCKS / 2 32-blocks (64 of K each) into d0 and d1, one commit and wait,
// then acc = d0 + d1 in f32 (fold_chains == 2: half the chain's accumulator error, 32 more adds a tile).
DSV4_INLINE void fi_chain_pair(float (&acc)[32], float (&d0)[32], float (&d1)[32], const unsigned char* kt,
                               const unsigned char* qt) {
  constexpr int HALF = FI_FOLD_BLOCKS / 2;
  wgmma_fence();
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b)
    fi_wgmma_acc(b < HALF ? d0 : d1, wgmma_desc_noswizzle(kt + 2 * b * FI_TILE_KEYS * 16, FI_TILE_KEYS * 16, 128),
                 wgmma_desc_noswizzle(qt + 2 * b * FI_MAX_HEADS * 16, FI_MAX_HEADS * 16, 128), b % HALF);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(d0);
  wgmma_fence_operand(d1);
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = __fadd_rn(d0[i], d1[i]);
}

// One wgmma m64n64k32 from zero: d = A B^T.
DSV4_INLINE void fi_wgmma(float (&d)[32], unsigned long long adesc, unsigned long long bdesc) {
  fi_wgmma_acc(d, adesc, bdesc, 0);
}

// acc = the tile's raw sums over all FI_FOLD_BLOCKS 32-blocks: one chain of wgmmas, one commit, one wait.
DSV4_INLINE void fi_chain(float (&acc)[32], const unsigned char* kt, const unsigned char* qt) {
  wgmma_fence();
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b)
    fi_wgmma_acc(acc, wgmma_desc_noswizzle(kt + 2 * b * FI_TILE_KEYS * 16, FI_TILE_KEYS * 16, 128),
                 wgmma_desc_noswizzle(qt + 2 * b * FI_MAX_HEADS * 16, FI_MAX_HEADS * 16, 128), b);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(acc);
}

// acc += d x (head factor x key factor) for the thread's values (layout: fi_score_kernel).
DSV4_INLINE void fi_promote(float (&acc)[32], const float (&d)[32], const float* qf, float k0, float k1) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 q = *reinterpret_cast<const float2*>(qf + 8 * j + 2 * t);
    acc[4 * j + 0] = fmaf(d[4 * j + 0], __fmul_rn(q.x, k0), acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(d[4 * j + 1], __fmul_rn(q.y, k0), acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(d[4 * j + 2], __fmul_rn(q.x, k1), acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(d[4 * j + 3], __fmul_rn(q.y, k1), acc[4 * j + 3]);
  }
}

// relu of two bf16 values (a word of bf16x2 codes): max with +0 on the packed pair, one instruction. A NaN
// becomes +0 (max without .NaN returns the other operand), as fmaxf(NaN, 0) did; -0 stays -0 or becomes
// +0, which adds the same to a sum that starts at +0.
DSV4_INLINE unsigned fi_relu_bf16x2(unsigned v) {
  unsigned r;
  asm("max.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(v), "r"(0u));
  return r;
}

// A key's factor 2^6 x its UE8M0 block scale 2^(s - 127), without branches: 2^(s - 121) (a normal f32 for
// s = 0 too), +inf from s = 249 (the product's overflow), NaN for s = 255 (e8m0_to_f32's NaN).
DSV4_INLINE float fi_key_factor(unsigned s) {
  const float f = s >= 249u ? DSV4_F32_INF : __uint_as_float((s + 6u) << 23);
  return s == 255u ? DSV4_F32_NAN : f;
}

// The factor a folding tile's finished score takes for its key of largest scale exponent E (in [FI_FOLD_E_MIN,
// FI_FOLD_E_MAX]): 2^ke = 2^(E - 133), a normal f32; 1 in a tile that does not fold.
DSV4_INLINE float fi_fold_factor(bool tile_fold, unsigned top) {
  return tile_fold ? __uint_as_float((top - 6u) << 23) : 1.0f;
}

// The e4m3 codes of 4 values (|v| < 448, exactly representable: see above) as one word, byte i = v[i]:
// the hardware conversion, two values an instruction (cvt's first source goes to the high byte). The
// values are exact, so any rounding gives the same codes as e4m3_code_rn, at a tenth of its
// instructions: at one tile a block, the queries' encoding was half of fi_score_kernel's.
DSV4_INLINE unsigned fi_e4m3x4(float v0, float v1, float v2, float v3) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(v1), "f"(v0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(v3), "f"(v2));
  return (unsigned)lo | ((unsigned)hi << 16);
}

// The largest |value| of a query 32-block held by a quad, 8 values a thread (v[0], v[1]: its dims 8c .. 8c + 7):
// the thread's, then the quad's by two shuffles (every lane of the warp takes part).
DSV4_INLINE float fi_quad_amax(const float4 (&v)[2]) {
  const float x[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) a = fmaxf(a, fabsf(x[j]));
  a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 1));
  return fmaxf(a, __shfl_xor_sync(0xffffffffu, a, 2));
}

// One head's part of the query fold rule (the scale fold's comment above): from the amax of its four 32-blocks
// (am[b]) and its weight w, the head's exponent qe = floor(log2 of its amax) - 7 (0 when all zero), and whether
// the head folds: every value finite, every nonzero block within FI_FOLD_SPAN octaves of the head's amax,
// |qe| <= FI_FOLD_QE, and w 0 or within 2^+-32.
DSV4_INLINE bool fi_head_folds(const float (&am)[FI_FOLD_BLOCKS], float w, int& qe) {
  int lb = -1000;  // floor(log2) of the head's amax (-1000: all zero)
  bool ok = true;
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b) {
    if (!(am[b] <= 3.0e38f)) ok = false;
    else if (am[b] > 0.0f) lb = max(lb, dsv4_floor_log2(am[b]));
  }
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b)
    if (am[b] > 0.0f && am[b] <= 3.0e38f && dsv4_floor_log2(am[b]) < lb - FI_FOLD_SPAN) ok = false;
  qe = lb == -1000 ? 0 : lb - 7;
  if (qe < -FI_FOLD_QE || qe > FI_FOLD_QE) ok = false;
  w = fabsf(w);
  if (!(w == 0.0f || (w >= 0x1p-32f && w <= 0x1p32f))) ok = false;
  return ok;
}

// The fold kernels' queries (the B operand) in the halves order of e2m1x8_to_e4m3_halves, which their keys'
// decode leaves: block b's dims 8c .. 8c + 3 (c < 4) in chunk 2b at bytes 4c .. 4c + 3, dims 8c + 4 .. 8c + 7 in
// chunk 2b + 1 (both operands permute K alike, so the products are the same). Returns, the same in every
// thread, whether the token's queries fold (the scale fold's comment above); then head h's codes are q / 2^qe_h,
// its block factors qf 1 and qexp[h] = qe_h, else as fi_score_kernel's: q / 2^e per (head, block), qf 2^e.
// Thread tid's FI_Q_BATCH = 2 FI_FOLD_BLOCKS items u (i = tid + FI_THREADS u, four threads a (head, block) pair as
// in fi_score) are blocks u / 2 of heads tid / 4 (u even) and tid / 4 + 32 (u odd): all blocks of its two heads.
DSV4_INLINE bool fi_queries_halves(const float* qi, const float* iw, int t, int HI, unsigned char* qt, float* qf,
                                   signed char* qexp) {
  static_assert(FI_Q_BATCH == 2 * FI_FOLD_BLOCKS, "one batch of items holds a thread's two heads");
  static_assert(FI_FOLD_BLOCKS == 4, "a head's four blocks are items p, p + 2, p + 4, p + 6");
  const int tid = threadIdx.x;
  float4 x[FI_Q_BATCH][2];
#pragma unroll
  for (int k = 0; k < FI_Q_BATCH; ++k) {
    const int i = tid + FI_THREADS * k, h = (i >> 2) % FI_MAX_HEADS, b = (i >> 2) / FI_MAX_HEADS;
    x[k][0] = x[k][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (h < HI) {
      const float* q = qi + ((long long)t * HI + h) * FI_FOLD_DIM + 32 * b + 8 * (i & 3);
      x[k][0] = *(const float4*)q;
      x[k][1] = *(const float4*)(q + 4);
    }
  }
  float am[FI_Q_BATCH];  // each item's block amax (its four threads')
#pragma unroll
  for (int k = 0; k < FI_Q_BATCH; ++k) am[k] = fi_quad_amax(x[k]);
  // Head p (tid / 4 + 32 p): items k = p, p + 2, ... hold its blocks 0, 1, ...
  int qe[2];
  bool ok = true;
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const int h = (tid >> 2) + 32 * p;
    const float ah[FI_FOLD_BLOCKS] = {am[p], am[p + 2], am[p + 4], am[p + 6]};
    if (!fi_head_folds(ah, h < HI ? iw[(long long)t * HI + h] : 0.0f, qe[p])) ok = false;
    if ((tid & 3) == 0) qexp[h] = (signed char)qe[p];  // read after the barrier below, when folding
  }
  const bool fold = !__syncthreads_or(!ok);
#pragma unroll
  for (int k = 0; k < FI_Q_BATCH; ++k) {
    const int i = tid + FI_THREADS * k, c4 = i & 3, h = (i >> 2) % FI_MAX_HEADS, b = (i >> 2) / FI_MAX_HEADS;
    const int e = fold ? qe[k & 1] : (am[k] > 0.0f && am[k] <= 3.0e38f ? dsv4_floor_log2(am[k]) - 7 : 0);
    const float inv = dsv4_pow2(-e);
    *(unsigned*)(qt + ((2 * b) * FI_MAX_HEADS + h) * 16 + 4 * c4) =
        fi_e4m3x4(x[k][0].x * inv, x[k][0].y * inv, x[k][0].z * inv, x[k][0].w * inv);
    *(unsigned*)(qt + ((2 * b + 1) * FI_MAX_HEADS + h) * 16 + 4 * c4) =
        fi_e4m3x4(x[k][1].x * inv, x[k][1].y * inv, x[k][1].z * inv, x[k][1].w * inv);
    if (c4 == 0) qf[b * FI_MAX_HEADS + h] = h < HI ? (fold ? 1.0f : dsv4_pow2(e)) : 0.0f;
  }
  return fold;
}

// The head sum on the BF16 tensor core (fi_score_tc_kernel): s[key][n] += A B over one k16 step of the heads,
// A = the relu'd bf16 d_h from registers (the m64n64 sums' fragment is the A fragment of m64nNk16: heads
// 16s + 2cq (+1) in a0 / a1, 16s + 8 + 2cq (+1) in a2 / a3, keys r0 / r0 + 8), B = the head weights in shared
// memory, K-major ([8 k-chunks of 8 heads][8 columns][16 bytes], no swizzle), column 0 the weights' bf16 high
// parts and column 1 their low parts (w = hi + lo within 2^-18 |w|), columns 2-7 zero. scale_d 0 starts from 0.
DSV4_INLINE void fi_wgmma_head_sum(float (&d)[4], const unsigned (&a)[4], unsigned long long bdesc, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %9, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0; }\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(scale_d));
}

// Bytes of the head-sum weights' B operand (fi_wgmma_head_sum): 64 heads x 8 columns of bf16.
#define FI_WB_BYTES (FI_MAX_HEADS * 8 * 2)

// The descriptors of the head sum's weights at `wb` (fi_wgmma_head_sum's B, 16-byte rows, core matrices 128 bytes
// apart) and of a tile's queries at `q` ([chunk][FI_MAX_HEADS rows][16 bytes], chunks FI_MAX_HEADS x 16 apart).
// Made once; a later operand at `bytes` past it is fi_desc_step's add to the address field (addresses >> 4 in
// 14 bits: shared memory stays below 256 KB, so the add never carries out of the field).
DSV4_INLINE unsigned long long fi_desc_wb(const unsigned char* wb) { return wgmma_desc_noswizzle(wb, 128, 128); }
DSV4_INLINE unsigned long long fi_desc_q(const unsigned char* q) {
  return wgmma_desc_noswizzle(q, FI_MAX_HEADS * 16, 128);
}
DSV4_INLINE unsigned long long fi_desc_step(unsigned long long desc, unsigned bytes) { return desc + (bytes >> 4); }

// hs = a tile's head sums on the tensor core, sum_h relu(bf16(d_h)) x (hi_h, lo_h): the relu'd d_h of `acc` (key
// rows, head columns: fi_score's layout) as the A fragments of four k16 steps over the heads, against the two
// weight columns at `wb` (its descriptor: fi_desc_wb); lane cq == 0 then holds both columns of keys r0 (hs[0],
// hs[1]) and r0 + 8 (hs[2], hs[3]).
DSV4_INLINE void fi_head_sum_tc(const float (&acc)[32], float (&hs)[4], unsigned long long wdesc) {
  unsigned a[4][4];
#pragma unroll
  for (int st = 0; st < 4; ++st)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int j = 2 * st + half;
      a[st][2 * half] = fi_relu_bf16x2(pack_bf16x2(acc[4 * j], acc[4 * j + 1]));
      a[st][2 * half + 1] = fi_relu_bf16x2(pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]));
    }
  wgmma_fence();
#pragma unroll
  for (int st = 0; st < 4; ++st) fi_wgmma_head_sum(hs, a[st], fi_desc_step(wdesc, st * 256), st);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(hs);
}

// The scoring kernels' body. TC_SUM: the head sum on the tensor core (fi_score_tc_kernel), else in f32 in a
// fixed order on the CUDA cores (fi_score_kernel). FOLD: the scale fold (see above; fi_score_fold_kernel,
// fi_score_fold_tc_kernel), both operands in the halves order, DI = FI_FOLD_DIM (a compile-time constant there:
// the loops over blocks and decode tasks unroll to exactly what 128 dims need).
template <bool TC_SUM, bool FOLD>
DSV4_INLINE void fi_score(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable, int ipps,
                          const int* positions, const int* seq_of, const int* seq_slots, int T, int HI, int DI,
                          int ratio, int maxe, int chunk_keys, int fold_chains, float* scores) {
  extern __shared__ __align__(128) unsigned char fi_smem[];
  // FOLD: the block scores chunks blockIdx.y, + gridDim.y, ... of its token (the queries made once), else
  // chunk blockIdx.y alone.
  const int t = blockIdx.x;
  int chunk = blockIdx.y;
  if (t >= T) return;
  const int slot = seq_slots[seq_of[t]];
  if (slot < 0) return;  // padding: nothing is scored (fi_topk_kernel selects nothing)
  int visible = (positions[t] + 1) / ratio;
  if (visible > maxe) visible = maxe;
  int e_begin = chunk * chunk_keys;
  if (e_begin >= visible) return;
  int e_end = e_begin + chunk_keys;
  if (e_end > visible) e_end = visible;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, cq = lane & 3;
  if (FOLD && DI != FI_FOLD_DIM) return;  // the host runs the fold kernels at FI_FOLD_DIM only
  const int nblk = FOLD ? FI_FOLD_BLOCKS : DI / 32;
  unsigned char* kt = fi_smem;                                    // [DI / 16][FI_TILE_KEYS][16]
  unsigned char* qt = kt + DI * FI_TILE_KEYS;                     // [DI / 16][FI_MAX_HEADS][16]
  unsigned char* raw = qt + DI * FI_MAX_HEADS;                    // [FI_CHUNK_KEYS][DI / 32][16]
  float* kf = (float*)(raw + FI_CHUNK_KEYS * DI / 2);             // [DI / 32][FI_TILE_KEYS]
  float* qf = kf + nblk * FI_TILE_KEYS;                           // [DI / 32][FI_MAX_HEADS]
  unsigned char* rsc = (unsigned char*)(qf + nblk * FI_MAX_HEADS);  // [FI_CHUNK_KEYS][DI / 32]
  unsigned char* wb = rsc + FI_CHUNK_KEYS * nblk;                   // TC_SUM: [8][8][16] (fi_wgmma_head_sum)
  // FOLD: each chunk key's largest scale exponent E, a flag per 32 chunk keys (some key does not fold) and
  // each head's qe.
  unsigned char* ktop = wb + (TC_SUM ? FI_WB_BYTES : 0);             // [FI_CHUNK_KEYS]
  unsigned char* bad32 = ktop + FI_CHUNK_KEYS;                       // [FI_CHUNK_KEYS / 32]
  signed char* qexp = (signed char*)(bad32 + 16);                    // [FI_MAX_HEADS]
  const KvRowFmt kf_fmt = kv_fmt_index(DI, 1);
  // i / nblk = (i x div_nblk) >> 16 for the decode tasks' i < FI_TILE_KEYS x nblk <= 512: with div_nblk =
  // ceil(2^16 / nblk) the product overshoots i / nblk by less than i / 2^16 < 1/128, less than the 1/nblk
  // that the fraction of i / nblk stays below 1 by. (A division in the tile loop was ~25 instructions a
  // task, three of them on the slow conversion and MUFU pipes.)
  const unsigned div_nblk = (65536u + nblk - 1) / nblk;

  // The chunk's keys as stored, all at once: thread tid looks up keys tid + FI_THREADS u (one block-table
  // lookup a key), copies their code bytes into shared memory by cp.async (16 bytes a 32-block) and loads
  // their scale bytes, all in flight while the queries are made below. (Loaded a tile ahead into
  // registers, as before, a block kept ~4 KB in flight and the kernel read 0.5 TB/s at 64K, T = 64.)
  int nkeys = e_end - e_begin;
  unsigned scv[FI_PRO_KEYS][FI_BLOCKS];
  auto load_chunk = [&]() {
#pragma unroll
    for (int u = 0; u < FI_PRO_KEYS; ++u) {
      const int j = tid + FI_THREADS * u;
      if (j < nkeys) {
        const KvRowPtr p = kv_row(kf_fmt, ikeys, itable, ipps, slot, e_begin + j);
#pragma unroll
        for (int b = 0; b < FI_BLOCKS; ++b)
          if (b < nblk) {
            cp_async_16(smem_addr(raw + 16 * (j * nblk + b)), p.row + 16 * b);
            scv[u][b] = p.sc[b];
          }
      }
    }
    cp_async_commit();
  };
  load_chunk();
  bool fold_q = false;  // FOLD: the token's queries fold (the same in every thread)
  if constexpr (FOLD) {
    fold_q = fi_queries_halves(qi, iw, t, HI, qt, qf, qexp);
  } else {
    // B: the queries, four threads a (head, 32-block) pair: thread c4 has the block's dims 8 c4 .. 8 c4 + 7,
    // whose even ones are codes 4 c4 .. 4 c4 + 3 of chunk 2b and odd ones of chunk 2b + 1. Item u of the
    // thread is i = tid + FI_THREADS u (u < 2 nblk): its loads go out FI_Q_BATCH items at a time, all before
    // any is used.
#pragma unroll
    for (int u0 = 0; u0 < 2 * FI_BLOCKS; u0 += FI_Q_BATCH) {
      float4 x[FI_Q_BATCH][2];
#pragma unroll
      for (int k = 0; k < FI_Q_BATCH; ++k) {
        const int i = tid + FI_THREADS * (u0 + k), h = (i >> 2) % FI_MAX_HEADS, b = (i >> 2) / FI_MAX_HEADS;
        x[k][0] = x[k][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (u0 + k < 2 * nblk && h < HI) {
          const float* q = qi + ((long long)t * HI + h) * DI + 32 * b + 8 * (i & 3);
          x[k][0] = *(const float4*)q;
          x[k][1] = *(const float4*)(q + 4);
        }
      }
#pragma unroll
      for (int k = 0; k < FI_Q_BATCH; ++k) {
        if (u0 + k < 2 * nblk) {  // uniform
          const int i = tid + FI_THREADS * (u0 + k), c4 = i & 3, h = (i >> 2) % FI_MAX_HEADS, b = (i >> 2) / FI_MAX_HEADS;
          const float v[8] = {x[k][0].x, x[k][0].y, x[k][0].z, x[k][0].w, x[k][1].x, x[k][1].y, x[k][1].z, x[k][1].w};
          float amax = 0.0f;
#pragma unroll
          for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(v[j]));
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the 4 threads of the pair
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
          const int e = amax > 0.0f && amax <= 3.0e38f ? dsv4_floor_log2(amax) - 7 : 0;
          const float inv = dsv4_pow2(-e);
          *(unsigned*)(qt + ((2 * b) * FI_MAX_HEADS + h) * 16 + 4 * c4) =
              fi_e4m3x4(v[0] * inv, v[2] * inv, v[4] * inv, v[6] * inv);
          *(unsigned*)(qt + ((2 * b + 1) * FI_MAX_HEADS + h) * 16 + 4 * c4) =
              fi_e4m3x4(v[1] * inv, v[3] * inv, v[5] * inv, v[7] * inv);
          if (c4 == 0) qf[b * FI_MAX_HEADS + h] = h < HI ? dsv4_pow2(e) : 0.0f;
        }
      }
    }
  }
  // The chunk's scale bytes into shared memory (and FOLD: its keys' E and flags).
  auto store_chunk_scales = [&]() {
#pragma unroll
    for (int u = 0; u < FI_PRO_KEYS; ++u) {
      const int j = tid + FI_THREADS * u;
#pragma unroll
      for (int b = 0; b < FI_BLOCKS; ++b)
        if (j < nkeys && b < nblk) rsc[j * nblk + b] = (unsigned char)scv[u][b];
    }
    if constexpr (FOLD) {
      // Each chunk key's E (133 past the keys: factor 1, codes zero) and, per 32 keys (a warp's, by one ballot),
      // whether one of them does not fold; read after the first tile's barrier.
#pragma unroll
      for (int u = 0; u < FI_PRO_KEYS; ++u) {
        const int j = tid + FI_THREADS * u;
        unsigned top = 133u;
        bool bad = false;
        if (j < nkeys) {
          unsigned lo = 255u;
          top = 0u;
#pragma unroll
          for (int b = 0; b < FI_BLOCKS; ++b)
            if (b < nblk) {
              top = max(top, scv[u][b]);
              lo = min(lo, scv[u][b]);
            }
          bad = top - lo > FI_FOLD_SPAN || top < FI_FOLD_E_MIN || top > FI_FOLD_E_MAX;
        }
        ktop[j] = (unsigned char)top;
        const unsigned any = __ballot_sync(0xffffffffu, bad);
        if (lane == 0) bad32[j >> 5] = any != 0u;
      }
    }
  };
  store_chunk_scales();
  // The thread's heads' weights: wv[2j + e] for head 8j + 2cq + e (0 past HI). TC_SUM: the weights as the
  // head sum's B operand instead, thread h < 64 writing head h's column entries (hi = bf16(w), lo =
  // bf16(w - hi); the first tile's fence and barrier make them visible to the wgmmas).
  float wv[16];
  if constexpr (TC_SUM) {
    if (tid < FI_MAX_HEADS) {
      float w = tid < HI ? iw[(long long)t * HI + tid] : 0.0f;
      if (FOLD && fold_q) w = __fmul_rn(w, dsv4_pow2(qexp[tid]));  // exact: w 2^qe_h stays normal
      const unsigned short hi = f32_to_bf16(w);
      const unsigned short lo = f32_to_bf16(__fsub_rn(w, bf16_to_f32(hi)));
      unsigned short* col = (unsigned short*)(wb + (tid >> 3) * 128 + (tid & 7) * 2);
#pragma unroll
      for (int n = 0; n < 8; ++n) col[n * 8] = n == 0 ? hi : (n == 1 ? lo : (unsigned short)0);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int h = 8 * j + 2 * cq + e;
        wv[2 * j + e] = h < HI ? iw[(long long)t * HI + h] : 0.0f;
        if (FOLD && fold_q) wv[2 * j + e] = __fmul_rn(wv[2 * j + e], dsv4_pow2(qexp[h]));
      }
  }

  cp_async_wait_all();  // this thread's copies; the first tile's barrier makes everyone's visible

  // Two accumulator sets for a round's two 32-blocks' products: defined once, so ptxas keeps the wgmmas
  // asynchronous (C7511); the wgmmas start from zero (scale-d 0).
  float d[2][32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[0][i] = d[1][i] = 0.0f;
  float hs[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // TC_SUM's head sums (defined once: C7511)
  const int r0 = 16 * warp + g;  // the thread's keys r0 and r0 + 8 of the tile
  for (;;) {  // the block's chunks (one unless FOLD)
  for (int e0 = e_begin; e0 < e_end; e0 += FI_TILE_KEYS) {
    __syncthreads();  // the previous tile's K consumed
    // FOLD: whether this tile's keys and the token's queries all fold (the same in every thread: the flags are
    // shared memory, written before the first barrier). Tiles start at multiples of FI_TILE_KEYS (the host
    // keeps chunk_keys one), so a key's scores do not depend on the work split.
    bool tile_fold = false;
    if constexpr (FOLD)
      tile_fold = fold_q && *(const unsigned short*)(bad32 + 2 * ((e0 - e_begin) / FI_TILE_KEYS)) == 0;
    // Keys e0 .. e0 + FI_TILE_KEYS - 1 (past e_end: zero codes and factors), a thread FI_DECODE_TASKS
    // (key row, 32-block) tasks: 16 code bytes (32 nibbles, low = even channel) and one scale byte.
    // Every task's loads first: the compiler cannot move a shared-memory load above a store to another
    // shared array (they might alias), so loads after the first task's stores waited for them.
    // (FOLD: 128 dims, exactly two tasks a thread.)
    constexpr int TASKS = FOLD ? FI_TILE_KEYS * FI_FOLD_BLOCKS / FI_THREADS : FI_DECODE_TASKS;
    uint4 code[TASKS];
    unsigned scale[TASKS], top[TASKS];
#pragma unroll
    for (int u = 0; u < TASKS; ++u) {
      const int i = tid + FI_THREADS * u, r = (int)(((unsigned)i * div_nblk) >> 16), b = i - r * nblk;
      const bool in = i < FI_TILE_KEYS * nblk && e0 + r < e_end;
      const int at = (e0 - e_begin + r) * nblk + b;
      code[u] = in ? *(const uint4*)(raw + 16 * at) : make_uint4(0u, 0u, 0u, 0u);
      scale[u] = in ? rsc[at] : 0u;
      if constexpr (FOLD) top[u] = in && tile_fold ? ktop[e0 - e_begin + r] : 12u;
    }
#pragma unroll
    for (int u = 0; u < TASKS; ++u) {
      const int i = tid + FI_THREADS * u, r = (int)(((unsigned)i * div_nblk) >> 16), b = i - r * nblk;
      if (FOLD && i < FI_TILE_KEYS * nblk) {
        // The halves order; a folding tile's codes are e2m1 x 2^(s - E + 6) (t = s - E + 12 in [1, 12]; zero
        // codes past e_end decode to zero with any table), the others' the plain bit move with their factors.
        const Fp4Table tab = tile_fold ? fp4_table_shifted(scale[u] + 12u - top[u]) : fp4_table_plain();
        const unsigned w[4] = {code[u].x, code[u].y, code[u].z, code[u].w};
        unsigned a0[4], a2[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) e2m1x8_to_e4m3_halves(w[k], tab, a0[k], a2[k]);
        *(uint4*)(kt + ((2 * b) * FI_TILE_KEYS + r) * 16) = make_uint4(a0[0], a0[1], a0[2], a0[3]);
        *(uint4*)(kt + ((2 * b + 1) * FI_TILE_KEYS + r) * 16) = make_uint4(a2[0], a2[1], a2[2], a2[3]);
        if (!tile_fold) kf[b * FI_TILE_KEYS + r] = e0 + r < e_end ? fi_key_factor(scale[u]) : 0.0f;
      } else if (i < FI_TILE_KEYS * nblk) {
        const unsigned w[4] = {code[u].x, code[u].y, code[u].z, code[u].w};
        unsigned ev[4], od[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) e2m1x8_to_e4m3_eo(w[k], ev[k], od[k]);
        *(uint4*)(kt + ((2 * b) * FI_TILE_KEYS + r) * 16) = make_uint4(ev[0], ev[1], ev[2], ev[3]);
        *(uint4*)(kt + ((2 * b + 1) * FI_TILE_KEYS + r) * 16) = make_uint4(od[0], od[1], od[2], od[3]);
        kf[b * FI_TILE_KEYS + r] = e0 + r < e_end ? fi_key_factor(scale[u]) : 0.0f;
      }
    }
    fence_proxy_async_shared();  // the tile's codes (and, the first time, the queries), for the wgmmas
    __syncthreads();

    // acc[4j + c]: key r0 + 8 (c >> 1) of the tile, head 8j + 2cq + (c & 1).
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    auto issue = [&](int b, float(&db)[32]) {
      fi_wgmma(db, wgmma_desc_noswizzle(kt + 2 * b * FI_TILE_KEYS * 16, FI_TILE_KEYS * 16, 128),
               wgmma_desc_noswizzle(qt + 2 * b * FI_MAX_HEADS * 16, FI_MAX_HEADS * 16, 128));
    };
    // Two 32-blocks a round: both wgmmas in one commit group, one wait, then both promoted in block order.
    // (Waiting for block b in the round that issues b + 1 would put a wgmma's wait in a later round than
    // its commit, and ptxas then serialises every wgmma: C7514.)
    if (FOLD && tile_fold) {  // the raw sums; no promotion
      if (fold_chains == 2)
        fi_chain_pair(acc, d[0], d[1], kt, qt);
      else
        fi_chain(acc, kt, qt);
    }
#pragma unroll
    for (int b = 0; b < FI_BLOCKS; b += 2) {
      if (!(FOLD && tile_fold) && b < nblk) {  // uniform
        const bool two = b + 1 < nblk;
        wgmma_fence();
        issue(b, d[0]);
        issue(b + 1, d[1]);  // past DI when nblk is odd: reads what follows K and Q in shared memory, unused
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(d[0]);
        wgmma_fence_operand(d[1]);
        fi_promote(acc, d[0], qf + b * FI_MAX_HEADS, kf[b * FI_TILE_KEYS + r0], kf[b * FI_TILE_KEYS + r0 + 8]);
        if (two)
          fi_promote(acc, d[1], qf + (b + 1) * FI_MAX_HEADS, kf[(b + 1) * FI_TILE_KEYS + r0],
                     kf[(b + 1) * FI_TILE_KEYS + r0 + 8]);
      }
    }
    if constexpr (TC_SUM) {
      // score = bf16(sum_h relu(bf16(d_h)) * (hi_h + lo_h)), the sum on the tensor core (fi_head_sum_tc).
      fi_head_sum_tc(acc, hs, fi_desc_wb(wb));
      if (cq == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int e = e0 + r0 + 8 * r;
          if (e < e_end) {
            float v = __fadd_rn(hs[2 * r], hs[2 * r + 1]);
            if constexpr (FOLD) {
              scores[(long long)t * maxe + e] = round_bf16_nonnan(__fmul_rn(v, fi_fold_factor(tile_fold, ktop[e - e_begin])));
            } else {
              scores[(long long)t * maxe + e] = round_bf16(v);
            }
          }
        }
      }
      continue;
    }
    // score = bf16(sum_h relu(bf16(d_h)) * w_h) of keys r0 (sk[0]) and r0 + 8 (sk[1]): the thread's 16
    // heads in order, then the quad's four partial sums (the same bits in each of its lanes). Two heads'
    // d_h are rounded by one cvt and their relu is one packed max (fi_relu_bf16x2): a NaN d_h (from a NaN
    // scale) is 0 after it however it was rounded.
    float sk[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int k = 0; k < 2; ++k) {  // key r0 + 8k: heads 8j + 2cq (low half) and 8j + 2cq + 1 (high half)
        const unsigned d2 = fi_relu_bf16x2(pack_bf16x2(acc[4 * j + 2 * k], acc[4 * j + 2 * k + 1]));
        sk[k] = __fadd_rn(sk[k], __fmul_rn(__uint_as_float(d2 << 16), wv[2 * j]));
        sk[k] = __fadd_rn(sk[k], __fmul_rn(__uint_as_float(d2 & 0xffff0000u), wv[2 * j + 1]));
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      sk[r] = __fadd_rn(sk[r], __shfl_xor_sync(0xffffffffu, sk[r], 1));
      sk[r] = __fadd_rn(sk[r], __shfl_xor_sync(0xffffffffu, sk[r], 2));
      const int e = e0 + r0 + 8 * r;
      if (cq == r && e < e_end) {
        if constexpr (FOLD) {
          scores[(long long)t * maxe + e] = round_bf16_nonnan(__fmul_rn(sk[r], fi_fold_factor(tile_fold, ktop[e - e_begin])));
        } else {
          scores[(long long)t * maxe + e] = round_bf16(sk[r]);
        }
      }
    }
  }
    if constexpr (!FOLD) {
      break;
    } else {
      // The next chunk: its keys' copies go out, then (every thread past the last tile's scores, which read
      // ktop) its scales and flags replace the last chunk's.
      chunk += gridDim.y;
      e_begin = chunk * chunk_keys;
      if (e_begin >= visible) break;  // uniform
      e_end = min(e_begin + chunk_keys, visible);
      nkeys = e_end - e_begin;
      load_chunk();
      __syncthreads();
      store_chunk_scales();
      cp_async_wait_all();
    }
  }
}

// Four blocks an SM (128 registers): with 148 the prologue's loads left room for three.
extern "C" __global__ void __launch_bounds__(FI_THREADS, 4)
    fi_score_kernel(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable, int ipps,
                    const int* positions, const int* seq_of, const int* seq_slots, int T, int HI, int DI, int ratio,
                    int maxe, int chunk_keys, float* scores) {
  dsv4_pdl_begin();
  fi_score<false, false>(qi, iw, ikeys, itable, ipps, positions, seq_of, seq_slots, T, HI, DI, ratio, maxe, chunk_keys,
                         1, scores);
}

// fi_score_kernel with the head sum on the BF16 tensor core (fi_wgmma_head_sum): from the first conversion to
// the scores' stores, 119 instructions a thread and tile of 64 keys (SASS; 16 F2FP, 16 packed max, four
// wgmmas, ~30 of them on the uniform datapath for the descriptors) where the f32 sum takes 184 (36 FADD, 32
// FMUL, the unpacking), in a kernel whose issue slots bound it (BENCHMARKS.md, issue 12 seventeenth part). The
// sum's order and rounding are the tensor core's and w is split into two bf16 columns, so the scores are not
// fi_score_kernel's bits; tests/gpu_fast_indexer.rs states the bound for both. FI_WB_BYTES more dynamic
// shared memory.
extern "C" __global__ void __launch_bounds__(FI_THREADS, 4)
    fi_score_tc_kernel(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable, int ipps,
                       const int* positions, const int* seq_of, const int* seq_slots, int T, int HI, int DI,
                       int ratio, int maxe, int chunk_keys, float* scores) {
  dsv4_pdl_begin();
  fi_score<true, false>(qi, iw, ikeys, itable, ipps, positions, seq_of, seq_slots, T, HI, DI, ratio, maxe, chunk_keys,
                        1, scores);
}

// fi_score_kernel with the scale fold (see above): one chain of wgmmas a tile and no promotion where the keys and
// queries fold, the per-block promotion elsewhere. Scores within the fold's bound (tests/gpu_fast_indexer.rs),
// not fi_score_kernel's bits. fold_chains: 1 (one chain of the four 32-blocks) or 2 (fi_chain_pair). Selectable
// (SelectPlan::fold); fi_score_fold_tc_kernel with one chain is the fast set's (fast_indexer.rs fast_plan).
extern "C" __global__ void __launch_bounds__(FI_THREADS, 4)
    fi_score_fold_kernel(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable, int ipps,
                         const int* positions, const int* seq_of, const int* seq_slots, int T, int HI, int DI,
                         int ratio, int maxe, int chunk_keys, int fold_chains, float* scores) {
  dsv4_pdl_begin();
  fi_score<false, true>(qi, iw, ikeys, itable, ipps, positions, seq_of, seq_slots, T, HI, DI, ratio, maxe,
                        chunk_keys, fold_chains, scores);
}

// The scale fold with the head sum on the tensor core.
extern "C" __global__ void __launch_bounds__(FI_THREADS, 4)
    fi_score_fold_tc_kernel(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable,
                            int ipps, const int* positions, const int* seq_of, const int* seq_slots, int T, int HI,
                            int DI, int ratio, int maxe, int chunk_keys, int fold_chains, float* scores) {
  dsv4_pdl_begin();
  fi_score<true, true>(qi, iw, ikeys, itable, ipps, positions, seq_of, seq_slots, T, HI, DI, ratio, maxe,
                       chunk_keys, fold_chains, scores);
}

// ---------------------------------------------------------------------------------------------------------
// A score's 16-bit order key (fi_topk_kernel's section below), which the fused kernel stages.
DSV4_INLINE unsigned fi_key16(float v);

// fi_score_stream_kernel: the scale fold with the tensor-core head sum (fi_score_fold_tc_kernel's operation) as a
// stream of whole key pages through a ring, the keys decoded straight into the wgmmas' A registers.
//
// Why. fi_score_fold_tc_kernel's tile is a chain within one warpgroup: decode the keys into shared memory, fence,
// block barrier, wgmmas, head sum, stores; its chunk's keys are copied in one batch when the chunk starts and
// waited for there, so a block's HBM reads and its tensor-core work take turns, and only the four blocks an SM
// overlap them (64K context, 64 tokens: 79 us against a 17 us floor, BENCHMARKS.md). Here:
// - a 64-key tile is exactly one page (FI_TILE_KEYS == KV_PAGE; tiles start at multiples of 64), so a tile is ONE
//   bulk copy of the page as stored (its 64 rows of code bytes, then their scale records) into a ring slot,
//   completing on the slot's mbarrier;
// - FI_STREAM_WGS warpgroups take the block's tiles in turn (warpgroup c: the block's tiles c, c + WGS, ...), each
//   with its own FI_STREAM_SLOTS / WGS slots, kept FI_STREAM_SLOTS / WGS - 1 tiles ahead by its first thread;
// - each thread loads its two key rows' 16 code bytes (one 16-byte load a row, no bank conflict) and scale
//   records, decodes them in registers into the A fragments of the four m64n64k32 wgmmas: no shared-memory copy
//   of the decoded keys, no fence, no block barrier in the loop;
// - the token's queries are encoded once a block (both k orders below), while the first pages arrive.
// Tiles are interleaved over a token's blocks (block y: tiles y, y + gridDim.y, ...); a tile's scores depend only
// on the tile, so the grid does not change them.
//
// The k order. A thread's 16-byte load of row r holds the row's 32-block cq (its quad lane) as four words; word s
// is the thread's part of wgmma step s: step s sums dims 32 cq' + 8 s .. 32 cq' + 8 s + 7 over the quad's lanes
// cq', a0 / a2 the low / high four of them (e2m1x8_to_e4m3_halves). The queries' B operand in this "A order" puts
// dims 32 y + 8 x + i (i < 4) in chunk 2x at bytes 4y + i, dims 32 y + 8 x + 4 + i in chunk 2x + 1. The products
// are those of fi_score_fold_tc_kernel's chain, grouped into other k32 steps, so the tensor core's sums may round
// otherwise: the same bound (tests/gpu_fast_indexer.rs, ScaleFold::Chain128), not the same bits.
// A tile that does not fold (a key's scales too far apart or out of range, or the token's queries; decided by a
// warpgroup-wide vote, bar.red.or) takes the per-32-block promotion, whose steps must each lie in one 32-block:
// its threads load word 4b + cq of each row for step b (four 4-byte loads a row) against the queries in the tiled
// kernels' "B order" (fi_queries_halves's).
//
// Shared memory: the ring of FI_STREAM_SLOTS pages, the queries in the A order and in the B order, the block
// factors qf [4][64] (B-order tiles), the head sum's weights, one mbarrier a slot.
#define FI_S_CODES (KV_PAGE * FI_FOLD_DIM / 2)  // a page's code bytes (64 a key)
#define FI_S_PAGE (KV_PAGE * (FI_FOLD_DIM / 2 + FI_FOLD_BLOCKS))  // the page as stored: codes, then scale records
#define FI_S_Q (FI_FOLD_DIM * FI_MAX_HEADS)
#define FI_S_QA (FI_STREAM_SLOTS * FI_S_PAGE)
#define FI_S_QB (FI_S_QA + FI_S_Q)
#define FI_S_QF (FI_S_QB + FI_S_Q)
#define FI_S_WB (FI_S_QF + 4 * FI_FOLD_BLOCKS * FI_MAX_HEADS)
#define FI_S_BARS (FI_S_WB + FI_WB_BYTES)
#define FI_S_BYTES (FI_S_BARS + 8 * FI_STREAM_SLOTS)
#define FI_S_WG_SLOTS (FI_STREAM_SLOTS / FI_STREAM_WGS)  // a warpgroup's ring
#define FI_S_BAR_WG 1  // named barrier 1 + c: warpgroup c's fold vote
static_assert(FI_TILE_KEYS == KV_PAGE, "fi_score_stream_kernel: a tile is one page");
static_assert(FI_FOLD_DIM / 2 % KV_ROW_ALIGN == 0 && FI_FOLD_BLOCKS % KV_SCALE_ALIGN == 0,
              "fi_score_stream_kernel: rows and scale records without padding");
static_assert(FI_S_PAGE % 16 == 0 && FI_S_QA % 16 == 0 && FI_S_BARS % 8 == 0, "fi_score_stream_kernel: alignment");
static_assert(FI_S_BYTES <= FI_STREAM_SMEM, "fi_score_stream_kernel: shared memory exceeds FI_STREAM_SMEM");
static_assert(FI_STREAM_THREADS == 128 * FI_STREAM_WGS && FI_MAX_HEADS * 4 == FI_STREAM_THREADS &&
                  FI_STREAM_SLOTS % FI_STREAM_WGS == 0 && FI_S_WG_SLOTS >= 2,
              "fi_score_stream_kernel: two warpgroups (four threads a head), two slots or more each");

// Whether `v` holds in any of the `threads` threads (a multiple of 32) that reach named barrier ID. The id is
// an immediate: with an id in a register ptxas reserves all 16 of the block's barriers, and named barriers
// have been seen to limit how many blocks an SM holds (two blocks an SM is this kernel's design).
template <unsigned ID>
DSV4_INLINE bool bar_red_or(unsigned threads, bool v) {
  unsigned r;
  asm volatile(
      "{ .reg .pred p, q;\n setp.ne.u32 q, %1, 0;\n bar.red.or.pred p, %2, %3, q;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(r)
      : "r"((unsigned)v), "n"(ID), "r"(threads)
      : "memory");
  return r != 0u;
}

// One wgmma m64n64k32 e4m3 x e4m3 -> f32 with A (the tile's keys) from registers: d = A B^T (scale_d 0) or
// d += A B^T.
DSV4_INLINE void fi_wgmma_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long bdesc, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1; }\n"
      : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc), "r"(scale_d));
}

// The largest and smallest byte of a scale record (a key's four UE8M0 exponents).
DSV4_INLINE void fi_record_range(unsigned rec, unsigned& top, unsigned& lo) {
  const unsigned b0 = rec & 0xffu, b1 = (rec >> 8) & 0xffu, b2 = (rec >> 16) & 0xffu, b3 = rec >> 24;
  top = max(max(b0, b1), max(b2, b3));
  lo = min(min(b0, b1), min(b2, b3));
}

// The streamed kernel's queries, by all FI_STREAM_THREADS threads (thread tid: head tid / 4, part c4 = tid % 4 of
// each of the head's four 32-blocks, dims 32 b + 8 c4 .. + 7): the fold decision (the same in every thread;
// fi_queries_halves's rule), the codes in the B order (qb, with qf) and in the A order (qa), and the head sum's
// weights (with 2^qe_h folded in when the queries fold). The caller fences and synchronises before the wgmmas
// read them.
DSV4_INLINE bool fi_stream_queries(const float* qi, const float* iw, int t, int HI, unsigned char* qa,
                                   unsigned char* qb, float* qf, unsigned char* wb) {
  const int tid = threadIdx.x, h = tid >> 2, c4 = tid & 3;
  float4 x[FI_FOLD_BLOCKS][2];
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b) {
    x[b][0] = x[b][1] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (h < HI) {
      const float* q = qi + ((long long)t * HI + h) * FI_FOLD_DIM + 32 * b + 8 * c4;
      x[b][0] = *(const float4*)q;
      x[b][1] = *(const float4*)(q + 4);
    }
  }
  const float w = h < HI ? iw[(long long)t * HI + h] : 0.0f;
  float am[FI_FOLD_BLOCKS];  // each block's amax (the quad's)
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b) am[b] = fi_quad_amax(x[b]);
  int qe;
  const bool fold = !__syncthreads_or(!fi_head_folds(am, w, qe));
#pragma unroll
  for (int b = 0; b < FI_FOLD_BLOCKS; ++b) {
    const int e = fold ? qe : (am[b] > 0.0f && am[b] <= 3.0e38f ? dsv4_floor_log2(am[b]) - 7 : 0);
    const float inv = dsv4_pow2(-e);
    const unsigned lo = fi_e4m3x4(x[b][0].x * inv, x[b][0].y * inv, x[b][0].z * inv, x[b][0].w * inv);
    const unsigned hi = fi_e4m3x4(x[b][1].x * inv, x[b][1].y * inv, x[b][1].z * inv, x[b][1].w * inv);
    *(unsigned*)(qb + ((2 * b) * FI_MAX_HEADS + h) * 16 + 4 * c4) = lo;
    *(unsigned*)(qb + ((2 * b + 1) * FI_MAX_HEADS + h) * 16 + 4 * c4) = hi;
    *(unsigned*)(qa + ((2 * c4) * FI_MAX_HEADS + h) * 16 + 4 * b) = lo;
    *(unsigned*)(qa + ((2 * c4 + 1) * FI_MAX_HEADS + h) * 16 + 4 * b) = hi;
    if (c4 == 0) qf[b * FI_MAX_HEADS + h] = h < HI ? (fold ? 1.0f : dsv4_pow2(e)) : 0.0f;
  }
  if (c4 == 0) {
    // The head sum's B operand (fi_wgmma_head_sum): column 0 bf16(w'), column 1 bf16(w' - bf16(w')), w' = w 2^qe_h
    // when folding (exact: w' stays normal), else w.
    const float wf = fold ? __fmul_rn(w, dsv4_pow2(qe)) : w;
    const unsigned short whi = f32_to_bf16(wf);
    const unsigned short wlo = f32_to_bf16(__fsub_rn(wf, bf16_to_f32(whi)));
    unsigned short* col = (unsigned short*)(wb + (h >> 3) * 128 + (h & 7) * 2);
#pragma unroll
    for (int n = 0; n < 8; ++n) col[n * 8] = n == 0 ? whi : (n == 1 ? wlo : (unsigned short)0);
  }
  return fold;
}

// One page into a warpgroup's ring slot: its bytes announced on, and completing, the slot's mbarrier.
DSV4_INLINE void fi_stream_copy(const unsigned char* ikeys, long long page, unsigned dst, unsigned bar) {
  mbar_arrive_expect_tx(bar, FI_S_PAGE);
  bulk_load(dst, ikeys + page * FI_S_PAGE, FI_S_PAGE, bar);
}

// A wgmma descriptor made where it is used, OPAQUE: through an asm ptxas cannot look through, so its per-step
// offsets are added at each use (uniform-datapath adds) instead of being hoisted out of the tile loop, each
// step's descriptor then held across it. fi_select_stream_kernel's selection code, in the same kernel, left
// ptxas too few uniform registers for all twelve held descriptors: five were spilled and reloaded every tile
// (44 bytes); with the head sum's and the non-folding path's descriptors made here it has no spills. The
// streamed kernel alone keeps them held (OPAQUE false: the descriptor as it is).
template <bool OPAQUE>
DSV4_INLINE unsigned long long fi_desc_here(unsigned long long desc) {
  if (!OPAQUE) return desc;
  unsigned long long d;
  asm volatile("mov.b64 %0, %1;" : "=l"(d) : "l"(desc));
  return d;
}

// Scores the tiles first, first + step, ... (mine of them, mine >= 1) of token t (keys in slot `slot`, `visible` of
// them) by the block: FI_STREAM_THREADS threads, the whole block calls it. Writes each visible entry e's score
// to scores_row[e] and, FUSED (then step == 1), its order key (fi_key16) to the block's stage, the u16 at
// FI_STREAM_SMEM + 2 (e - 64 first) of the dynamic shared memory (whose start is the stream's, FI_S_BYTES), the
// scores row then optional (null: not written). (The stage's place is a constant and its index comes from
// `first`, which the loop holds anyway: no pointer or offset more in the tile loop's registers.)
template <bool FUSED>
DSV4_INLINE void fi_stream_score(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable,
                                 int ipps, int slot, int t, int HI, int visible, int first, int step, int mine,
                                 float* scores_row, unsigned char* fis_smem) {
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127;
  const unsigned sbase = smem_addr(fis_smem);
  // Warpgroup wg: the block's tiles k = wg + WGS i, i < n, in its slots wg SW + i % SW (SW = FI_S_WG_SLOTS).
  const int n = mine > wg ? (mine - wg + FI_STREAM_WGS - 1) / FI_STREAM_WGS : 0;
  const unsigned ring = sbase + wg * FI_S_WG_SLOTS * FI_S_PAGE;
  const unsigned bars = sbase + FI_S_BARS + 8 * wg * FI_S_WG_SLOTS;
  // The page of the warpgroup's tile i (kv_row's lookup).
  const long long row0 = (long long)slot * ipps + first;
  auto page_of = [&](int i) -> long long {
    const long long r = row0 + (long long)(wg + FI_STREAM_WGS * i) * step;
    return itable != 0 ? (long long)itable[r] : r;
  };
  if (tid == 0) {
    for (int s = 0; s < FI_STREAM_SLOTS; ++s) mbar_init(sbase + FI_S_BARS + 8 * s, 1);
    fence_mbar_init();
  }
  __syncthreads();
  // The issuer (the warpgroup's first thread) asks for its first SW pages at once (their table entries loaded
  // together), then keeps the ring SW - 1 tiles ahead; `next` holds the page of the tile it asks for next.
  long long next = 0;
  if (wtid == 0) {
    long long pg[FI_S_WG_SLOTS];
#pragma unroll
    for (int i = 0; i < FI_S_WG_SLOTS; ++i) pg[i] = i < n ? page_of(i) : 0;
#pragma unroll
    for (int i = 0; i < FI_S_WG_SLOTS; ++i)
      if (i < n) fi_stream_copy(ikeys, pg[i], ring + i * FI_S_PAGE, bars + 8 * i);
    if (FI_S_WG_SLOTS < n) next = page_of(FI_S_WG_SLOTS);
  }

  unsigned char* qa = fis_smem + FI_S_QA;
  unsigned char* qb = fis_smem + FI_S_QB;
  float* qf = (float*)(fis_smem + FI_S_QF);
  unsigned char* wb = fis_smem + FI_S_WB;
  const bool fold_q = fi_stream_queries(qi, iw, t, HI, qa, qb, qf, wb);
  fence_proxy_async_shared();  // the queries and weights, for the wgmmas
  __syncthreads();

  const int lane = tid & 31, warp = (tid >> 5) & 3, cq = lane & 3;
  const int r0 = 16 * warp + (lane >> 2);  // the thread's key rows r0 and r0 + 8 of a tile
  const unsigned long long dqa = fi_desc_q(qa), dqb = fi_desc_q(qb), dwb = fi_desc_wb(wb);
  // Accumulators defined once, so ptxas keeps the wgmmas asynchronous (C7511).
  float acc[32], d[32], hs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = d[i] = 0.0f;
  for (int i = 0; i < n; ++i) {
    const int s = i % FI_S_WG_SLOTS;
    const int e0 = (first + (wg + FI_STREAM_WGS * i) * step) * FI_TILE_KEYS;
    const unsigned char* pg = fis_smem + (ring - sbase) + s * FI_S_PAGE;
    mbar_wait(bars + 8 * s, (i / FI_S_WG_SLOTS) & 1);
    // The thread's two rows: 16 code bytes (its 32-block cq) and the scale record. Rows past the visible keys
    // read as zero codes with exponents 133 (factors 2^12: finite, and they fold).
    const bool in0 = e0 + r0 < visible, in1 = e0 + r0 + 8 < visible;
    uint4 c0 = *(const uint4*)(pg + r0 * (FI_FOLD_DIM / 2) + 16 * cq);
    uint4 c1 = *(const uint4*)(pg + (r0 + 8) * (FI_FOLD_DIM / 2) + 16 * cq);
    unsigned s0 = *(const unsigned*)(pg + FI_S_CODES + 4 * r0);
    unsigned s1 = *(const unsigned*)(pg + FI_S_CODES + 4 * (r0 + 8));
    if (!in0) {
      c0 = make_uint4(0u, 0u, 0u, 0u);
      s0 = 0x85858585u;
    }
    if (!in1) {
      c1 = make_uint4(0u, 0u, 0u, 0u);
      s1 = 0x85858585u;
    }
    unsigned top0, lo0, top1, lo1;
    fi_record_range(s0, top0, lo0);
    fi_record_range(s1, top1, lo1);
    const bool bad = top0 - lo0 > FI_FOLD_SPAN || top0 < FI_FOLD_E_MIN || top0 > FI_FOLD_E_MAX ||
                     top1 - lo1 > FI_FOLD_SPAN || top1 < FI_FOLD_E_MIN || top1 > FI_FOLD_E_MAX;
    // The vote; past it every thread of the warpgroup is done with tile i - 1's slot (all its reads came before
    // that tile's wgmmas), so the issuer refills it with tile i - 1 + SW.
    const bool vote = bad || !fold_q;
    const bool tile_fold = !(wg == 0 ? bar_red_or<FI_S_BAR_WG>(128, vote) : bar_red_or<FI_S_BAR_WG + 1>(128, vote));
    if (wtid == 0 && i >= 1 && i - 1 + FI_S_WG_SLOTS < n) {
      const int j = i - 1 + FI_S_WG_SLOTS, sj = j % FI_S_WG_SLOTS;
      fi_stream_copy(ikeys, next, ring + sj * FI_S_PAGE, bars + 8 * sj);
      if (j + 1 < n) next = page_of(j + 1);
    }
    if (tile_fold) {
      // The A order: step st is word st of each row's 16 bytes, decoded with the row's shifted table for its
      // block cq (t = s - E + 12 in [1, 12]: the fold's exact range).
      const Fp4Table t0 = fp4_table_shifted(byte_of(s0, cq) + 12u - top0);
      const Fp4Table t1 = fp4_table_shifted(byte_of(s1, cq) + 12u - top1);
      const unsigned w0[4] = {c0.x, c0.y, c0.z, c0.w}, w1[4] = {c1.x, c1.y, c1.z, c1.w};
      unsigned a[4][4];
#pragma unroll
      for (int st = 0; st < 4; ++st) {
        e2m1x8_to_e4m3_halves(w0[st], t0, a[st][0], a[st][2]);
        e2m1x8_to_e4m3_halves(w1[st], t1, a[st][1], a[st][3]);
      }
      wgmma_fence();
#pragma unroll
      for (int st = 0; st < 4; ++st)
        fi_wgmma_rs(acc, a[st], fi_desc_step(dqa, 2 * st * FI_MAX_HEADS * 16), st);
      wgmma_commit();
      wgmma_wait<0>();
      wgmma_fence_operand(acc);
    } else {
      // The B order: step b is word 4b + cq of each row (block b), the plain bit move (value 2^-6, the 2^6 in the
      // key factor), each block's sum promoted with its factors (fi_score's per-block path).
      unsigned w0[4], w1[4];
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        w0[b] = in0 ? *(const unsigned*)(pg + r0 * (FI_FOLD_DIM / 2) + 16 * b + 4 * cq) : 0u;
        w1[b] = in1 ? *(const unsigned*)(pg + (r0 + 8) * (FI_FOLD_DIM / 2) + 16 * b + 4 * cq) : 0u;
      }
#pragma unroll
      for (int j = 0; j < 32; ++j) acc[j] = 0.0f;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        unsigned a[4];
        e2m1x8_to_e4m3_halves(w0[b], fp4_table_plain(), a[0], a[2]);
        e2m1x8_to_e4m3_halves(w1[b], fp4_table_plain(), a[1], a[3]);
        wgmma_fence();
        fi_wgmma_rs(d, a, fi_desc_step(fi_desc_here<FUSED>(dqb), 2 * b * FI_MAX_HEADS * 16), 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(d);
        fi_promote(acc, d, qf + b * FI_MAX_HEADS, fi_key_factor(byte_of(s0, b)), fi_key_factor(byte_of(s1, b)));
      }
    }
    // score = bf16(2^ke sum_h relu(bf16(d_h)) (hi_h + lo_h)) on the BF16 tensor core (fi_score's TC_SUM path).
    fi_head_sum_tc(acc, hs, fi_desc_here<FUSED>(dwb));
    if (cq == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int e = e0 + r0 + 8 * r;
        if (e < visible) {
          const float v = __fadd_rn(hs[2 * r], hs[2 * r + 1]);
          const float score = round_bf16_nonnan(__fmul_rn(v, fi_fold_factor(tile_fold, r ? top1 : top0)));
          if (!FUSED || scores_row != 0) scores_row[e] = score;
          if (FUSED)
            ((unsigned short*)(fis_smem + FI_STREAM_SMEM))[e - first * FI_TILE_KEYS] = (unsigned short)fi_key16(score);
        }
      }
    }
  }
}

// Grid (T, blocks a token), FI_STREAM_THREADS threads: FI_STREAM_WGS warpgroups. Head dim FI_FOLD_DIM only (the
// host runs the plain kernels at others), HI <= FI_MAX_HEADS. Scores as fi_score_fold_tc_kernel's (its comment),
// within the same bound; each tile's decisions (fold or not) are its own. Block y of a token takes its tiles y,
// y + gridDim.y, ...
// FI_STREAM_MIN_BLOCKS: the blocks an SM ptxas must leave room for (its register cap). 2 (123 registers, no
// spills); `dsv4 bench attn --defines FI_STREAM_MIN_BLOCKS=3` times three (80 registers, with spills).
#ifndef FI_STREAM_MIN_BLOCKS
#define FI_STREAM_MIN_BLOCKS 2
#endif
extern "C" __global__ void __launch_bounds__(FI_STREAM_THREADS, FI_STREAM_MIN_BLOCKS)
    fi_score_stream_kernel(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable, int ipps,
                           const int* positions, const int* seq_of, const int* seq_slots, int T, int HI, int DI,
                           int ratio, int maxe, float* scores) {
  dsv4_pdl_begin();
  extern __shared__ __align__(128) unsigned char fis_smem[];
  const int t = blockIdx.x;
  if (t >= T || DI != FI_FOLD_DIM) return;
  const int slot = seq_slots[seq_of[t]];
  if (slot < 0) return;  // padding: nothing is scored (fi_topk_kernel selects nothing)
  int visible = (positions[t] + 1) / ratio;
  if (visible > maxe) visible = maxe;
  const int tiles = (visible + FI_TILE_KEYS - 1) / FI_TILE_KEYS;
  const int first = blockIdx.y, step = gridDim.y;
  if (first >= tiles) return;
  const int mine = (tiles - first + step - 1) / step;  // the block's tiles
  fi_stream_score<false>(qi, iw, ikeys, itable, ipps, slot, t, HI, visible, first, step, mine,
                         scores + (long long)t * maxe, fis_smem);
}

// A score's 16-bit order key: larger score, larger key; NaN as -inf; -0 as +0 (the reference's
// top_k compares them equal). Scores are BF16 values, so the top half of their bits is exact.
DSV4_INLINE unsigned fi_key16(float v) {
  if (v != v) v = -DSV4_F32_INF;
  if (v == 0.0f) v = 0.0f;
  const unsigned b = __float_as_uint(v) >> 16;
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// Lanes below this one (for a lane's rank among the lanes of a ballot).
DSV4_INLINE unsigned fi_lanes_below() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// hist[bin] += 1 for every active lane of the warp, one shared atomic per distinct bin (lanes with
// the same bin add their count through their leader): BF16 scores crowd a few high-byte bins, and
// one atomic per lane on one address serialises the warp.
DSV4_INLINE void fi_hist_add(int* hist, unsigned bin, bool active) {
  const unsigned act = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(act, bin);
  if ((threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1)) atomicAdd(&hist[bin], __popc(peers));
}

// FI_TOPK_PLAIN_LOW (default 1; `dsv4 bench attn --defines FI_TOPK_PLAIN_LOW=0` times the aggregated form): the
// second pass's histogram (the low byte of the keys in the chosen high bin, spread over many bins) by one plain
// shared atomic a lane instead of fi_hist_add's aggregation. The same counts. Measured (bench attn, H100, best of
// 2 rounds, the fast set's whole select, µs, 0 / 1): 64K 64 tokens 67.20 / 66.09, 8 tokens 24.02 / 23.20; 8K 64
// tokens 22.20 / 22.11, 8 tokens 13.13 / 13.02; a one-block top-k 116.5 / 107.5 (BENCHMARKS.md 2026-12-05,
// thirty-third part).
#ifndef FI_TOPK_PLAIN_LOW
#define FI_TOPK_PLAIN_LOW 1
#endif

// Entries a lane has in flight in each pass of the selection (its loads all issued before any is
// used: a pass over a warp's segment of global scores is a few round trips, not one a 32 entries).
#define FI_TOPK_BATCH 8

// The int at `p` (this block's shared memory) in each block r < nc <= MAXC of the cluster, v[r] from block
// r (0 for r >= nc): every load issued before any is used (one at a time, each waited for, 64 a lane cost a
// block ~25 us).
template <int MAXC>
DSV4_INLINE void fi_ld_cluster_all(const int* p, int nc, int (&v)[MAXC]) {
  const unsigned a = smem_addr(p);
#pragma unroll
  for (int r = 0; r < MAXC; ++r) v[r] = r < nc ? ld_cluster_s32(cluster_map(a, r)) : 0;
}

// A selecting block's own shared memory besides its staged keys (fi_cluster_select).
struct FiTopkShared {
  int hist[2][256];
  int total[256];  // the cluster's histogram of the pass
  int warp_gt[FI_TOPK_THREADS / 32], warp_eq[FI_TOPK_THREADS / 32];
  int block_cnt[2];  // this block's keys above / equal to the k-th
  int bin, above, gt0, eq0;
};

// The exact top-k of one token over a cluster of nc <= MAXC blocks (FI_TOPK_THREADS threads each),
// block `rank` of which owns the token's visible entries blo .. bhi - 1 (contiguous, in rank order, blo a multiple
// of 32), its warp w a contiguous run of that (each a multiple of 32), read 32 at a time by the lanes (coalesced;
// (i, lane) order is index order within the warp), FI_TOPK_BATCH a lane in flight. The order keys (u16) are
// read either from the scores row (`row`, the scores as fi_score's kernels write them) or, where the block's run
// fits (`staged`), from `stage` ([bhi - blo] keys from entry blo), which the first pass fills from the row; or,
// with FROM_STAGE, from `stage` only, which the caller filled (and made visible to the block) before the call.
// - The k-th largest order key, a byte at a time: each block histograms its run (high byte, then the low byte of
//   the keys in the chosen high bin; shared atomics aggregated per warp); after a cluster barrier every block adds
//   the cluster's histograms (distributed shared memory; integer sums, any order) and finds the same bin.
// - Then the selection, in index order: entry e is taken when its key is above the k-th, or equal to it with fewer
//   than `need` equal keys before it (ties to the lower index), and it goes to position (keys above the k-th
//   before e) + min(equal keys before e, need). The counts before e come from per-block totals (shared through the
//   cluster), per-warp totals and ballots: no atomics decide anything, and the k positions are written once each.
// sel: the token's [topk] row, in increasing entry index (the attention's softmax does not depend on the order;
// the set is `top_k`'s: larger score, ties to the lower index, NaN lowest), -1 past nsel = k = min(topk,
// visible) >= 1 (written by rank 0). Every block of the cluster calls this, with the same k, nc and topk.
template <bool FROM_STAGE, int MAXC>
DSV4_INLINE void fi_cluster_select(const float* row, unsigned short* stage, bool staged, int blo, int bhi, int nc,
                                   int rank, int k, int topk, int* sel, int* nsel, FiTopkShared& sh) {
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
  const int wseg = ((bhi - blo + nwarps - 1) / nwarps + 31) & ~31;
  const int lo = min(blo + warp * wseg, bhi), hi = min(lo + wseg, bhi);
  // The order keys of entries e0 + 32 u + lane (u < FI_TOPK_BATCH; 0 at or past hi): every load
  // issued before any key is used. `from_scores` reads the scores row (the first pass), else the
  // staged keys when the block's run fits, the scores otherwise.
  auto keys_at = [&](int e0, bool from_scores, unsigned (&key)[FI_TOPK_BATCH]) {
    if (FROM_STAGE || (staged && !from_scores)) {
#pragma unroll
      for (int u = 0; u < FI_TOPK_BATCH; ++u) {
        const int e = e0 + 32 * u + lane;
        key[u] = e < hi ? stage[e - blo] : 0u;
      }
    } else {
      float v[FI_TOPK_BATCH];
#pragma unroll
      for (int u = 0; u < FI_TOPK_BATCH; ++u) {
        const int e = e0 + 32 * u + lane;
        v[u] = e < hi ? row[e] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < FI_TOPK_BATCH; ++u) key[u] = e0 + 32 * u + lane < hi ? fi_key16(v[u]) : 0u;
    }
  };
  const int step = 32 * FI_TOPK_BATCH;

  for (int b = tid; b < 2 * 256; b += nt) sh.hist[b >> 8][b & 255] = 0;
  __syncthreads();
  // The k-th largest key, a byte at a time. The cluster's count of bin b is the sum of its blocks';
  // warp 0 of each block finds the bin: lane l sums bins 255 - 8l down to 248 - 8l, an inclusive
  // scan over lanes gives the count above each lane's bins, and the lane whose bins reach `need`
  // walks them.
  unsigned prefix = 0;
  int need = k, above = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int e0 = lo; e0 < hi; e0 += step) {
      unsigned key[FI_TOPK_BATCH];
      keys_at(e0, pass == 0, key);
#pragma unroll
      for (int u = 0; u < FI_TOPK_BATCH; ++u) {
        const int e = e0 + 32 * u + lane;
        if (!FROM_STAGE && pass == 0 && staged && e < hi) stage[e - blo] = (unsigned short)key[u];
        const bool in = e < hi && (pass == 0 || (key[u] >> 8) == prefix);
        if (FI_TOPK_PLAIN_LOW && pass == 1) {
          if (in) atomicAdd(&sh.hist[1][key[u] & 0xffu], 1);
        } else {
          fi_hist_add(sh.hist[pass], pass == 0 ? key[u] >> 8 : key[u] & 0xffu, in);
        }
      }
    }
    cluster_sync();  // every block's histogram (and this block's staged keys) complete
    for (int b = tid; b < 256; b += nt) {
      int v[MAXC];
      fi_ld_cluster_all<MAXC>(&sh.hist[pass][b], nc, v);
      int sum = 0;
#pragma unroll
      for (int r = 0; r < MAXC; ++r) sum += v[r];
      sh.total[b] = sum;
    }
    __syncthreads();
    if (warp == 0) {
      int mine[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        mine[i] = sh.total[255 - 8 * lane - i];
        sum += mine[i];
      }
      int incl = sum;  // bins 255 .. 248 - 8 lane together
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += v;
      }
      const int before = incl - sum;  // keys in the bins above this lane's
      // The crossing lane: the first whose inclusive count reaches need (bin 0 takes the rest).
      const unsigned reach = __ballot_sync(0xffffffffu, incl >= need);
      const int first = reach ? __ffs(reach) - 1 : 31;
      if (lane == first) {
        int acc = before, i = 0;
        for (; i < 7 && acc + mine[i] < need; ++i) acc += mine[i];
        sh.bin = 255 - 8 * lane - i;
        sh.above = acc;
      }
    }
    __syncthreads();
    prefix = pass == 0 ? (unsigned)sh.bin : (prefix << 8) | (unsigned)sh.bin;
    above += sh.above;
    need -= sh.above;
  }
  const unsigned kth = prefix;  // exactly `above` keys are larger; `need` more equal it

  // Keys above / equal to kth: per warp, then per block (warp order = index order), shared.
  int gt = 0, eq = 0;
  for (int e0 = lo; e0 < hi; e0 += step) {
    unsigned key[FI_TOPK_BATCH];
    keys_at(e0, false, key);
#pragma unroll
    for (int u = 0; u < FI_TOPK_BATCH; ++u) {
      const bool real = e0 + 32 * u + lane < hi;
      gt += __popc(__ballot_sync(0xffffffffu, real && key[u] > kth));
      eq += __popc(__ballot_sync(0xffffffffu, real && key[u] == kth));
    }
  }
  if (lane == 0) {
    sh.warp_gt[warp] = gt;
    sh.warp_eq[warp] = eq;
  }
  __syncthreads();
  if (tid == 0) {
    int a = 0, q = 0;
    for (int i = 0; i < nwarps; ++i) {
      const int x = sh.warp_gt[i], y = sh.warp_eq[i];
      sh.warp_gt[i] = a;
      sh.warp_eq[i] = q;
      a += x;
      q += y;
    }
    sh.block_cnt[0] = a;
    sh.block_cnt[1] = q;
  }
  cluster_sync();  // every block's counts (and the last pass's histogram reads) done
  if (tid < 2) {  // thread i: the cluster's blocks before this one, count i
    int v[MAXC];
    fi_ld_cluster_all<MAXC>(&sh.block_cnt[tid], nc, v);
    int a = 0;
#pragma unroll
    for (int r = 0; r < MAXC; ++r) a += r < rank ? v[r] : 0;
    (tid == 0 ? sh.gt0 : sh.eq0) = a;
  }
  // This block reads no other block's shared memory after this point; the wait before it exits
  // keeps its own readable until every block has arrived.
  cluster_arrive();
  __syncthreads();

  // The gather, in index order (see above).
  int og = sh.gt0 + sh.warp_gt[warp], oe = sh.eq0 + sh.warp_eq[warp];
  const unsigned below = fi_lanes_below();
  for (int e0 = lo; e0 < hi; e0 += step) {
    unsigned key[FI_TOPK_BATCH];
    keys_at(e0, false, key);
#pragma unroll
    for (int u = 0; u < FI_TOPK_BATCH; ++u) {
      const int e = e0 + 32 * u + lane;
      const bool is_gt = e < hi && key[u] > kth, is_eq = e < hi && key[u] == kth;
      const unsigned bg = __ballot_sync(0xffffffffu, is_gt), be = __ballot_sync(0xffffffffu, is_eq);
      const int gt_before = og + __popc(bg & below), eq_before = oe + __popc(be & below);
      if (is_gt || (is_eq && eq_before < need)) sel[gt_before + min(eq_before, need)] = e;
      og += __popc(bg);
      oe += __popc(be);
    }
  }
  if (rank == 0) {
    for (int r = k + tid; r < topk; r += nt) sel[r] = -1;
    if (tid == 0) *nsel = k;
  }
  cluster_wait();
}

// The token's visible entries (positions[t] + 1) / ratio, at most maxe; 0 for padding (a slot < 0).
DSV4_INLINE int fi_visible(const int* positions, const int* seq_of, const int* seq_slots, int t, int ratio,
                           int maxe) {
  if (seq_slots[seq_of[t]] < 0) return 0;
  const int visible = (positions[t] + 1) / ratio;
  return visible < maxe ? visible : maxe;
}

// One cluster of nc <= FI_TOPK_CLUSTER blocks per token (grid nc x T, block r of token t at blockIdx.x =
// nc t + r; the host picks nc by the token count), FI_TOPK_THREADS threads a block: fi_cluster_select over the scores
// rows fi_score's kernels wrote. One block took ~35 us for 16K entries (the SM's instruction issue, not memory):
// the cluster splits every pass nc ways. Block r owns a contiguous run of the token's visible entries (a
// multiple of 32), whose order keys the first pass stages in the block's dynamic shared memory when they fit
// (run <= stage_keys), and the later passes read them there instead of the scores.
// selected: [T][topk] (fi_cluster_select's row), nsel[t] = min(topk, visible).
extern "C" __global__ void __launch_bounds__(FI_TOPK_THREADS)
    fi_topk_kernel(const float* scores, const int* positions, const int* seq_of,
                   const int* seq_slots, int T, int ratio, int maxe, int topk, int stage_keys, int nc,
                   int* selected, int* nsel) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) unsigned short fi_staged[];  // [stage_keys] order keys
  __shared__ FiTopkShared sh;
  const int t = blockIdx.x / nc, rank = blockIdx.x % nc;
  if (t >= T) return;  // the whole cluster (nc divides the grid)
  int* sel = selected + (long long)t * topk;
  const int visible = fi_visible(positions, seq_of, seq_slots, t, ratio, maxe);
  const int k = topk < visible ? topk : visible;
  if (k == 0) {  // padding, or nothing visible yet (the whole cluster returns here)
    if (rank == 0) {
      for (int r = threadIdx.x; r < topk; r += blockDim.x) sel[r] = -1;
      if (threadIdx.x == 0) nsel[t] = 0;
    }
    return;
  }
  const int bseg = ((visible + nc - 1) / nc + 31) & ~31;
  const int blo = min(rank * bseg, visible), bhi = min(blo + bseg, visible);
  fi_cluster_select<false, FI_TOPK_CLUSTER>(scores + (long long)t * maxe, fi_staged, bhi - blo <= stage_keys, blo,
                                            bhi, nc, rank, k, topk, sel, nsel + t, sh);
}

// A token's run in fi_select_stream_kernel's block `rank` of nc: m = ceil(tiles / nc) tiles a block, the block's
// first tile and its count (mine, possibly 0), its entries blo .. bhi - 1.
struct FiFusedRun {
  int m, first, mine, blo, bhi;
};
DSV4_INLINE FiFusedRun fi_fused_run(int visible, int nc, int rank) {
  const int tiles = (visible + FI_TILE_KEYS - 1) / FI_TILE_KEYS;
  const int m = (tiles + nc - 1) / nc, first = rank * m;
  const int blo = min(first * FI_TILE_KEYS, visible);
  return {m, first, max(0, min(m, tiles - first)), blo, min(blo + m * FI_TILE_KEYS, visible)};
}

// fi_select_stream_kernel: the streamed scoring and the top-k in one launch, the scores never leaving the SMs.
// Grid (T, nc), clusters of (1, nc, 1): one cluster a token, nc <= FI_FUSED_MAX_CLUSTER (16: a non-portable
// size above 8, which H100 / H200 schedule) blocks of FI_STREAM_THREADS (== FI_TOPK_THREADS) threads. Block r scores the token's tiles r m .. r m + m - 1 (fi_fused_run: a contiguous run,
// as the selection needs) with fi_stream_score, their order keys into the block's stage (dynamic shared memory
// from FI_STREAM_SMEM, stage_keys >= 64 m keys: the host checks), then fi_cluster_select runs on the stage: the
// same scores, tile for tile, as fi_score_stream_kernel's and the same selection as fi_topk_kernel's on them.
// `scores` may be null (the row is then not written); the tests pass it to compare the scores. Saves the scores
// row's write and read and the top-k's launch; costs the scoring's spread over T x nc blocks, so it pays only
// where many tokens fill the GPU (SelectPlan::fused_topk).
// Nothing the selection needs is held in registers across the scoring (ptxas spilled 72 bytes in its tile loop
// when the run, k and the row pointers were): the visible count goes through shared memory and the rest is made
// again from it. With that alone ptxas still spilled 44 bytes there (five of the wgmmas' descriptors, reloaded
// from L1 a tile; the selection's code in the same kernel changed the loop's allocation even with constant
// arguments, and out of line, as a call, the scoring's wgmmas were serialized): fi_desc_here makes the head
// sum's and the non-folding path's descriptors at their use, and the kernel has 124 registers and no spills.
extern "C" __global__ void __launch_bounds__(FI_STREAM_THREADS, 2)
    fi_select_stream_kernel(const float* qi, const float* iw, const unsigned char* ikeys, const int* itable, int ipps,
                            const int* positions, const int* seq_of, const int* seq_slots, int T, int HI, int DI,
                            int ratio, int maxe, int topk, int stage_keys, float* scores, int* selected, int* nsel) {
  dsv4_pdl_begin();
  extern __shared__ __align__(128) unsigned char fis_smem[];
  __shared__ FiTopkShared sh;
  __shared__ int sh_visible;
  const int t = blockIdx.x;
  if (t >= T || DI != FI_FOLD_DIM) return;  // whole clusters (a cluster is one token's blocks)
  {
    const int visible = fi_visible(positions, seq_of, seq_slots, t, ratio, maxe);
    if (min(topk, visible) == 0) {  // padding, or nothing visible yet (the whole cluster returns here)
      if (blockIdx.y == 0) {
        for (int r = threadIdx.x; r < topk; r += blockDim.x) selected[(long long)t * topk + r] = -1;
        if (threadIdx.x == 0) nsel[t] = 0;
      }
      return;
    }
    if (threadIdx.x == 0) sh_visible = visible;
    __syncthreads();  // (sh_visible read by every thread after the scoring)
    const FiFusedRun run = fi_fused_run(visible, gridDim.y, blockIdx.y);
    if (run.m * FI_TILE_KEYS > stage_keys) __trap();  // the host sized the stage for maxe
    if (run.mine > 0)  // uniform over the block; the stage from entry blo = 64 first
      fi_stream_score<true>(qi, iw, ikeys, itable, ipps, seq_slots[seq_of[t]], t, HI, visible, run.first, 1,
                            run.mine, scores != 0 ? scores + (long long)t * maxe : nullptr, fis_smem);
  }
  // (fi_cluster_select's first barrier makes the stage's keys visible to the whole block.)
  const int visible = sh_visible;
  const FiFusedRun run = fi_fused_run(visible, gridDim.y, blockIdx.y);
  fi_cluster_select<true, FI_FUSED_MAX_CLUSTER>(nullptr, (unsigned short*)(fis_smem + FI_STREAM_SMEM), true, run.blo,
                                                run.bhi, gridDim.y, blockIdx.y, min(topk, visible), topk,
                                                selected + (long long)t * topk, nsel + t, sh);
}
