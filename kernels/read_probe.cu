// read_probe kernel family (benches only: `dsv4 bench dense --read-probe`): reads a buffer once in
// 16-byte streaming loads and does nothing with the bytes but fold them into a value that is stored
// only if it equals a constant no real data hits, so the loads stay live and nothing is written.
// Timed like the gemv (a graph of calls over enough copies that L2 holds none, programmatic
// launches, its first loads issued before its wait), it is what reading a projection's bytes costs
// at that size: the launch, the first bytes' latency and the last wave's tail are in it, the
// arithmetic is not. It separates what a kernel's own work costs from what the size costs.
// A launch may ask for dynamic shared memory it never touches, only so that no more than a given
// number of its blocks fit on an SM: then, like a kernel whose registers fill the SM, the next call's
// blocks cannot start until this one's leave.
#include "common.cuh"

// A streamed 16-byte load (fast_dense.cu's fd_ld_stream).
DSV4_INLINE uint4 rp_ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Thread i reads words i, i + threads, ... (threads: the grid's), U loads in flight at a time.
template <int U>
DSV4_INLINE void read_probe(const uint4* __restrict__ p, long long words, unsigned* sink) {
  const long long threads = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  unsigned fold = 0;
  bool waited = false;
  for (; i < words; i += U * threads) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = i + u * threads;
      v[u] = j < words ? rp_ld_stream(p + j) : make_uint4(0u, 0u, 0u, 0u);
    }
    if (!waited) {  // as fd_gemv: the first loads out, then the wait (they read no kernel's output)
      dsv4_pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) fold ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (!waited) dsv4_pdl_wait();
  if (fold == 0x9e3779b9u) sink[blockIdx.x] = fold;
}

// `words` 16-byte words at p (16-byte aligned); sink: one word a block (written only for the constant above).
extern "C" __global__ void read_probe_u2_kernel(const unsigned char* p, long long words, unsigned* sink) {
  dsv4_pdl_trigger();  // read_probe waits after its first loads
  read_probe<2>(reinterpret_cast<const uint4*>(p), words, sink);
}

extern "C" __global__ void read_probe_u4_kernel(const unsigned char* p, long long words, unsigned* sink) {
  dsv4_pdl_trigger();  // read_probe waits after its first loads
  read_probe<4>(reinterpret_cast<const uint4*>(p), words, sink);
}

extern "C" __global__ void read_probe_u8_kernel(const unsigned char* p, long long words, unsigned* sink) {
  dsv4_pdl_trigger();  // read_probe waits after its first loads
  read_probe<8>(reinterpret_cast<const uint4*>(p), words, sink);
}

extern "C" __global__ void read_probe_u16_kernel(const unsigned char* p, long long words, unsigned* sink) {
  dsv4_pdl_trigger();  // read_probe waits after its first loads
  read_probe<16>(reinterpret_cast<const uint4*>(p), words, sink);
}

// The gemv's addresses without its work (fast_dense.cu fd_gemv, FP8, one slice): `rows` rows of
// row_bytes bytes (a multiple of 128), a block of 8 warps a row tile of 128 rows, warp w rows 16w..16w+15
// of it; lane (g = lane / 4, c = lane % 4) reads 16 bytes at 16c of each 64 of rows g and g + 8, four
// 128-byte blocks of k at a time. Grid ceil(rows / 128), 256 threads. Tells the cost of the gemv's order
// of reads apart from the cost of its arithmetic and staging.
extern "C" __global__ void read_probe_rows_kernel(const unsigned char* w, int row_bytes, int rows, unsigned* sink) {
  dsv4_pdl_trigger();  // waits after its first loads, as fd_gemv
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.x * 128 + warp * 16;
  const uint4* p0 = reinterpret_cast<const uint4*>(w + (long long)min(n0 + g, rows - 1) * row_bytes + 16 * c);
  const uint4* p1 = reinterpret_cast<const uint4*>(w + (long long)min(n0 + g + 8, rows - 1) * row_bytes + 16 * c);
  const int blocks = row_bytes / 128;
  unsigned fold = 0;
  bool waited = false;
  for (int kb0 = 0; kb0 < blocks; kb0 += 4) {
    uint4 v[4][2][2];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
      for (int ch = 0; ch < 2; ++ch) {
        const bool in = kb0 + p < blocks;
        const int off = ((kb0 + p) * 128 + 64 * ch) / 16;
        v[p][ch][0] = in ? rp_ld_stream(p0 + off) : make_uint4(0u, 0u, 0u, 0u);
        v[p][ch][1] = in ? rp_ld_stream(p1 + off) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (!waited) {
      dsv4_pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int ch = 0; ch < 2; ++ch)
#pragma unroll
        for (int r = 0; r < 2; ++r) fold ^= v[p][ch][r].x ^ v[p][ch][r].y ^ v[p][ch][r].z ^ v[p][ch][r].w;
  }
  if (!waited) dsv4_pdl_wait();
  if (fold == 0x9e3779b9u) sink[blockIdx.x] = fold;
}
