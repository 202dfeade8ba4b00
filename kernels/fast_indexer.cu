// fast_indexer kernel family: see kernels/SPEC.md (fast_indexer.cu) and MODEL.md §6.4.
//
// The fast set's lightning indexer: `indexer_kernel`'s operation (scores of every visible
// indexer key, then the top min(topk, visible) in rank order: larger first, ties to the lower
// entry index, NaN lowest) in two launches.
// - fi_score_kernel: per (token, chunk of keys), all heads of the token against a chunk of its
//   keys on BF16 tensor cores: queries and keys are official FP4 values (e2m1 x 2^k, exact in
//   BF16), so the products are exact and only the f32 sum over the 128 dims differs from the
//   reference's f64 one. d_h = bf16(q_h . k), score = bf16(sum_h relu(d_h) * w_h) (f32 sums over
//   heads in a fixed tree order). Writes the scores (BF16 values) to the workspace row.
// - fi_topk_kernel: one block per token, exact selection on the scores: a 16-bit order key per
//   BF16 score, two 8-bit radix histograms find the k-th key, the keys above it and the lowest
//   indices among those equal to it are gathered in index order (no atomics decide anything),
//   then a bitonic sort of (key, -index) orders them by rank.
#include "common.cuh"
#include "fp8_mma.cuh"
#include "kv_pages.cuh"

// FI_THREADS, FI_TILE_KEYS, FI_CHUNK_KEYS, FI_MAX_HEADS, FI_MAX_DIM, FI_TOPK_THREADS,
// FI_MAX_SORT (dsv4_consts.cuh).
#define FI_WARPS (FI_THREADS / 32)

// Grid (T, ceil(maxe / FI_CHUNK_KEYS)), FI_THREADS threads (warp w: heads 16w .. 16w + 15).
// Dynamic shared memory: Q [FI_MAX_HEADS][DI + 8] bf16, K [FI_TILE_KEYS][DI + 8] bf16, w
// [FI_MAX_HEADS] f32, per-warp partial scores [FI_WARPS][FI_TILE_KEYS] f32. HI <= FI_MAX_HEADS,
// DI % 16 == 0 and <= FI_MAX_DIM (the wrapper checks). ikeys: official indexer-key pages
// (kv_pages.cuh) through itable. scores: [T][maxe], entries < visible of real tokens written.
extern "C" __global__ void __launch_bounds__(FI_THREADS)
    fi_score_kernel(const float* qi, const float* iw, const unsigned char* ikeys,
                    const int* itable, int ipps, const int* positions, const int* seq_of,
                    const int* seq_slots, int T, int HI, int DI, int ratio, int maxe,
                    float* scores) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) unsigned char fi_smem[];
  const int t = blockIdx.x, chunk = blockIdx.y;
  if (t >= T) return;
  const int slot = seq_slots[seq_of[t]];
  if (slot < 0) return;  // padding: nothing is scored (fi_topk_kernel selects nothing)
  int visible = (positions[t] + 1) / ratio;
  if (visible > maxe) visible = maxe;
  const int e_begin = chunk * FI_CHUNK_KEYS;
  if (e_begin >= visible) return;
  int e_end = e_begin + FI_CHUNK_KEYS;
  if (e_end > visible) e_end = visible;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, cq = lane & 3;
  const int stride = DI + 8;  // bf16 elements: rows 16 bytes apart modulo 128 (ldmatrix banks)
  unsigned short* qs = (unsigned short*)fi_smem;
  unsigned short* ks = qs + FI_MAX_HEADS * stride;
  float* ws = (float*)(ks + FI_TILE_KEYS * stride);
  float* part = ws + FI_MAX_HEADS;
  const KvRowFmt kf = kv_fmt_index(DI, 1);

  // Q as bf16 (rows past HI zero) and the head weights.
  const int q4 = DI / 4;
  for (int i = tid; i < FI_MAX_HEADS * q4; i += FI_THREADS) {
    const int h = i / q4, c = (i % q4) * 4;
    uint2 w = make_uint2(0u, 0u);
    if (h < HI) {
      const float4 v = *(const float4*)(qi + ((long long)t * HI + h) * DI + c);
      w = make_uint2(pack_bf16x2(v.x, v.y), pack_bf16x2(v.z, v.w));
    }
    *(uint2*)(qs + h * stride + c) = w;
  }
  for (int h = tid; h < FI_MAX_HEADS; h += FI_THREADS) ws[h] = h < HI ? iw[(long long)t * HI + h] : 0.0f;

  const unsigned qa = smem_addr(qs + (warp * 16 + (lane & 15)) * stride + (lane >> 4) * 8);
  const unsigned kb =
      smem_addr(ks + ((lane & 7) + ((lane >> 4) << 3)) * stride + ((lane >> 3) & 1) * 8);
  const int h0 = warp * 16 + g, h1 = h0 + 8;

  for (int e0 = e_begin; e0 < e_end; e0 += FI_TILE_KEYS) {
    __syncthreads();  // Q, w written; the previous tile's K and partials consumed
    // Keys e0 .. e0 + FI_TILE_KEYS - 1 decoded to bf16 (past visible: zero), 8 values a task:
    // 4 code bytes (8 nibbles, low = even channel) of one scale block.
    const int tasks = DI / 8;
    for (int i = tid; i < FI_TILE_KEYS * tasks; i += FI_THREADS) {
      const int r = i / tasks, c0 = (i % tasks) * 8;
      uint4 w = make_uint4(0u, 0u, 0u, 0u);
      if (e0 + r < e_end) {
        const KvRowPtr p = kv_row(kf, ikeys, itable, ipps, slot, e0 + r);
        const unsigned codes = *(const unsigned*)(p.row + c0 / 2);
        const float s = e8m0_to_f32(p.sc[c0 / KV_FP4_BLOCK]);
        unsigned v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const unsigned b = (codes >> (8 * k)) & 0xffu;
          v[k] = pack_bf16x2(__fmul_rn(e2m1_to_f32(b & 15u), s), __fmul_rn(e2m1_to_f32(b >> 4), s));
        }
        w = make_uint4(v[0], v[1], v[2], v[3]);
      }
      *(uint4*)(ks + r * stride + c0) = w;
    }
    __syncthreads();

    // d = Q K^T for this warp's 16 heads x the tile's keys (n-tiles of 8 keys).
    float d[FI_TILE_KEYS / 8][4];
#pragma unroll
    for (int n = 0; n < FI_TILE_KEYS / 8; ++n) d[n][0] = d[n][1] = d[n][2] = d[n][3] = 0.0f;
    for (int k0 = 0; k0 < DI; k0 += 16) {
      unsigned a[4];
      ldmatrix_x4(qa + 2 * k0, a);
#pragma unroll
      for (int np = 0; np < FI_TILE_KEYS / 16; ++np) {
        unsigned b[4];
        ldmatrix_x4(kb + 2 * (k0 + np * 16 * stride), b);
        mma_bf16_16816(d[2 * np], a, b[0], b[1]);
        mma_bf16_16816(d[2 * np + 1], a, b[2], b[3]);
      }
    }
    // relu(bf16(d_h)) * w_h summed over the warp's heads per key: rows g and g + 8 of the
    // thread, then the 8 row groups of the warp (lanes with the same cq).
    const float w0 = ws[h0], w1 = ws[h1];
#pragma unroll
    for (int n = 0; n < FI_TILE_KEYS / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = __fadd_rn(__fmul_rn(fmaxf(round_bf16(d[n][e]), 0.0f), w0),
                            __fmul_rn(fmaxf(round_bf16(d[n][2 + e]), 0.0f), w1));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 4));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 8));
        v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 16));
        if (g == 0) part[warp * FI_TILE_KEYS + 8 * n + 2 * cq + e] = v;
      }
    }
    __syncthreads();
    // The warps' partials in warp order, bf16.
    for (int j = tid; j < FI_TILE_KEYS; j += FI_THREADS) {
      if (e0 + j < e_end) {
        float s = part[j];
        for (int w = 1; w < FI_WARPS; ++w) s = __fadd_rn(s, part[w * FI_TILE_KEYS + j]);
        scores[(long long)t * maxe + e0 + j] = round_bf16(s);
      }
    }
  }
}

// A score's 16-bit order key: larger score, larger key; NaN as -inf; -0 as +0 (the reference's
// top_k compares them equal). Scores are BF16 values, so the top half of their bits is exact.
DSV4_INLINE unsigned fi_key16(float v) {
  if (v != v) v = -DSV4_F32_INF;
  if (v == 0.0f) v = 0.0f;
  const unsigned b = __float_as_uint(v) >> 16;
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// One block per token, FI_TOPK_THREADS threads; thread i owns the entries [i * seg, (i + 1) *
// seg) of the token's visible ones. Static shared memory: histogram, per-thread counts, the
// candidates (key << 32 | ~index) for the bitonic sort. topk <= FI_MAX_SORT. selected: [T][topk]
// best first (ties: lower index), -1 past nsel[t] = min(topk, visible).
extern "C" __global__ void __launch_bounds__(FI_TOPK_THREADS)
    fi_topk_kernel(const float* scores, const int* positions, const int* seq_of,
                   const int* seq_slots, int T, int ratio, int maxe, int topk, int* selected,
                   int* nsel) {
  dsv4_pdl_begin();
  __shared__ int hist[256];
  __shared__ int cnt_gt[FI_TOPK_THREADS], cnt_eq[FI_TOPK_THREADS];
  __shared__ unsigned long long cand[FI_MAX_SORT];
  __shared__ int sh_bin, sh_above, sh_g;
  const int t = blockIdx.x;
  if (t >= T) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  int* sel = selected + (long long)t * topk;
  const int slot = seq_slots[seq_of[t]];
  int visible = 0;
  if (slot >= 0) {
    visible = (positions[t] + 1) / ratio;
    if (visible > maxe) visible = maxe;
  }
  const int k = topk < visible ? topk : visible;
  if (k == 0) {  // padding, or nothing visible yet
    for (int r = tid; r < topk; r += nt) sel[r] = -1;
    if (tid == 0) nsel[t] = 0;
    return;
  }
  const float* row = scores + (long long)t * maxe;
  const int seg = (visible + nt - 1) / nt;
  const int lo = tid * seg < visible ? tid * seg : visible;
  const int hi = lo + seg < visible ? lo + seg : visible;

  // The k-th largest key, a byte at a time: high byte, then low byte among that bin.
  unsigned prefix = 0;
  int need = k, above = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int b = tid; b < 256; b += nt) hist[b] = 0;
    __syncthreads();
    for (int e = lo; e < hi; ++e) {
      const unsigned key = fi_key16(row[e]);
      if (pass == 0) atomicAdd(&hist[key >> 8], 1);
      else if ((key >> 8) == prefix) atomicAdd(&hist[key & 0xffu], 1);
    }
    __syncthreads();
    if (tid == 0) {
      int acc = 0, b = 255;
      for (; b > 0 && acc + hist[b] < need; --b) acc += hist[b];
      sh_bin = b;
      sh_above = acc;
    }
    __syncthreads();
    prefix = pass == 0 ? (unsigned)sh_bin : (prefix << 8) | (unsigned)sh_bin;
    above += sh_above;
    need -= sh_above;
  }
  const unsigned kth = prefix;  // exactly `above` keys are larger; `need` more equal it

  // Counts per segment, their exclusive scans (in thread order = index order), then the gather:
  // every key above kth, and the `need` lowest-index keys equal to it.
  int gt = 0, eq = 0;
  for (int e = lo; e < hi; ++e) {
    const unsigned key = fi_key16(row[e]);
    gt += key > kth;
    eq += key == kth;
  }
  cnt_gt[tid] = gt;
  cnt_eq[tid] = eq;
  __syncthreads();
  if (tid == 0) {
    int a = 0, q = 0;
    for (int i = 0; i < nt; ++i) {
      const int x = cnt_gt[i], y = cnt_eq[i];
      cnt_gt[i] = a;
      cnt_eq[i] = q;
      a += x;
      q += y;
    }
    sh_g = a;
  }
  __syncthreads();
  int og = cnt_gt[tid], oe = cnt_eq[tid];
  for (int e = lo; e < hi; ++e) {
    const unsigned key = fi_key16(row[e]);
    const unsigned long long c = ((unsigned long long)key << 32) | (unsigned)(~(unsigned)e);
    if (key > kth) cand[og++] = c;
    else if (key == kth) {
      if (oe < need) cand[sh_g + oe] = c;
      ++oe;
    }
  }
  int kpad = 1;
  while (kpad < k) kpad <<= 1;
  for (int i = k + tid; i < kpad; i += nt) cand[i] = 0ull;  // below every real candidate
  __syncthreads();

  // Bitonic sort of cand[0 .. kpad), descending.
  for (int size = 2; size <= kpad; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < kpad / 2; i += nt) {
        const int a = 2 * i - (i & (stride - 1));
        const int b = a + stride;
        const bool desc = (a & size) == 0;
        const unsigned long long x = cand[a], y = cand[b];
        if ((x < y) == desc) {
          cand[a] = y;
          cand[b] = x;
        }
      }
      __syncthreads();
    }
  }
  for (int r = tid; r < topk; r += nt) sel[r] = r < k ? (int)(~(unsigned)(cand[r] & 0xffffffffull)) : -1;
  if (tid == 0) nsel[t] = k;
}
