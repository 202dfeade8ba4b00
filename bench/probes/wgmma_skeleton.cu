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
//   modes 6-8  A from shared memory (SS wgmma), as if other warps had decoded the FP4 (below, skel_ss_kernel)
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
// (scripts/gpu-probe-skeleton.sh does both.) Arguments: [FP8 peak TFLOP/s] [first mode].
//
// Measured 2026-12-04 (H200, clock64 cycles a block step, one / two warpgroups; BENCHMARKS.md, issue 11
// twenty-third version): 0 178 / 287, 1 449 / 676, 2 569 / 813, 3 264 / 424, 4 - / 868, 5 - / 707, 6 195 / 298,
// 7 488 / 710, 8 - / 796 with the decoders at 1046 a block. So A from shared memory does not let the promotion
// overlap the other warpgroup's wgmmas (7 is no faster than 1), and a warpgroup decoding whole 128-row blocks
// into shared memory is slower than the consumers' own decode in registers.
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
static constexpr int kBlocks = 132;
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
  fmw_issue<FMW_TOKENS>(cur, d);
  if (kPingPong && !(last && wg == 1)) skel_bar_arrive(SKEL_TURN + 1 - wg);
  if (MODE >= 2 && MODE <= 4) fmw_load_block<true, true>(st, b, base, base, next);
  if (MODE != 0 && MODE != 3) {
    fmw_finish<true, FMW_TOKENS>(cur, d, acc);
  } else {
    wgmma_wait<0>();
    wgmma_fence_operand(d);
  }
}

// The end of a timed loop (after the consumers' barrier): thread 0's clock64 and %globaltimer spans (from c0,
// t0) into cycles and ns, then each of the block's `threads` consumers' acc[64] and d[64] into out (the check
// reads them).
__device__ __forceinline__ void skel_record(long long c0, unsigned long long t0, int threads, const float (&d)[64],
                                            const float (&acc)[64], float* out, long long* cycles,
                                            unsigned long long* ns) {
  const long long c1 = clock64();
  unsigned long long t1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
  if (threadIdx.x == 0) {
    cycles[blockIdx.x] = c1 - c0;
    ns[blockIdx.x] = t1 - t0;
  }
  float* o = out + ((long long)blockIdx.x * threads + threadIdx.x) * 128;
#pragma unroll
  for (int v = 0; v < 64; ++v) o[v] = acc[v], o[64 + v] = d[v];
}

// Modes 6-8: the A operand from shared memory (SS wgmma), as if FP4 were decoded to e4m3 into shared memory
// once per block by other warps. Does the promotion then overlap the other warpgroup's wgmmas? (Mode 1 says
// it does not with A from registers: 449 -> 680 cycles a block step from one to two warpgroups.)
//   mode 6  SS wgmmas + wait
//   mode 7  + the promotion
//   mode 8  mode 7 (two warpgroups) beside a third warpgroup decoding FP4 blocks of the stage into a scratch
//           buffer of e4m3 rows (the decode's issue and shared-memory traffic, unsynchronised, as many blocks as
//           the consumers run); the decoders' own cycles are reported too
// The decoded A region: two 128-blocks x 128 rows x 128 bytes (a row's 16-byte chunk c at c ^ (row % 8), the
// 128-byte swizzle, as the tokens' panels), warpgroup w's m64 tile at rows 64w ..; the check data's codes are
// 64.0 (0x68) in block 0 and 128.0 (0x70) in block 1, so the sums equal the FP4 modes' closed form.
#define SKEL_A_OFF FMW_SLOT                  // after the stage
#define SKEL_A_BLOCK (FMW_ROWS * 128)        // one decoded 128-block
#define SKEL_SCRATCH_OFF (SKEL_A_OFF + 2 * SKEL_A_BLOCK)

__device__ __forceinline__ void skel_wgmma_ss(float (&d)[64], unsigned long long adesc, unsigned long long bdesc,
                                              int accumulate) {
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
               "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1; }\n"
               : WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24), WGMMA_ACC8(d, 32),
                 WGMMA_ACC8(d, 40), WGMMA_ACC8(d, 48), WGMMA_ACC8(d, 56)
               : "l"(adesc), "l"(bdesc), "r"(accumulate));
}

// Block b's A descriptor for the thread's warpgroup (step q adds 2q, as B's).
__device__ __forceinline__ unsigned long long skel_adesc(const unsigned char* st, int b) {
  return wgmma_desc_sw128(st + SKEL_A_OFF + b * SKEL_A_BLOCK + (threadIdx.x >> 7) * 64 * 128);
}

// The decoded A region's contents (see above); random data: any e4m3 code but NaN.
__device__ void skel_fill_a(unsigned char* st, bool check) {
  unsigned char* a = st + SKEL_A_OFF;
  for (int i = threadIdx.x; i < 2 * SKEL_A_BLOCK; i += blockDim.x)
    a[i] = check ? (i < SKEL_A_BLOCK ? 0x68 : 0x70) : probe_token_code(i + 12345);
}

// A decoder thread (l = 0 .. 127 of the third warpgroup): row l of block b of the stage's FP4 codes (four
// 16-byte chunks, one per 32-group with its UE8M0 exponent, folded with the shifted bit move as the consumers
// do) into row l of a decoded block at dst, in the 128-byte swizzle.
__device__ __forceinline__ void skel_decode_row(const unsigned char* st, int b, unsigned base, unsigned char* dst) {
  const int l = threadIdx.x & 127;
  const unsigned e = *reinterpret_cast<const unsigned*>(st + FMW_SLOT_W + l * 8 + 4 * b);
  const unsigned tv = fmw_fold_shifts(e, base);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 w = *reinterpret_cast<const uint4*>(st + l * FMW_RB + (((4 * b + q) ^ (l & 7)) << 4));
    const Fp4Table tab = fp4_table_shifted(byte_of(tv, q));
    unsigned o[8];
    e2m1x8_to_e4m3_halves(w.x, tab, o[0], o[1]);
    e2m1x8_to_e4m3_halves(w.y, tab, o[2], o[3]);
    e2m1x8_to_e4m3_halves(w.z, tab, o[4], o[5]);
    e2m1x8_to_e4m3_halves(w.w, tab, o[6], o[7]);
    unsigned char* row = dst + l * 128;
    *reinterpret_cast<uint4*>(row + (((2 * q) ^ (l & 7)) << 4)) = make_uint4(o[0], o[1], o[2], o[3]);
    *reinterpret_cast<uint4*>(row + (((2 * q + 1) ^ (l & 7)) << 4)) = make_uint4(o[4], o[5], o[6], o[7]);
  }
}

// One SS block step: block b's four wgmmas, then (modes 7, 8) the promotion or (mode 6) the wait alone.
template <int MODE>
__device__ __forceinline__ void skel_ss_step(const unsigned char* st, int b, float (&d)[64], float (&acc)[64]) {
  FmwBlock blk;
  blk.as = reinterpret_cast<const float*>(st + FMW_SLOT_W + FMW_SLOT_S + FMW_SLOT_A) + b * FMW_TOKENS;
  blk.desc = fmw_desc(st, b);
  blk.w0 = blk.w8 = 1.0f;
  const unsigned long long adesc = skel_adesc(st, b);
  wgmma_fence();
#pragma unroll
  for (int q = 0; q < 4; ++q) skel_wgmma_ss(d, adesc + 2 * q, fmw_desc_step(blk.desc, q), q > 0);
  wgmma_commit();
  if (MODE != 6) {
    fmw_finish<true, FMW_TOKENS>(blk, d, acc);
  } else {
    wgmma_wait<0>();
    wgmma_fence_operand(d);
  }
}

// Modes 6-8. Threads 0 .. 128·wgs - 1 consume; in mode 8 a third warpgroup decodes. cycles[blockIdx.x]: the
// consumers' clock64 span (thread 0); cycles[kBlocks + blockIdx.x]: the decoders' (mode 8).
template <int MODE>
__global__ void __launch_bounds__(384, 1)
    skel_ss_kernel(int iters, int check, int wgs, float* out, long long* cycles, unsigned long long* ns) {
  extern __shared__ __align__(1024) unsigned char skel_smem[];
  unsigned char* st = skel_smem;
  skel_fill(st, check != 0);
  skel_fill_a(st, check != 0);
  fence_proxy_async_shared();
  __syncthreads();
  // Mode 8's registers: the block is launched with 384 x 168 of them, and setmaxnreg.inc waits until the pool
  // holds what it asks for, so the consumers' 256 x 200 and the decoders' 128 x 104 must fit in those 64512
  // (208 / 96 hung: the first run, 2026-12-04).
  if (threadIdx.x >= 128 * wgs) {  // mode 8's decoders
    asm volatile("setmaxnreg.dec.sync.aligned.u32 104;\n");
    const unsigned base = fmw_fold_base(127);
    const long long c0 = clock64();
#pragma unroll 1
    for (int i = 0; i < 2 * iters; ++i) skel_decode_row(st, i & 1, base, skel_smem + SKEL_SCRATCH_OFF + (i & 1) * SKEL_A_BLOCK);
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
    if (threadIdx.x == 128 * wgs) cycles[kBlocks + blockIdx.x] = clock64() - c0;
    return;
  }
  if (MODE == 8) asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n");
  float d[64], acc[64];
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.0f, acc[v] = 0.0f;
  unsigned long long t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  const long long c0 = clock64();
#pragma unroll 1
  for (int it = 0; it < iters; ++it) {
    skel_ss_step<MODE>(st, 0, d, acc);
    skel_ss_step<MODE>(st, 1, d, acc);
  }
  named_barrier(2, 128 * wgs);
  skel_record(c0, t0, 128 * wgs, d, acc, out, cycles, ns);
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
  skel_record(c0, t0, blockDim.x, d, acc, out, cycles, ns);
}

struct SkelRun {
  float ms;
  double cycles_per_step;  // mean over blocks of clock64 cycles per block step (both warpgroups' blocks)
  double sm_ghz;           // clock64 cycles / globaltimer ns, mean over blocks
  long long bad;           // threads whose sums differ from the closed form (check data only)
  double decoder_cycles_per_step;  // mode 8: the decoders' clock64 cycles per block step
};

template <int MODE>
static void launch(int wgs, int iters, int check, float* out, long long* cyc, unsigned long long* ns) {
  if constexpr (MODE >= 6) {
    const int threads = 128 * wgs + (MODE == 8 ? 128 : 0);
    skel_ss_kernel<MODE><<<kBlocks, threads, 200 * 1024>>>(iters, check, wgs, out, cyc, ns);
  } else {
    skel_kernel<MODE><<<kBlocks, 128 * wgs, 200 * 1024>>>(iters, check, out, cyc, ns);
  }
}

template <int MODE>
static SkelRun run(int wgs, int iters, bool check, float* out, long long* cyc, unsigned long long* ns) {
  if constexpr (MODE >= 6)
    cudaFuncSetAttribute(skel_ss_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  else
    cudaFuncSetAttribute(skel_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  const int threads = 128 * wgs;
  launch<MODE>(wgs, 2, check, out, cyc, ns);  // warm-up (200 KB: one block an SM)
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  launch<MODE>(wgs, iters, check, out, cyc, ns);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  SkelRun r{0.0f, 0.0, 0.0, 0, 0.0};
  cudaEventElapsedTime(&r.ms, a, b);
  static long long hc[2 * kBlocks];
  static unsigned long long hn[kBlocks];
  cudaMemcpy(hc, cyc, sizeof(hc), cudaMemcpyDeviceToHost);
  cudaMemcpy(hn, ns, sizeof(hn), cudaMemcpyDeviceToHost);
  for (int i = 0; i < kBlocks; ++i) {
    r.cycles_per_step += (double)hc[i] / (2.0 * iters) / kBlocks;
    r.sm_ghz += (double)hc[i] / (double)hn[i] / kBlocks;
    if (MODE == 8) r.decoder_cycles_per_step += (double)hc[kBlocks + i] / (2.0 * iters) / kBlocks;
  }
  if (check) {
    // Block 0's d = Σ_k 1.0 · 2^6 · 1.0 over 128 k, block 1's twice that; the last block issued is block 1,
    // and the promoting modes add both blocks per iteration (exact in f32: multiples of 2^13 below 2^30).
    const float d0 = 128.0f * 64.0f, dv = 2.0f * d0, av = (MODE != 0 && MODE != 3 && MODE != 6) ? (float)iters * (d0 + dv) : 0.0f;
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
  const int first_mode = argc > 2 ? atoi(argv[2]) : 0;
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const int iters = 20000;
  float* out;
  long long* cyc;
  unsigned long long* ns;
  if (cudaMalloc(&out, (size_t)kBlocks * 256 * 128 * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&cyc, 2 * kBlocks * sizeof(long long)) != cudaSuccess ||
      cudaMalloc(&ns, kBlocks * sizeof(unsigned long long)) != cudaSuccess)
    return 1;
  const char* names[9] = {"wgmma+wait", "+promote", "+promote+decode (the real loop)", "+decode, no promote",
                          "the real loop, ping-pong", "+promote, ping-pong", "SS wgmma+wait", "SS +promote",
                          "SS +promote, a decoder warpgroup beside"};
  int rc = 0;
  for (int mode = first_mode; mode < 9; ++mode) {
    for (int wgs = (mode >= 4 && mode <= 5) || mode == 8 ? 2 : 1; wgs <= 2; ++wgs) {
      for (int check = 1; check >= 0; --check) {
        const SkelRun r = mode == 0 ? run<0>(wgs, iters, check, out, cyc, ns)
                        : mode == 1 ? run<1>(wgs, iters, check, out, cyc, ns)
                        : mode == 2 ? run<2>(wgs, iters, check, out, cyc, ns)
                        : mode == 3 ? run<3>(wgs, iters, check, out, cyc, ns)
                        : mode == 4 ? run<4>(wgs, iters, check, out, cyc, ns)
                        : mode == 5 ? run<5>(wgs, iters, check, out, cyc, ns)
                        : mode == 6 ? run<6>(wgs, iters, check, out, cyc, ns)
                        : mode == 7 ? run<7>(wgs, iters, check, out, cyc, ns)
                                    : run<8>(wgs, iters, check, out, cyc, ns);
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
               "\"cycles_per_block_step\":%.1f,\"cycles_per_m64n128k32\":%.1f,\"decoder_cycles_per_block_step\":%.1f,"
               "\"sm_ghz\":%.3f}\n",
               mode, names[mode], wgs, check ? "check" : "random", check ? "true" : "false", r.ms, tflops,
               tflops / peak, peak, r.cycles_per_step, per_wgmma, r.decoder_cycles_per_step, r.sm_ghz);
      }
    }
  }
  return rc;
}
