// attention kernel family: see kernels/SPEC.md (attention.cu) and MODEL.md §6.5-6.6, §11.
//
// Batch metadata, the core attention over window + compressed keys with the per-head sink,
// the window ring update and the slot lengths. Reproduces src/reference/attention.rs
// (`attention_core`, `attend_with_sink`) bit for bit, reading the state in its stored format
// (kv_pages.cuh: official codes or f32, each decoding to the reference's f32 values): every sum
// is an f64 accumulation in the reference's own order (ops.rs `dot`: four strided accumulators;
// `sum`: sequential from -0.0; P.V: per channel, keys in order, from +0.0), every f32
// product/sum is explicitly rounded (__fmul_rn & co., so no FMA contraction), exp in f64
// rounded once.
#include "common.cuh"
#include "attn_keys.cuh"
#include "kv_pages.cuh"
#include "ref_math.cuh"

// ops.rs `dot` of an f64 vector `a` (the query, converted once) and a float row `b`:
// acc[0..4] over chunks of 4, s = (acc0 + acc2) + (acc1 + acc3), then the remainder added to
// s in order. Products of two floats are exact in f64, so contracting `acc += x * y` into an
// FMA does not change any bit.
DSV4_INLINE float attn_dot_ref(const double* a, const float* b, int n) {
  double c0 = 0.0, c1 = 0.0, c2 = 0.0, c3 = 0.0;
  const int n4 = n & ~3;
  if ((((unsigned long long)a & 15ull) | ((unsigned long long)b & 15ull)) == 0ull) {
    const double2* a2 = (const double2*)a;
    const float4* b4 = (const float4*)b;
#pragma unroll 4
    for (int i = 0; i < (n4 >> 2); ++i) {
      const double2 x0 = a2[2 * i], x1 = a2[2 * i + 1];
      const float4 y = b4[i];
      c0 += x0.x * (double)y.x;
      c1 += x0.y * (double)y.y;
      c2 += x1.x * (double)y.z;
      c3 += x1.y * (double)y.w;
    }
  } else {
    for (int i = 0; i < n4; i += 4) {
      c0 += a[i] * (double)b[i];
      c1 += a[i + 1] * (double)b[i + 1];
      c2 += a[i + 2] * (double)b[i + 2];
      c3 += a[i + 3] * (double)b[i + 3];
    }
  }
  double s = (c0 + c2) + (c1 + c3);
  for (int i = n4; i < n; ++i) s += a[i] * (double)b[i];
  return (float)s;
}

// attn_dot_ref over a stored row: the same accumulators in the same order, each value decoded
// (kv_value gives exactly the f32 attn_dot_ref would read from an f32 row).
DSV4_INLINE float attn_dot_row(const double* a, const KvRowFmt& f, const KvRowPtr& p, int n) {
  if (!f.packed) return attn_dot_ref(a, (const float*)p.row, n);
  double c0 = 0.0, c1 = 0.0, c2 = 0.0, c3 = 0.0;
  const int n4 = n & ~3;
#pragma unroll 4
  for (int i = 0; i < n4; i += 4) {
    const float4 v = kv_value4(f, p, i);
    c0 += a[i] * (double)v.x;
    c1 += a[i + 1] * (double)v.y;
    c2 += a[i + 2] * (double)v.z;
    c3 += a[i + 3] * (double)v.w;
  }
  double s = (c0 + c2) + (c1 + c3);
  for (int i = n4; i < n; ++i) s += a[i] * (double)kv_value(f, p, i);
  return (float)s;
}

// Values c, c + 1 of key row p (c even).
DSV4_INLINE float2 attn_value2(const AttnKeys& k, bool stored, const KvRowPtr& p, int c) {
  return stored ? kv_value2(k.state, p, c) : *(const float2*)(p.row + 4 * c);
}

// seq_of[t] = s for every token t of sequence s (query_start[s] <= t < query_start[s+1]).
// Grid: one block per sequence.
extern "C" __global__ void batch_meta_kernel(const int* query_start, int S, int* seq_of) {
  dsv4_pdl_begin();
  const int s = blockIdx.x;
  if (s >= S) return;
  const int a = query_start[s], b = query_start[s + 1];
  for (int t = a + threadIdx.x; t < b; t += blockDim.x) seq_of[t] = s;
}

// ATTN_MAX_CPT (dsv4_consts.cuh): most f64 P.V accumulators per thread (channel pairs tid,
// tid + blockDim, ...), so hd <= ATTN_MAX_CPT * blockDim; even.

// One block per (token, head): blockIdx.x = t * H + h. Dynamic shared memory: double q[hd]
// (padded to 2), float logits[nk_max], then int sel[topk] (CSA), nk_max = W + (selected ?
// topk : maxe) (the wrapper sizes it). Keys (each also the value): window positions
// max(0, p-W+1) .. p (ring row pos % W of the slot for positions before the sequence's first
// position in this batch, else this batch's kv row), then compressed entries: HCA
// (selected == NULL, ratio > 0) every w < (p+1)/ratio, CSA selected[t][0 .. nsel[t]] in the
// indexer's order. ratio == 0: window only. The ring (ceil(W / KV_PAGE) pages per slot) and
// the entries (pages through etable, epps per slot) are stored in kv_pages.cuh's KV row format
// for `official` (nope channels [0, nope)).
extern "C" __global__ void attention_kernel(const float* q, const float* kv, const unsigned char* ring,
                                           const unsigned char* entries, const int* etable, int epps,
                                           const int* selected, const int* nsel, const int* positions,
                                           const int* seq_of, const int* query_start,
                                           const int* seq_slots, const float* sinks, int T, int H,
                                           int hd, int nope, int W, int ratio, int maxe, int topk,
                                           int official, float* o) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) double attn_smem[];
  __shared__ float red[32];
  __shared__ float den_s;
  const long long bid = blockIdx.x;
  const int t = (int)(bid / H), h = (int)(bid % H);
  if (t >= T) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  double* qs = attn_smem;
  float* lg = (float*)(attn_smem + ((hd + 1) & ~1));

  const int s = seq_of[t];
  const int slot = seq_slots[s];
  if (slot < 0) {  // padding (or a bad batch): no state is read, o is zero
    float* orow = o + ((long long)t * H + h) * hd;
    for (int c = tid; c < hd; c += nt) orow[c] = 0.0f;
    return;
  }
  const float* qrow = q + ((long long)t * H + h) * hd;
  for (int c = tid; c < hd; c += nt) qs[c] = (double)qrow[c];

  AttnKeys keys;
  const int nk = attn_keys_init(&keys, t, s, slot, kv, ring, entries, etable, epps, selected, nsel,
                                positions, query_start, hd, nope, W, ratio, maxe, topk, official);
  if (keys.sel != 0) {  // the CSA selection, copied to shared memory
    int* sel = (int*)(lg + W + topk);
    for (int i = tid; i < nk - keys.nw; i += nt) sel[i] = keys.sel[i];
    keys.sel = sel;
  }
  __syncthreads();

  // Logits l_j = f32(q . k_j) * f32(hd^-1/2), and their max (over real keys only).
  const float scale = (float)(1.0 / sqrt((double)hd));
  float mx = -DSV4_F32_INF;
  for (int j = tid; j < nk; j += nt) {
    bool stored;
    const KvRowPtr kp = attn_key(keys, j, &stored);
    const float l = __fmul_rn(attn_dot_row(qs, stored ? keys.state : keys.batch, kp, hd), scale);
    lg[j] = l;
    mx = fmaxf(mx, l);
  }
  const float m = block_max(mx, red);  // ends with a barrier: every lg[j] is written

  // e_j = exp(l_j - m), kept unrounded for the denominator.
  for (int j = tid; j < nk; j += nt) lg[j] = ref_exp(__fsub_rn(lg[j], m));
  __syncthreads();

  // o[c] = f32(sum_j f64(p_j) * f64(v_j[c])) / den, keys in order from +0.0 (reference P.V);
  // p_j = bf16(e_j) if official. Thread 0 also sums the denominator f32(sum_j f64 e_j) keys in
  // order from -0.0 (ops.rs `sum`), + exp(sink - m). A thread owns channel pairs (2q, 2q + 1),
  // q = tid, tid + blockDim, ... (hd is even), read two at a time; four keys per step: their
  // loads are independent of the accumulators, so they are in flight together.
  double acc[ATTN_MAX_CPT];
#pragma unroll
  for (int r = 0; r < ATTN_MAX_CPT; ++r) acc[r] = 0.0;
  double dacc = -0.0;
  int j = 0;
  for (; j + 4 <= nk; j += 4) {
    const float e0 = lg[j], e1 = lg[j + 1], e2 = lg[j + 2], e3 = lg[j + 3];
    if (tid == 0) {
      dacc += (double)e0;
      dacc += (double)e1;
      dacc += (double)e2;
      dacc += (double)e3;
    }
    const double p0d = (double)(official ? round_bf16(e0) : e0);
    const double p1d = (double)(official ? round_bf16(e1) : e1);
    const double p2d = (double)(official ? round_bf16(e2) : e2);
    const double p3d = (double)(official ? round_bf16(e3) : e3);
    bool s0, s1, s2, s3;
    const KvRowPtr k0 = attn_key(keys, j, &s0), k1 = attn_key(keys, j + 1, &s1);
    const KvRowPtr k2 = attn_key(keys, j + 2, &s2), k3 = attn_key(keys, j + 3, &s3);
#pragma unroll
    for (int r = 0; r < ATTN_MAX_CPT; r += 2) {
      const int c = 2 * (tid + (r / 2) * nt);
      if (c < hd) {
        const float2 v0 = attn_value2(keys, s0, k0, c), v1 = attn_value2(keys, s1, k1, c);
        const float2 v2 = attn_value2(keys, s2, k2, c), v3 = attn_value2(keys, s3, k3, c);
        acc[r] += p0d * (double)v0.x;
        acc[r] += p1d * (double)v1.x;
        acc[r] += p2d * (double)v2.x;
        acc[r] += p3d * (double)v3.x;
        acc[r + 1] += p0d * (double)v0.y;
        acc[r + 1] += p1d * (double)v1.y;
        acc[r + 1] += p2d * (double)v2.y;
        acc[r + 1] += p3d * (double)v3.y;
      }
    }
  }
  for (; j < nk; ++j) {
    const float e = lg[j];
    if (tid == 0) dacc += (double)e;
    const double pv = (double)(official ? round_bf16(e) : e);
    bool st;
    const KvRowPtr kr = attn_key(keys, j, &st);
#pragma unroll
    for (int r = 0; r < ATTN_MAX_CPT; r += 2) {
      const int c = 2 * (tid + (r / 2) * nt);
      if (c < hd) {
        const float2 v = attn_value2(keys, st, kr, c);
        acc[r] += pv * (double)v.x;
        acc[r + 1] += pv * (double)v.y;
      }
    }
  }
  if (tid == 0) den_s = __fadd_rn((float)dacc, ref_exp(__fsub_rn(sinks[h], m)));
  __syncthreads();
  const float den = den_s;
  float* orow = o + ((long long)t * H + h) * hd;
#pragma unroll
  for (int r = 0; r < ATTN_MAX_CPT; ++r) {
    const int c = 2 * (tid + (r / 2) * nt) + (r & 1);
    if (c < hd) {
      const float v = __fdiv_rn((float)acc[r], den);
      orow[c] = official ? round_bf16(v) : v;
    }
  }
}

// The last min(len, W) window vectors of each sequence into ring row pos % W of their slot,
// in the stored format (kv_pages.cuh; nope channels [0, nope)). Grid (S, W): blockIdx.y is the
// row among the kept ones. Runs after attention.
extern "C" __global__ void ring_update_kernel(const float* kv, const int* positions,
                                             const int* query_start, const int* seq_slots, int S,
                                             int W, int hd, int nope, int official,
                                             unsigned char* ring) {
  dsv4_pdl_begin();
  const int s = blockIdx.x, r = blockIdx.y;
  if (s >= S) return;
  if (seq_slots[s] < 0) return;  // padding: writes no state
  const int a = query_start[s], b = query_start[s + 1];
  const int keep = b - a < W ? b - a : W;
  if (r >= keep) return;
  const int i = b - keep + r;
  const int pos = positions[i];
  const KvRowFmt f = kv_fmt_kv(hd, nope, official);
  kv_store_row(f, kv_row(f, ring, 0, kv_ring_pages(W), seq_slots[s], pos % W),
               kv + (long long)i * hd);
}

// slot_len[seq_slots[s]] = last position of sequence s + 1 (padding sequences: nothing).
extern "C" __global__ void slot_len_kernel(const int* positions, const int* query_start,
                                          const int* seq_slots, int S, int* slot_len) {
  dsv4_pdl_begin();
  for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < S; s += gridDim.x * blockDim.x)
    if (seq_slots[s] >= 0) slot_len[seq_slots[s]] = positions[query_start[s + 1] - 1] + 1;
}
