// norm_rope.cu — RMSNorm, RoPE, the KV / indexer fake-quantisation and small elementwise and
// copy kernels (kernels/SPEC.md "norm_rope.cu"). Each kernel reproduces its CPU reference bit
// for bit (src/reference/ops.rs rms_norm, src/model/rope.rs apply, src/reference/precision.rs
// kv_nope_sim / index_sim / hadamard, src/weights/quant.rs fp8_sim / fp4_sim / round_bf16):
//   - every f32 operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...)
//     so the compiler can never contract a multiply and an add into an FMA (the reference
//     rounds every product);
//   - reductions accumulate in f64 (products of two f32 are exact in f64) and round once;
//   - rsqrt, sin, cos are evaluated in double precision (correctly rounded sqrt and division,
//     libdevice sin/cos) and rounded once to f32 — never the float / fast intrinsics.
#include "common.cuh"
#include "ref_math.cuh"

// ---------------------------------------------------------------------------------- RMSNorm

// In place over `rows` rows of `dim` values at stride `ld`: ms = f32(Σ f64 x² / dim),
// r = rsqrt(ms + eps) (f32 add, f64 rsqrt), x = x * r * w (f32, that order; x * r without a
// weight), then bf16 if round_out. One block per row (grid-stride over rows).
extern "C" __global__ void rmsnorm_kernel(float* x, int rows, int dim, int ld, const float* weight, float eps,
                                          int round_out) {
  __shared__ double scratch[32];
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    double acc = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
      const double v = (double)row[i];
      acc = __dadd_rn(acc, __dmul_rn(v, v));
    }
    const double s = ref_block_sum_f64(acc, scratch);
    const float ms = (float)__ddiv_rn(s, (double)dim);
    const float rr = ref_rsqrt(__fadd_rn(ms, eps));
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
      float v = __fmul_rn(row[i], rr);
      if (weight != nullptr) v = __fmul_rn(v, weight[i]);
      if (round_out) v = round_bf16(v);
      row[i] = v;
    }
  }
}

// --------------------------------------------------------------------------------------- RoPE

// Every row r (stride ld) holds `heads` heads of `head_dim` values; the last 2*half_rope
// channels of each head rotate in interleaved pairs (k: channels 2k, 2k+1 of the tail):
// θ = f32(pos[r]) * inv_freq[k] (f32), c = f32(cos(f64 θ)), s = sign * f32(sin(f64 θ)),
// a' = a*c - b*s, b' = a*s + b*c (f32, every product rounded). With round_out the WHOLE head
// (nope channels too) is then rounded to bf16, as the reference's `prec.bf16` after
// `rope::apply` does (in the model the nope channels are already bf16 there, so this is a no-op
// on them). One block per row (grid-stride).
extern "C" __global__ void rope_kernel(float* x, int rows, int ld, int heads, int head_dim, const int* pos,
                                       const float* inv_freq, int half_rope, float sign, int round_out) {
  const int nope = head_dim - 2 * half_rope;
  const int npairs = heads * half_rope;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    const float p = __int2float_rn(pos[r]);
    for (int q = threadIdx.x; q < npairs; q += blockDim.x) {
      const int h = q / half_rope, k = q - h * half_rope;
      float* t = row + (long long)h * head_dim + nope + 2 * k;
      const float theta = __fmul_rn(p, inv_freq[k]);
      const double td = (double)theta;
      const float c = (float)cos(td);
      const float s = __fmul_rn(sign, (float)sin(td));
      const float a = t[0], b = t[1];
      float a2 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      float b2 = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
      if (round_out) {
        a2 = round_bf16(a2);
        b2 = round_bf16(b2);
      }
      t[0] = a2;
      t[1] = b2;
    }
    if (round_out && nope > 0) {
      for (int q = threadIdx.x; q < heads * nope; q += blockDim.x) {
        const int h = q / nope, i = q - h * nope;
        float* v = row + (long long)h * head_dim + i;
        *v = round_bf16(*v);
      }
    }
  }
}

// ------------------------------------------------------------------------- KV nope FP8 sim

// Per row (stride ld): fp8sim(x[0:nope], 64) — per block of 64 (the last one may be shorter):
// amax = max(max|x|, 1e-4), s = ue8m0(amax / 448), x = e4m3(clamp(x / s, ±448)) * s.
// One block per row; each warp takes 64-blocks (two values per lane).
extern "C" __global__ void kv_sim_kernel(float* x, int rows, int ld, int nope) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int nblk = (nope + 63) / 64;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    for (int b = warp; b < nblk; b += nwarps) {
      const int i0 = b * 64 + lane, i1 = i0 + 32;
      const bool h0 = i0 < nope, h1 = i1 < nope;
      const float v0 = h0 ? row[i0] : 0.0f;
      const float v1 = h1 ? row[i1] : 0.0f;
      float amax = warp_max(fmaxf(fabsf(v0), fabsf(v1)));
      amax = fmaxf(amax, 1e-4f);
      const float s = ue8m0_scale(amax, DSV4_E4M3_MAX);
      if (h0) row[i0] = ref_fp8_sim_value(v0, s);
      if (h1) row[i1] = ref_fp8_sim_value(v1, s);
    }
  }
}

// ----------------------------------------------------------------------- indexer Hadamard sim

// HADAMARD_MAX (dsv4_consts.cuh): largest row length of index_sim_kernel.

// Per row of `dim` values (a power of two <= 1024, rows contiguous): normalised Sylvester
// Walsh–Hadamard transform with f64 butterflies (the same butterfly network as
// precision.rs hadamard, so every output is computed by the same operations), each output
// f32(Σ) * f32(dim^-1/2); then fp4sim(·, 32) (amax floor 6 * 2^-126, ue8m0(amax / 6),
// e2m1(clamp(x / s, ±6)) * s); then bf16. One block per row.
extern "C" __global__ void index_sim_kernel(float* x, int rows, int dim) {
  __shared__ double y[HADAMARD_MAX];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  // f32(dim^-1/2): dim is a power of two, so the f64 value is 2^-k or 2^-k * sqrt(1/2) up to
  // one f64 rounding, which rounds to the same f32 as the reference's powf(-0.5).
  const float sc = ref_rsqrt((float)dim);
  const float floor4 = DSV4_E2M1_MAX * __int_as_float(0x00800000);  // 6 * 2^-126, exact
  const int nblk = (dim + 31) / 32;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) y[i] = (double)row[i];
    __syncthreads();
    ref_hadamard_f64(y, dim);
    for (int b = warp; b < nblk; b += nwarps) {
      const int i = b * 32 + lane;
      const bool have = i < dim;
      const float v = have ? __fmul_rn((float)y[i], sc) : 0.0f;
      float amax = warp_max(fabsf(v));
      amax = fmaxf(amax, floor4);
      const float s = ue8m0_scale(amax, DSV4_E2M1_MAX);
      if (have) {
        const float q = ref_fp4_sim_value(v, s);
        row[i] = round_bf16(q);
      }
    }
    __syncthreads();  // y is reused by the next row
  }
}

// ------------------------------------------------------------------------------ elementwise

// x = bf16(x) for n values.
extern "C" __global__ void round_bf16_kernel(float* x, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    x[i] = round_bf16(x[i]);
}

// x = x * s1 * s2 (f32, that order) for n values.
extern "C" __global__ void scale2_kernel(float* x, long long n, float s1, float s2) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    x[i] = __fmul_rn(__fmul_rn(x[i], s1), s2);
}

// x[t, n, :] = table[tokens[t], :] for every token t < T and stream n < N (rows of D values).
extern "C" __global__ void embed_kernel(const int* tokens, int T, const float* table, int D, int N, float* x) {
  const long long total = (long long)T * D;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long t = e / D, i = e - t * D;
    const float v = table[(long long)tokens[t] * D + i];
    float* o = x + t * N * D + i;
    for (int n = 0; n < N; ++n) o[(long long)n * D] = v;
  }
}

// dst[r, :] = src[rows[r], :] (rows of row_len values; rows == NULL: src[r, :]) for r < nrows.
extern "C" __global__ void gather_rows_kernel(const float* src, int row_len, const int* rows, int nrows, float* dst) {
  const long long total = (long long)nrows * row_len;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total; e += (long long)gridDim.x * blockDim.x) {
    const long long r = e / row_len, i = e - r * row_len;
    const long long sr = rows != nullptr ? (long long)rows[r] : r;
    dst[e] = src[sr * row_len + i];
  }
}

// dst = bf16 bit patterns of src (round to nearest even; NaN kept), n values.
extern "C" __global__ void to_bf16_kernel(const float* src, unsigned short* dst, long long n) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
    dst[i] = f32_to_bf16(src[i]);
}
