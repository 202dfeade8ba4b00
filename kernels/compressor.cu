// compressor kernel family: see kernels/SPEC.md (compressor.cu) and MODEL.md §6.3, App. A.
//
// The token-streaming KV compressor of one layer (main KV entries or indexer keys), one block
// per sequence, tokens in order. Reproduces src/reference/compressor.rs `push`/`pool` and
// src/reference/attention.rs `compress_chunk` bit for bit: pooled -> bf16 -> RMSNorm -> bf16
// -> RoPE at w*r -> bf16 -> fp8sim of the nope channels (KV) or Hadamard + fp4sim + bf16
// (indexer key), the bf16/sim steps only in official mode. Sums are f64 in the reference's
// order (sequential from -0.0, like Rust's f64 `Sum`); f32 arithmetic is explicitly rounded
// (__fmul_rn & co.: no FMA contraction); exp/sin/cos/rsqrt in f64, rounded once.
#include "common.cuh"
#include "kv_pages.cuh"
#include "ref_math.cuh"

// quant.rs fp8_sim over one block of min(n, 64) values, in place, by one warp (all 32 lanes
// call; two values per lane). amax is a max, so the butterfly order is immaterial; fmaxf
// ignores NaN like the reference's f32::max fold from 0.
DSV4_INLINE void comp_fp8_sim_warp(float* x, int n) {
  const int lane = threadIdx.x & 31;
  if (n > 64) n = 64;
  float amax = 0.0f;
  for (int i = lane; i < n; i += 32) amax = fmaxf(amax, fabsf(x[i]));
  amax = fmaxf(warp_max(amax), 1e-4f);
  const float s = ue8m0_scale(amax, DSV4_E4M3_MAX);
  for (int i = lane; i < n; i += 32)
    x[i] = ref_fp8_sim_value(x[i], s);
}

// quant.rs fp4_sim over one block of min(n, 32) values, in place, by one warp.
DSV4_INLINE void comp_fp4_sim_warp(float* x, int n) {
  const int lane = threadIdx.x & 31;
  if (n > 32) n = 32;
  float amax = lane < n ? fabsf(x[lane]) : 0.0f;
  amax = fmaxf(warp_max(amax), __fmul_rn(DSV4_E2M1_MAX, 1.17549435e-38f));  // 6 * f32::MIN_POSITIVE
  const float s = ue8m0_scale(amax, DSV4_E2M1_MAX);
  if (lane < n)
    x[lane] = ref_fp4_sim_value(x[lane], s);
}

// The reference's pool of one window into ent (official: bf16), one thread a channel: per channel j the
// slots are the previous window's A halves (np of them: prev_z / prev_a (sl, j)), then this window's
// rows (cur_z / cur_a (sl, j): B halves with overlap, whole rows without). Softmax of z over the
// slots, in f64 sums in slot order; each exp in f64, rounded once.
template <class PrevZ, class PrevA, class CurZ, class CurA>
DSV4_INLINE void comp_pool(float* ent, int dc, int np, int ratio, int official, PrevZ prev_z, PrevA prev_a,
                           CurZ cur_z, CurA cur_a) {
  for (int j = threadIdx.x; j < dc; j += blockDim.x) {
    float m = -DSV4_F32_INF;
    for (int sl = 0; sl < np; ++sl) m = fmaxf(m, prev_z(sl, j));
    for (int sl = 0; sl < ratio; ++sl) m = fmaxf(m, cur_z(sl, j));
    // (Unrolled: the exps of consecutive slots are independent and overlap; the sums still add in
    // slot order.)
    double dacc = -0.0;
#pragma unroll 4
    for (int sl = 0; sl < np; ++sl) dacc += (double)ref_exp(__fsub_rn(prev_z(sl, j), m));
#pragma unroll 4
    for (int sl = 0; sl < ratio; ++sl) dacc += (double)ref_exp(__fsub_rn(cur_z(sl, j), m));
    const float den = (float)dacc;
    double acc = -0.0;
#pragma unroll 4
    for (int sl = 0; sl < np; ++sl) {
      const float e = ref_exp(__fsub_rn(prev_z(sl, j), m));
      acc += (double)__fdiv_rn(e, den) * (double)prev_a(sl, j);
    }
#pragma unroll 4
    for (int sl = 0; sl < ratio; ++sl) {
      const float e = ref_exp(__fsub_rn(cur_z(sl, j), m));
      acc += (double)__fdiv_rn(e, den) * (double)cur_a(sl, j);
    }
    const float v = (float)acc;
    ent[j] = official ? round_bf16(v) : v;
  }
}

// The rest of a window's entry after its pool (all threads of the block call it; ent complete): RMSNorm
// -> bf16 -> RoPE at position w * ratio -> bf16 -> the KV fp8sim (kind 0) or Hadamard + fp4sim + bf16
// (kind 1), each official step only if `official`; then the entry goes to row w of the slot's entries
// (when w < maxe).
DSV4_INLINE void comp_finish(float* ent, double* hbuf, int dc, float eps, const float* __restrict__ norm_w,
                             const float* __restrict__ inv_freq, int half_rope, int w, int ratio, int kind, int nope,
                             int official, const KvRowFmt& fmt, unsigned char* entries, const int* etable, int epps,
                             int slot, int maxe) {
  __shared__ float rnorm_s;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int warp = tid >> 5, nwarps = nt >> 5;
  __syncthreads();  // ent complete
  // RMSNorm: ms = f32(sum f64 v^2 / dc) (sequential), r = f32(1 / sqrt(f64(ms + eps))).
  if (tid == 0) {
    double acc = -0.0;
    for (int c = 0; c < dc; ++c) acc += (double)ent[c] * (double)ent[c];
    const float ms = (float)(acc / (double)dc);
    rnorm_s = (float)(1.0 / sqrt((double)__fadd_rn(ms, eps)));
  }
  __syncthreads();
  const float rn = rnorm_s;
  for (int c = tid; c < dc; c += nt) {
    float v = __fmul_rn(__fmul_rn(ent[c], rn), norm_w[c]);
    ent[c] = official ? round_bf16(v) : v;
  }
  __syncthreads();

  // RoPE of the trailing 2*half_rope channels at the window's first position w*r.
  const float fpos = (float)(w * ratio);
  const int base = dc - 2 * half_rope;
  for (int k = tid; k < half_rope; k += nt) {
    const float th = __fmul_rn(fpos, inv_freq[k]);
    double sd, cd;
    sincos((double)th, &sd, &cd);
    const float sn = (float)sd, cs = (float)cd;
    const float x0 = ent[base + 2 * k], x1 = ent[base + 2 * k + 1];
    float y0 = __fsub_rn(__fmul_rn(x0, cs), __fmul_rn(x1, sn));
    float y1 = __fadd_rn(__fmul_rn(x0, sn), __fmul_rn(x1, cs));
    if (official) {
      y0 = round_bf16(y0);
      y1 = round_bf16(y1);
    }
    ent[base + 2 * k] = y0;
    ent[base + 2 * k + 1] = y1;
  }
  __syncthreads();
  if (official) {
    if (kind == 0) {
      // fp8sim of the nope channels, blocks of 64 (the last one may be short): a warp per block.
      for (int b = warp; b * 64 < nope; b += nwarps) comp_fp8_sim_warp(ent + b * 64, nope - b * 64);
    } else {
      // Hadamard (Sylvester order, f64 butterflies, precision.rs `hadamard`), then
      // f32(.) * f32(dc^-1/2), fp4sim in blocks of 32, bf16.
      for (int c = tid; c < dc; c += nt) hbuf[c] = (double)ent[c];
      __syncthreads();
      ref_hadamard_f64(hbuf, dc);
      const float hs = (float)(1.0 / sqrt((double)dc));
      for (int c = tid; c < dc; c += nt) ent[c] = __fmul_rn((float)hbuf[c], hs);
      __syncthreads();
      for (int b = warp; b * 32 < dc; b += nwarps) comp_fp4_sim_warp(ent + b * 32, dc - b * 32);
      __syncthreads();
      for (int c = tid; c < dc; c += nt) ent[c] = round_bf16(ent[c]);
    }
  }
  __syncthreads();
  if (w < maxe) kv_store_row(fmt, kv_row(fmt, entries, etable, epps, slot, w), ent);
  __syncthreads();
}

// One block per sequence (blockDim a multiple of 32, at most 512). Dynamic shared memory: double hbuf[dc]
// (Hadamard, indexer keys only) then float ent[dc].
//
// State per slot: pend_a/pend_z [slot][ratio][width] (width = 2*dc if overlap else dc),
// prev_a/prev_z [slot][ratio][dc] and has_prev[slot] (overlap only; may be NULL otherwise),
// entries: maxe rows per slot in pages through etable (epps pages per slot), in kv_pages.cuh's
// format for `official` (KV rows for kind 0, indexer keys for kind 1). Inputs a, z:
// [T][width] (z without ape). kind 0: KV entry (fp8sim of channels [0, nope) in blocks of 64),
// 1: indexer key (Hadamard, fp4sim in blocks of 32).
extern "C" __global__ void __launch_bounds__(COMP_THREADS)
    compress_kernel(const float* a, const float* z, const int* positions, const int* query_start,
                    const int* seq_slots, int S, float* pend_a, float* pend_z, float* prev_a,
                    float* prev_z, int* has_prev, const float* ape, const float* norm_w,
                    const float* inv_freq, int half_rope, int ratio, int overlap, int dc, float eps,
                    int kind, int nope, int official, unsigned char* entries, const int* etable,
                    int epps, int maxe) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) double comp_smem[];
  const int sq = blockIdx.x;
  if (sq >= S) return;
  const int tid = threadIdx.x, nt = blockDim.x;
  double* hbuf = comp_smem;
  float* ent = (float*)(comp_smem + dc);
  const int width = overlap ? 2 * dc : dc;
  const int slot = seq_slots[sq];
  if (slot < 0) return;  // padding (or a bad batch): reads and writes no state
  const int ta = query_start[sq], tb = query_start[sq + 1];
  const int p_first = positions[ta];
  float* pa = pend_a + (long long)slot * ratio * width;
  float* pz = pend_z + (long long)slot * ratio * width;
  float* qa = overlap ? prev_a + (long long)slot * ratio * dc : 0;
  float* qz = overlap ? prev_z + (long long)slot * ratio * dc : 0;
  // A sequence starting at position 0 starts without a previous window.
  int hp = (overlap && p_first != 0) ? has_prev[slot] : 0;
  const KvRowFmt fmt = kind == 0 ? kv_fmt_kv(dc, nope, official) : kv_fmt_index(dc, official);
  const int cur_off = overlap ? dc : 0;

  // Tokens go window by window: a segment is this batch's tokens of one window (positions
  // are consecutive), pushed together; the window is pooled when its last token is pushed.
  for (int i = ta; i < tb;) {
    const int r0 = positions[i] % ratio;
    const int n = ratio - r0 < tb - i ? ratio - r0 : tb - i;
    // push: pending row r0 + k = a, z + ape[r0 + k] (f32 add) for the segment's token i + k.
    for (int x = tid; x < n * width; x += nt) {
      const int k = x / width, c = x % width, row = r0 + k;
      const long long src = (long long)(i + k) * width + c;
      pa[row * width + c] = a[src];
      pz[row * width + c] = __fadd_rn(z[src], ape[row * width + c]);
    }
    const int p = positions[i + n - 1];
    i += n;
    if (p % ratio != ratio - 1) continue;  // (only the sequence's last segment)
    __syncthreads();  // the window's rows are complete

    // pool, then (overlap) this window's A halves become the previous window's: the thread of channel
    // j shifts column j, which it alone reads and writes (comp_pool's channel loop, the same j).
    comp_pool(
        ent, dc, (overlap && hp) ? ratio : 0, ratio, official, [&](int sl, int j) { return qz[sl * dc + j]; },
        [&](int sl, int j) { return qa[sl * dc + j]; }, [&](int sl, int j) { return pz[sl * width + cur_off + j]; },
        [&](int sl, int j) { return pa[sl * width + cur_off + j]; });
    if (overlap) {
      for (int j = tid; j < dc; j += nt)
        for (int sl = 0; sl < ratio; ++sl) {
          qa[sl * dc + j] = pa[sl * width + j];
          qz[sl * dc + j] = pz[sl * width + j];
        }
      hp = 1;
    }
    comp_finish(ent, hbuf, dc, eps, norm_w, inv_freq, half_rope, p / ratio, ratio, kind, nope, official, fmt,
                entries, etable, epps, slot, maxe);
  }
  if (overlap && tid == 0) has_prev[slot] = hp;
}

// ---- Many tokens a sequence (prefill): the windows in parallel ----
//
// compress_kernel walks a sequence's tokens in order in one block: a 4096-token prefill took 15 ms a
// call (ncu). But a window's entry depends only on its rows and the previous window's A halves, which
// are this batch's rows (a, z + ape) or, before the batch's first position, the slot's state (pend_*
// for the first window's earlier rows, prev_* for the window before it). So compress_windows_kernel
// makes every window completed in the batch at once, a block each, reading the state and writing only
// entries; then compress_state_kernel, a block a sequence, leaves the state as compress_kernel would.
// Same values bit for bit: each window's arithmetic is compress_kernel's (comp_pool, comp_finish). The
// three kernels take the same arguments (compressor.rs CompressArgs).

// Sequence sq's batch span and the windows it completes: w0 = p_first / ratio is the first window the
// batch touches; windows w0 .. w0 + done - 1 end inside the batch (a window ends at w * ratio + ratio - 1).
// A sequence's completed windows number at most ceil(its tokens / ratio).
struct CompSpan {
  int ta, p_first, p_last, w0, done;
};
DSV4_INLINE CompSpan comp_span(const int* positions, const int* query_start, int sq, int ratio) {
  CompSpan s;
  s.ta = query_start[sq];
  const int tb = query_start[sq + 1];
  s.p_first = tb > s.ta ? positions[s.ta] : 0;
  s.p_last = tb > s.ta ? positions[tb - 1] : -1;
  s.w0 = s.p_first / ratio;
  s.done = tb > s.ta ? (s.p_last + 1) / ratio - s.w0 : 0;
  return s;
}

// Grid (x >= the most windows a sequence completes, S), one block a (window, sequence): block (k, sq)
// makes window w0 + k of sequence sq if the batch completes it. Reads a, z, ape and the slot's state;
// writes only entry rows. Dynamic shared memory as compress_kernel.
extern "C" __global__ void __launch_bounds__(COMP_THREADS)
    compress_windows_kernel(const float* a, const float* z, const int* positions, const int* query_start,
                    const int* seq_slots, int S, float* pend_a, float* pend_z, float* prev_a,
                    float* prev_z, int* has_prev, const float* ape, const float* norm_w,
                    const float* inv_freq, int half_rope, int ratio, int overlap, int dc, float eps,
                    int kind, int nope, int official, unsigned char* entries, const int* etable,
                    int epps, int maxe) {
  dsv4_pdl_begin();
  extern __shared__ __align__(16) double comp_smem[];
  const int sq = blockIdx.y;
  if (sq >= S) return;
  const int slot = seq_slots[sq];
  if (slot < 0) return;  // padding (or a bad batch): reads and writes no state
  const CompSpan sp = comp_span(positions, query_start, sq, ratio);
  const int k = blockIdx.x;
  if (k >= sp.done) return;
  double* hbuf = comp_smem;
  float* ent = (float*)(comp_smem + dc);
  const int width = overlap ? 2 * dc : dc;
  const float* pa = pend_a + (long long)slot * ratio * width;
  const float* pz = pend_z + (long long)slot * ratio * width;
  const float* qa = overlap ? prev_a + (long long)slot * ratio * dc : 0;
  const float* qz = overlap ? prev_z + (long long)slot * ratio * dc : 0;
  const int w = sp.w0 + k, cur_off = overlap ? dc : 0;
  // Row sl of window v, column c: this batch's token at position v * ratio + sl (a; z + ape, the f32
  // add compress_kernel's push does), or before the batch's first position the pending row.
  auto row_a = [&](int v, int sl, int c) {
    const int pos = v * ratio + sl;
    return pos >= sp.p_first ? a[(long long)(sp.ta + pos - sp.p_first) * width + c] : pa[sl * width + c];
  };
  auto row_z = [&](int v, int sl, int c) {
    const int pos = v * ratio + sl;
    return pos >= sp.p_first ? __fadd_rn(z[(long long)(sp.ta + pos - sp.p_first) * width + c], ape[sl * width + c])
                             : pz[sl * width + c];
  };
  // The previous window's A halves: the state's for the batch's first window (if it has one: not
  // after a restart at position 0), else window w - 1's rows.
  const bool first = k == 0;
  const int hp = first ? ((overlap && sp.p_first != 0) ? has_prev[slot] : 0) : 1;
  comp_pool(
      ent, dc, (overlap && hp) ? ratio : 0, ratio, official,
      [&](int sl, int j) { return first ? qz[sl * dc + j] : row_z(w - 1, sl, j); },
      [&](int sl, int j) { return first ? qa[sl * dc + j] : row_a(w - 1, sl, j); },
      [&](int sl, int j) { return row_z(w, sl, cur_off + j); }, [&](int sl, int j) { return row_a(w, sl, cur_off + j); });
  const KvRowFmt fmt = kind == 0 ? kv_fmt_kv(dc, nope, official) : kv_fmt_index(dc, official);
  comp_finish(ent, hbuf, dc, eps, norm_w, inv_freq, half_rope, w, ratio, kind, nope, official, fmt, entries, etable,
              epps, slot, maxe);
}

// After compress_windows_kernel: one block a sequence leaves the slot's state as compress_kernel does.
// - prev_a / prev_z (overlap): the A halves of the last window the batch completed, if any;
// - pend_a / pend_z: each row r holds the last of this batch's tokens at a position p = r (mod ratio),
//   if there is one (compress_kernel pushes every token into its row, and a later push overwrites);
// - has_prev (overlap): 1 once a window completes; else 0 for a sequence starting at position 0, else
//   unchanged.
// prev is taken first: the last completed window may be the batch's first, whose early rows are the
// pending rows about to be overwritten.
extern "C" __global__ void __launch_bounds__(COMP_THREADS)
    compress_state_kernel(const float* a, const float* z, const int* positions, const int* query_start,
                    const int* seq_slots, int S, float* pend_a, float* pend_z, float* prev_a,
                    float* prev_z, int* has_prev, const float* ape, const float* norm_w,
                    const float* inv_freq, int half_rope, int ratio, int overlap, int dc, float eps,
                    int kind, int nope, int official, unsigned char* entries, const int* etable,
                    int epps, int maxe) {
  dsv4_pdl_begin();
  const int sq = blockIdx.x;
  if (sq >= S) return;
  const int slot = seq_slots[sq];
  if (slot < 0) return;
  const CompSpan sp = comp_span(positions, query_start, sq, ratio);
  if (sp.p_last < sp.p_first) return;  // no tokens
  const int tid = threadIdx.x, nt = blockDim.x;
  const int width = overlap ? 2 * dc : dc;
  float* pa = pend_a + (long long)slot * ratio * width;
  float* pz = pend_z + (long long)slot * ratio * width;
  auto token_of = [&](int pos) { return (long long)(sp.ta + pos - sp.p_first); };
  if (overlap && sp.done > 0) {
    float* qa = prev_a + (long long)slot * ratio * dc;
    float* qz = prev_z + (long long)slot * ratio * dc;
    const int wl = sp.w0 + sp.done - 1;
    for (int x = tid; x < ratio * dc; x += nt) {
      const int sl = x / dc, j = x - sl * dc, pos = wl * ratio + sl;
      const bool in_batch = pos >= sp.p_first;
      qa[x] = in_batch ? a[token_of(pos) * width + j] : pa[sl * width + j];
      qz[x] = in_batch ? __fadd_rn(z[token_of(pos) * width + j], ape[sl * width + j]) : pz[sl * width + j];
    }
  }
  __syncthreads();  // the old pending rows are read
  for (int x = tid; x < ratio * width; x += nt) {
    const int r = x / width, c = x - r * width;
    const int pos = sp.p_last - ((sp.p_last - r) % ratio + ratio) % ratio;  // the last position = r (mod ratio)
    if (pos >= sp.p_first) {
      pa[x] = a[token_of(pos) * width + c];
      pz[x] = __fadd_rn(z[token_of(pos) * width + c], ape[x]);
    }
  }
  if (overlap && tid == 0)
    has_prev[slot] = sp.done > 0 ? 1 : (sp.p_first != 0 ? has_prev[slot] : 0);
}
