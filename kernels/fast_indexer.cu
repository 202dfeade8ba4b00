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
//   BF16 score, two 8-bit radix histograms (warp-aggregated shared atomics) find the k-th key,
//   the keys above it and the lowest indices among those equal to it are gathered in index order
//   (warp ballots: no atomics decide anything), then a bitonic sort of (key, -index) orders them
//   by rank (shuffles for strides below 32, shared memory above).
#include "common.cuh"
#include "fp8_mma.cuh"
#include "kv_pages.cuh"

// FI_THREADS, FI_TILE_KEYS, FI_CHUNK_KEYS, FI_MAX_HEADS, FI_MAX_DIM, FI_TOPK_THREADS,
// FI_MAX_SORT (dsv4_consts.cuh).
#define FI_WARPS (FI_THREADS / 32)

// Grid (T, ceil(maxe / FI_CHUNK_KEYS)), FI_THREADS threads (warp w: heads 16w .. 16w + 15).
// Dynamic shared memory: Q [FI_MAX_HEADS][DI + 8] bf16, K [FI_TILE_KEYS][DI + 8] bf16, w
// [FI_MAX_HEADS] f32, per-warp partial scores [FI_WARPS][FI_TILE_KEYS] f32, the chunk's key row and
// scale addresses [2][FI_CHUNK_KEYS] (8 bytes each). HI <= FI_MAX_HEADS, DI % 16 == 0 and <=
// FI_MAX_DIM (the wrapper checks). ikeys: official indexer-key pages (kv_pages.cuh) through
// itable. scores: [T][maxe], entries < visible of real tokens written.
// Memory latency: the chunk's block-table lookups are made once, together, at the start; a key
// tile's code and scale loads (FI_DECODE_TASKS a thread, 16 values each) are all issued before any
// is used, and the next tile's are issued before this tile's products, so they are in flight
// during them. (Loading and decoding 8 values at a time, each behind its own table lookup, waited
// ~16 memory round trips a tile.)
#define FI_DECODE_TASKS (FI_TILE_KEYS * (FI_MAX_DIM / 16) / FI_THREADS)
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
  const unsigned char** krow = (const unsigned char**)(part + FI_WARPS * FI_TILE_KEYS);
  const unsigned char** ksc = krow + FI_CHUNK_KEYS;
  const KvRowFmt kf = kv_fmt_index(DI, 1);

  // The chunk's key addresses (one block-table lookup a key).
  for (int j = tid; j < e_end - e_begin; j += FI_THREADS) {
    const KvRowPtr p = kv_row(kf, ikeys, itable, ipps, slot, e_begin + j);
    krow[j] = p.row;
    ksc[j] = p.sc;
  }
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

  // A tile's decode tasks: task i = tid + FI_THREADS u is key row i / per_key, values 16 (i %
  // per_key) .. + 15: 8 code bytes (16 nibbles, low = even channel) of one scale block.
  const int per_key = DI / 16, tasks = FI_TILE_KEYS * per_key;
  uint2 code[FI_DECODE_TASKS];
  unsigned scb[FI_DECODE_TASKS];
  auto fetch = [&](int e0) {
#pragma unroll
    for (int u = 0; u < FI_DECODE_TASKS; ++u) {
      const int i = tid + FI_THREADS * u, r = i / per_key, c16 = i - r * per_key;
      code[u] = make_uint2(0u, 0u);
      scb[u] = 0u;
      if (i < tasks && e0 + r < e_end) {
        code[u] = *(const uint2*)(krow[e0 - e_begin + r] + 8 * c16);
        scb[u] = ksc[e0 - e_begin + r][16 * c16 / KV_FP4_BLOCK];
      }
    }
  };
  __syncthreads();  // the addresses, Q and w written
  fetch(e_begin);

  for (int e0 = e_begin; e0 < e_end; e0 += FI_TILE_KEYS) {
    __syncthreads();  // the previous tile's K and partials consumed
    // Keys e0 .. e0 + FI_TILE_KEYS - 1 decoded to bf16 (past e_end: zero).
#pragma unroll
    for (int u = 0; u < FI_DECODE_TASKS; ++u) {
      const int i = tid + FI_THREADS * u, r = i / per_key, c16 = i - r * per_key;
      if (i < tasks) {
        uint4 w[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
        if (e0 + r < e_end) {
          const float s = e8m0_to_f32((ue8m0_t)scb[u]);
          unsigned v[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            const unsigned b = ((k < 4 ? code[u].x : code[u].y) >> (8 * (k & 3))) & 0xffu;
            v[k] = pack_bf16x2(__fmul_rn(e2m1_to_f32(b & 15u), s), __fmul_rn(e2m1_to_f32(b >> 4), s));
          }
          w[0] = make_uint4(v[0], v[1], v[2], v[3]);
          w[1] = make_uint4(v[4], v[5], v[6], v[7]);
        }
        uint4* dst = (uint4*)(ks + r * stride + 16 * c16);
        dst[0] = w[0];
        dst[1] = w[1];
      }
    }
    // The next tile's loads go out now: in flight during this tile's products.
    if (e0 + FI_TILE_KEYS < e_end) fetch(e0 + FI_TILE_KEYS);
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

// One block per token, FI_TOPK_THREADS threads. Warp w owns the entries [w * seg, (w + 1) * seg)
// of the token's visible ones (seg a multiple of 32); its lanes read them 32 at a time, entry
// base + 32 i + lane, so loads are coalesced and (i, lane) order is index order within the warp.
// Static shared memory: histogram, per-warp counts, the candidates (key << 32 | ~index) for the
// sort. topk <= FI_MAX_SORT. selected: [T][topk] best first (ties: lower index), -1 past
// nsel[t] = min(topk, visible).
extern "C" __global__ void __launch_bounds__(FI_TOPK_THREADS)
    fi_topk_kernel(const float* scores, const int* positions, const int* seq_of,
                   const int* seq_slots, int T, int ratio, int maxe, int topk, int* selected,
                   int* nsel) {
  dsv4_pdl_begin();
  __shared__ int hist[256];
  __shared__ int warp_gt[FI_TOPK_THREADS / 32], warp_eq[FI_TOPK_THREADS / 32];
  __shared__ unsigned long long cand[FI_MAX_SORT];
  __shared__ int sh_bin, sh_above, sh_g;
  const int t = blockIdx.x;
  if (t >= T) return;
  const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
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
  const int seg = ((visible + nwarps - 1) / nwarps + 31) & ~31;
  const int lo = min(warp * seg, visible), hi = min(lo + seg, visible);

  // The k-th largest key, a byte at a time: high byte, then low byte among that bin. The bin is
  // found by warp 0: lane l sums bins 255 - 8l down to 248 - 8l, an inclusive scan over lanes
  // gives the count above each lane's bins, and the lane whose bins reach `need` walks them.
  unsigned prefix = 0;
  int need = k, above = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int b = tid; b < 256; b += nt) hist[b] = 0;
    __syncthreads();
    for (int e0 = lo; e0 < hi; e0 += 32) {
      const int e = e0 + lane;
      const unsigned key = e < hi ? fi_key16(row[e]) : 0u;
      const bool in = e < hi && (pass == 0 || (key >> 8) == prefix);
      fi_hist_add(hist, pass == 0 ? key >> 8 : key & 0xffu, in);
    }
    __syncthreads();
    if (warp == 0) {
      int mine[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        mine[i] = hist[255 - 8 * lane - i];
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
        sh_bin = 255 - 8 * lane - i;
        sh_above = acc;
      }
    }
    __syncthreads();
    prefix = pass == 0 ? (unsigned)sh_bin : (prefix << 8) | (unsigned)sh_bin;
    above += sh_above;
    need -= sh_above;
  }
  const unsigned kth = prefix;  // exactly `above` keys are larger; `need` more equal it

  // Per-warp counts, their exclusive scan over warps (warp order = index order), then the gather:
  // every key above kth, and the `need` lowest-index keys equal to it, each at its rank in index
  // order (ballots: no atomics decide anything).
  int gt = 0, eq = 0;
  for (int e0 = lo; e0 < hi; e0 += 32) {
    const int e = e0 + lane;
    const unsigned key = e < hi ? fi_key16(row[e]) : 0u;
    gt += __popc(__ballot_sync(0xffffffffu, e < hi && key > kth));
    eq += __popc(__ballot_sync(0xffffffffu, e < hi && key == kth));
  }
  if (lane == 0) {
    warp_gt[warp] = gt;
    warp_eq[warp] = eq;
  }
  __syncthreads();
  if (tid == 0) {
    int a = 0, q = 0;
    for (int i = 0; i < nwarps; ++i) {
      const int x = warp_gt[i], y = warp_eq[i];
      warp_gt[i] = a;
      warp_eq[i] = q;
      a += x;
      q += y;
    }
    sh_g = a;
  }
  __syncthreads();
  int og = warp_gt[warp], oe = warp_eq[warp];
  const unsigned below = fi_lanes_below();
  for (int e0 = lo; e0 < hi; e0 += 32) {
    const int e = e0 + lane;
    const unsigned key = e < hi ? fi_key16(row[e]) : 0u;
    const bool is_gt = e < hi && key > kth, is_eq = e < hi && key == kth;
    const unsigned bg = __ballot_sync(0xffffffffu, is_gt), be = __ballot_sync(0xffffffffu, is_eq);
    const unsigned long long c = ((unsigned long long)key << 32) | (unsigned)(~(unsigned)e);
    if (is_gt) cand[og + __popc(bg & below)] = c;
    if (is_eq) {
      const int r = oe + __popc(be & below);
      if (r < need) cand[sh_g + r] = c;
    }
    og += __popc(bg);
    oe += __popc(be);
  }
  int kpad = 1;
  while (kpad < k) kpad <<= 1;
  for (int i = k + tid; i < kpad; i += nt) cand[i] = 0ull;  // below every real candidate
  __syncthreads();

  // Bitonic sort of cand[0 .. kpad), descending. Up to one element a thread: strides below 32
  // exchange through shuffles (partner in the same warp), larger ones through shared memory.
  if (kpad <= nt) {
    unsigned long long x = tid < kpad ? cand[tid] : 0ull;
    for (int size = 2; size <= kpad; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        unsigned long long y;
        if (stride >= 32) {
          __syncthreads();  // every read of the previous exchange is done
          if (tid < kpad) cand[tid] = x;
          __syncthreads();
          y = tid < kpad ? cand[tid ^ stride] : 0ull;
        } else {
          y = __shfl_xor_sync(0xffffffffu, x, stride);
        }
        // Pair (i, i ^ stride): the lower index keeps the larger value in a descending run
        // ((i & size) == 0), the smaller in an ascending one.
        const bool desc = (tid & size) == 0, lower = (tid & stride) == 0;
        const bool take_max = lower == desc;
        x = take_max ? (x > y ? x : y) : (x < y ? x : y);
      }
    }
    for (int r = tid; r < topk; r += nt)
      sel[r] = r < k ? (int)(~(unsigned)(x & 0xffffffffull)) : -1;  // r < k only at r == tid (k <= kpad <= nt)
  } else {
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
  }
  if (tid == 0) nsel[t] = k;
}
