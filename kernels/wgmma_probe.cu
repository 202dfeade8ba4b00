// wgmma_probe kernel family (tests only, tests/gpu_wgmma_probe.rs): one warpgroup runs
// wgmma.mma_async m64nNk32 f32 += e4m3 x e4m3 with A (64 x 32) from registers and B (N x 32, K-major) from
// shared memory through a matrix descriptor, N in {8, 16, 32}, and writes D (64 x N, f32). It checks the
// fragment and descriptor layouts a wgmma GEMM relies on (../shared/KERNELS.md §1) against a host matmul,
// before any GEMM is built on them.
//
// Assumed layouts (what the test confirms or refutes):
// - A registers (RS form): warp w of the warpgroup holds rows 16w..16w+15 exactly like mma.m16n8k32's A
//   fragment: thread (g = lane / 4, t = lane % 4) a0 = row g, k 4t..4t+3; a1 = row g + 8, same k; a2 = row g,
//   k 16 + 4t..; a3 = row g + 8, k 16 + 4t...
// - B in shared memory, K-major without swizzle: core matrices of 8 rows x 16 bytes (128 contiguous bytes,
//   row r at 16 r); core matrix (row group G, k half h) at G * 256 + h * 128. The descriptor's leading byte
//   offset (LBO) is the step between the two k halves, its stride byte offset (SBO) the step between row
//   groups; `swap` = 1 exchanges them (to see which one the hardware reads as which).
// - D: thread (g, t) of warp w, n8 block j: d[4j] = (16w + g, 8j + 2t), d[4j + 1] = (16w + g, 8j + 2t + 1),
//   d[4j + 2] = (16w + g + 8, 8j + 2t), d[4j + 3] = (16w + g + 8, 8j + 2t + 1).
#include "common.cuh"
#include "fp8_mma.cuh"

// a: [64][32] e4m3 codes; b: [n][32] e4m3 codes (row = output column); d: [64][n] f32. One block of 128
// threads. n must be 8, 16 or 32 (else d is left untouched).
extern "C" __global__ void __launch_bounds__(128)
    wgmma_probe_kernel(const unsigned char* a, const unsigned char* b, int n, int swap, float* d) {
  __shared__ __align__(256) unsigned char bs[32 * 32];
  const int tid = threadIdx.x;
  for (int i = tid; i < n * 2; i += 128) {
    const int r = i >> 1, h = i & 1;
    const uint4 v = *reinterpret_cast<const uint4*>(b + r * 32 + h * 16);
    *reinterpret_cast<uint4*>(bs + (r >> 3) * 256 + h * 128 + (r & 7) * 16) = v;
  }
  // Shared-memory writes by the generic proxy must be visible to wgmma's async proxy.
  fence_proxy_async_shared();
  __syncthreads();
  const int w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const unsigned char* r0 = a + (16 * w + g) * 32;
  const unsigned char* r8 = a + (16 * w + g + 8) * 32;
  const unsigned a0 = *reinterpret_cast<const unsigned*>(r0 + 4 * t);
  const unsigned a1 = *reinterpret_cast<const unsigned*>(r8 + 4 * t);
  const unsigned a2 = *reinterpret_cast<const unsigned*>(r0 + 16 + 4 * t);
  const unsigned a3 = *reinterpret_cast<const unsigned*>(r8 + 16 + 4 * t);
  const unsigned long long desc = swap ? wgmma_desc_noswizzle(bs, 256, 128) : wgmma_desc_noswizzle(bs, 128, 256);
  float acc[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) acc[i] = 0.0f;
  wgmma_fence();
  if (n == 8) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1; }\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
  } else if (n == 16) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, "
        "1, 1; }\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]),
          "+f"(acc[7])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
  } else if (n == 32) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1; }\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]),
          "+f"(acc[7]), "+f"(acc[8]), "+f"(acc[9]), "+f"(acc[10]), "+f"(acc[11]), "+f"(acc[12]), "+f"(acc[13]),
          "+f"(acc[14]), "+f"(acc[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
  } else {
    return;  // uniform over the block
  }
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_fence_operand(acc);
  for (int j = 0; j < n / 8; ++j) {
    const int row = 16 * w + g, col = 8 * j + 2 * t;
    d[row * n + col] = acc[4 * j];
    d[row * n + col + 1] = acc[4 * j + 1];
    d[(row + 8) * n + col] = acc[4 * j + 2];
    d[(row + 8) * n + col + 1] = acc[4 * j + 3];
  }
}
