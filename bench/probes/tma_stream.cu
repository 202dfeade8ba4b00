// tma_stream: how fast can one SM stream expert weight rows through a TMA ring when nothing consumes them?
// The decode expert GEMMs (kernels/fast_moe_gemm.cu) stream each item's 256 weight rows 128 bytes of every
// row a stage (two TMA boxes of 128 rows x 128 bytes, 128-byte swizzle) through a ring of 4 shared-memory
// slots. With their consumers' compute removed the B = 1 layer still took 64 of its 72 us (BENCHMARKS.md,
// 2026-12-03), so the stream itself is the bound. This probe times that stream alone, and the same bytes in
// other box shapes: every block (one or two an SM) walks its own rows (an item: `rows` rows of `row_bytes`
// bytes, disjoint between blocks, a fresh region every launch so L2 holds none of it) stage by stage; a
// stage is `rows` x `inner` bytes in boxes of `box_rows` rows x `inner` bytes; one thread issues the boxes
// once a slot is free, one warp waits for each slot to fill and frees it at once. Prints one JSON line a
// case: GB/s over all SMs and per SM. The cases with FP4 rows (2048 bytes up, 1024 down) make each launch one
// item a block, as at B = 1, so their time includes each launch's start and tail; TS_TILED cases read the same
// bytes laid out stage by stage (what a derived weight layout would give the GEMMs).
//
// Build and run on the GPU machine:
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a bench/probes/tma_stream.cu -o ts -lcuda && ./ts
// (scripts/gpu-probe-decode.sh does both, with decode_consumer.cu.)
#ifdef __CUDACC_RTC__  // NVRTC compile-checks the device code alone (CI has no nvcc)
struct alignas(64) CUtensorMap {
  unsigned long long opaque[16];
};
#else
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <vector>
#endif

__device__ __forceinline__ unsigned ts_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void ts_wait(unsigned bar, unsigned phase) {
  asm volatile(
      "{ .reg .pred p; W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra W; }\n" ::"r"(bar),
      "r"(phase)
      : "memory");
}

// A stage: `stage_bytes` over `boxes` TMA boxes; slots of `slot_bytes`; full[s] at bars + 8 s, empty[s] at
// bars + 8 (stages + s).
// `side` adds the decode GEMMs' other per-stage copies (fmoe_produce), a bit each: TS_TOKENS, the 32 lanes of the
// producer warp copy 16 x 256 bytes of token codes from `tokens` (L2-resident, as the activations are; every
// block the same lines) by cp.async, and the full barrier also waits for the lanes' cp.async arrivals;
// TS_ONE_COLUMN, only the lanes of token column 0 copy (the producer since 8e6970f, at one token); TS_SCALES,
// lane 0 also makes two 1 KiB bulk copies of `scales` (all blocks the same addresses).
#define TS_TOKENS 1
#define TS_SCALES 2
#define TS_ONE_COLUMN 4
// TS_TILED: the weights in stage tiles (each stage's `rows` x `inner` bytes one contiguous run, an item's
// stages one after another), as a layout derived for the kernel would hold them, instead of rows of
// `row_bytes` where a stage takes `inner` bytes of every row (the checkpoint's layout, the GEMMs' now).
#define TS_TILED 8

__global__ void ts_kernel(const __grid_constant__ CUtensorMap map, int rows, int box_rows, int inner, int nks,
                          int stages, int slot_bytes, int row_base, int side, const unsigned char* tokens,
                          const unsigned char* scales) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const unsigned base = ts_smem(smem);
  const unsigned bars = base + stages * slot_bytes;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bars + 8 * s), "r"((side & TS_TOKENS) ? 33 : 1));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bars + 8 * (stages + s)));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int row0 = row_base + blockIdx.x * rows;
  const int boxes = rows / box_rows;
  const unsigned stage_bytes = (unsigned)(rows * inner);
  if (threadIdx.x < 32 && ((side & TS_TOKENS) || threadIdx.x == 0)) {
    const int lane = threadIdx.x;
    for (int i = 0; i < nks; ++i) {
      const int s = i % stages;
      const unsigned phase = (unsigned)((i / stages) & 1);
      ts_wait(bars + 8 * (stages + s), phase ^ 1);
      const unsigned full = bars + 8 * s, dst = base + s * slot_bytes;
      if (lane == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(full),
                     "r"(stage_bytes + ((side & TS_SCALES) ? 2048u : 0u))
                     : "memory");
        for (int b = 0; b < boxes; ++b) {
          // Tiled: the map's rows are `inner` bytes; the item at row0 starts at tile row row0 * nks.
          const int x = (side & TS_TILED) ? 0 : i * inner;
          const int y = (side & TS_TILED) ? row0 * nks + i * rows + b * box_rows : row0 + b * box_rows;
          asm volatile(
              "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
              "%3}], [%4];\n" ::"r"(dst + b * box_rows * inner),
              "l"(&map), "r"(x), "r"(y), "r"(full)
              : "memory");
        }
        if (side & TS_SCALES)
          for (int q = 0; q < 2; ++q)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1024, [%2];\n" ::"r"(
                             base + stages * slot_bytes + 16 * stages + 1024 * q),
                         "l"(scales + 2048 * (i % 64) + 1024 * q), "r"(full)
                         : "memory");
      }
      if (side & TS_TOKENS) {
        // Lane L copies chunks L / 16, L / 16 + 2, ... of token column L % 16 (fmoe_produce's gather), into the
        // stage's 4 KiB after the barriers and the scales (the probe does not read them).
        const unsigned d0 = base + stages * slot_bytes + 16 * stages + 2048 + 4096 * s + (lane >> 4) * 256 + (lane & 15) * 16;
        const unsigned char* s0 = tokens + (i % 16) * 256 + 16 * (lane >> 4);
        if (!(side & TS_ONE_COLUMN) || (lane & 15) == 0)
          for (int c = 0; c < 8; ++c)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d0 + 512 * c), "l"(s0 + 32 * c) : "memory");
        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
      }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else if (threadIdx.x >= 32 && threadIdx.x < 64) {
    for (int i = 0; i < nks; ++i) {
      const int s = i % stages;
      ts_wait(bars + 8 * s, (unsigned)((i / stages) & 1));
      if (threadIdx.x == 32) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bars + 8 * (stages + s)) : "memory");
      __syncwarp();
    }
  }
}

#ifndef __CUDACC_RTC__
int main() {
  cuInit(0);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const long long total_bytes = 1LL << 30;  // 1 GiB
  unsigned char* w = nullptr;
  if (cudaMalloc(&w, total_bytes) != cudaSuccess) return 1;
  cudaMemset(w, 0x11, total_bytes);
  struct Case {
    int inner, box_rows, rows, stages, blocks_per_sm, side, grid_blocks;  // grid_blocks 0: SMs x blocks_per_sm
    int row_bytes = 4096;  // an FP8 up row (K = 4096); FP4 up rows are 2048 bytes, FP4 down rows (K = 2048) 1024
  };
  const std::vector<Case> cases = {
      {128, 128, 256, 4, 1, 0, 0},  // the decode GEMMs' stage and ring
      {128, 128, 256, 4, 1, TS_TOKENS | TS_SCALES, 0},  // + their token gather and scale copies (before 8e6970f)
      {128, 128, 256, 4, 1, TS_TOKENS, 0},  // the parts of those, one at a time (BENCHMARKS.md 2026-12-03, fourteenth version)
      {128, 128, 256, 4, 1, TS_SCALES, 0},
      {128, 128, 256, 4, 1, TS_TOKENS | TS_ONE_COLUMN, 0},
      {128, 128, 256, 4, 1, TS_TOKENS | TS_ONE_COLUMN | TS_SCALES, 0},  // the producer since 8e6970f, at B = 1
      {128, 128, 256, 4, 1, 0, 112}, {128, 128, 256, 4, 1, TS_TOKENS | TS_SCALES, 112},  // 112 blocks (B = 1's up items)
      {128, 64, 256, 4, 1, 0, 0},   {128, 256, 256, 4, 1, 0, 0},   {128, 128, 256, 6, 1, 0, 0},
      {128, 128, 128, 4, 2, 0, 0},  {64, 128, 256, 8, 1, 0, 0},    {256, 128, 256, 2, 1, 0, 0},
      {256, 128, 256, 3, 1, 0, 0},  {256, 128, 128, 3, 2, 0, 0},
      // FP4 rows (a launch is then one item a block: 16 stages up, 8 down, as at B = 1), and the same bytes
      // in stage tiles.
      {128, 128, 256, 4, 1, 0, 0, 2048}, {128, 128, 256, 4, 1, 0, 112, 2048}, {128, 128, 256, 4, 1, 0, 0, 1024},
      {128, 128, 256, 4, 1, TS_TILED, 0, 2048}, {128, 128, 256, 4, 1, TS_TILED, 112, 2048},
      {128, 128, 256, 4, 1, TS_TILED, 0, 1024}, {128, 128, 256, 4, 1, TS_TILED, 0, 4096},
      {128, 256, 256, 4, 1, TS_TILED, 112, 2048}, {128, 128, 256, 6, 1, TS_TILED, 112, 2048},
      {128, 128, 256, 4, 1, TS_TOKENS | TS_ONE_COLUMN | TS_SCALES, 112, 2048},
      {128, 128, 256, 4, 1, TS_TOKENS | TS_ONE_COLUMN | TS_SCALES | TS_TILED, 112, 2048},
  };
  unsigned char *tokens = nullptr, *scales = nullptr;
  cudaMalloc(&tokens, 16 * 256);
  cudaMalloc(&scales, 64 * 2048);
  cudaMemset(tokens, 0x38, 16 * 256);
  cudaMemset(scales, 127, 64 * 2048);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (const Case& c : cases) {
    CUtensorMap map;
    const long long row_bytes = c.row_bytes, total_rows = total_bytes / row_bytes;
    const bool tiled = (c.side & TS_TILED) != 0;
    const cuuint64_t map_row = tiled ? (cuuint64_t)c.inner : (cuuint64_t)row_bytes;
    const cuuint64_t dims[2] = {map_row, (cuuint64_t)(total_bytes / map_row)};
    const cuuint64_t strides[1] = {map_row};
    const cuuint32_t box[2] = {(cuuint32_t)c.inner, (cuuint32_t)c.box_rows};
    const cuuint32_t estr[2] = {1, 1};
    const CUtensorMapSwizzle sw = c.inner == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : c.inner == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                  : CU_TENSOR_MAP_SWIZZLE_NONE;
    CUresult r = cuTensorMapEncodeTiled(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, w, dims, strides, box, estr,
                                        CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
      printf("{\"inner\": %d, \"box_rows\": %d, \"error\": \"encode %d\"}\n", c.inner, c.box_rows, (int)r);
      continue;
    }
    const int nks = (int)(row_bytes / c.inner);
    const int slot = c.rows * c.inner;
    const int smem = c.stages * slot + 16 * c.stages + 2048 + ((c.side & TS_TOKENS) ? 4096 * c.stages : 0);
    cudaFuncSetAttribute(ts_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    const int grid = c.grid_blocks > 0 ? c.grid_blocks : sms * c.blocks_per_sm;
    const long long per_launch = (long long)grid * c.rows;
    const int launches = (int)(total_rows / per_launch);
    ts_kernel<<<grid, 64, smem>>>(map, c.rows, c.box_rows, c.inner, nks, c.stages, slot, 0, c.side, tokens, scales);
    cudaEventRecord(a);
    for (int l = 0; l < launches; ++l)
      ts_kernel<<<grid, 64, smem>>>(map, c.rows, c.box_rows, c.inner, nks, c.stages, slot, (int)(l * per_launch),
                                    c.side, tokens, scales);
    cudaEventRecord(b);
    cudaError_t e = cudaEventSynchronize(b);
    if (e != cudaSuccess) {
      printf("{\"inner\": %d, \"error\": \"%s\"}\n", c.inner, cudaGetErrorString(e));
      return 1;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    const double bytes = (double)launches * per_launch * row_bytes;
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    printf("{\"row_bytes\": %d, \"tiled\": %d, \"inner\": %d, \"box_rows\": %d, \"rows\": %d, \"stages\": %d, "
           "\"blocks\": %d, \"side_copies\": %d, \"us_per_launch\": %.2f, \"gb_per_s\": %.1f, "
           "\"gb_per_s_per_block\": %.2f}\n",
           c.row_bytes, tiled ? 1 : 0, c.inner, c.box_rows, c.rows, c.stages, grid, c.side, ms * 1000.0 / launches,
           gbs, gbs / grid);
  }
  return 0;
}
#endif
