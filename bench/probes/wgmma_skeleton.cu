// wgmma_skeleton: how fast can the prefill expert GEMMs' consumer loop run with nothing else in the way?
// The loop of fmw_pass_fp4<true> (kernels/fast_moe_wide.cu, included whole so the device code is the
// kernel's own) on one stage that sits in shared memory: no producer, no ring barriers, no epilogue, no
// partial tiles. Each mode adds one piece of the consumer's work per 128-block:
//   mode 0  the four wgmmas m64n128k32 and the wait (the A fragments of the first block, reused)
//   mode 1  + the promotion (acc += d · the tokens' scales, 64 FFMA and the scale loads)
//   mode 2  + the A fragments decoded from FP4 every block (ldmatrix, the shifted bit move) — the real loop
//   mode 3  mode 2 without the promotion
//   mode 4  mode 2 with the warpgroups' wgmma issues in turn (ping-pong; two warpgroups only)
//   mode 5  mode 1 in ping-pong
// with one or two consumer warpgroups (wgs), 132 blocks of one SM each. Prints one JSON line per case:
// TFLOP/s of the wgmmas and the fraction of the FP8 peak given on the command line (default 1399, the
// seventh version's in-run ceiling, BENCHMARKS.md). The real kernel at B = 4096 runs its mainloop at
// what this says for mode 2 minus its waits for the producer, its epilogues and its partial tiles.
//
// Its first run (2026-12-02) gave rates above the H200's FP8 dense spec, so it checks itself before it times
// anything: every mode runs once on check data (FP4 weights 1.0 in the stage's 128-block 0 and 2.0 in block
// 1, token codes 1.0, scales 1), where each thread's sums have a closed form (block 0's d = 128 · 2^6, block
// 1's twice that; acc = iters · (both)), and a case whose sums differ prints an error line instead of a rate.
// The two blocks differ so that a promotion reading the other block's d (a wait that did not wait) fails
// the check; the first version (one value in both blocks, run 2026-12-02) could not tell. Each case is then
// timed on random data and on the check data, by CUDA events and by the SM's own clock64 around the loop
// (cycles per block step, independent of the clock the events imply). The two-valued check has compiled
// (NVRTC) but not yet run.
//
// Build and run (GPU machine; the generated dsv4_consts.cuh from
// `DSV4_DUMP_CUBIN_DIR=dir cargo test --release --test kernels_compile every_family`):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I kernels -I dir bench/probes/wgmma_skeleton.cu -o skel && ./skel
// (scripts/gpu-probe-skeleton.sh does both.)
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "fast_moe_wide.cu"
#include "probe_data.cuh"

// Fills the stage. Random (check = false): FP4 weight codes (pseudo-random bytes), token codes (pseudo-random
// e4m3 below 448 in magnitude, never NaN). Check data: FP4 codes 1.0 (0x2) in every row's 128-block 0 and
// 2.0 (0x4) in block 1 (row r's 16-byte chunk c sits at c ^ (r % 8), the 128-byte swizzle; chunks 0-3 are
// block 0), every token 1.0 (0x38). Both: UE8M0 bytes 127 (the fold's shift 12 with base
// fmw_fold_base(127), so a code is its value · 2^6) and the tokens' scales 1.
__device__ void skel_fill(unsigned char* st, bool check) {
  for (int i = threadIdx.x; i < FMW_SLOT_W / 4; i += blockDim.x) {
    const int r = 4 * i / FMW_RB, chunk = ((4 * i % FMW_RB) / 16) ^ (r & 7);
    reinterpret_cast<unsigned*>(st)[i] = check ? (chunk < 4 ? 0x22222222u : 0x44444444u) : probe_weight_word(i);
  }
  for (int i = threadIdx.x; i < FMW_SLOT_S; i += blockDim.x) st[FMW_SLOT_W + i] = 127;
  unsigned char* tok = st + FMW_SLOT_W + FMW_SLOT_S;
  for (int i = threadIdx.x; i < FMW_SLOT_A; i += blockDim.x) tok[i] = check ? 0x38 : probe_token_code(i);
  float* as = reinterpret_cast<float*>(tok + FMW_SLOT_A);
  for (int i = threadIdx.x; i < 2 * FMW_TOKENS; i += blockDim.x) as[i] = 1.0f;
}

// Modes 4 and 5 are modes 2 and 1 with the two warpgroups' wgmma issues in turn ("ping-pong"): warpgroup w
// waits on named barrier SKEL_TURN + w before it issues a block's wgmmas and arrives on the other's after,
// so the tensor core runs one warpgroup's block while the other waits for its own, promotes and decodes.
// (Measured 2026-12-02: 904 cycles a block step against 934 in step, and 707 against 680 for mode 5; the
// same turns in the kernel made its up GEMM 3% slower, so the kernel does not take them.)
#define SKEL_TURN 5
__device__ __forceinline__ void skel_bar_arrive(unsigned id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}
// One block step of fmw_pass_fp4's loop: issue `cur`'s wgmmas, decode block `b` of the stage into `next`
// while they run (modes 2-4), then wait and promote (modes 1, 2, 4, 5) or only wait. first / last: the
// warpgroup's first and last step (ping-pong: warpgroup 0 does not wait for its first turn, and warpgroup 1
// does not hand over after its last, so every barrier's arrivals and waits pair up).
template <int MODE>
__device__ __forceinline__ void skel_step(const unsigned char* st, int b, unsigned base, const FmwBlock& cur,
                                          FmwBlock& next, float (&d)[64], float (&acc)[64], bool first, bool last) {
  constexpr bool kPingPong = MODE >= 4;
  const int wg = threadIdx.x >> 7;
  if (kPingPong && !(first && wg == 0)) named_barrier(SKEL_TURN + wg, 256);
  fmw_issue(cur, d);
  if (kPingPong && !(last && wg == 1)) skel_bar_arrive(SKEL_TURN + 1 - wg);
  if (MODE >= 2 && MODE <= 4) fmw_load_block<true, true>(st, b, base, base, next);
  if (MODE != 0 && MODE != 3) {
    fmw_finish<true>(cur, d, acc);
  } else {
    wgmma_wait<0>();
    wgmma_fence_operand(d);
  }
}

// out: each thread's acc[64] then d[64] (the check reads them); cycles: thread 0's clock64 around the loop,
// one per block; ns: its %globaltimer around the loop.
template <int MODE>
__global__ void __launch_bounds__(256, 1)
    skel_kernel(int iters, int check, float* out, long long* cycles, unsigned long long* ns) {
  extern __shared__ __align__(1024) unsigned char skel_smem[];
  unsigned char* st = skel_smem;
  skel_fill(st, check != 0);
  fence_proxy_async_shared();
  __syncthreads();
  const unsigned base = fmw_fold_base(127);
  FmwBlock b0, b1;
  float d[64], acc[64];
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.0f, acc[v] = 0.0f;
  fmw_load_block<true, true>(st, 0, base, base, b0);
  fmw_load_block<true, true>(st, 1, base, base, b1);
  __syncthreads();
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    skel_step<MODE>(st, 1, base, b0, b1, d, acc, it == 0, false);  // block 0 runs, block 1 is decoded
    skel_step<MODE>(st, 0, base, b1, b0, d, acc, false, it + 1 == iters);  // and the other way round
  }
  __syncthreads();
  const long long c1 = clock64();
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) {
    cycles[blockIdx.x] = c1 - c0;
    ns[blockIdx.x] = t1 - t0;
  }
  float* o = out + ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 128;
#pragma unroll
  for (int v = 0; v < 64; ++v) o[v] = acc[v], o[64 + v] = d[v];
}

struct SkelRun {
  float ms;
  double cycles_per_step;  // mean over blocks of clock64 cycles per block step (both warpgroups' blocks)
  double sm_ghz;           // clock64 cycles / globaltimer ns, mean over blocks
  long long bad;           // threads whose sums differ from the closed form (check data only)
};

static constexpr int kBlocks = 132;

template <int MODE>
static SkelRun run(int wgs, int iters, bool check, float* out, long long* cyc, unsigned long long* ns) {
  auto k = skel_kernel<MODE>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  const int threads = 128 * wgs;
  k<<<kBlocks, threads, 200 * 1024>>>(2, check, out, cyc, ns);  // warm-up (200 KB: one block an SM)
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  k<<<kBlocks, threads, 200 * 1024>>>(iters, check, out, cyc, ns);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  SkelRun r{0.0f, 0.0, 0.0, 0};
  cudaEventElapsedTime(&r.ms, a, b);
  static long long hc[kBlocks];
  static unsigned long long hn[kBlocks];
  cudaMemcpy(hc, cyc, sizeof(hc), cudaMemcpyDeviceToHost);
  cudaMemcpy(hn, ns, sizeof(hn), cudaMemcpyDeviceToHost);
  for (int i = 0; i < kBlocks; ++i) {
    r.cycles_per_step += (double)hc[i] / (2.0 * iters) / kBlocks;
    r.sm_ghz += (double)hc[i] / (double)hn[i] / kBlocks;
  }
  if (check) {
    // Block 0's d = Σ_k 1.0 · 2^6 · 1.0 over 128 k, block 1's twice that; the last block issued is block 1,
    // and the promoting modes add both blocks per iteration (exact in f32: multiples of 2^13 below 2^30).
    const float d0 = 128.0f * 64.0f, dv = 2.0f * d0, av = (MODE != 0 && MODE != 3) ? (float)iters * (d0 + dv) : 0.0f;
    const long long n = (long long)kBlocks * threads;
    float* h = (float*)malloc(n * 128 * sizeof(float));
    cudaMemcpy(h, out, n * 128 * sizeof(float), cudaMemcpyDeviceToHost);
    for (long long i = 0; i < n; ++i) {
      bool ok = true;
      for (int v = 0; v < 64; ++v) ok = ok && h[i * 128 + v] == av && h[i * 128 + 64 + v] == dv;
      if (!ok) ++r.bad;
    }
    free(h);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return r;
}

int main(int argc, char** argv) {
  const double peak = argc > 1 ? atof(argv[1]) : 1399.0;
  const int iters = 20000;
  float* out;
  long long* cyc;
  unsigned long long* ns;
  if (cudaMalloc(&out, (size_t)kBlocks * 256 * 128 * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&cyc, kBlocks * sizeof(long long)) != cudaSuccess ||
      cudaMalloc(&ns, kBlocks * sizeof(unsigned long long)) != cudaSuccess)
    return 1;
  const char* names[6] = {"wgmma+wait", "+promote", "+promote+decode (the real loop)", "+decode, no promote",
                          "the real loop, ping-pong", "+promote, ping-pong"};
  int rc = 0;
  for (int mode = 0; mode < 6; ++mode) {
    for (int wgs = mode >= 4 ? 2 : 1; wgs <= 2; ++wgs) {
      for (int check = 1; check >= 0; --check) {
        const SkelRun r = mode == 0 ? run<0>(wgs, iters, check, out, cyc, ns)
                        : mode == 1 ? run<1>(wgs, iters, check, out, cyc, ns)
                        : mode == 2 ? run<2>(wgs, iters, check, out, cyc, ns)
                        : mode == 3 ? run<3>(wgs, iters, check, out, cyc, ns)
                        : mode == 4 ? run<4>(wgs, iters, check, out, cyc, ns)
                                    : run<5>(wgs, iters, check, out, cyc, ns);
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) {
          printf("{\"mode\":%d,\"error\":\"%s\"}\n", mode, cudaGetErrorString(e));
          return 1;
        }
        if (r.bad != 0) {
          printf("{\"probe\":\"wgmma_skeleton\",\"mode\":%d,\"warpgroups\":%d,\"error\":\"%lld threads' sums differ "
                 "from the closed form\"}\n", mode, wgs, r.bad);
          rc = 1;
          continue;
        }
        // Per iteration: two 128-blocks a warpgroup, four m64n128k32 each.
        const double flop = (double)kBlocks * wgs * iters * 2 * 4 * (2.0 * 64 * 128 * 32);
        const double tflops = flop / (r.ms * 1e-3) / 1e12;
        // Tensor-core cycles of one m64n128k32 the measured cycles imply (all the block step's wgmmas).
        const double per_wgmma = r.cycles_per_step / (4.0 * wgs);
        printf("{\"probe\":\"wgmma_skeleton\",\"mode\":%d,\"what\":\"%s\",\"warpgroups\":%d,\"data\":\"%s\","
               "\"checked\":%s,\"ms\":%.3f,\"tflops\":%.1f,\"of_peak\":%.3f,\"peak_tflops\":%.0f,"
               "\"cycles_per_block_step\":%.1f,\"cycles_per_m64n128k32\":%.1f,\"sm_ghz\":%.3f}\n",
               mode, names[mode], wgs, check ? "check" : "random", check ? "true" : "false", r.ms, tflops,
               tflops / peak, peak, r.cycles_per_step, per_wgmma, r.sm_ghz);
      }
    }
  }
  return rc;
}
