// decode_consumer: how fast can the decode expert GEMMs' consumers (fmoe_up_kernel / fmoe_down_kernel,
// kernels/fast_moe_gemm.cu, included whole so the device code is the kernel's own) take one FP4 stage when
// nothing else is in the way: no producer, no ring barriers, no epilogue. One stage (256 k of 256 weight
// rows, two 128-blocks, 8 tokens) sits in shared memory and every consumer warpgroup runs over it `iters`
// times. Modes, per stage and warpgroup:
//   mode 0  the eight wgmmas m64n8k32 (A fragments made once, reused), a wait per block of four
//   mode 1  mode 0 + the promotion (fmoe_block_finish: per-32 weight scales, the tokens' scales)
//   mode 2  fmoe_compute_stage<FP4, NT8 = 1>: ldmatrix, the bit move, wgmmas, promotion — the real loop
//   mode 3  the A fragments alone (ldmatrix and the bit move, folded into a checksum), no wgmma
//   mode 4  mode 0 with A from shared memory (SS: the stage's rows read as e4m3, 128-byte swizzle)
//   mode 5  mode 0 at n16 (16 tokens: m64n16k32)
// with 1, 2 or 4 consumer warpgroups (wgs) a block, 132 blocks of one SM each. The kernel's blocks have
// 4 warpgroups; one FP4 stage of a block is 32 KiB of weights, so at 4 warpgroups a stage every
// `cycles_per_stage` is 32768 / cycles_per_stage bytes a cycle an SM (18.3 keeps up with 4.24 TB/s at
// 1.755 GHz on 132 SMs). Prints one JSON line a case.
//
// Check first: mode 2 on check data (every FP4 code 1.0, tokens 1.0, scales 1) has a closed form per thread
// (acc = iters · 2 blocks · 128 · 1.0 = 256 · iters); a case whose sums differ prints an error line.
//
// Build and run on the GPU machine (dsv4_consts.cuh from `DSV4_DUMP_CUBIN_DIR=dir cargo test --release
// --test kernels_compile every_family`):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I kernels -I dir bench/probes/decode_consumer.cu -o dc && ./dc
// (scripts/gpu-probe-decode.sh does both, with tma_stream.cu.)
#ifndef __CUDACC_RTC__  // NVRTC compile-checks the device code alone
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#endif

#include "fast_moe_gemm.cu"
#include "probe_data.cuh"

// One m64n8k32 step with both operands in shared memory (mode 4).
DSV4_INLINE void dc_wgmma_ss(float (&d)[8], unsigned long long da, unsigned long long db) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1; }\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db), "r"(0));
}

// Random (check = false) or check data in one FP4 stage of FMOE_SLOT layout: weights, UE8M0 scale bytes,
// token codes (fragment order does not matter for a rate), the tokens' scales.
__device__ void dc_fill(unsigned char* st, bool check) {
  for (int i = threadIdx.x; i < FMOE_SLOT_W / 4; i += blockDim.x) {
    reinterpret_cast<unsigned*>(st)[i] = check ? 0x22222222u : probe_weight_word(i);
  }
  for (int i = threadIdx.x; i < FMOE_SLOT_S; i += blockDim.x) st[FMOE_SLOT_W + i] = 127;
  unsigned char* tok = st + FMOE_SLOT_W + FMOE_SLOT_S;
  for (int i = threadIdx.x; i < FMOE_SLOT_A; i += blockDim.x) tok[i] = check ? 0x38 : probe_token_code(i);
  float* as = reinterpret_cast<float*>(tok + FMOE_SLOT_A);
  for (int i = threadIdx.x; i < 2 * FMOE_TOKENS; i += blockDim.x) as[i] = 1.0f;
}

// One kernel a mode (a mode's registers do not limit another's wgmma pipeline).
template <int mode>
__global__ void __launch_bounds__(FMOE_CONSUMERS, 1)
    dc_kernel(int wgs, int iters, int check, float* out, long long* cycles) {
  extern __shared__ __align__(1024) unsigned char dc_smem[];
  dc_fill(dc_smem, check != 0);
  __syncthreads();
  if (threadIdx.x >= wgs * 128) return;
  float acc[8];
#pragma unroll
  for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
  unsigned sink = 0;
  const int lane = threadIdx.x & 31, g = lane >> 2;
  const int r16 = (threadIdx.x >> 5) * 16;
  const unsigned row = smem_addr(dc_smem) + (r16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * FMOE_RB;
  const unsigned la = row | ((unsigned)((lane >> 4) ^ (lane & 7)) << 4);
  const unsigned char* act = dc_smem + FMOE_SLOT_W + FMOE_SLOT_S;
  const float* as = reinterpret_cast<const float*>(act + FMOE_SLOT_A);
  const float* sc = reinterpret_cast<const float*>(dc_smem + FMOE_SLOT_W);
  unsigned af[4][4];
  float d[4][8];
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int v = 0; v < 8; ++v) d[q][v] = 0.0f;
  fmoe_block_frags<true>(la, 0, af);
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    if (mode == 2) {
      fmoe_compute_stage<true, 1>(dc_smem, 256, 0, true, acc);
    } else if (mode == 3) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        fmoe_block_frags<true>(la, b, af);
#pragma unroll
        for (int q = 0; q < 4; ++q) sink ^= af[q][0] ^ af[q][1] ^ af[q][2] ^ af[q][3];
      }
    } else if (mode == 4) {
      // The warpgroup's 64 rows start at row 64 w; 128-byte rows, so k32 step q of block b is 64 b + 32 q bytes on.
      const unsigned long long da0 = wgmma_desc_sw128(dc_smem + (threadIdx.x >> 7) * 64 * FMOE_RB);
      const unsigned long long db0 = wgmma_desc_noswizzle(act, FMOE_TOKENS * 16, 128);
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        wgmma_fence();
#pragma unroll
        for (int q = 0; q < 4; ++q)
          dc_wgmma_ss(d[q], da0 + (unsigned)(4 * b + 2 * q), db0 + (unsigned)((8 * b + 2 * q) * (FMOE_TOKENS * 16) / 16));
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(d[0]);
        acc[0] += d[0][0];
      }
    } else if (mode == 5) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        fmoe_block_issue<2>(af, act + b * 8 * FMOE_TOKENS * 16, d);
        wgmma_wait<0>();
        wgmma_fence_operand(d[0]);
        acc[0] += d[0][0] + d[0][4];
      }
    } else {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        fmoe_block_issue<1>(af, act + b * 8 * FMOE_TOKENS * 16, d);
        if (mode == 1) {
          float s0[4], s8[4];
          fmoe_fp4_scales(sc, r16 + g, b, true, s0, s8);
          fmoe_block_finish<true, 1>(d, s0, s8, as + b * FMOE_TOKENS, acc);
        } else {
          wgmma_wait<0>();
          wgmma_fence_operand(d[0]);
          acc[0] += d[0][0];
        }
      }
    }
  }
  const long long t1 = clock64();
  if ((threadIdx.x & 127) == 0) cycles[blockIdx.x * 4 + threadIdx.x / 128] = t1 - t0;
  const int tid = blockIdx.x * FMOE_CONSUMERS + threadIdx.x;
  out[tid] = acc[0] + acc[1] + acc[2] + acc[3] + (float)(sink & 1u);
  if (check && mode == 2) {
    // Thread (g, t): its four values of token columns 2t, 2t + 1 (rows g, g + 8), all 256 · iters.
    for (int v = 0; v < 4; ++v)
      if (acc[v] != 256.0f * (float)iters) out[tid] = -1.0f;
  }
}

template __global__ void dc_kernel<0>(int, int, int, float*, long long*);
template __global__ void dc_kernel<1>(int, int, int, float*, long long*);
template __global__ void dc_kernel<2>(int, int, int, float*, long long*);
template __global__ void dc_kernel<3>(int, int, int, float*, long long*);
template __global__ void dc_kernel<4>(int, int, int, float*, long long*);
template __global__ void dc_kernel<5>(int, int, int, float*, long long*);

#ifndef __CUDACC_RTC__
typedef void (*DcKernel)(int, int, int, float*, long long*);
static const DcKernel dc_kernels[6] = {dc_kernel<0>, dc_kernel<1>, dc_kernel<2>, dc_kernel<3>, dc_kernel<4>, dc_kernel<5>};

int main() {
  const int blocks = 132, iters = 2000;
  float* out;
  long long* cyc;
  cudaMalloc(&out, (size_t)blocks * FMOE_CONSUMERS * 4);
  cudaMalloc(&cyc, (size_t)blocks * 4 * 8);
  const int smem = FMOE_SLOT;
  for (int m = 0; m < 6; ++m) cudaFuncSetAttribute(dc_kernels[m], cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  float* host = (float*)malloc((size_t)blocks * FMOE_CONSUMERS * 4);
  long long hc[132 * 4];
  // Check.
  dc_kernel<2><<<blocks, FMOE_CONSUMERS, smem>>>(4, 3, 1, out, cyc);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    printf("{\"error\": \"%s\"}\n", cudaGetErrorString(e));
    return 1;
  }
  cudaMemcpy(host, out, (size_t)blocks * FMOE_CONSUMERS * 4, cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int i = 0; i < blocks * FMOE_CONSUMERS; ++i) bad += host[i] == -1.0f;
  printf("{\"check\": \"mode 2 closed form\", \"threads_wrong\": %d}\n", bad);
  if (bad) return 1;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int mode = 0; mode < 6; ++mode) {
    for (int wgs = 1; wgs <= 4; wgs *= 2) {
      dc_kernels[mode]<<<blocks, FMOE_CONSUMERS, smem>>>(wgs, 50, 0, out, cyc);
      cudaEventRecord(a);
      dc_kernels[mode]<<<blocks, FMOE_CONSUMERS, smem>>>(wgs, iters, 0, out, cyc);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      cudaMemcpy(hc, cyc, sizeof(hc), cudaMemcpyDeviceToHost);
      double mean = 0;
      for (int i = 0; i < blocks; ++i) mean += (double)hc[i * 4];
      mean /= blocks;
      const double per_stage = mean / iters;
      printf("{\"mode\": %d, \"wgs\": %d, \"cycles_per_stage\": %.1f, \"us_per_stage\": %.4f, "
             "\"bytes_per_cycle_per_sm\": %.2f}\n",
             mode, wgs, per_stage, ms * 1000.0 / iters, wgs * 8192.0 / per_stage);
    }
  }
  return 0;
}
#endif
