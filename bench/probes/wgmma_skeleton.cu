// wgmma_skeleton: how fast can the prefill expert GEMMs' consumer loop run with nothing else in the way?
// The loop of fmw_pass_fp4<true> (kernels/fast_moe_wide.cu, included whole so the device code is the
// kernel's own) on one stage that sits in shared memory: no producer, no ring barriers, no epilogue, no
// partial tiles. Each mode adds one piece of the consumer's work per 128-block:
//   mode 0  the four wgmmas m64n128k32 and the wait (the A fragments of the first block, reused)
//   mode 1  + the promotion (acc += d · the tokens' scales, 64 FFMA and the scale loads)
//   mode 2  + the A fragments decoded from FP4 every block (ldmatrix, the shifted bit move) — the real loop
//   mode 3  mode 2 without the promotion
// with one or two consumer warpgroups (wgs), 132 blocks of one SM each. Prints one JSON line per case:
// TFLOP/s of the wgmmas and the fraction of the FP8 peak given on the command line (default 1399, the
// seventh version's in-run ceiling, BENCHMARKS.md). The real kernel at B = 4096 runs its mainloop at
// what this says for mode 2 minus its waits for the producer, its epilogues and its partial tiles.
//
// STATUS (2026-12-02, BENCHMARKS.md "the up epilogue through shared memory"): NOT VALIDATED. Its first run
// gave rates above the H200's FP8 dense spec (mode 0, two warpgroups: 3.4 PFLOP/s; ncu: 179 cycles per four
// m64n128k32 with the tensor pipe 72% busy), so it does not yet do or count the work it claims. Before its
// numbers mean anything: check D against a host matmul (as gpu_wgmma_probe does) and run cuBLASLt's FP8 GEMM
// in the same process as the reference rate.
//
// Build and run (GPU machine; the generated dsv4_consts.cuh from
// `DSV4_DUMP_CUBIN_DIR=dir cargo test --release --test kernels_compile every_family`):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I kernels -I dir bench/probes/wgmma_skeleton.cu -o skel && ./skel
// (scripts/gpu-probe-skeleton.sh does both.)
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "fast_moe_wide.cu"

// Fills the stage: FP4 weight codes (pseudo-random bytes), their UE8M0 bytes (all 127: the fold's shift 12
// with base fmw_fold_base(127)), token codes (e4m3 bytes & 0x37: below 1, never NaN) and the tokens' scales
// (1).
__device__ void skel_fill(unsigned char* st) {
  for (int i = threadIdx.x; i < FMW_SLOT_W / 4; i += blockDim.x) {
    unsigned x = (unsigned)i * 2654435761u ^ 0x9e3779b9u;
    x ^= x >> 13;
    reinterpret_cast<unsigned*>(st)[i] = x * 0x2c1b3c6du;
  }
  for (int i = threadIdx.x; i < FMW_SLOT_S; i += blockDim.x) st[FMW_SLOT_W + i] = 127;
  unsigned char* tok = st + FMW_SLOT_W + FMW_SLOT_S;
  for (int i = threadIdx.x; i < FMW_SLOT_A; i += blockDim.x) tok[i] = (unsigned char)((i * 37 + 11) & 0x37);
  float* as = reinterpret_cast<float*>(tok + FMW_SLOT_A);
  for (int i = threadIdx.x; i < 2 * FMW_TOKENS; i += blockDim.x) as[i] = 1.0f;
}

// One block step of fmw_pass_fp4's loop: issue `cur`'s wgmmas, decode block `b` of the stage into `next`
// while they run (modes 2, 3), then wait and promote (modes 1, 2) or only wait.
template <int MODE>
__device__ __forceinline__ void skel_step(const unsigned char* st, int b, unsigned base, const FmwBlock& cur,
                                          FmwBlock& next, float (&d)[64], float (&acc)[64]) {
  fmw_issue(cur, d);
  if (MODE >= 2) fmw_load_block<true, true>(st, b, base, base, next);
  if (MODE == 1 || MODE == 2) {
    fmw_finish<true>(cur, d, acc);
  } else {
    wgmma_wait<0>();
    wgmma_fence_operand(d);
  }
}

template <int MODE>
__global__ void __launch_bounds__(256, 1) skel_kernel(int iters, float* out) {
  extern __shared__ __align__(1024) unsigned char skel_smem[];
  unsigned char* st = skel_smem;
  skel_fill(st);
  fence_proxy_async_shared();
  __syncthreads();
  const unsigned base = fmw_fold_base(127);
  FmwBlock b0, b1;
  float d[64], acc[64];
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.0f, acc[v] = 0.0f;
  fmw_load_block<true, true>(st, 0, base, base, b0);
  fmw_load_block<true, true>(st, 1, base, base, b1);
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    skel_step<MODE>(st, 1, base, b0, b1, d, acc);  // block 0 runs, block 1 is decoded
    skel_step<MODE>(st, 0, base, b1, b0, d, acc);  // and the other way round
  }
  float s = 0.0f;
#pragma unroll
  for (int v = 0; v < 64; ++v) s += acc[v] + d[v];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

template <int MODE>
static float run(int wgs, int iters, float* out) {
  auto k = skel_kernel<MODE>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  k<<<132, 128 * wgs, 200 * 1024>>>(2, out);  // warm-up (also takes the whole SM: 200 KB)
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  k<<<132, 128 * wgs, 200 * 1024>>>(iters, out);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, a, b);
  return ms;
}

int main(int argc, char** argv) {
  const double peak = argc > 1 ? atof(argv[1]) : 1399.0;
  const int iters = 20000;
  float* out;
  if (cudaMalloc(&out, 132 * 256 * sizeof(float)) != cudaSuccess) return 1;
  const char* names[4] = {"wgmma+wait", "+promote", "+promote+decode (the real loop)", "+decode, no promote"};
  for (int mode = 0; mode < 4; ++mode) {
    for (int wgs = 1; wgs <= 2; ++wgs) {
      float ms = mode == 0 ? run<0>(wgs, iters, out)
               : mode == 1 ? run<1>(wgs, iters, out)
               : mode == 2 ? run<2>(wgs, iters, out)
                           : run<3>(wgs, iters, out);
      const cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        printf("{\"mode\":%d,\"error\":\"%s\"}\n", mode, cudaGetErrorString(e));
        return 1;
      }
      // Per iteration: two 128-blocks a warpgroup, four m64n128k32 each.
      const double flop = 132.0 * wgs * iters * 2 * 4 * (2.0 * 64 * 128 * 32);
      const double tflops = flop / (ms * 1e-3) / 1e12;
      int khz = 0;
      cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
      // SM cycles per 128-block pair (both warpgroups) at the nominal clock.
      const double cycles = (ms * 1e-3) * (khz * 1e3) / (iters * 2.0);
      printf("{\"probe\":\"wgmma_skeleton\",\"mode\":%d,\"what\":\"%s\",\"warpgroups\":%d,\"ms\":%.3f,"
             "\"tflops\":%.1f,\"of_peak\":%.3f,\"peak_tflops\":%.0f,\"cycles_per_block_step\":%.0f}\n",
             mode, names[mode], wgs, ms, tflops, tflops / peak, peak, cycles);
    }
  }
  return 0;
}
