// indexer kernel family: see kernels/SPEC.md (indexer.cu) and MODEL.md §6.4.
//
// The lightning indexer's scores and top-k selection, one block per token. Reproduces
// src/reference/attention.rs `select_entries` bit for bit: per head d_h = f32(q_h . k) in the
// order of ops.rs `dot` (bf16 if official), score = f32(sum_h f64(relu(d_h) * w_h)) summed
// over heads in order from -0.0 (bf16 if official), then ops.rs `top_k`: the
// min(topk, visible) best scores, larger first, ties to the LOWER entry index, NaN ranking
// below everything.
#include "common.cuh"
#include "kv_pages.cuh"

// Entries per register block of idx_dots: one thread computes one head's dots with IDX_NB
// entries, so each q load serves IDX_NB entries (shared memory bandwidth bounds this loop).
#define IDX_NB 4

// ops.rs `dot` of the f64 row `a` with each of the nb (<= IDX_NB) f64 rows b + r * st (floats
// converted once into shared memory; products of two floats are exact in f64). Per row:
// acc[0..4] over chunks of 4, s = (acc0 + acc2) + (acc1 + acc3), then the remainder added to s
// in order. Rows are 16-byte aligned and n is what they hold.
DSV4_INLINE void idx_dots(const double* a, const double* b, int st, int nb, int n, float* out) {
  double c[IDX_NB][4];
#pragma unroll
  for (int r = 0; r < IDX_NB; ++r) c[r][0] = c[r][1] = c[r][2] = c[r][3] = 0.0;
  const int n4 = n & ~3;
  const double2* a2 = (const double2*)a;
#pragma unroll 2
  for (int i = 0; i < (n4 >> 2); ++i) {
    const double2 x0 = a2[2 * i], x1 = a2[2 * i + 1];
#pragma unroll
    for (int r = 0; r < IDX_NB; ++r) {
      if (r < nb) {
        const double2* b2 = (const double2*)(b + r * st);
        const double2 y0 = b2[2 * i], y1 = b2[2 * i + 1];
        c[r][0] += x0.x * y0.x;
        c[r][1] += x0.y * y0.y;
        c[r][2] += x1.x * y1.x;
        c[r][3] += x1.y * y1.y;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < IDX_NB; ++r) {
    if (r < nb) {
      double s = (c[r][0] + c[r][2]) + (c[r][1] + c[r][3]);
      for (int i = n4; i < n; ++i) s += a[i] * b[r * st + i];
      out[r] = (float)s;
    }
  }
}

DSV4_INLINE unsigned idx_dynamic_smem_bytes() {
  unsigned v;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
  return v;
}

// IDX_TILE (dsv4_consts.cuh): entries scored per tile (the wrapper sizes shared memory for it).

// Shared-memory row stride (doubles) of q heads and key rows: DI rounded up to 4, plus 2. Rows
// stay 16-byte aligned, and consecutive rows start 16 bytes apart modulo 128, so the double2
// loads of 8 consecutive rows hit distinct banks.
DSV4_INLINE int idx_stride(int DI) { return ((DI + 3) & ~3) + 2; }

// One block per token t. Dynamic shared memory: double q[HI][stride], double keys[IDX_TILE]
// [stride], float d[IDX_TILE][HI], float w[HI]; afterwards its start is reused for the scores
// when they fit. ikeys: maxe keys per slot in pages through itable (ipps pages per slot), in
// kv_pages.cuh's indexer-key format for `official`; scores: [T][maxe] (workspace, bf16 values in
// official mode); selected: [T][topk] in rank order, -1 past nsel[t] = min(topk, visible).
extern "C" __global__ void indexer_kernel(const float* qi, const float* iw,
                                         const unsigned char* ikeys, const int* itable, int ipps,
                                         const int* positions, const int* seq_of,
                                         const int* seq_slots, int T, int HI, int DI, int ratio,
                                         int topk, int maxe, int official, float* scores,
                                         int* selected, int* nsel) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) double idx_smem[];
  const int t = blockIdx.x;
  if (t >= T) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int st = idx_stride(DI);
  double* qs = idx_smem;
  double* ks = qs + HI * st;
  float* ds = (float*)(ks + IDX_TILE * st);
  float* ws = ds + IDX_TILE * HI;

  const int p = positions[t];
  const int slot = seq_slots[seq_of[t]];
  if (slot < 0) {  // padding (or a bad batch): no keys are read, nothing is selected
    for (int r = tid; r < topk; r += nt) selected[(long long)t * topk + r] = -1;
    if (tid == 0) nsel[t] = 0;
    return;
  }
  int visible = (p + 1) / ratio;
  if (visible > maxe) visible = maxe;
  const float* qrow = qi + (long long)t * HI * DI;
  for (int i = tid; i < HI * DI; i += nt) qs[(i / DI) * st + i % DI] = (double)qrow[i];
  for (int h = tid; h < HI; h += nt) ws[h] = iw[(long long)t * HI + h];
  const KvRowFmt kfmt = kv_fmt_index(DI, official);
  float* sc = scores + (long long)t * maxe;

  for (int e0 = 0; e0 < visible; e0 += IDX_TILE) {
    const int ne = visible - e0 < IDX_TILE ? visible - e0 : IDX_TILE;
    __syncthreads();  // q/w loaded; the previous tile is consumed
    for (int i = tid; i < ne * DI; i += nt) {
      const int e = i / DI, c = i % DI;
      ks[e * st + c] = (double)kv_value(kfmt, kv_row(kfmt, ikeys, itable, ipps, slot, e0 + e), c);
    }
    __syncthreads();
    // Consecutive threads take consecutive heads of one block of IDX_NB entries (q rows
    // spread over banks, the key rows broadcast).
    const int nblk = (ne + IDX_NB - 1) / IDX_NB;
    for (int it = tid; it < nblk * HI; it += nt) {
      const int eb = (it / HI) * IDX_NB, h = it % HI;
      const int nb = ne - eb < IDX_NB ? ne - eb : IDX_NB;
      float d[IDX_NB];
      idx_dots(qs + h * st, ks + eb * st, st, nb, DI, d);
#pragma unroll
      for (int r = 0; r < IDX_NB; ++r)
        if (r < nb) ds[(eb + r) * HI + h] = official ? round_bf16(d[r]) : d[r];
    }
    __syncthreads();
    for (int e = tid; e < ne; e += nt) {
      double acc = -0.0;
      for (int h = 0; h < HI; ++h) acc += (double)__fmul_rn(fmaxf(ds[e * HI + h], 0.0f), ws[h]);
      const float s = (float)acc;
      sc[e0 + e] = official ? round_bf16(s) : s;
    }
  }
  __syncthreads();  // every score is in `sc` (global writes of this block are visible to it)

  // top-k by rank: rank(e) = #{j : key_j > key_e or (key_j == key_e and j < e)}, key = score
  // with NaN as -inf. Ranks are distinct, so selected[rank] gets exactly one entry.
  const int k = topk < visible ? topk : visible;
  const float* keys = sc;
  if ((unsigned)visible * 4u <= idx_dynamic_smem_bytes()) {
    float* kf = (float*)idx_smem;
    for (int e = tid; e < visible; e += nt) {
      const float v = sc[e];
      kf[e] = v != v ? -DSV4_F32_INF : v;
    }
    keys = kf;
    __syncthreads();
  }
  int* sel = selected + (long long)t * topk;
  for (int e = tid; e < visible; e += nt) {
    float ke = keys[e];
    if (ke != ke) ke = -DSV4_F32_INF;
    int rank = 0;
    for (int j = 0; j < visible && rank < k; ++j) {
      float kj = keys[j];
      if (kj != kj) kj = -DSV4_F32_INF;
      rank += (kj > ke || (kj == ke && j < e)) ? 1 : 0;
    }
    if (rank < k) sel[rank] = e;
  }
  for (int r = k + tid; r < topk; r += nt) sel[r] = -1;
  if (tid == 0) nsel[t] = k;
}
