// l2_prefetch.cu — asks L2 for weights ahead of the kernels that read them (the fast set's decode step).
//
// At few tokens many kernels of a step are bound by their dependent chains, not by HBM (the mHC's, the norms,
// the router's, the attention's at short contexts): HBM idles while they run. The weights a later projection
// streams are known before the step starts and never written by a forward, so they can be asked of L2 during
// those kernels, and the projection then reads them from L2 (50 MB on H100 / H200). What to ask for and where
// is the caller's (src/cuda/kernels/l2_prefetch.rs); this kernel only issues the requests.
#include "common.cuh"
#include "fp8_mma.cuh"  // l2_prefetch_share

// Up to three ranges [p_i, p_i + bytes_i) (16-byte aligned, bytes a multiple of 16; NULL / 0: none): warp i of
// each block asks L2 for its block's share of range i (l2_prefetch_share). It triggers the next kernel's launch
// first (it reads nothing the step writes, so nothing orders it after the kernel before it but the chain), then
// waits for the kernel before it to finish before it ends, so the kernel after it, whose own wait ends when this
// one has finished, still runs after everything before (common.cuh's programmatic-launch chain).
extern "C" __global__ void __launch_bounds__(96)
    l2_prefetch_kernel(const unsigned char* p0, unsigned long long bytes0, const unsigned char* p1,
                       unsigned long long bytes1, const unsigned char* p2, unsigned long long bytes2) {
  dsv4_pdl_trigger();
  const int w = threadIdx.x >> 5;
  l2_prefetch_share(w == 0 ? p0 : w == 1 ? p1 : p2, w == 0 ? bytes0 : w == 1 ? bytes1 : bytes2, blockIdx.x,
                    gridDim.x, false);
  dsv4_pdl_wait();
}
