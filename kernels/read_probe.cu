// read_probe kernel family (benches only: `dsv4 bench dense --read-probe`): reads a buffer once in
// 16-byte streaming loads and does nothing with the bytes but fold them into a value that is stored
// only if it equals a constant no real data hits, so the loads stay live and nothing is written.
// Timed like the gemv (a graph of calls over enough copies that L2 holds none, programmatic
// launches, its first loads issued before its wait), it is what reading a projection's bytes costs
// at that size: the launch, the first bytes' latency and the last wave's tail are in it, the
// arithmetic is not. It separates what a kernel's own work costs from what the size costs.
// read_probe_rows_kernel (below) reads with fd_gemv's own addresses instead, in several orders.
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
// of it, four 128-byte blocks of k at a time, 16 loads a lane. `order`:
// 0: fd_gemv's: lane (g = lane / 4, c = lane % 4) reads 16 bytes at 16c of each 64 of rows g and g + 8
//    (a warp load covers half of each of 8 rows' 128-byte lines);
// 1, 2: the same with the L2::128B / L2::256B fetch-size hint;
// 3: whole lines: lane l reads 16 bytes at 16 (l % 8) of rows l / 8 + 4i (a warp load covers four whole
//    128-byte lines).
// Grid ceil(rows / 128), 256 threads. Tells the cost of an order of reads apart from the cost of the
// gemv's arithmetic and staging.
template <int ORDER>
DSV4_INLINE uint4 rp_ld_rows(const uint4* p) {
  uint4 r;
  if (ORDER == 1)
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else if (ORDER == 2)
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  else
    r = rp_ld_stream(p);
  return r;
}

template <int ORDER>
DSV4_INLINE void read_probe_rows(const unsigned char* w, int row_bytes, int rows, unsigned* sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.x * 128 + warp * 16;
  // Four (row, byte) starts a lane; load j of block kb reads start j + kb * 128 (+ 64 for orders 0-2's
  // second chunk, which they take as starts 2 and 3).
  const unsigned char* st[4];
  if (ORDER == 3) {
#pragma unroll
    for (int i = 0; i < 4; ++i) st[i] = w + (long long)min(n0 + (lane >> 3) + 4 * i, rows - 1) * row_bytes + 16 * (lane & 7);
  } else {
    st[0] = w + (long long)min(n0 + g, rows - 1) * row_bytes + 16 * c;
    st[1] = w + (long long)min(n0 + g + 8, rows - 1) * row_bytes + 16 * c;
    st[2] = st[0] + 64;
    st[3] = st[1] + 64;
  }
  const int blocks = row_bytes / 128;
  unsigned fold = 0;
  bool waited = false;
  for (int kb0 = 0; kb0 < blocks; kb0 += 4) {
    uint4 v[4][4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool in = kb0 + p < blocks;
        v[p][j] = in ? rp_ld_rows<ORDER>(reinterpret_cast<const uint4*>(st[j] + (kb0 + p) * 128)) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (!waited) {
      dsv4_pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int p = 0; p < 4; ++p)
#pragma unroll
      for (int j = 0; j < 4; ++j) fold ^= v[p][j].x ^ v[p][j].y ^ v[p][j].z ^ v[p][j].w;
  }
  if (!waited) dsv4_pdl_wait();
  if (fold == 0x9e3779b9u) sink[blockIdx.x] = fold;
}

extern "C" __global__ void read_probe_rows_kernel(const unsigned char* w, int row_bytes, int rows, int order,
                                                  unsigned* sink) {
  dsv4_pdl_trigger();  // waits after its first loads, as fd_gemv
  switch (order) {
    case 1: read_probe_rows<1>(w, row_bytes, rows, sink); break;
    case 2: read_probe_rows<2>(w, row_bytes, rows, sink); break;
    case 3: read_probe_rows<3>(w, row_bytes, rows, sink); break;
    default: read_probe_rows<0>(w, row_bytes, rows, sink); break;
  }
}
