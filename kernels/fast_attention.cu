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
// the splits in order with the sink. Deterministic run to run: fixed tiles, fixed split order,
// no atomics. The split count comes from the batch size (kernels/SPEC.md), so a token's output
// may differ in rounding between batch sizes (the reference kernels bound both).
#include "common.cuh"
#include "attn_keys.cuh"
#include "fp8_mma.cuh"
#include "kv_pages.cuh"

// FA_THREADS, FA_TILE_KEYS, FA_MAX_HEADS, FA_MAX_HD (dsv4_consts.cuh).
#define FA_WARPS (FA_THREADS / 32)
// The prologue's Q rows: warp w takes rows w + 2 FA_WARPS i and w + FA_WARPS + 2 FA_WARPS i, lane l
// the 16-byte words l + 32 u of each (8 loads in flight a thread at hd = 512; no index division).
#if FA_MAX_HEADS % (2 * FA_WARPS) != 0
#error "the Q prologue takes FA_MAX_HEADS rows two per warp at a time"
#endif
#define FA_Q_WORDS (FA_MAX_HD / 128)
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

// Values c0 .. c0 + 7 of a stored official row as 8 bf16 (one 16-byte word), from its bytes
// `raw` (value bytes, then the scale record at row_bytes). nope % 16 == 0, so the 8 values
// are 8 codes of one scale block or 8 BF16 values.
DSV4_INLINE uint4 fa_stored_chunk(const KvRowFmt& f, const unsigned char* raw, int c0) {
  if (c0 >= f.nope) return *(const uint4*)(raw + f.nope + 2 * (c0 - f.nope));
  const uint2 codes = *(const uint2*)(raw + c0);
  const float s = e8m0_to_f32(raw[f.row_bytes + c0 / KV_FP8_BLOCK]);
  unsigned w[4];
  const unsigned c[2] = {codes.x, codes.y};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = kv_e4m3x2_to_f32((unsigned short)(c[i >> 1] >> (16 * (i & 1))));
    w[i] = pack_bf16x2(__fmul_rn(v.x, s), __fmul_rn(v.y, s));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Values c0 .. c0 + 7 of an f32 row (the batch's own official rows: BF16 values) as 8 bf16.
DSV4_INLINE uint4 fa_f32_chunk(const float* row, int c0) {
  const float4 a = *(const float4*)(row + c0), b = *(const float4*)(row + c0 + 4);
  return make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                    pack_bf16x2(b.z, b.w));
}

// Grid (T, splits), FA_THREADS threads. Inputs as attention_kernel (kernels/SPEC.md), plus H <=
// FA_MAX_HEADS, hd % 32 == 0 and <= FA_MAX_HD, nope % 16 == 0 (the wrapper checks). splits == 1:
// writes o (bf16 values, o before the inverse RoPE) directly. splits > 1: writes part_o
// [T][splits][H][hd] (unnormalised) and part_ml [T][splits][H] (running max, exp sum; max -inf
// for a split without keys), which fa_combine_kernel reads.
extern "C" __global__ void __launch_bounds__(FA_THREADS, 1)
    fa_attention_kernel(const float* q, const float* kv, const unsigned char* ring,
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
  const int stride = fa_row_stride(hd);
  unsigned short* qs = (unsigned short*)fa_smem;
  unsigned short* ks = qs + FA_MAX_HEADS * stride;
  float* xs = (float*)(ks + FA_TILE_KEYS * stride);
  const KvRowFmt sf = kv_fmt_kv(hd, nope, 1);  // the stored rows
  const int raw_stride = kv_round_up(sf.row_bytes + sf.scale_bytes, 16);
  unsigned char* raw = (unsigned char*)(xs + FA_WARPS * 32 * 16);
  unsigned long long* krow = (unsigned long long*)(raw + 2 * FA_TILE_KEYS * raw_stride);
  unsigned long long* ksc = krow + 2 * FA_TILE_KEYS;
  int* kind = (int*)(ksc + 2 * FA_TILE_KEYS);
  const int hh = hd / 2;           // dims per half
  const int dim0 = half * hh;      // this warp's first dim
  const long long part = (long long)t * splits + split;
  float2* ml = (float2*)part_ml;  // (max, exp sum) pairs

  const int s = seq_of[t];
  const int slot = seq_slots[s];
  AttnKeys keys;
  int nk = 0;
  if (slot >= 0)
    nk = attn_keys_init(&keys, t, s, slot, kv, ring, entries, etable, epps, selected, nsel,
                        positions, query_start, hd, nope, W, ratio, maxe, topk, 1);
  const int tiles = (nk + FA_TILE_KEYS - 1) / FA_TILE_KEYS;
  const int tile0 = (int)((long long)split * tiles / splits);
  const int tile1 = (int)((long long)(split + 1) * tiles / splits);
  if (tile0 >= tile1) {  // padding (no keys) or an empty split: o zero / max -inf
    if (splits == 1) {
      for (int i = tid; i < H * hd; i += FA_THREADS) o[(long long)t * H * hd + i] = 0.0f;
    } else {
      for (int h = tid; h < H; h += FA_THREADS)
        ml[part * H + h] = make_float2(-DSV4_F32_INF, 0.0f);
    }
    return;
  }

  // Where tile `tile`'s keys are, into address slot b (one thread per key: its selection and
  // block-table lookups; nothing past the block's tiles).
  auto locate = [&](int tile, int b) {
    if (tid < FA_TILE_KEYS) {
      const int j = tile * FA_TILE_KEYS + tid;
      int k = FA_KEY_NONE;
      KvRowPtr p;
      p.row = p.sc = 0;
      if (tile < tile1 && j < nk) {
        bool stored;
        p = attn_key(keys, j, &stored);
        k = stored ? FA_KEY_STORED : FA_KEY_BATCH;
      }
      krow[b * FA_TILE_KEYS + tid] = (unsigned long long)p.row;
      ksc[b * FA_TILE_KEYS + tid] = (unsigned long long)p.sc;
      kind[b * FA_TILE_KEYS + tid] = k;
    }
  };
  // The stored rows of address slot b into raw tile b, asynchronously (one commit group per
  // call): 16-byte copies of the value bytes, 4-byte copies of the scale record.
  const int row_chunks = sf.row_bytes / 16;
  auto fetch = [&](int b) {
    for (FaWalk it(tid, row_chunks + 1); it.r < FA_TILE_KEYS; it.next()) {
      const int r = it.r, c = it.c;
      if (kind[b * FA_TILE_KEYS + r] != FA_KEY_STORED) continue;
      unsigned char* dst = raw + (b * FA_TILE_KEYS + r) * raw_stride;
      if (c < row_chunks) {
        cp_async_16(smem_addr(dst + 16 * c), (const void*)(krow[b * FA_TILE_KEYS + r] + 16 * c));
      } else {
        for (int o4 = 0; o4 < sf.scale_bytes; o4 += 4)
          cp_async_4(smem_addr(dst + sf.row_bytes + o4),
                     (const void*)(ksc[b * FA_TILE_KEYS + r] + o4));
      }
    }
    cp_async_commit();
  };
  locate(tile0, 0);
  locate(tile0 + 1, 1);

  // Q as bf16 (rows past H zero), two rows a warp at a time (FA_Q_WORDS above).
  const int q4 = hd / 4;
  for (int r0 = warp; r0 < FA_MAX_HEADS; r0 += 2 * FA_WARPS) {
    float4 v[2][FA_Q_WORDS];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int u = 0; u < FA_Q_WORDS; ++u) {
        const int r = r0 + a * FA_WARPS, c = lane + 32 * u;
        v[a][u] = r < H && c < q4 ? *(const float4*)(q + ((long long)t * H + r) * hd + 4 * c)
                                  : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
      for (int u = 0; u < FA_Q_WORDS; ++u) {
        const int r = r0 + a * FA_WARPS, c = lane + 32 * u;
        if (c < q4)
          *(uint2*)(qs + r * stride + 4 * c) = make_uint2(pack_bf16x2(v[a][u].x, v[a][u].y),
                                                          pack_bf16x2(v[a][u].z, v[a][u].w));
      }
  }
  __syncthreads();  // tile0's addresses
  fetch(0);

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
    fetch(b ^ 1);
    cp_async_wait<1>();
    __syncthreads();  // tile i's raw rows have landed
    // Decode the tile's keys into K (rows past nk zero).
    const int chunks = hd / 8;
    for (FaWalk it(tid, chunks); it.r < FA_TILE_KEYS; it.next()) {
      const int r = it.r, c0 = 8 * it.c;
      const int k = kind[b * FA_TILE_KEYS + r];
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (k == FA_KEY_STORED)
        w = fa_stored_chunk(sf, raw + (b * FA_TILE_KEYS + r) * raw_stride, c0);
      else if (k == FA_KEY_BATCH)
        w = fa_f32_chunk((const float*)krow[b * FA_TILE_KEYS + r], c0);
      *(uint4*)(ks + r * stride + c0) = w;
    }
    __syncthreads();  // K is complete; address slot b is free
    locate(tile + 2, b);

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
    // S = S_lo + S_hi, the same sum in both warps of the head group.
    // (Value v of a thread at xs[v][thread]: consecutive lanes, consecutive banks.)
    float* mine = xs + tid;
    const float* other = xs + ((warp ^ 4) * 32 + lane);
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(n * 4 + e) * FA_THREADS] = sc[n][e];
    __syncthreads();
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

    // Online softmax per head row (rows g and g + 8; a quad holds a row's 32 keys).
    unsigned pa[2][4];  // P as the A fragments of the two k16 steps of P V
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -DSV4_F32_INF;
#pragma unroll
      for (int n = 0; n < 4; ++n) mx = fmaxf(mx, fmaxf(sc[n][2 * r], sc[n][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mnew = fmaxf(mrow[r], mx);  // finite: every tile holds a real key
      const float corr = mrow[r] == -DSV4_F32_INF ? 0.0f : expf(__fsub_rn(mrow[r], mnew));
      mrow[r] = mnew;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float e0 = expf(__fsub_rn(sc[n][2 * r], mnew));
        const float e1 = expf(__fsub_rn(sc[n][2 * r + 1], mnew));
        sum = __fadd_rn(__fadd_rn(sum, e0), e1);
        sc[n][2 * r] = e0;
        sc[n][2 * r + 1] = e1;
      }
      lrow[r] = __fadd_rn(__fmul_rn(lrow[r], corr), sum);
#pragma unroll
      for (int n = 0; n < FA_MAX_HD / 16; ++n) {
        acc[n][2 * r] = __fmul_rn(acc[n][2 * r], corr);
        acc[n][2 * r + 1] = __fmul_rn(acc[n][2 * r + 1], corr);
      }
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      pa[kk][0] = pack_bf16x2(sc[2 * kk][0], sc[2 * kk][1]);
      pa[kk][1] = pack_bf16x2(sc[2 * kk][2], sc[2 * kk][3]);
      pa[kk][2] = pack_bf16x2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
      pa[kk][3] = pack_bf16x2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
    }
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
              make_float2(round_bf16(__fdiv_rn(acc[n][2 * r], den)),
                          round_bf16(__fdiv_rn(acc[n][2 * r + 1], den)));
    } else {
      float* prow = part_o + (part * H + h) * hd + dim0;
#pragma unroll
      for (int n = 0; n < FA_MAX_HD / 16; ++n)
        if (n * 8 < hh)
          *(float2*)(prow + n * 8 + 2 * cq) = make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
      if (half == 0 && cq == 0) ml[part * H + h] = make_float2(mrow[r], lrow[r]);
    }
  }
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
    const float w = v.x == -DSV4_F32_INF ? 0.0f : expf(__fsub_rn(v.x, m));
    const float term = v.x == -DSV4_F32_INF ? 0.0f : __fmul_rn(v.y, w);
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
      for (int u = 0; u < FA_COMBINE_LOADS; ++u) {
        const int s = s0 + u;
        const float w = s < splits ? wsh[s] : 0.0f;
        if (w != 0.0f) {  // (an empty split's partial was never written)
          v.x = __fadd_rn(v.x, __fmul_rn(p[u].x, w));
          v.y = __fadd_rn(v.y, __fmul_rn(p[u].y, w));
          v.z = __fadd_rn(v.z, __fmul_rn(p[u].z, w));
          v.w = __fadd_rn(v.w, __fmul_rn(p[u].w, w));
        }
      }
    }
    *(float4*)(orow + c) = make_float4(round_bf16(__fdiv_rn(v.x, den)), round_bf16(__fdiv_rn(v.y, den)),
                                       round_bf16(__fdiv_rn(v.z, den)), round_bf16(__fdiv_rn(v.w, den)));
  }
}
