// attention kernel family: see kernels/SPEC.md (attention.cu) and MODEL.md §6.5-6.6, §11.
//
// Batch metadata, the core attention over window + compressed keys with the per-head sink,
// the window ring update and the slot lengths. Reproduces src/reference/attention.rs
// (`attention_core`, `attend_with_sink`) bit for bit: every sum is an f64 accumulation in the
// reference's own order (ops.rs `dot`: four strided accumulators; `sum`: sequential from -0.0;
// P.V: per channel, keys in order, from +0.0), every f32 product/sum is explicitly rounded
// (__fmul_rn & co., so no FMA contraction), exp in f64 rounded once.
#include "common.cuh"
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

// seq_of[t] = s for every token t of sequence s (query_start[s] <= t < query_start[s+1]).
// Grid: one block per sequence.
extern "C" __global__ void batch_meta_kernel(const int* query_start, int S, int* seq_of) {
  const int s = blockIdx.x;
  if (s >= S) return;
  const int a = query_start[s], b = query_start[s + 1];
  for (int t = a + threadIdx.x; t < b; t += blockDim.x) seq_of[t] = s;
}

// ATTN_MAX_CPT (dsv4_consts.cuh): most f64 P.V accumulators per thread (channels tid,
// tid + blockDim, ...), so hd <= ATTN_MAX_CPT * blockDim.

// One block per (token, head): blockIdx.x = t * H + h. Dynamic shared memory: double q[hd]
// (padded to 2), float logits[nk_max], then int sel[topk] (CSA), nk_max = W + (selected ?
// topk : maxe) (the wrapper sizes it). Keys (each also the value): window positions
// max(0, p-W+1) .. p (ring row pos % W of the slot for positions before the sequence's first
// position in this batch, else this batch's kv row), then compressed entries: HCA
// (selected == NULL, ratio > 0) every w < (p+1)/ratio, CSA selected[t][0 .. nsel[t]] in the
// indexer's order. ratio == 0: window only.
extern "C" __global__ void attention_kernel(const float* q, const float* kv, const float* ring,
                                           const float* entries, const int* selected,
                                           const int* nsel, const int* positions,
                                           const int* seq_of, const int* query_start,
                                           const int* seq_slots, const float* sinks, int T, int H,
                                           int hd, int W, int ratio, int maxe, int topk,
                                           int official, float* o) {
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

  const int p = positions[t];
  const int t0 = query_start[s];
  const int p0 = positions[t0];
  const int lo = p - W + 1 > 0 ? p - W + 1 : 0;
  const int nw = p - lo + 1;
  int nc = 0;
  if (ratio > 0) {
    if (selected != 0) {
      nc = nsel[t];
      if (nc > topk) nc = topk;
    } else {
      nc = (p + 1) / ratio;
      if (nc > maxe) nc = maxe;
    }
    if (nc < 0) nc = 0;
  }
  const int nk = nw + nc;
  int* sel = (int*)(lg + W + topk);  // CSA only
  if (ratio > 0 && selected != 0)
    for (int i = tid; i < nc; i += nt) sel[i] = selected[(long long)t * topk + i];
  const float* ring_slot = ring + (long long)slot * W * hd;
  const float* ent_slot = entries + (long long)slot * maxe * hd;
  const bool csa = selected != 0;
  // The j-th key row.
#define ATTN_KEY(j)                                                                   \
  ((j) < nw ? ((lo + (j)) < p0 ? ring_slot + (long long)((lo + (j)) % W) * hd          \
                               : kv + (long long)(t0 + (lo + (j)) - p0) * hd)          \
            : ent_slot + (long long)(csa ? sel[(j) - nw] : (j) - nw) * hd)
  __syncthreads();

  // Logits l_j = f32(q . k_j) * f32(hd^-1/2), and their max (over real keys only).
  const float scale = (float)(1.0 / sqrt((double)hd));
  float mx = -DSV4_F32_INF;
  for (int j = tid; j < nk; j += nt) {
    const float l = __fmul_rn(attn_dot_ref(qs, ATTN_KEY(j), hd), scale);
    lg[j] = l;
    mx = fmaxf(mx, l);
  }
  const float m = block_max(mx, red);  // ends with a barrier: every lg[j] is written

  // e_j = exp(l_j - m), kept unrounded for the denominator.
  for (int j = tid; j < nk; j += nt) lg[j] = ref_exp(__fsub_rn(lg[j], m));
  __syncthreads();

  // o[c] = f32(sum_j f64(p_j) * f64(v_j[c])) / den, keys in order from +0.0 (reference P.V);
  // p_j = bf16(e_j) if official. Thread 0 also sums the denominator f32(sum_j f64 e_j) keys in
  // order from -0.0 (ops.rs `sum`), + exp(sink - m). Four keys per step: their loads are
  // independent of the accumulators, so they are in flight together.
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
    const float* k0 = ATTN_KEY(j);
    const float* k1 = ATTN_KEY(j + 1);
    const float* k2 = ATTN_KEY(j + 2);
    const float* k3 = ATTN_KEY(j + 3);
#pragma unroll
    for (int r = 0; r < ATTN_MAX_CPT; ++r) {
      const int c = tid + r * nt;
      if (c < hd) {
        const float v0 = k0[c], v1 = k1[c], v2 = k2[c], v3 = k3[c];
        acc[r] += p0d * (double)v0;
        acc[r] += p1d * (double)v1;
        acc[r] += p2d * (double)v2;
        acc[r] += p3d * (double)v3;
      }
    }
  }
  for (; j < nk; ++j) {
    const float e = lg[j];
    if (tid == 0) dacc += (double)e;
    const double pv = (double)(official ? round_bf16(e) : e);
    const float* kr = ATTN_KEY(j);
#pragma unroll
    for (int r = 0; r < ATTN_MAX_CPT; ++r) {
      const int c = tid + r * nt;
      if (c < hd) acc[r] += pv * (double)kr[c];
    }
  }
#undef ATTN_KEY
  if (tid == 0) den_s = __fadd_rn((float)dacc, ref_exp(__fsub_rn(sinks[h], m)));
  __syncthreads();
  const float den = den_s;
  float* orow = o + ((long long)t * H + h) * hd;
#pragma unroll
  for (int r = 0; r < ATTN_MAX_CPT; ++r) {
    const int c = tid + r * nt;
    if (c < hd) {
      const float v = __fdiv_rn((float)acc[r], den);
      orow[c] = official ? round_bf16(v) : v;
    }
  }
}

// The last min(len, W) window vectors of each sequence into ring[slot][pos % W]. Grid
// (S, W): blockIdx.y is the row among the kept ones. Runs after attention.
extern "C" __global__ void ring_update_kernel(const float* kv, const int* positions,
                                             const int* query_start, const int* seq_slots, int S,
                                             int W, int hd, float* ring) {
  const int s = blockIdx.x, r = blockIdx.y;
  if (s >= S) return;
  if (seq_slots[s] < 0) return;  // padding: writes no state
  const int a = query_start[s], b = query_start[s + 1];
  const int keep = b - a < W ? b - a : W;
  if (r >= keep) return;
  const int i = b - keep + r;
  const int pos = positions[i];
  float* dst = ring + ((long long)seq_slots[s] * W + pos % W) * hd;
  const float* src = kv + (long long)i * hd;
  for (int c = threadIdx.x; c < hd; c += blockDim.x) dst[c] = src[c];
}

// slot_len[seq_slots[s]] = last position of sequence s + 1 (padding sequences: nothing).
extern "C" __global__ void slot_len_kernel(const int* positions, const int* query_start,
                                          const int* seq_slots, int S, int* slot_len) {
  for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < S; s += gridDim.x * blockDim.x)
    if (seq_slots[s] >= 0) slot_len[seq_slots[s]] = positions[query_start[s + 1] - 1] + 1;
}
