// fast_attention kernel family: see kernels/SPEC.md (fast_attention.cu) and MODEL.md §6.5.
//
// The fast set's sparse attention: for each token, one softmax over its keys (window + the
// compressed entries, attn_keys.cuh) with the per-head sink, MLA style: one block takes ALL
// heads of a token against a run of its keys, so every key row is read from memory and decoded
// once per token, not once per head (64 heads share one 512-wide KV). Keys are decoded exactly
// to BF16 in shared memory (e4m3 * 2^k and the BF16 RoPE channels are BF16 values; so are the
// batch's own official f32 rows), Q is BF16 (official queries are BF16 values), and both
// products run on tensor cores (mma.sync m16n8k16, f32 accumulators): S = Q K^T, then an online
// softmax (running max per head, p = bf16(exp(s - max)) as the reference rounds it, the
// denominator from the unrounded exps), then O += P V with V = the same decoded rows.
//
// Work split: 8 warps; warp w takes heads 16 (w & 3) .. + 15 and the dims half w >> 2 of the
// head: its half of S = Q K^T (over its 256 of 512 dims), exchanged through shared memory so
// both warps of a head group hold S = S_lo + S_hi (the same sum, the same softmax), and its
// half of the output dims (16 x 256 f32 accumulators: 128 per thread). Keys per block: a run of
// whole 32-key tiles of the token's keys (split `blockIdx.y` of `splits`); more than one split
// writes its unnormalised O, running max and exp sum to a workspace and fa_combine_kernel adds
// the splits in order with the sink; launched as one thread-block cluster a token (at most
// FA_CLUSTER_MAX_SPLITS splits), the splits combine through distributed shared memory instead
// (fa_cluster_combine: the same operations, the same bits). Deterministic run to run: fixed tiles,
// fixed split order, no atomics. The split count comes from the batch size (kernels/SPEC.md), so a token's output
// may differ in rounding between batch sizes (the reference kernels bound both).
//
// fa_attention_wgmma_kernel (the second half of this file) is the same attention with both products
// on wgmma, for many tokens at head dim 512; it shares the helpers below and gives the same bits.
// fa_stage_rows_kernel writes the batch's own rows in the stored format first, for both.
#include "common.cuh"
#include "attn_keys.cuh"
#include "fp8_mma.cuh"
#include "kv_pages.cuh"

// FA_THREADS, FA_TILE_KEYS, FA_MAX_HEADS, FA_MAX_HD (dsv4_consts.cuh).
#define FA_WARPS (FA_THREADS / 32)
// Split partials fa_combine_kernel has in flight per thread (float4 each).
#define FA_COMBINE_LOADS 8

// Shared memory (dynamic), kernels/SPEC.md: Q [FA_MAX_HEADS][hd + 8] bf16, K [FA_TILE_KEYS][hd + 8]
// bf16 (rows padded by 16 bytes so ldmatrix's 8 rows fall in distinct banks), the S exchange
// [16 values][FA_THREADS] f32, two raw tiles [2][FA_TILE_KEYS][raw stride] (stored rows as
// they are in memory: value bytes then scale record), and per raw tile its keys' row and scale
// addresses and kinds.
DSV4_INLINE int fa_row_stride(int hd) { return hd + 8; }  // bf16 elements

// What a key of a tile is: nothing (past the token's keys), a stored row, a batch f32 row.
#define FA_KEY_NONE 0
#define FA_KEY_STORED 1
#define FA_KEY_BATCH 2

// i = start, start + FA_THREADS, ... over a [rows][width] grid as (row r, column c), without a
// division per step.
struct FaWalk {
  int r, c, dr, dc, width;
  __device__ __forceinline__ FaWalk(int start, int w)
      : r(start / w), c(start % w), dr(FA_THREADS / w), dc(FA_THREADS % w), width(w) {}
  __device__ __forceinline__ void next() {
    r += dr;
    c += dc;
    if (c >= width) {
      c -= width;
      ++r;
    }
  }
};

// e8m0_to_f32 by selects: one of these per 8 values decoded, where the branches cost more than the
// conversion.
DSV4_INLINE float fa_e8m0(unsigned e) {
  const unsigned bits = e == 0u ? 0x00400000u : e << 23;
  return e == 255u ? DSV4_F32_NAN : __uint_as_float(bits);
}

// 8 e4m3 codes (at `codes`, 8-byte aligned) times their block's scale s as 8 bf16 (one 16-byte word):
// exact (an e4m3 value times a power of two is a BF16 value, as the reference decodes it).
DSV4_INLINE uint4 fa_fp8_chunk(const unsigned char* codes8, float s) {
  const uint2 codes = *(const uint2*)codes8;
  unsigned w[4];
  const unsigned c[2] = {codes.x, codes.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = kv_e4m3x2_to_f32((unsigned short)(c[i >> 1] >> (16 * (i & 1))));
    w[i] = pack_bf16x2(__fmul_rn(v.x, s), __fmul_rn(v.y, s));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Values c0 .. c0 + 7 of a stored official row as 8 bf16 (one 16-byte word), from its bytes
// `raw` (value bytes, then the scale record at row_bytes). nope % 16 == 0, so the 8 values
// are 8 codes of one scale block or 8 BF16 values.
DSV4_INLINE uint4 fa_stored_chunk(const KvRowFmt& f, const unsigned char* raw, int c0) {
  if (c0 >= f.nope) return *(const uint4*)(raw + f.nope + 2 * (c0 - f.nope));
  return fa_fp8_chunk(raw + c0, fa_e8m0(raw[f.row_bytes + c0 / KV_FP8_BLOCK]));
}

// FA_DECODE_FAST (default 1; `dsv4 bench attn --defines FA_DECODE_FAST=0` times the general decode, which rows of
// other formats and exponents take anyway; gpu_fast_attention compares the =0 build's bits with the default's).
// Measured with FA_FETCH_FAST (bench attn, H100, best of 2 rounds, the fast path, µs: 0 / 1 for both): CSA 64K
// 64 tokens 49.28 / 47.97, 32 tokens 36.29 / 35.84; CSA 8K 64 tokens 47.06 / 46.05; HCA 64K 64 tokens 43.47 /
// 42.70; 8 tokens within 0.1 either way (BENCHMARKS.md 2026-12-05, thirty-third part). The wgmma kernel decodes a stored row of Flash's format (FA_DF_NOPE = 448
// FP8 channels in 7 blocks of 64, then 64 BF16 RoPE channels) whose 7 block exponents all lie in
// [FA_DF_E_MIN, 254] with fewer instructions, the same values:
// - the row's scale record is read once (8 bytes), not a byte a chunk, and each block's scale is its BF16 bits,
//   e << 7 (2^(e - 127)), with no select for e = 0 or 255 (those rows take the default decode);
// - a pair of codes goes e4m3x2 -> f16x2 -> two f32 -> bf16x2, all exact (unscaled e4m3 values are BF16 values),
//   then ONE mul.rn.bf16x2 by the scale instead of two f32 multiplies: the product is a BF16 value and exact as
//   long as it is normal, which e >= FA_DF_E_MIN makes sure of (the smallest e4m3 value 2^-9 times 2^(e - 127) is
//   at least 2^-126); past 2^128 both forms give inf; a NaN code gives NaN in both, possibly with other payload
//   bits (the official writer's satfinite conversion never stores one);
// - the RoPE chunk is known by its index (no per-chunk comparison with nope).
#ifndef FA_DECODE_FAST
#define FA_DECODE_FAST 1
#endif
// FA_FETCH_FAST (default 1, measured with FA_DECODE_FAST above; =0 the general loops): fa_fetch copies a row of Flash's size (FA_DF_ROW_BYTES value bytes, an
// FA_DF_SCALE_BYTES scale record) by unrolled copies with immediate offsets instead of its general loops (whose
// trip counts and 64-bit address arithmetic cost ~90 instructions a thread and tile in the wgmma kernel's SASS,
// between the softmax and P V); the same bytes land in the same places.
#ifndef FA_FETCH_FAST
#define FA_FETCH_FAST 1
#endif
#define FA_DF_NOPE 448
#define FA_DF_ROW_BYTES (FA_DF_NOPE + 2 * 64)
#define FA_DF_SCALE_BYTES 8
#define FA_DF_BLOCKS (FA_DF_NOPE / 64)
#define FA_DF_E_MIN 10u

// Whether every block exponent of a scale record (bytes 0 .. FA_DF_BLOCKS - 1 of rec) takes the fast decode.
DSV4_INLINE bool fa_df_record_ok(uint2 rec) {
  bool ok = true;
#pragma unroll
  for (int j = 0; j < FA_DF_BLOCKS; ++j) {
    const unsigned e = ((j < 4 ? rec.x : rec.y) >> (8 * (j & 3))) & 0xffu;
    ok = ok && e - FA_DF_E_MIN <= 254u - FA_DF_E_MIN;
  }
  return ok;
}

// 8 e4m3 codes (at codes8, 8-byte aligned) times 2^(e - 127) as 8 bf16, e the block's exponent (fa_df_record_ok):
// fa_fp8_chunk's values.
DSV4_INLINE uint4 fa_df_chunk(const unsigned char* codes8, unsigned e) {
  const uint2 codes = *(const uint2*)codes8;
  const unsigned s2 = e * 0x00800080u;  // bf16x2 of 2^(e - 127) in both halves: e << 7, e << 23
  unsigned w[4];
  const unsigned c[2] = {codes.x, codes.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = kv_e4m3x2_to_f32((unsigned short)(c[i >> 1] >> (16 * (i & 1))));
    unsigned x = pack_bf16x2(v.x, v.y);
    asm("mul.rn.bf16x2 %0, %0, %1;\n" : "+r"(x) : "r"(s2));
    w[i] = x;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Values c0 .. c0 + 7 of an f32 row (the batch's own official rows: BF16 values) as 8 bf16.
DSV4_INLINE uint4 fa_f32_chunk(const float* row, int c0) {
  const float4 a = *(const float4*)(row + c0), b = *(const float4*)(row + c0 + 4);
  return make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                    pack_bf16x2(b.z, b.w));
}

// Bytes between the batch's rows staged in the stored format (value bytes, then the scale record;
// 16-byte aligned for the async copies).
DSV4_INLINE int fa_staged_stride(const KvRowFmt& f) { return kv_round_up(f.row_bytes + f.scale_bytes, 16); }

// The batch's own KV rows (f32 official values: FP8-simulated nope channels, BF16 RoPE) in the
// stored official format, row i at staged + i * fa_staged_stride: kv_store_row, as ring_update_kernel
// stores them, which is exact (kv_pages.rs), so the attention decodes the same values. Grid T, a
// block a row (its warps take the FP8 blocks).
extern "C" __global__ void fa_stage_rows_kernel(const float* kv, int T, int hd, int nope, unsigned char* staged) {
  dsv4_pdl_begin();
  const int i = blockIdx.x;
  if (i >= T) return;
  const KvRowFmt f = kv_fmt_kv(hd, nope, 1);
  KvRowPtr p;
  p.row = staged + (long long)i * fa_staged_stride(f);
  p.sc = p.row + f.row_bytes;
  kv_store_row(f, p, kv + (long long)i * hd);
}

// The key metadata of a tile's address slots in shared memory: for slot b and key r of the tile,
// krow / ksc [b * FA_TILE_KEYS + r] are its row and scale addresses and kind its FA_KEY_*.
struct FaSlots {
  unsigned long long* krow;
  unsigned long long* ksc;
  int* kind;
};

// Where tile `tile`'s keys are, into address slot b (threads tid < FA_TILE_KEYS, one a key: its
// selection and block-table lookups; nothing at or past tile1 or nk). With `staged` (the batch's
// rows in the stored format, fa_stage_rows_kernel) a batch row is fetched and decoded like a stored
// one: the same values, read through the async copies instead of the decode's own f32 loads.
// PREFETCH: each stored row's lines (its values, then its scale record) are asked into L2 as well, so that
// the row's fetch, tiles later, waits for L2 rather than for HBM.
template <bool PREFETCH = false>
DSV4_INLINE void fa_locate(const FaSlots& s, const AttnKeys& keys, int nk, int tile, int tile1, int b, int tid,
                           const unsigned char* staged, const KvRowFmt& sf) {
  if (tid < FA_TILE_KEYS) {
    const int j = tile * FA_TILE_KEYS + tid;
    int k = FA_KEY_NONE;
    KvRowPtr p;
    p.row = p.sc = 0;
    if (tile < tile1 && j < nk) {
      bool stored;
      p = attn_key(keys, j, &stored);
      if (!stored && staged != 0) {  // window position lo + j at or past the batch's first, p0
        p.row = (unsigned char*)staged + (long long)(keys.t0 + keys.lo + j - keys.p0) * fa_staged_stride(sf);
        p.sc = p.row + sf.row_bytes;
        stored = true;
      }
      k = stored ? FA_KEY_STORED : FA_KEY_BATCH;
      if (PREFETCH && stored) {
        for (int o = 0; o < sf.row_bytes; o += 128) asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.row + o));
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p.sc));
      }
    }
    s.krow[b * FA_TILE_KEYS + tid] = (unsigned long long)p.row;
    s.ksc[b * FA_TILE_KEYS + tid] = (unsigned long long)p.sc;
    s.kind[b * FA_TILE_KEYS + tid] = k;
  }
}

// The stored rows of address slot b into raw tile rb (raw + rb * FA_TILE_KEYS * raw_stride),
// asynchronously, one commit group a call: TPR threads a row (so a row's kind and addresses are read
// once; `tid` counts from 0 over FA_TILE_KEYS * TPR threads), 16-byte copies of the value bytes, 4-byte
// copies of the scale record.
template <int TPR>
DSV4_INLINE void fa_fetch(const FaSlots& s, const KvRowFmt& sf, unsigned char* raw, int raw_stride, int b, int rb,
                          int tid) {
  const int r = (int)((unsigned)tid / TPR), u = (int)((unsigned)tid % TPR);  // (tid >= 0: shifts)
  if (s.kind[b * FA_TILE_KEYS + r] == FA_KEY_STORED) {
    unsigned char* dst = raw + (rb * FA_TILE_KEYS + r) * raw_stride;
    const unsigned char* src = (const unsigned char*)s.krow[b * FA_TILE_KEYS + r];
    const unsigned char* sc = (const unsigned char*)s.ksc[b * FA_TILE_KEYS + r];
    if (FA_FETCH_FAST && sf.row_bytes == FA_DF_ROW_BYTES && sf.scale_bytes == FA_DF_SCALE_BYTES) {
      // Flash's rows (FA_FETCH_FAST): the same copies with the row's size known, unrolled with their
      // offsets as immediates; the scale record by the last thread of the row, which has one chunk fewer.
      constexpr int CHUNKS = FA_DF_ROW_BYTES / 16;
      const unsigned d = smem_addr(dst);
#pragma unroll
      for (int i = 0; i < CHUNKS / TPR; ++i) cp_async_16(d + 16 * (u + TPR * i), src + 16 * (u + TPR * i));
      if (CHUNKS % TPR != 0)
        cp_async_16_if(d + 16 * (u + TPR * (CHUNKS / TPR)), src + 16 * (u + TPR * (CHUNKS / TPR)),
                       u < CHUNKS % TPR);
      cp_async_4_if(d + FA_DF_ROW_BYTES, sc, u == TPR - 1);
      cp_async_4_if(d + FA_DF_ROW_BYTES + 4, sc + 4, u == TPR - 1);
    } else {
      for (int c = u; c < sf.row_bytes / 16; c += TPR) cp_async_16(smem_addr(dst + 16 * c), src + 16 * c);
      for (int o4 = 4 * u; o4 < sf.scale_bytes; o4 += 4 * TPR)
        cp_async_4(smem_addr(dst + sf.row_bytes + o4), sc + o4);
    }
  }
  cp_async_commit();
}

// Values c0 .. c0 + 7 of key r of tile slot b as 8 bf16 (zeros past the token's keys).
DSV4_INLINE uint4 fa_key_chunk(const FaSlots& s, const KvRowFmt& sf, const unsigned char* raw, int raw_stride, int b,
                               int r, int c0) {
  const int k = s.kind[b * FA_TILE_KEYS + r];
  if (k == FA_KEY_STORED) return fa_stored_chunk(sf, raw + (b * FA_TILE_KEYS + r) * raw_stride, c0);
  if (k == FA_KEY_BATCH) return fa_f32_chunk((const float*)s.krow[b * FA_TILE_KEYS + r], c0);
  return make_uint4(0u, 0u, 0u, 0u);
}

// Token t's Q into shared memory by cp.async: q is the BF16 copy [T][H][hd] that head_prep writes for the
// fast attention (official queries are BF16 values). One 16-byte unit (8 dims) a copy; thread tid of
// FA_THREADS takes units tid, tid + FA_THREADS, ... of the [FA_MAX_HEADS][hd / 8] grid, unit u of row r
// to byte at(r, u) of base; rows past H are zeroed by stores. Nothing is committed: the caller's next
// cp_async_commit takes the copies into its group, whose wait (and a barrier) makes Q visible. No
// register holds Q: the prologue's f32 loads and conversions (128 KB a block, read again by every split of
// a token) had been its longest part at few tokens. The kernels issue the copies after the first tiles'
// address lookups, not before them: issued first (they need only t), they delayed the lookups' chain of
// dependent loads (bench attn, H100: the mma.sync kernel 0.15-0.6 us slower at 1 to 16 tokens;
// BENCHMARKS.md 2026-12-05, thirty-first part).
template <class At>
DSV4_INLINE void fa_copy_q(const unsigned short* q, int t, int H, int hd, int tid, unsigned char* base, At at) {
  const unsigned short* qt = q + (long long)t * H * hd;
  for (FaWalk it(tid, hd / 8); it.r < FA_MAX_HEADS; it.next()) {
    unsigned char* dst = base + at(it.r, it.c);
    if (it.r < H)
      cp_async_16(smem_addr(dst), qt + (long long)it.r * hd + 8 * it.c);
    else
      *(uint4*)dst = make_uint4(0u, 0u, 0u, 0u);
  }
}

// q (f32 [n4 * 4]) as BF16 for the attention kernels, where the caller has no BF16 copy (the forward's
// head_prep writes one; tests and benches may pass f32 queries): exact on BF16 values, round to nearest
// even otherwise. Grid-stride, 4 values a thread a step.
extern "C" __global__ void fa_q_bf16_kernel(const float* q, long long n4, unsigned short* out) {
  dsv4_pdl_begin();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
    const float4 v = ((const float4*)q)[i];
    ((uint2*)out)[i] = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
  }
}

// The softmax's exponential, e^x as 2^(x log2 e) on the SFU (ex2.approx: ~2 instructions where expf
// takes ~8; the ncu profile of 2026-12-05 counted 18 exponentials in the ~509 instructions of a
// tile's softmax). Relative error <= 2^-21 + |x| 2^-23 (the SFU's, and the product's rounding),
// far inside p's bf16 rounding (2^-9); results below 2^-126 flush to zero, an absolute error
// below 2^-126 on a p beside the row max's p >= 1. tests/gpu_fast_attention.rs's bound carries it.
DSV4_INLINE float fa_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(__fmul_rn(x, 1.44269504088896341f)));
  return y;
}

// The lazy running max (FlashAttention-4's): a row's max moves only when a tile's max beats it by
// more than this, so O's rescale (128 multiplies a thread) runs on few tiles, and p = e^(s - m) <=
// e^5.5 ~ 245: bf16's relative rounding and f32's sums do not depend on that scale, and the combine
// and the sink take each split's m as it is.
#define FA_LAZY_MAX 5.5f

// Row r (of the fragment's two, r = e >> 1) of a tile's softmax over the column pairs of s (N blocks of 8
// keys): the lazy running max moves to mx only past FA_LAZY_MAX (fa_exp), s becomes p = e^(s - m) in
// place, and lrow takes the tile's exp sum (keys in order); returns O's correction factor (1 where the max
// stays, 0 on the first tile).
template <int N>
DSV4_INLINE float fa_row_step(float (&s)[N][4], int r, float mx, float& mrow, float& lrow) {
  const float mnew = mx > mrow + FA_LAZY_MAX ? mx : mrow;
  const float corr = mrow == -DSV4_F32_INF ? 0.0f : mnew == mrow ? 1.0f : fa_exp(__fsub_rn(mrow, mnew));
  mrow = mnew;
  float sum = 0.0f;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    const float e0 = fa_exp(__fsub_rn(s[n][2 * r], mnew));
    const float e1 = fa_exp(__fsub_rn(s[n][2 * r + 1], mnew));
    sum = __fadd_rn(__fadd_rn(sum, e0), e1);
    s[n][2 * r] = e0;
    s[n][2 * r + 1] = e1;
  }
  lrow = __fadd_rn(__fmul_rn(lrow, corr), sum);
  return corr;
}

// O's two rows times their correction factors, skipped when no row's max moved in the whole warp (every
// factor is then exactly 1).
DSV4_INLINE void fa_rescale_o(float (&acc)[FA_MAX_HD / 16][4], const float (&corr)[2]) {
  if (!__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) return;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int n = 0; n < FA_MAX_HD / 16; ++n) {
      acc[n][2 * r] = __fmul_rn(acc[n][2 * r], corr[r]);
      acc[n][2 * r + 1] = __fmul_rn(acc[n][2 * r + 1], corr[r]);
    }
}

// One tile's softmax step for a thread's two head rows (g and g + 8 of its warp's 16), shared by both
// kernels: sc holds this warp's half-dims part of S (sc[n][e]: key 8n + 2cq + (e & 1), row g + 8 (e >> 1)),
// exchanged through xs with the warp of the other dims half (tid ^ FA_THREADS / 2: the same heads) so both
// hold S = S_lo + S_hi; then the online softmax (lazy running max per row, FA_LAZY_MAX; p = bf16(exp(s -
// max)) as the reference rounds it, fa_exp, the exp sum from the unrounded exps), O rescaled by exp(old max
// - new max), and P packed as the A fragments of the two k16 steps of P V. The rescale is skipped when no
// row's max moved in the whole warp (the factor is then exactly 1). `exchange()` is the barrier between
// the two warps' stores to xs and their loads (the mma kernel's __syncthreads, the wgmma kernel's pair of
// warps); `before_o()` runs after the maxima and sums, before O is first touched (the warp-specialized
// kernel waits there for the P V still writing O).
template <class Exchange, class BeforeO>
DSV4_INLINE void fa_softmax_tile(float (&sc)[4][4], float* xs, int tid, int half, int cq, int j0, int nk, float scale,
                                 float (&mrow)[2], float (&lrow)[2], float (&acc)[FA_MAX_HD / 16][4],
                                 unsigned (&pa)[2][4], Exchange exchange, BeforeO before_o) {
  // (Value v of a thread at xs[v][thread]: consecutive lanes, consecutive banks.)
  float* mine = xs + tid;
  const float* other = xs + (tid ^ (FA_THREADS / 2));
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(n * 4 + e) * FA_THREADS] = sc[n][e];
  exchange();
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float lo = half == 0 ? sc[n][e] : other[(n * 4 + e) * FA_THREADS];
      const float hi = half == 0 ? other[(n * 4 + e) * FA_THREADS] : sc[n][e];
      // Logit of key j0 + 8n + 2 cq + (e & 1), head row g + 8 (e >> 1); -inf past nk.
      const int j = j0 + 8 * n + 2 * cq + (e & 1);
      sc[n][e] = j < nk ? __fmul_rn(__fadd_rn(lo, hi), scale) : -DSV4_F32_INF;
    }
  float corr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -DSV4_F32_INF;
#pragma unroll
    for (int n = 0; n < 4; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    corr[r] = fa_row_step(sc, r, mx, mrow[r], lrow[r]);  // (mx is finite: every tile holds a real key)
  }
  before_o();
  fa_rescale_o(acc, corr);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    pa[kk][0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
    pa[kk][1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
    pa[kk][2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
    pa[kk][3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
  }
}

// The combine's two steps, shared by fa_combine_kernel and fa_cluster_combine (so the two give the same
// bits): split s's weight w = exp(m_s - m) and denominator term l_s w (both 0 for a split without keys,
// m_s = -inf), and v += p w for a float4 of its unnormalised O (skipped at w = 0: that partial was never
// written).
DSV4_INLINE float fa_split_weight(float2 ml_s, float m, float& term) {
  const bool empty = ml_s.x == -DSV4_F32_INF;
  const float w = empty ? 0.0f : expf(__fsub_rn(ml_s.x, m));
  term = empty ? 0.0f : __fmul_rn(ml_s.y, w);
  return w;
}
DSV4_INLINE void fa_add_weighted(float4& v, const float4& p, float w) {
  if (w == 0.0f) return;
  v.x = __fadd_rn(v.x, __fmul_rn(p.x, w));
  v.y = __fadd_rn(v.y, __fmul_rn(p.y, w));
  v.z = __fadd_rn(v.z, __fmul_rn(p.z, w));
  v.w = __fadd_rn(v.w, __fmul_rn(p.w, w));
}

// ------------------------------------------------------------------------- the split combine in a cluster
// A token's splits launched as one cluster (1, splits, 1) (fast_attention.rs: up to FA_CLUSTER_MAX_SPLITS)
// leave their partials in their own shared memory (the loop's buffers, free by then; the host sizes the
// block for them, cluster_smem_bytes): the unnormalised O [FA_MAX_HEADS][hd + 8] f32 (8 more a row: a warp's
// float2 stores of 8 rows in distinct banks) and (max, Σ e) [FA_MAX_HEADS]. Then block r of the cluster
// combines its share of the dims (whole float4s, split evenly) of every head from every block's partials, read through
// distributed shared memory, with fa_combine_kernel's operations in its order (the same bits), and writes o.
// That saves the workspace's write and read of the partials (T x splits x H x hd f32: 16.8 MB at 64 tokens of
// 2 splits) and the combine's launch.
DSV4_INLINE int fa_cl_row(int hd) { return hd + 8; }  // f32 a partial row
// Items (float4 columns of a head) a thread combines together, their remote loads all in flight first
// (fa_cluster_combine). `dsv4 bench attn --defines FA_CL_BATCH=N` times others (1: an item a round trip).
#ifndef FA_CL_BATCH
#define FA_CL_BATCH 4
#endif
// Byte offsets in the block's shared memory: the (max, Σ e) pairs, the weights [FA_CLUSTER_MAX_SPLITS]
// [FA_MAX_HEADS], then den and max [FA_MAX_HEADS] each (fast_attention.rs cluster_smem_bytes is the end).
DSV4_INLINE int fa_cl_ml(int hd) { return 4 * FA_MAX_HEADS * fa_cl_row(hd); }
DSV4_INLINE int fa_cl_w(int hd) { return fa_cl_ml(hd) + 8 * FA_MAX_HEADS; }

// FA_SOFTMAX_SPLIT (default 1; `dsv4 bench attn --defines FA_SOFTMAX_SPLIT=0` times the unshared form, fa_softmax_tile:
// 0.3-1% slower at 64 tokens on an H100 in the same build, BENCHMARKS.md 2026-12-05): the two warps of a head group
// (dims halves w and w + 4, which hold the same 16 heads x 32 keys of S, each its half-dims part) share the softmax
// instead of both computing all of it: warp half h takes keys 16 h .. 16 h + 15 of the tile (its n-blocks 2h, 2h + 1)
// and P V's k16 step h. Three exchanges through xs: the S parts of the partner's keys (8 values, the first `exchange`,
// which the kernels also use as their tile barrier), the rows' maxima over each warp's keys (2; `pair`), and the packed
// P of each warp's k16 step (4 words; `pair`). The same S, maxima, p and P as fa_softmax_tile; each warp's exp sums
// cover its own keys, and fa_pair_lsum adds the two in a fixed order (half 0's first) before fa_finish, so the
// denominators round otherwise (within the bound's ε_den: the same terms in another order).
#ifndef FA_SOFTMAX_SPLIT
#define FA_SOFTMAX_SPLIT 1
#endif
// xs slots (of 16 a thread): 0 .. 7 the S parts, 8, 9 the maxima, 10 .. 13 P, 14, 15 the exp sums.
template <class Exchange, class Pair, class BeforeO>
DSV4_INLINE void fa_softmax_tile_split(float (&sc)[4][4], float* xs, int tid, int half, int cq, int j0, int nk,
                                       float scale, float (&mrow)[2], float (&lrow)[2],
                                       float (&acc)[FA_MAX_HD / 16][4], unsigned (&pa)[2][4], Exchange exchange,
                                       Pair pair, BeforeO before_o) {
  float* mine = xs + tid;
  const float* other = xs + (tid ^ (FA_THREADS / 2));
  const int own = 2 * half;  // this warp's first n-block (its keys: 8 own .. 8 own + 15 of the tile)
  // (Selects between constant indices: a runtime index into sc would take S's wgmma accumulators out of
  // registers.)
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(nn * 4 + e) * FA_THREADS] = half == 0 ? sc[2 + nn][e] : sc[nn][e];
  exchange();
  float v[2][4];  // S of this warp's keys: v[nn][e] is key j0 + 8 (own + nn) + 2 cq + (e & 1)
#pragma unroll
  for (int nn = 0; nn < 2; ++nn)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = j0 + 8 * (own + nn) + 2 * cq + (e & 1);
      // (lo + hi in either order: IEEE addition commutes.)
      const float part = half == 0 ? sc[nn][e] : sc[2 + nn][e];
      v[nn][e] = j < nk ? __fmul_rn(__fadd_rn(part, other[(nn * 4 + e) * FA_THREADS]), scale) : -DSV4_F32_INF;
    }
  float mx[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m = fmaxf(fmaxf(v[0][2 * r], v[0][2 * r + 1]), fmaxf(v[1][2 * r], v[1][2 * r + 1]));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    mine[(8 + r) * FA_THREADS] = m;  // -inf where all 16 of this warp's keys lie past nk
    mx[r] = m;
  }
  pair();
  float corr[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m = fmaxf(mx[r], other[(8 + r) * FA_THREADS]);  // finite: the tile holds a real key
    corr[r] = fa_row_step(v, r, m, mrow[r], lrow[r]);
  }
  // This warp's k16 step of P V (keys 16 half ..), then the partner's from it.
  const unsigned p4[4] = {pack_bf16x2(v[0][0], v[0][1]), pack_bf16x2(v[0][2], v[0][3]),
                          pack_bf16x2(v[1][0], v[1][1]), pack_bf16x2(v[1][2], v[1][3])};
#pragma unroll
  for (int k = 0; k < 4; ++k) mine[(10 + k) * FA_THREADS] = __uint_as_float(p4[k]);
  pair();
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned q = __float_as_uint(other[(10 + k) * FA_THREADS]);
    pa[0][k] = half == 0 ? p4[k] : q;
    pa[1][k] = half == 0 ? q : p4[k];
  }
  before_o();
  fa_rescale_o(acc, corr);
}

// With FA_SOFTMAX_SPLIT, a thread's exp sums cover its warp's keys only: add the partner's (the same rows and
// column pair over the other keys), half 0's first, so both warps hold the same sums. `pair` is the barrier
// of the two warps; xs is free (past the loop).
template <class Pair>
DSV4_INLINE void fa_pair_lsum(float (&lrow)[2], float* xs, int tid, int half, Pair pair) {
  if (!FA_SOFTMAX_SPLIT) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) xs[(14 + r) * FA_THREADS + tid] = lrow[r];
  pair();
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float o = xs[(14 + r) * FA_THREADS + (tid ^ (FA_THREADS / 2))];
    lrow[r] = half == 0 ? __fadd_rn(lrow[r], o) : __fadd_rn(o, lrow[r]);
  }
}

// The tile's softmax step as FA_SOFTMAX_SPLIT picks (`pair`: the two warps' barrier; unused without it).
template <class Exchange, class Pair, class BeforeO>
DSV4_INLINE void fa_softmax(float (&sc)[4][4], float* xs, int tid, int half, int cq, int j0, int nk, float scale,
                            float (&mrow)[2], float (&lrow)[2], float (&acc)[FA_MAX_HD / 16][4], unsigned (&pa)[2][4],
                            Exchange exchange, Pair pair, BeforeO before_o) {
  if (FA_SOFTMAX_SPLIT)
    fa_softmax_tile_split(sc, xs, tid, half, cq, j0, nk, scale, mrow, lrow, acc, pa, exchange, pair, before_o);
  else
    fa_softmax_tile(sc, xs, tid, half, cq, j0, nk, scale, mrow, lrow, acc, pa, exchange, before_o);
}

// round_bf16 of each of four values (common.cuh round_bf16x2: the hardware conversion for non-NaN pairs).
DSV4_INLINE float4 fa_round_bf16x4(float4 v) {
  const float2 lo = round_bf16x2(make_float2(v.x, v.y)), hi = round_bf16x2(make_float2(v.z, v.w));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// The block's result for a thread's two head rows (hg * 16 + g, + 8), dims dim0 + 8n + 2cq (+1) for
// 8n < hd / 2: splits == 1 writes o = bf16(O / (Σ e + exp(sink - max))); else the unnormalised O and
// (max, Σ e): to part_o and part_ml for fa_combine_kernel, or with `cl` (a cluster launch: the block's
// shared memory, every warp past its last read of it) to cl for fa_cluster_combine.
DSV4_INLINE void fa_finish(const float (&acc)[FA_MAX_HD / 16][4], const float (&mrow)[2], float (&lrow)[2], int t,
                           int H, int hd, int hg, int g, int cq, int half, int dim0, long long part, int splits,
                           const float* sinks, float* part_o, float2* ml, float* o, unsigned char* cl = nullptr) {
  const int hh = hd / 2;
  // Exp sums of whole rows (the quad's four parts, in a fixed order).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lrow[r] = __fadd_rn(lrow[r], __shfl_xor_sync(0xffffffffu, lrow[r], 1));
    lrow[r] = __fadd_rn(lrow[r], __shfl_xor_sync(0xffffffffu, lrow[r], 2));
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int h = hg * 16 + g + 8 * r;
    if (h >= H) continue;
    if (splits == 1) {
      const float den = __fadd_rn(lrow[r], expf(__fsub_rn(sinks[h], mrow[r])));
      float* orow = o + ((long long)t * H + h) * hd + dim0;
#pragma unroll
      for (int n = 0; n < FA_MAX_HD / 16; ++n)
        if (n * 8 < hh)
          *(float2*)(orow + n * 8 + 2 * cq) =
              round_bf16x2(make_float2(__fdiv_rn(acc[n][2 * r], den), __fdiv_rn(acc[n][2 * r + 1], den)));
    } else {
      float* prow = cl != nullptr ? (float*)cl + h * fa_cl_row(hd) + dim0 : part_o + (part * H + h) * hd + dim0;
#pragma unroll
      for (int n = 0; n < FA_MAX_HD / 16; ++n)
        if (n * 8 < hh) *(float2*)(prow + n * 8 + 2 * cq) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
      if (half == 0 && cq == 0) {
        float2* dst = cl != nullptr ? (float2*)(cl + fa_cl_ml(hd)) + h : ml + part * H + h;
        *dst = make_float2(mrow[r], lrow[r]);
      }
    }
  }
}

// Token t's keys (attn_keys.cuh; none for a padding token) and the whole tiles [tile0, tile1) of
// them that split `split` of `splits` takes; false when that run is empty.
DSV4_INLINE bool fa_split_tiles(AttnKeys* keys, int* nk, int* tile0, int* tile1, int t, int split, int splits,
                                const float* kv, const unsigned char* ring, const unsigned char* entries,
                                const int* etable, int epps, const int* selected, const int* nsel,
                                const int* positions, const int* seq_of, const int* query_start,
                                const int* seq_slots, int hd, int nope, int W, int ratio, int maxe, int topk) {
  const int s = seq_of[t];
  const int slot = seq_slots[s];
  *nk = 0;
  if (slot >= 0)
    *nk = attn_keys_init(keys, t, s, slot, kv, ring, entries, etable, epps, selected, nsel, positions, query_start,
                         hd, nope, W, ratio, maxe, topk, 1);
  const int tiles = (*nk + FA_TILE_KEYS - 1) / FA_TILE_KEYS;
  *tile0 = (int)((long long)split * tiles / splits);
  *tile1 = (int)((long long)(split + 1) * tiles / splits);
  return *tile0 < *tile1;
}

// A block whose token has no keys in its split (padding, or an empty split): o zero / max -inf (in
// the workspace, or with `cl` in the block's shared memory for fa_cluster_combine).
DSV4_INLINE void fa_empty(int t, int H, int hd, int tid, long long part, int splits, float2* ml, float* o,
                          unsigned char* cl = nullptr) {
  if (cl != nullptr) {
    for (int h = tid; h < H; h += FA_THREADS) ((float2*)(cl + fa_cl_ml(hd)))[h] = make_float2(-DSV4_F32_INF, 0.0f);
  } else if (splits == 1) {
    for (int i = tid; i < H * hd; i += FA_THREADS) o[(long long)t * H * hd + i] = 0.0f;
  } else {
    for (int h = tid; h < H; h += FA_THREADS) ml[part * H + h] = make_float2(-DSV4_F32_INF, 0.0f);
  }
}

// The cluster's splits of token t combined (see "the split combine in a cluster" above), after every block
// left its partials in `cl` (fa_finish / fa_empty): weights and denominators of each head by threads h < H
// (fa_combine_kernel's warp 0, with a serial max: exact in any order), then this block's dims slice, each
// float4 of it from every split in split order. Every thread of every block of the cluster calls it.
DSV4_INLINE void fa_cluster_combine(int t, int H, int hd, int splits, const float* sinks, float* o,
                                    unsigned char* cl, int tid) {
  cluster_sync();  // every block's partials written
  const unsigned rank = cluster_rank();
  const unsigned base = smem_addr(cl);
  float* wsh = (float*)(cl + fa_cl_w(hd));  // [FA_CLUSTER_MAX_SPLITS][FA_MAX_HEADS]
  float* den_sh = wsh + FA_CLUSTER_MAX_SPLITS * FA_MAX_HEADS;
  float* max_sh = den_sh + FA_MAX_HEADS;
  if (tid < H) {
    const int h = tid;
    float2 v[FA_CLUSTER_MAX_SPLITS];
#pragma unroll
    for (int s = 0; s < FA_CLUSTER_MAX_SPLITS; ++s)
      if (s < splits) {
        const unsigned a = cluster_map(base + fa_cl_ml(hd) + 8u * h, (unsigned)s);
        v[s] = make_float2(ld_cluster_f32(a), ld_cluster_f32(a + 4u));
      }
    float m = -DSV4_F32_INF;
#pragma unroll
    for (int s = 0; s < FA_CLUSTER_MAX_SPLITS; ++s)
      if (s < splits) m = fmaxf(m, v[s].x);
    float den = 0.0f;
#pragma unroll
    for (int s = 0; s < FA_CLUSTER_MAX_SPLITS; ++s)
      if (s < splits) {
        float term;
        wsh[s * FA_MAX_HEADS + h] = fa_split_weight(v[s], m, term);
        den = __fadd_rn(den, term);
      }
    if (m != -DSV4_F32_INF) den = __fadd_rn(den, expf(__fsub_rn(sinks[h], m)));
    den_sh[h] = den;
    max_sh[h] = m;
  }
  __syncthreads();
  // This block's float4 columns: quads q0 .. q1 - 1 of the hd / 4 (hd % 32 == 0), split evenly. A thread's
  // items go FA_CL_BATCH at a time: every remote load of the batch is issued before any sum uses one (each
  // ld.shared::cluster is volatile, so one item a round trip otherwise: 16 at 64 tokens of 2 splits).
  const int quads = hd / 4, q0 = (int)rank * quads / splits, nq = ((int)rank + 1) * quads / splits - q0;
  const int items = H * nq;
  unsigned remote[FA_CLUSTER_MAX_SPLITS];  // each block's partials in the cluster's window
#pragma unroll
  for (int s = 0; s < FA_CLUSTER_MAX_SPLITS; ++s) remote[s] = s < splits ? cluster_map(base, (unsigned)s) : 0u;
  // Item idx = (head idx / nq, quad q0 + idx % nq), stepped without a division an item (one took ~25 SASS
  // instructions: nq is a runtime value).
  FaWalk walk(tid, nq);
  for (int i0 = tid; i0 < items; i0 += FA_CL_BATCH * FA_THREADS) {
    float4 p[FA_CL_BATCH][FA_CLUSTER_MAX_SPLITS];
    int hb[FA_CL_BATCH], cb[FA_CL_BATCH];
#pragma unroll
    for (int b = 0; b < FA_CL_BATCH; ++b) {
      if (i0 + b * FA_THREADS >= items) break;
      hb[b] = walk.r;
      cb[b] = 4 * (q0 + walk.c);
      walk.next();
#pragma unroll
      for (int s = 0; s < FA_CLUSTER_MAX_SPLITS; ++s)
        if (s < splits) p[b][s] = ld_cluster_f32x4(remote[s] + 4u * (hb[b] * fa_cl_row(hd) + cb[b]));
    }
#pragma unroll
    for (int b = 0; b < FA_CL_BATCH; ++b) {
      if (i0 + b * FA_THREADS >= items) break;
      const int h = hb[b], c = cb[b];
      float* orow = o + ((long long)t * H + h) * hd + c;
      if (max_sh[h] == -DSV4_F32_INF) {
        *(float4*)orow = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        continue;
      }
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int s = 0; s < FA_CLUSTER_MAX_SPLITS; ++s)
        if (s < splits) fa_add_weighted(v, p[b][s], wsh[s * FA_MAX_HEADS + h]);
      const float den = den_sh[h];
      *(float4*)orow = fa_round_bf16x4(
          make_float4(__fdiv_rn(v.x, den), __fdiv_rn(v.y, den), __fdiv_rn(v.z, den), __fdiv_rn(v.w, den)));
    }
  }
  cluster_sync();  // no block leaves while another may still read its shared memory
}

// Grid (T, splits), FA_THREADS threads. Inputs as attention_kernel (kernels/SPEC.md), plus `staged`
// (NULL, or the batch's rows from fa_stage_rows_kernel), H <=
// FA_MAX_HEADS, hd % 32 == 0 and <= FA_MAX_HD, nope % 16 == 0 (the wrapper checks). splits == 1:
// writes o (bf16 values, o before the inverse RoPE) directly. splits > 1: writes part_o
// [T][splits][H][hd] (unnormalised) and part_ml [T][splits][H] (running max, exp sum; max -inf
// for a split without keys), which fa_combine_kernel reads.
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_attention_kernel(const unsigned short* q, const float* kv, const unsigned char* staged, const unsigned char* ring,
                        const unsigned char* entries, const int* etable, int epps,
                        const int* selected, const int* nsel, const int* positions,
                        const int* seq_of, const int* query_start, const int* seq_slots,
                        const float* sinks, int T, int H, int hd, int nope, int W, int ratio,
                        int maxe, int topk, int splits, float* part_o, float* part_ml, float* o) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) unsigned char fa_smem[];
  const int t = blockIdx.x, split = blockIdx.y;
  if (t >= T) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hg = warp & 3, half = warp >> 2;  // head group (16 heads), dims half
  const int g = lane >> 2, cq = lane & 3;      // mma fragment row / column pair
  const auto pair = [warp] { named_barrier(1u + (warp & 3), 64); };  // warps w, w + 4 (FA_SOFTMAX_SPLIT)
  const int stride = fa_row_stride(hd);
  unsigned short* qs = (unsigned short*)fa_smem;
  unsigned short* ks = qs + FA_MAX_HEADS * stride;
  float* xs = (float*)(ks + FA_TILE_KEYS * stride);
  const KvRowFmt sf = kv_fmt_kv(hd, nope, 1);  // the stored rows
  const int raw_stride = kv_round_up(sf.row_bytes + sf.scale_bytes, 16);
  unsigned char* raw = (unsigned char*)(xs + FA_WARPS * 32 * 16);
  FaSlots sl;
  sl.krow = (unsigned long long*)(raw + 2 * FA_TILE_KEYS * raw_stride);
  sl.ksc = sl.krow + 2 * FA_TILE_KEYS;
  sl.kind = (int*)(sl.ksc + 2 * FA_TILE_KEYS);
  const int hh = hd / 2;           // dims per half
  const int dim0 = half * hh;      // this warp's first dim
  const long long part = (long long)t * splits + split;
  float2* ml = (float2*)part_ml;  // (max, exp sum) pairs
  unsigned char* cl = splits > 1 && cluster_blocks() == (unsigned)splits ? fa_smem : nullptr;  // a cluster a token

  AttnKeys keys;
  int nk, tile0, tile1;
  if (!fa_split_tiles(&keys, &nk, &tile0, &tile1, t, split, splits, kv, ring, entries, etable, epps, selected, nsel,
                      positions, seq_of, query_start, seq_slots, hd, nope, W, ratio, maxe, topk)) {
    fa_empty(t, H, hd, tid, part, splits, ml, o, cl);
    if (cl != nullptr) fa_cluster_combine(t, H, hd, splits, sinks, o, cl, tid);
    return;
  }
  fa_locate(sl, keys, nk, tile0, tile1, 0, tid, staged, sf);
  fa_locate(sl, keys, nk, tile0 + 1, tile1, 1, tid, staged, sf);
  // Q's copies: the oldest copy group, landed by the loop's first wait.
  fa_copy_q(q, t, H, hd, tid, (unsigned char*)qs, [stride](int r, int u) { return 2 * (r * stride + 8 * u); });
  cp_async_commit();
  __syncthreads();  // tile0's addresses
  fa_fetch<FA_THREADS / FA_TILE_KEYS>(sl, sf, raw, raw_stride, 0, 0, tid);

  const float scale = (float)(1.0 / sqrt((double)hd));
  float acc[FA_MAX_HD / 16][4];  // O: n-tiles of 8 dims of this warp's half
#pragma unroll
  for (int n = 0; n < FA_MAX_HD / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float mrow[2] = {-DSV4_F32_INF, -DSV4_F32_INF};  // running max of rows g, g + 8
  float lrow[2] = {0.0f, 0.0f};                    // this thread's part of their exp sums
  // ldmatrix lane addresses: A (Q rows of the head group), B (K rows), V (K rows, transposed).
  const unsigned qa = smem_addr(qs + (hg * 16 + (lane & 15)) * stride + dim0 + (lane >> 4) * 8);
  const unsigned kb = smem_addr(ks + ((lane & 7) + ((lane >> 4) << 3)) * stride + dim0 +
                                   ((lane >> 3) & 1) * 8);
  const unsigned vb = smem_addr(ks + ((lane & 7) + (((lane >> 3) & 1) << 3)) * stride + dim0 +
                                   (lane >> 4) * 8);

  // Pipeline: while tile i is computed, tile i + 1's rows are in flight and tile i + 2's
  // addresses are looked up.
  for (int tile = tile0; tile < tile1; ++tile) {
    const int j0 = tile * FA_TILE_KEYS;
    const int b = (tile - tile0) & 1;
    __syncthreads();  // tile i + 1's addresses are visible; tile i - 1's K, raw, S consumed
    fa_fetch<FA_THREADS / FA_TILE_KEYS>(sl, sf, raw, raw_stride, b ^ 1, b ^ 1, tid);
    cp_async_wait<1>();
    __syncthreads();  // tile i's raw rows (and, at the first tile, Q) have landed
    // Decode the tile's keys into K (rows past nk zero).
    for (FaWalk it(tid, hd / 8); it.r < FA_TILE_KEYS; it.next())
      *(uint4*)(ks + it.r * stride + 8 * it.c) = fa_key_chunk(sl, sf, raw, raw_stride, b, it.r, 8 * it.c);
    __syncthreads();  // K is complete; address slot b is free
    fa_locate(sl, keys, nk, tile + 2, tile1, b, tid, staged, sf);

    // This warp's half of S = Q K^T: 16 heads x 32 keys (4 n-tiles of 8 keys).
    float sc[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll 4
    for (int k0 = 0; k0 < hh; k0 += 16) {
      unsigned a[4], b01[4], b23[4];
      ldmatrix_x4(qa + 2 * k0, a);
      ldmatrix_x4(kb + 2 * k0, b01);
      ldmatrix_x4(kb + 2 * (k0 + 16 * stride), b23);
      mma_bf16_16816(sc[0], a, b01[0], b01[1]);
      mma_bf16_16816(sc[1], a, b01[2], b01[3]);
      mma_bf16_16816(sc[2], a, b23[0], b23[1]);
      mma_bf16_16816(sc[3], a, b23[2], b23[3]);
    }
    unsigned pa[2][4];  // P as the A fragments of the two k16 steps of P V
    fa_softmax(sc, xs, tid, half, cq, j0, nk, scale, mrow, lrow, acc, pa, [] { __syncthreads(); }, pair, [] {});
    // O += P V over this warp's dims (n-tile pairs of 16 dims).
#pragma unroll
    for (int kk = 0; kk < 2; ++kk)
#pragma unroll
      for (int np = 0; np < FA_MAX_HD / 32; ++np) {
        if (np * 16 < hh) {
          unsigned vf[4];
          ldmatrix_x4_trans(vb + 2 * (kk * 16 * stride + np * 16), vf);
          mma_bf16_16816(acc[2 * np], pa[kk], vf[0], vf[1]);
          mma_bf16_16816(acc[2 * np + 1], pa[kk], vf[2], vf[3]);
        }
      }
  }
  fa_pair_lsum(lrow, xs, tid, half, pair);
  if (cl != nullptr) {
    cp_async_wait<0>();
    __syncthreads();  // every warp past its last read of K: the shared memory takes the partials
  }
  fa_finish(acc, mrow, lrow, t, H, hd, hg, g, cq, half, dim0, part, splits, sinks, part_o, ml, o, cl);
  if (cl != nullptr) fa_cluster_combine(t, H, hd, splits, sinks, o, cl, tid);
}

// ------------------------------------------------------------------------------------------ wgmma path

// The same attention with both products on wgmma (sm_90a), for head dim FA_WG_HD: each warpgroup
// (128 threads) takes all 64 head rows (wgmma M) and one half of the head dims. S = Q K^T: SS
// wgmma m64n32k16 over its 256 dims (Q and the key tile K-major in shared memory); S = S_lo + S_hi
// and the softmax exactly as above (fa_softmax_tile); O += P V: RS wgmma m64n256k16 with P from
// registers and V = the same key rows read N-major (imm-trans-b). Both operands sit in the 128-byte
// swizzle (16-byte unit u of a 128-byte row at u ^ (row % 8)) in chunks of 64 dims, so one stored
// tile serves as K (K-major: rows = keys) and V (N-major: rows = keys, dims contiguous; LBO = the
// chunk stride, SBO = 8 rows).
//
// Pipeline per tile i: S(i) is in flight on entry; tile i + 1's raw rows are decoded into the
// other K buffer while it runs; S(i)'s wait, the softmax, then P V(i) and S(i + 1) issued and P V(i)
// waited (every wait in the iteration of its commits: see the loop). Raw rows are fetched up to
// three tiles ahead (FA_WG_RAW slots: the tile being decoded and two in flight; addresses looked
// up with them).
// Deterministic: fixed tiles and order. Not batch invariant (the split count depends on T).
#define FA_WG_HD 512
#define FA_WG_RAW 3
#define FA_WG_Q_CHUNK (FA_MAX_HEADS * 128)  // bytes of a 64-dim chunk of Q
#define FA_WG_K_CHUNK (FA_TILE_KEYS * 128)  // bytes of a 64-dim chunk of a key tile
#define FA_WG_K_TILE (8 * FA_WG_K_CHUNK)
#define FA_WG_Q_BYTES (8 * FA_WG_Q_CHUNK)
#if FA_WG_HD != 8 * 64 || FA_MAX_HD < FA_WG_HD
#error "the wgmma path tiles a head of FA_WG_HD dims as 8 chunks of 64"
#endif
#if FA_MAX_HEADS != 64 || FA_THREADS != 256 || FA_TILE_KEYS != 32
#error "the wgmma path is two warpgroups of m64 (all heads) over 32-key tiles"
#endif

// Byte offset of 16-byte unit u (0 .. 63) of row r in a chunked, 128-byte swizzled operand whose
// 64-dim chunks are chunk_bytes apart.
DSV4_INLINE unsigned fa_sw(int r, int u, int chunk_bytes) {
  return (unsigned)((u >> 3) * chunk_bytes + r * 128 + (((u & 7) ^ (r & 7)) << 4));
}


// S (64 heads x 32 keys, f32) += Q K^T over one k16 step: both operands K-major in shared memory
// (128-byte swizzle). scale_d = 0 starts the sum from zero.
DSV4_INLINE void fa_wgmma_s(float (&d)[4][4], unsigned long long qdesc, unsigned long long kdesc, int scale_d) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0; }\n"
      :
        "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
      : "l"(qdesc), "l"(kdesc), "r"(scale_d));
}

// O (64 heads x 256 dims, f32) += P V over one k16 step of keys: P from registers (the A fragments of
// S's accumulators), V N-major in shared memory (the key rows themselves, 128-byte swizzle).
DSV4_INLINE void fa_wgmma_pv(float (&d)[FA_MAX_HD / 16][4], const unsigned (&a)[4], unsigned long long vdesc) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "{%128, %129, %130, %131}, %132, p, 1, 1, 1; }\n"
      :
        "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]),
        "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]),
        "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
        "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]),
        "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]),
        "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]),
        "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]),
        "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]),
        "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]),
        "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]),
        "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]),
        "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]),
        "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]),
        "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]),
        "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(vdesc), "r"(1));
}


// Grid (T, splits), FA_THREADS threads, the inputs and outputs of fa_attention_kernel; hd == FA_WG_HD
// (the wrapper checks). Dynamic shared memory 1024-byte aligned: Q, two K tiles, the S exchange,
// FA_WG_RAW raw tiles and address slots (fast_attention.rs wgmma_smem_bytes).
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_attention_wgmma_kernel(const unsigned short* q, const float* kv, const unsigned char* staged,
                              const unsigned char* ring,
                              const unsigned char* entries, const int* etable, int epps,
                              const int* selected, const int* nsel, const int* positions,
                              const int* seq_of, const int* query_start, const int* seq_slots,
                              const float* sinks, int T, int H, int hd, int nope, int W, int ratio,
                              int maxe, int topk, int splits, float* part_o, float* part_ml, float* o) {
  dsv4_pdl_begin();
  extern __shared__ __align__(1024) unsigned char fa_smem[];
  if ((smem_addr(fa_smem) & 1023u) != 0) __trap();  // the swizzle needs 1024-byte aligned operands
  const int t = blockIdx.x, split = blockIdx.y;
  if (t >= T) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // head group (16 rows of the m64), warpgroup = dims half. The warpgroup index goes through a shuffle, and so
  // do the split's tiles below, so that the compiler knows they are the same in the whole warp: the wgmma
  // descriptors made from them then live in uniform registers, with no move to them before each wgmma (the
  // tile loop's SASS: 68 R2UR -> 20, 1305 instructions -> 1193 with the decode's branch below; bench attn,
  // H200, 16 and 64 tokens: 2-3% faster, BENCHMARKS.md 2026-12-05, thirty-first part).
  const int hg = warp & 3, half = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int g = lane >> 2, cq = lane & 3;      // accumulator fragment row / column pair
  const auto pair = [warp] { named_barrier(1u + (warp & 3), 64); };  // warps w, w + 4 (FA_SOFTMAX_SPLIT)
  unsigned char* qs = fa_smem;
  unsigned char* ks = qs + FA_WG_Q_BYTES;
  float* xs = (float*)(ks + 2 * FA_WG_K_TILE);
  const KvRowFmt sf = kv_fmt_kv(hd, nope, 1);  // the stored rows
  const int raw_stride = kv_round_up(sf.row_bytes + sf.scale_bytes, 16);
  unsigned char* raw = (unsigned char*)(xs + FA_THREADS * 16);
  const bool flash_rows = sf.nope == FA_DF_NOPE && sf.scale_bytes >= 8;  // (FA_DECODE_FAST: the record's 8 bytes)
  FaSlots sl;
  sl.krow = (unsigned long long*)(raw + FA_WG_RAW * FA_TILE_KEYS * raw_stride);
  sl.ksc = sl.krow + FA_WG_RAW * FA_TILE_KEYS;
  sl.kind = (int*)(sl.ksc + FA_WG_RAW * FA_TILE_KEYS);
  const int dim0 = half * (FA_WG_HD / 2);
  const long long part = (long long)t * splits + split;
  float2* ml = (float2*)part_ml;
  unsigned char* cl = splits > 1 && cluster_blocks() == (unsigned)splits ? fa_smem : nullptr;  // a cluster a token

  AttnKeys keys;
  int nk, tile0, tile1;
  if (!fa_split_tiles(&keys, &nk, &tile0, &tile1, t, split, splits, kv, ring, entries, etable, epps, selected, nsel,
                      positions, seq_of, query_start, seq_slots, hd, nope, W, ratio, maxe, topk)) {
    fa_empty(t, H, hd, tid, part, splits, ml, o, cl);
    if (cl != nullptr) fa_cluster_combine(t, H, hd, splits, sinks, o, cl, tid);
    return;
  }
  tile0 = __shfl_sync(0xffffffffu, tile0, 0);  // (see `half`: the tile loop and its K buffer index warp-uniform)
  tile1 = __shfl_sync(0xffffffffu, tile1, 0);
  // The keys of raw / address slot rs decoded into K buffer kb: 8 threads a key row (its kind and
  // addresses read once), thread u of a row taking the 16-byte unit u of each 64-dim chunk.
  auto decode = [&](int rs, int kb) {
    const int r = tid >> 3, u = tid & 7;
    const int k = sl.kind[rs * FA_TILE_KEYS + r];
    const unsigned char* rr = raw + (rs * FA_TILE_KEYS + r) * raw_stride;
    const float* fr = (const float*)sl.krow[rs * FA_TILE_KEYS + r];
    unsigned char* dst = ks + kb * FA_WG_K_TILE + fa_sw(r, u, FA_WG_K_CHUNK);
    if (FA_DECODE_FAST && flash_rows && k == FA_KEY_STORED) {
      const uint2 rec = *(const uint2*)(rr + sf.row_bytes);
      if (fa_df_record_ok(rec)) {
#pragma unroll
        for (int j = 0; j < FA_DF_BLOCKS; ++j)
          *(uint4*)(dst + j * FA_WG_K_CHUNK) =
              fa_df_chunk(rr + 64 * j + 8 * u, ((j < 4 ? rec.x : rec.y) >> (8 * (j & 3))) & 0xffu);
#pragma unroll
        for (int j = FA_DF_BLOCKS; j < FA_WG_HD / 64; ++j)
          *(uint4*)(dst + j * FA_WG_K_CHUNK) = *(const uint4*)(rr + FA_DF_NOPE + 2 * (64 * j + 8 * u - FA_DF_NOPE));
        fence_proxy_async_shared();
        return;
      }
    }
    if (k == FA_KEY_STORED) {  // (a stored row, the common case: one branch a row, not one a chunk)
#pragma unroll
      for (int j = 0; j < FA_WG_HD / 64; ++j) *(uint4*)(dst + j * FA_WG_K_CHUNK) = fa_stored_chunk(sf, rr, 64 * j + 8 * u);
    } else {  // a batch row's f32 values, or zeros past the split's keys
#pragma unroll
      for (int j = 0; j < FA_WG_HD / 64; ++j) {
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (k == FA_KEY_BATCH) w = fa_f32_chunk(fr, 64 * j + 8 * u);
        *(uint4*)(dst + j * FA_WG_K_CHUNK) = w;
      }
    }
    fence_proxy_async_shared();  // generic-proxy writes, read next by wgmma (async proxy)
  };
  for (int i = 0; i < FA_WG_RAW; ++i) fa_locate(sl, keys, nk, tile0 + i, tile1, i, tid, staged, sf);
  // Q's copies: the oldest copy group, landed by the prologue's first wait.
  fa_copy_q(q, t, H, hd, tid, qs, [](int r, int u) { return fa_sw(r, u, FA_WG_Q_CHUNK); });
  cp_async_commit();
  __syncthreads();  // the first tiles' addresses
  for (int i = 0; i < FA_WG_RAW; ++i) fa_fetch<FA_THREADS / FA_TILE_KEYS>(sl, sf, raw, raw_stride, i, i, tid);
  cp_async_wait<FA_WG_RAW - 1>();
  __syncthreads();  // Q and tile0's raw rows have landed
  decode(0, 0);     // (its fence also orders this thread's Q copies and zero rows before the wgmmas)
  cp_async_wait<FA_WG_RAW - 2>();
  __syncthreads();  // K buffer 0 and Q complete; tile0 + 1's raw rows landed

  const float scale = (float)(1.0 / sqrt((double)hd));
  float acc[FA_MAX_HD / 16][4];  // O: 64 heads x this warpgroup's 256 dims (wgmma D fragments)
#pragma unroll
  for (int n = 0; n < FA_MAX_HD / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float mrow[2] = {-DSV4_F32_INF, -DSV4_F32_INF};
  float lrow[2] = {0.0f, 0.0f};
  // Descriptors of this warpgroup's dims half: Q and a K tile (K-major), V (N-major).
  const unsigned long long qd = wgmma_desc_sw128(qs + half * 4 * FA_WG_Q_CHUNK);
  const unsigned long long kd0 = wgmma_desc_sw128(ks + half * 4 * FA_WG_K_CHUNK);
  // V: N-major 128-byte swizzle (CUTLASS's canonical MN-major SW128 layout): atoms of 8 key rows x 128
  // bytes of dims, LBO the step between 64-dim chunks (along N), SBO between 8-row groups (along K).
  const unsigned long long vd0 = wgmma_desc(ks + half * 4 * FA_WG_K_CHUNK, FA_WG_K_CHUNK, 1024, 1);
  // S of the tile in K buffer kb: this warpgroup's 256 dims, 16 k16 steps (a 64-dim chunk is 4 steps of
  // 32 bytes), one commit group.
  float sc[4][4];
  auto issue_s = [&](int kb) {
    const unsigned long long kd = kd0 + ((kb * FA_WG_K_TILE) >> 4);
    wgmma_fence();
#pragma unroll
    for (int st = 0; st < 16; ++st)
      fa_wgmma_s(sc, qd + (((st >> 2) * FA_WG_Q_CHUNK + (st & 3) * 32) >> 4),
                 kd + (((st >> 2) * FA_WG_K_CHUNK + (st & 3) * 32) >> 4), st > 0);
    wgmma_commit();
  };
  issue_s(0);

  // Tile i: S(i) is in flight on entry. Every wait is in the iteration of its commits (ptxas then sees
  // which group retires; a wait<1> retiring the previous iteration's P V made it serialize every wgmma).
  int rcur = 0;  // raw / address slot of tile i (i mod FA_WG_RAW)
  for (int tile = tile0; tile < tile1; ++tile) {
    const int b = (tile - tile0) & 1;  // K buffer of tile i
    const int rnext = rcur + 1 == FA_WG_RAW ? 0 : rcur + 1;
    decode(rnext, b ^ 1);  // tile i + 1 (zeros past the split's keys) while S(i) runs
    fa_locate(sl, keys, nk, tile + FA_WG_RAW, tile1, rcur, tid, staged, sf);  // into tile i's slot, decoded already
    wgmma_wait<0>();  // S(i)
    wgmma_fence_operand(sc);
    unsigned pa[2][4];
    // (Its barrier: K buffer b ^ 1 and the new addresses complete.)
    fa_softmax(sc, xs, tid, half, cq, tile * FA_TILE_KEYS, nk, scale, mrow, lrow, acc, pa, [] { __syncthreads(); },
               pair, [] {});
    fa_fetch<FA_THREADS / FA_TILE_KEYS>(sl, sf, raw, raw_stride, rcur, rcur, tid);  // tile i + FA_WG_RAW
    // P V(i) over this warpgroup's dims, two k16 steps of 16 keys (2048 bytes of rows apart), then
    // S(i + 1) (past the split: zero keys, never read).
    wgmma_fence_operand(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) fa_wgmma_pv(acc, pa[kk], vd0 + ((b * FA_WG_K_TILE + kk * 2048) >> 4));
    wgmma_commit();
    issue_s(b ^ 1);
    wgmma_wait<1>();  // P V(i)
    wgmma_fence_operand(acc);
    cp_async_wait<FA_WG_RAW - 2>();  // tile i + 2's raw rows (this thread's copies)
    __syncthreads();  // both warpgroups past P V(i): K buffer b free; everyone's tile i + 2 rows landed
    rcur = rnext;
  }
  wgmma_wait<0>();  // the S past the last tile
  wgmma_fence_operand(sc);
  cp_async_wait<0>();
  fa_pair_lsum(lrow, xs, tid, half, pair);
  if (cl != nullptr) __syncthreads();  // both warpgroups' wgmmas done with K: the shared memory takes the partials
  fa_finish(acc, mrow, lrow, t, H, hd, hg, g, cq, half, dim0, part, splits, sinks, part_o, ml, o, cl);
  if (cl != nullptr) fa_cluster_combine(t, H, hd, splits, sinks, o, cl, tid);
}

// ------------------------------------------------------------------------------ warp-specialized wgmma path

// fa_attention_wgmma_ws_kernel (and fa_attention_wgmma_ws_early_kernel, below: fa_attention_ws's EARLY_PV):
// the wgmma path's attention (the same operands, products, softmax code
// and bits), warp-specialized. Roles (FA_WS_THREADS threads): warpgroups 0 and 1 are the consumers of the
// wgmma path above (all 64 heads, a dims half each); warpgroup 2 is the producer, which looks up each
// tile's key addresses, fetches its raw rows (cp.async, up to two tiles ahead) and decodes them into a
// ring of FA_WS_KBUF K buffers, signalling each full on an mbarrier; the consumers free a buffer on
// another once the P V that read it has completed. setmaxnreg gives the producer's registers to the
// consumers (FA_WS_CONSUMER_REGS / FA_WS_PRODUCER_REGS).
//
// The consumers' pipeline per tile i: S(i) has completed and P V(i - 1) may still run on entry; S(i + 1)
// is issued first, so the tensor cores run P V(i - 1) and S(i + 1) during the first part of the softmax
// of tile i (the halves' exchange, the maxima, the exps and sums); the softmax then waits for both
// (before_o) before it touches O, and P V(i) is issued. So S does not wait in the softmax's chain. The
// decode does, in part: with FA_WS_KBUF = 3 every buffer is taken at a step's start (tile i - 1's by P V(i -
// 1), tile i's, tile i + 1's by S(i + 1)), so the producer can start tile i + 1 only once P V(i - 2) has
// retired (step i - 1's before_o), and step i waits for it at its first instruction: the decode overlaps the end
// of step i - 1 (O's rescale, P's packing, P V's issue) and P V(i - 1), not a whole softmax. A fourth buffer
// (32 KB) would let the producer run a tile ahead, but does not fit beside two raw tiles (252,848 bytes of
// 232,448); with one raw tile the fetch's latency would land on the producer instead.
// Every wait retires all groups: ptxas serialized every wgmma when a wait had to leave one in flight
// across the loop's back edge (or a copy of S's accumulators crossed it), so the two S register sets
// alternate (the loop takes tiles in pairs).
// The two warps of a head group's halves (w and w + 4) exchange their halves of S through xs with a
// 64-thread barrier of their own (two a tile: one before the stores, so the partner has read the last
// tile's values, and one after).
// Deterministic: fixed tiles and order. Not batch invariant (the split count depends on T).
#define FA_WS_THREADS (FA_THREADS + 128)
#define FA_WS_PRODUCER0 FA_THREADS  // first thread of the producer warpgroup
// FA_WS_KBUF (K buffers), FA_WS_RAW (raw tiles), FA_WS_ADDR (address slots) come from dsv4_consts.cuh
// (fast_attention.rs). Three K buffers: tile i - 1's (its P V), tile i's and tile i + 1's (S(i + 1)); so the
// producer decodes tile i + 1 between P V(i - 2)'s retirement and step i's start (above). Raw tiles: the one
// being decoded and one in flight; address slots: those two and two looked up ahead (their rows asked into L2
// then: fa_locate<true>), so a tile's fetch comes two tiles after its lookup.
// FA_WS_CONSUMER_REGS and FA_WS_PRODUCER_REGS (setmaxnreg's counts) come from dsv4_consts.cuh too: the host
// refuses the launch unless ptxas gave the kernel the registers they add up to (with fewer, the consumers'
// setmaxnreg.inc would wait forever).
// Named barriers (0 is __syncthreads): the consumers' 256 threads, the producer's 128, and the
// pair of warps w, w + 4 (FA_WS_BAR_PAIR0 + w).
#define FA_WS_BAR_CONSUMERS 1
#define FA_WS_BAR_PRODUCER 2
#define FA_WS_BAR_PAIR0 3
// The warp-specialized block's shared memory (dynamic, 1024-byte aligned start): Q, FA_WS_KBUF K tiles,
// the S exchange, FA_WS_RAW raw tiles, FA_WS_ADDR address slots, then the K ring's mbarriers:
// full[FA_WS_KBUF] (the producer's 128 threads arrive) and empty[FA_WS_KBUF] (the consumers' 256).
// fast_attention.rs wgmma_ws_smem_bytes is its size.
struct FaWsSmem {
  unsigned char* qs;
  unsigned char* ks;
  float* xs;
  unsigned char* raw;
  FaSlots sl;
  unsigned bars;  // shared-space address
  __device__ __forceinline__ FaWsSmem(unsigned char* base, int raw_stride) {
    qs = base;
    ks = qs + FA_WG_Q_BYTES;
    xs = (float*)(ks + FA_WS_KBUF * FA_WG_K_TILE);
    raw = (unsigned char*)(xs + FA_THREADS * 16);
    sl.krow = (unsigned long long*)(raw + FA_WS_RAW * FA_TILE_KEYS * raw_stride);
    sl.ksc = sl.krow + FA_WS_ADDR * FA_TILE_KEYS;
    sl.kind = (int*)(sl.ksc + FA_WS_ADDR * FA_TILE_KEYS);
    bars = smem_addr(sl.kind + FA_WS_ADDR * FA_TILE_KEYS);
  }
  __device__ __forceinline__ unsigned full(int kb) const { return bars + 8u * kb; }
  __device__ __forceinline__ unsigned empty(int kb) const { return bars + 8u * (FA_WS_KBUF + kb); }
};
#if (FA_WS_ADDR * FA_TILE_KEYS * 20) % 8 != 0
#error "the mbarriers after the address slots need 8-byte alignment"
#endif

// The producer warpgroup (p = 0 .. 127): tiles [tile0, tile1) of the token's keys, each looked up
// FA_WS_ADDR - 1 tiles ahead (threads p < FA_TILE_KEYS, fa_locate), fetched FA_WS_RAW - 1 ahead (4
// threads a row) and decoded into K buffer i mod FA_WS_KBUF once the consumers have freed it: 4
// threads a key row, thread u the 16-byte units u and u + 4 of each 64-dim chunk, exact to BF16 (zeros
// past the split's keys), then a proxy fence and an arrival on the buffer's full barrier.
#if FA_TILE_KEYS * 4 != 128
#error "the producer gives each key row of a tile 4 threads"
#endif
#if KV_FP8_BLOCK % 64 != 0
#error "the producer reads one scale for the two units of a 64-dim chunk"
#endif
DSV4_INLINE void fa_ws_produce(const FaWsSmem& m, const AttnKeys& keys, int nk, int tile0, int tile1,
                               const unsigned char* staged, const KvRowFmt& sf, int raw_stride, int p) {
  for (int i = 0; i < FA_WS_ADDR; ++i) fa_locate<true>(m.sl, keys, nk, tile0 + i, tile1, i, p, staged, sf);
  named_barrier(FA_WS_BAR_PRODUCER, 128);  // the first tiles' addresses
  for (int i = 0; i < FA_WS_RAW; ++i) fa_fetch<4>(m.sl, sf, m.raw, raw_stride, i, i, p);
  const int r = p >> 2, u0 = p & 3;
  int as = 0, rs = 0, kb = 0;  // address slot, raw tile, K buffer of tile i
  for (int i = 0; tile0 + i < tile1; ++i) {
    cp_async_wait<FA_WS_RAW - 1>();           // this thread's copies of tile i
    named_barrier(FA_WS_BAR_PRODUCER, 128);  // everyone's; tile i + FA_WS_RAW's addresses
    if (i >= FA_WS_KBUF) mbar_wait(m.empty(kb), (unsigned)((i / FA_WS_KBUF - 1) & 1));
    // The row's kind decides once for its 16 units (a branch per unit cost ~20 instructions each).
    const int k = m.sl.kind[as * FA_TILE_KEYS + r];
    unsigned char* dst = m.ks + kb * FA_WG_K_TILE + r * 128;
    const int sw0 = (u0 ^ (r & 7)) << 4, sw1 = ((u0 + 4) ^ (r & 7)) << 4;  // units u0, u0 + 4 of a chunk
    if (k == FA_KEY_STORED) {
      const unsigned char* rr = m.raw + (rs * FA_TILE_KEYS + r) * raw_stride;
      const int fp8_chunks = sf.nope / 64;  // chunks all of whose values are FP8
#pragma unroll
      for (int j = 0; j < FA_WG_HD / 64; ++j) {
        const int c0 = 64 * j + 8 * u0, c1 = c0 + 32;
        uint4 w0, w1;
        if (j < fp8_chunks) {  // both FP8, of one scale block (KV_FP8_BLOCK % 64 == 0): its scale once
          const float sc = fa_e8m0(rr[sf.row_bytes + c0 / KV_FP8_BLOCK]);
          w0 = fa_fp8_chunk(rr + c0, sc);
          w1 = fa_fp8_chunk(rr + c1, sc);
        } else {
          w0 = fa_stored_chunk(sf, rr, c0);
          w1 = fa_stored_chunk(sf, rr, c1);
        }
        *(uint4*)(dst + j * FA_WG_K_CHUNK + sw0) = w0;
        *(uint4*)(dst + j * FA_WG_K_CHUNK + sw1) = w1;
      }
    } else if (k == FA_KEY_BATCH) {
      const float* fr = (const float*)m.sl.krow[as * FA_TILE_KEYS + r];
#pragma unroll
      for (int j = 0; j < FA_WG_HD / 64; ++j) {
        *(uint4*)(dst + j * FA_WG_K_CHUNK + sw0) = fa_f32_chunk(fr, 64 * j + 8 * u0);
        *(uint4*)(dst + j * FA_WG_K_CHUNK + sw1) = fa_f32_chunk(fr, 64 * j + 8 * u0 + 32);
      }
    } else {
#pragma unroll
      for (int j = 0; j < FA_WG_HD / 64; ++j) {
        *(uint4*)(dst + j * FA_WG_K_CHUNK + sw0) = make_uint4(0u, 0u, 0u, 0u);
        *(uint4*)(dst + j * FA_WG_K_CHUNK + sw1) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    fence_proxy_async_shared();  // generic-proxy writes, read next by wgmma (async proxy)
    mbar_arrive(m.full(kb));
    named_barrier(FA_WS_BAR_PRODUCER, 128);  // raw tile rs and address slot as are read
    const int as_fetch = as + FA_WS_RAW < FA_WS_ADDR ? as + FA_WS_RAW : as + FA_WS_RAW - FA_WS_ADDR;
    fa_fetch<4>(m.sl, sf, m.raw, raw_stride, as_fetch, rs, p);  // tile i + FA_WS_RAW
    fa_locate<true>(m.sl, keys, nk, tile0 + i + FA_WS_ADDR, tile1, as, p, staged, sf);
    as = as + 1 == FA_WS_ADDR ? 0 : as + 1;
    rs = rs + 1 == FA_WS_RAW ? 0 : rs + 1;
    kb = kb + 1 == FA_WS_KBUF ? 0 : kb + 1;
  }
  cp_async_wait<0>();
}

// The warp-specialized kernels' body (fa_attention_wgmma_ws_kernel, fa_attention_wgmma_ws_early_kernel):
// grid (T, splits), FA_WS_THREADS threads, the inputs and outputs of fa_attention_kernel; hd == FA_WG_HD (the
// wrapper checks). Dynamic shared memory as FaWsSmem. EARLY_PV: where the consumers retire P V(i - 1) and free
// its K buffer.
// - false: at the softmax's first touch of O (before_o), with S(i + 1), which was issued at step i's start.
//   The producer can then decode tile i + 1 only from step i - 1's before_o on, and step i waits for it at its
//   start (the comment above).
// - true: at the softmax's exchange (after the S halves are stored and the pair's barrier), before S(i + 1) is
//   issued; before_o then retires S(i + 1) alone. P V(i - 1), issued at step i - 1's end, is exposed for what
//   the stores and the barrier do not cover; in return the producer decodes tile i + 2 from step i's exchange
//   on, a step ahead, and the decode leaves the consumers' path. The same operations either way, so the same
//   bits; which one is faster is the device's to say (`dsv4 bench attn`: fast_wgmma_ws, fast_wgmma_ws_early).
// Not AttentionPath::Auto's: both measured slower than the wgmma kernel (fast_attention.rs, AttentionPath).
template <bool EARLY_PV>
DSV4_INLINE void fa_attention_ws(const unsigned short* q, const float* kv, const unsigned char* staged,
                                 const unsigned char* ring, const unsigned char* entries, const int* etable,
                                 int epps, const int* selected, const int* nsel, const int* positions,
                                 const int* seq_of, const int* query_start, const int* seq_slots,
                                 const float* sinks, int T, int H, int hd, int nope, int W, int ratio,
                                 int maxe, int topk, int splits, float* part_o, float* part_ml, float* o) {
  extern __shared__ __align__(1024) unsigned char fa_smem[];
  if ((smem_addr(fa_smem) & 1023u) != 0) __trap();  // the swizzle needs 1024-byte aligned operands
  const int t = blockIdx.x, split = blockIdx.y;
  if (t >= T) return;
  const KvRowFmt sf = kv_fmt_kv(hd, nope, 1);  // the stored rows
  const int raw_stride = kv_round_up(sf.row_bytes + sf.scale_bytes, 16);
  const FaWsSmem m(fa_smem, raw_stride);
  if (threadIdx.x == 0) {
    for (int kb = 0; kb < FA_WS_KBUF; ++kb) {
      mbar_init(m.full(kb), 128);
      mbar_init(m.empty(kb), FA_THREADS);
    }
  }
  __syncthreads();
  // (Each role works out its keys after its setmaxnreg: values live across it would be spilled.)
  AttnKeys keys;
  int nk, tile0, tile1;
  if (threadIdx.x >= FA_WS_PRODUCER0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(FA_WS_PRODUCER_REGS));
    if (fa_split_tiles(&keys, &nk, &tile0, &tile1, t, split, splits, kv, ring, entries, etable, epps, selected, nsel,
                       positions, seq_of, query_start, seq_slots, hd, nope, W, ratio, maxe, topk))
      fa_ws_produce(m, keys, nk, tile0, tile1, staged, sf, raw_stride, threadIdx.x - FA_WS_PRODUCER0);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(FA_WS_CONSUMER_REGS));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // The warpgroup index through a shuffle, so the compiler knows it is the same in the whole warp: the
  // descriptors built from it then live in uniform registers (no R2UR per wgmma).
  const int hg = warp & 3, half = __shfl_sync(0xffffffffu, warp >> 2, 0);
  const int g = lane >> 2, cq = lane & 3;      // accumulator fragment row / column pair
  const int dim0 = half * (FA_WG_HD / 2);
  const long long part = (long long)t * splits + split;
  float2* ml = (float2*)part_ml;
  if (!fa_split_tiles(&keys, &nk, &tile0, &tile1, t, split, splits, kv, ring, entries, etable, epps, selected, nsel,
                      positions, seq_of, query_start, seq_slots, hd, nope, W, ratio, maxe, topk)) {
    fa_empty(t, H, hd, tid, part, splits, ml, o);
    return;
  }
  // Q's copies by the consumers (the producer's copy groups are its own threads').
  fa_copy_q(q, t, H, hd, tid, m.qs, [](int r, int u) { return fa_sw(r, u, FA_WG_Q_CHUNK); });
  cp_async_commit();
  // (The same in every thread; shuffled so the compiler knows it: the loop and its K buffer index are
  // then warp-uniform, and so are the descriptors.)
  tile0 = __shfl_sync(0xffffffffu, tile0, 0);
  tile1 = __shfl_sync(0xffffffffu, tile1, 0);
  cp_async_wait<0>();          // this thread's Q copies
  fence_proxy_async_shared();  // Q's generic-proxy writes (the copies, the zero rows), read by wgmma
  named_barrier(FA_WS_BAR_CONSUMERS, FA_THREADS);

  const float scale = (float)(1.0 / sqrt((double)hd));
  float acc[FA_MAX_HD / 16][4];  // O: 64 heads x this warpgroup's 256 dims (wgmma D fragments)
#pragma unroll
  for (int n = 0; n < FA_MAX_HD / 16; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float mrow[2] = {-DSV4_F32_INF, -DSV4_F32_INF};
  float lrow[2] = {0.0f, 0.0f};
  // Descriptors of this warpgroup's dims half: Q and a K tile (K-major), V (N-major).
  const unsigned long long qd = wgmma_desc_sw128(m.qs + half * 4 * FA_WG_Q_CHUNK);
  const unsigned long long kd0 = wgmma_desc_sw128(m.ks + half * 4 * FA_WG_K_CHUNK);
  // V: N-major 128-byte swizzle (CUTLASS's canonical MN-major SW128 layout): atoms of 8 key rows x 128
  // bytes of dims, LBO the step between 64-dim chunks (along N), SBO between 8-row groups (along K).
  const unsigned long long vd0 = wgmma_desc(m.ks + half * 4 * FA_WG_K_CHUNK, FA_WG_K_CHUNK, 1024, 1);
  // S of the tile in K buffer kb into s: this warpgroup's 256 dims, 16 k16 steps (a 64-dim chunk is 4
  // steps of 32 bytes), one commit group.
  auto issue_s = [&](float (&s)[4][4], int kb) {
    const unsigned long long kd = kd0 + ((kb * FA_WG_K_TILE) >> 4);
    wgmma_fence();
#pragma unroll
    for (int st = 0; st < 16; ++st)
      fa_wgmma_s(s, qd + (((st >> 2) * FA_WG_Q_CHUNK + (st & 3) * 32) >> 4),
                 kd + (((st >> 2) * FA_WG_K_CHUNK + (st & 3) * 32) >> 4), st > 0);
    wgmma_commit();
  };
  const unsigned pair_bar = FA_WS_BAR_PAIR0 + (warp & 3);  // warps w and w + 4 (tid ^ FA_THREADS / 2)
  // Tile i (sc: S(i), complete; sn: the other set, for S(i + 1)).
  int kb = 0;  // K buffer of tile i
  auto step = [&](float (&sc)[4][4], float (&sn)[4][4], int i) {
    const int tile = tile0 + i;
    const int kprev = kb == 0 ? FA_WS_KBUF - 1 : kb - 1;
    const int knext = kb + 1 == FA_WS_KBUF ? 0 : kb + 1;
    wgmma_fence_operand(sc);  // S(i): retired by the last wait (the last tile's before_o, or the prologue's)
    // Past the split's last tile S(i + 1) reads buffer knext as it is (an earlier tile's keys, or never
    // written in a block of one or two tiles; no writer now: the producer stops at tile1) and is never
    // used: issued on one path either way (a branch around wgmmas made ptxas serialize them; the
    // accumulators merged from two paths).
    auto next_s = [&] {
      if (tile + 1 < tile1) mbar_wait(m.full(knext), (unsigned)(((i + 1) / FA_WS_KBUF) & 1));
      issue_s(sn, knext);
    };
    // P V(i - 1) retired: O is ours again, and K buffer kprev free.
    auto pv_done = [&] {
      wgmma_fence_operand(acc);
      if (i > 0) mbar_arrive(m.empty(kprev));
    };
    if (!EARLY_PV) next_s();
    unsigned pa[2][4];
    named_barrier(pair_bar, 64);  // the partner has read the last tile's S half from xs
    fa_softmax(
        sc, m.xs, tid, half, cq, tile * FA_TILE_KEYS, nk, scale, mrow, lrow, acc, pa,
        [&] {
          named_barrier(pair_bar, 64);
          if (EARLY_PV) {
            wgmma_wait<0>();  // P V(i - 1)
            pv_done();
            next_s();
          }
        },
        [&] { named_barrier(pair_bar, 64); },
        [&] {
          wgmma_wait<0>();  // S(i + 1), and (!EARLY_PV) P V(i - 1)
          if (!EARLY_PV) pv_done();
        });
    // P V(i) over this warpgroup's dims, two k16 steps of 16 keys (2048 bytes of rows apart).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) fa_wgmma_pv(acc, pa[kk], vd0 + ((kb * FA_WG_K_TILE + kk * 2048) >> 4));
    wgmma_commit();
    kb = knext;
  };
  float sa[4][4], sb[4][4];
  mbar_wait(m.full(0), 0u);
  issue_s(sa, 0);
  wgmma_wait<0>();
  for (int i = 0; tile0 + i < tile1; i += 2) {
    step(sa, sb, i);
    if (tile0 + i + 1 >= tile1) break;
    step(sb, sa, i + 1);
  }
  wgmma_wait<0>();
  wgmma_fence_operand(acc);
  fa_pair_lsum(lrow, m.xs, tid, half, [&] { named_barrier(pair_bar, 64); });
  fa_finish(acc, mrow, lrow, t, H, hd, hg, g, cq, half, dim0, part, splits, sinks, part_o, ml, o);
}

// (Written out twice: tests/kernel_decls.rs reads each entry point's signature from this text.)
extern "C" __global__ void __launch_bounds__(FA_WS_THREADS, 1)
    fa_attention_wgmma_ws_kernel(const unsigned short* q, const float* kv, const unsigned char* staged,
                                 const unsigned char* ring, const unsigned char* entries, const int* etable,
                                 int epps, const int* selected, const int* nsel, const int* positions,
                                 const int* seq_of, const int* query_start, const int* seq_slots,
                                 const float* sinks, int T, int H, int hd, int nope, int W, int ratio,
                                 int maxe, int topk, int splits, float* part_o, float* part_ml, float* o) {
  dsv4_pdl_begin();
  fa_attention_ws<false>(q, kv, staged, ring, entries, etable, epps, selected, nsel, positions, seq_of, query_start,
                         seq_slots, sinks, T, H, hd, nope, W, ratio, maxe, topk, splits, part_o, part_ml, o);
}

extern "C" __global__ void __launch_bounds__(FA_WS_THREADS, 1)
    fa_attention_wgmma_ws_early_kernel(const unsigned short* q, const float* kv, const unsigned char* staged,
                                       const unsigned char* ring, const unsigned char* entries, const int* etable,
                                       int epps, const int* selected, const int* nsel, const int* positions,
                                       const int* seq_of, const int* query_start, const int* seq_slots,
                                       const float* sinks, int T, int H, int hd, int nope, int W, int ratio,
                                       int maxe, int topk, int splits, float* part_o, float* part_ml, float* o) {
  dsv4_pdl_begin();
  fa_attention_ws<true>(q, kv, staged, ring, entries, etable, epps, selected, nsel, positions, seq_of, query_start,
                        seq_slots, sinks, T, H, hd, nope, W, ratio, maxe, topk, splits, part_o, part_ml, o);
}

// The splits of fa_attention_kernel combined, in split order: m = max_s m_s, w_s = exp(m_s - m)
// (0 for a split without keys), den = sum_s l_s w_s + exp(sink - m), o = bf16(sum_s O_s w_s /
// den); a token without keys (padding) gets zeros. Grid (T, H), blockDim a multiple of 32;
// splits <= FA_MAX_SPLITS <= 32, hd % 4 == 0. Warp 0 makes the weights once per block, lane s
// for split s (the max by shuffles is exact in any order; one expf a lane, where one thread's 32
// serial expf cost ~0.8 us at T <= 8); each lane adds den's terms in split order (lane 0's is
// kept). Each thread then has FA_COMBINE_LOADS splits' partials of its four channels in flight.
#if FA_MAX_SPLITS > 32
#error "fa_combine_kernel gives each split a lane of warp 0"
#endif
extern "C" __global__ void fa_combine_kernel(const float* part_o, const float* part_ml,
                                             const float* sinks, int T, int H, int hd, int splits,
                                             float* o) {
  dsv4_pdl_begin();
  __shared__ float wsh[FA_MAX_SPLITS];
  __shared__ float den_sh, max_sh;
  const int t = blockIdx.x, h = blockIdx.y;
  if (t >= T || h >= H) return;
  const long long base = (long long)t * splits;
  const float2* ml = (const float2*)part_ml;
  if (threadIdx.x < 32) {
    const int s = threadIdx.x;
    const float2 v = s < splits ? ml[(base + s) * H + h] : make_float2(-DSV4_F32_INF, 0.0f);
    float m = v.x;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float term;
    const float w = fa_split_weight(v, m, term);
    if (s < FA_MAX_SPLITS) wsh[s] = w;
    // den in split order, every lane adding each lane's term in turn. An empty split's term is
    // +0, and den (a sum of non-negative terms from +0) + 0 == den: the serial form's skip.
    float den = 0.0f;
    for (int k = 0; k < splits; ++k) den = __fadd_rn(den, __shfl_sync(0xffffffffu, term, k));
    if (s == 0) {
      if (m != -DSV4_F32_INF) den = __fadd_rn(den, expf(__fsub_rn(sinks[h], m)));
      den_sh = den;
      max_sh = m;
    }
  }
  __syncthreads();
  float* orow = o + ((long long)t * H + h) * hd;
  if (max_sh == -DSV4_F32_INF) {
    for (int c = threadIdx.x; c < hd; c += blockDim.x) orow[c] = 0.0f;
    return;
  }
  const float den = den_sh;
  for (int c = 4 * threadIdx.x; c < hd; c += 4 * blockDim.x) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // FA_COMBINE_LOADS splits' partials in flight, then added in split order (all FA_MAX_SPLITS
    // at once took 128 registers and spilled).
    for (int s0 = 0; s0 < splits; s0 += FA_COMBINE_LOADS) {
      float4 p[FA_COMBINE_LOADS];
#pragma unroll
      for (int u = 0; u < FA_COMBINE_LOADS; ++u)
        if (s0 + u < splits) p[u] = *(const float4*)(part_o + ((base + s0 + u) * H + h) * hd + c);
#pragma unroll
      for (int u = 0; u < FA_COMBINE_LOADS; ++u)  // (the weight as a select, not a branch: 91a4ca4's
        fa_add_weighted(v, p[u], s0 + u < splits ? wsh[s0 + u] : 0.0f);  // branch cost 0.8 us at T = 1)
    }
    *(float4*)(orow + c) = fa_round_bf16x4(
        make_float4(__fdiv_rn(v.x, den), __fdiv_rn(v.y, den), __fdiv_rn(v.z, den), __fdiv_rn(v.w, den)));
  }
}
