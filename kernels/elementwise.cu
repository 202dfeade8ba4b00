// elementwise.cu — small elementwise and copy kernels (kernels/SPEC.md "elementwise.cu"):
// scaling, the embedding lookup into the residual streams, row gathers and the f32 -> bf16
// conversion. Grid-stride loops; f32 products are explicit round-to-nearest intrinsics.
#include "common.cuh"

// ------------------------------------------------------------------------------ elementwise

// x = x * s1 * s2 (f32, that order) for n values.
extern "C" __global__ void scale2_kernel(float* x, long long n, float s1, float s2) {
  dsv4_pdl_begin();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    x[i] = __fmul_rn(__fmul_rn(x[i], s1), s2);
}

// x[t, n, :] = table[tokens[t], :] for every token t < T and stream n < N (rows of D values).
extern "C" __global__ void embed_kernel(const int* tokens, int T, const void* table, int bf16, int D, int N,
                                        float* x) {
  dsv4_pdl_begin();
  const long long total = (long long)T * D;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long t = e / D, i = e - t * D;
    const long long at = (long long)tokens[t] * D + i;
    const float v = bf16 ? bf16_to_f32(static_cast<const bf16_t*>(table)[at]) : static_cast<const float*>(table)[at];
    float* o = x + t * N * D + i;
    for (int n = 0; n < N; ++n) o[(long long)n * D] = v;
  }
}

// dst[r, :] = src[rows[r], :] (rows of row_len values; rows == NULL: src[r, :]) for r < nrows.
extern "C" __global__ void gather_rows_kernel(const float* src, int row_len, const int* rows, int nrows, float* dst) {
  dsv4_pdl_begin();
  const long long total = (long long)nrows * row_len;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long r = e / row_len, i = e - r * row_len;
    const long long sr = rows != nullptr ? (long long)rows[r] : r;
    dst[e] = src[sr * row_len + i];
  }
}

// dst = bf16 bit patterns of src (round to nearest even; NaN kept), n values.
extern "C" __global__ void to_bf16_kernel(const float* src, unsigned short* dst, long long n) {
  dsv4_pdl_begin();
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = f32_to_bf16(src[i]);
}
