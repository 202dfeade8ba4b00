// weight_convert.cu — writing weights from device memory (dsv4_refit / dsv4_load_tensors with
// DSV4_MEMORY_DEVICE entries; kernels/SPEC.md "weight_convert.cu"): a check pass over the
// values before anything is written, and the conversion of a source's rows into a weight's
// storage layout. Bit for bit as the host path: src/weights/load.rs write_rows (decoders of
// dtype.rs), src/weights/rows.rs quantize_rows / encode_rows; every f32 operation is an
// explicit round-to-nearest intrinsic.
#include "common.cuh"
#include "ref_math.cuh"

// Source encodings (src/cuda/kernels/weight_convert.rs SourceEnc).
#define WC_F32 0
#define WC_BF16 1
#define WC_F16 2
#define WC_FP8 3
#define WC_FP4 4
#define WC_I32 5
#define WC_I64 6

// Destination storage: the StorageFormat codes (F32 0, BF16 1, FP8 2, FP4 3), and 4 for int32
// index tables.
#define WD_F32 0
#define WD_BF16 1
#define WD_FP8 2
#define WD_FP4 3
#define WD_I32 4

#define WC_THREADS 256

// IEEE half bits -> f32, exact (dtype.rs f16_to_f32).
DSV4_INLINE float wc_f16_to_f32(unsigned short h) {
  unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
  if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e == 0u) {
    float v = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// Scale element i of a block-scale tensor: UE8M0 bytes, or f32 when `scale_f32`.
DSV4_INLINE float wc_scale(const void* s, int scale_f32, long long i) {
  return scale_f32 ? ((const float*)s)[i] : e8m0_to_f32(((const unsigned char*)s)[i]);
}

// Element (g, c) of a source with `cols` columns (g a global row of its matrix view), decoded
// as dtype.rs does: FP8 with the [sbr, sbc] block scale of matrix g / mat_rows, FP4 with its
// row's 1x32 scale.
DSV4_INLINE float wc_decode(const void* src, int enc, const void* scale, int scale_f32, int sbr, int sbc,
                            long long mat_rows, long long g, int cols, int c) {
  const long long i = g * cols + c;
  switch (enc) {
    case WC_F32: return ((const float*)src)[i];
    case WC_BF16: return bf16_to_f32(((const unsigned short*)src)[i]);
    case WC_F16: return wc_f16_to_f32(((const unsigned short*)src)[i]);
    case WC_FP8: {
      const long long m = g / mat_rows, r = g % mat_rows;
      const long long scols = (cols + sbc - 1) / sbc, per_mat = ((mat_rows + sbr - 1) / sbr) * scols;
      const float s = wc_scale(scale, scale_f32, m * per_mat + (r / sbr) * scols + c / sbc);
      return __fmul_rn(e4m3_to_f32(((const unsigned char*)src)[i]), s);
    }
    case WC_FP4: {
      const unsigned char b = ((const unsigned char*)src)[g * (cols / 2) + c / 2];
      const float s = wc_scale(scale, scale_f32, g * ((cols + 31) / 32) + c / 32);
      return __fmul_rn(e2m1_to_f32((c & 1) ? (b >> 4) : (b & 15u)), s);
    }
  }
  return 0.0f;
}

// Element i of an integer source.
DSV4_INLINE long long wc_int(const void* src, int enc, long long i) {
  return enc == WC_I64 ? ((const long long*)src)[i] : (long long)((const int*)src)[i];
}

// The check pass: `*first` (set to ~0 before) becomes the smallest index i < n whose element
// is bad: a float (F32 / BF16 / F16) that is not finite, or an integer (I32 / I64) outside
// [0, bound). Other encodings are not checked (as on the host).
extern "C" __global__ void wc_scan_kernel(const void* src, int enc, long long n, long long bound,
                                          unsigned long long* first) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    bool bad;
    if (enc == WC_I32 || enc == WC_I64) {
      const long long v = wc_int(src, enc, i);
      bad = v < 0 || v >= bound;
    } else if (enc == WC_F32 || enc == WC_BF16 || enc == WC_F16) {
      float x;
      if (enc == WC_F32) x = ((const float*)src)[i];
      else if (enc == WC_BF16) x = bf16_to_f32(((const unsigned short*)src)[i]);
      else x = wc_f16_to_f32(((const unsigned short*)src)[i]);
      bad = !isfinite(x);
    } else {
      bad = false;
    }
    if (bad) atomicMin(first, (unsigned long long)i);
  }
}

// Rows [row0, row0 + rows) of a source with `cols` columns, written as a whole weight
// [rows, cols] in storage `dst_fmt` (`dst`, and `dst_scale` for FP8 / FP4):
// - F32 / BF16: each value decoded, then as is / rounded to nearest even (one thread each);
// - I32: each integer narrowed (the check pass bounded them);
// - FP8 with [dbr, dbc] blocks: per block (one thread block each) amax of |v|, scale =
//   ue8m0(max(amax, 1e-4) / 448), codes e4m3(clamp(v / scale, ±448));
// - FP4: per row and 32 columns (one warp each) amax, scale = ue8m0(max(amax, 6 * 2^-126) / 6),
//   nibbles e2m1(clamp(v / scale, ±6)), two per byte (low nibble = even column).
extern "C" __global__ void wc_convert_kernel(const void* src, int enc, const void* scale, int scale_f32, int sbr,
                                             int sbc, long long mat_rows, long long row0, int rows, int cols,
                                             void* dst, float* dst_scale, int dst_fmt, int dbr, int dbc) {
  __shared__ float red[WC_THREADS / 32];
  const long long total = (long long)rows * cols;
  if (dst_fmt == WD_F32 || dst_fmt == WD_BF16 || dst_fmt == WD_I32) {
    for (long long o = blockIdx.x * (long long)blockDim.x + threadIdx.x; o < total;
         o += (long long)gridDim.x * blockDim.x) {
      const long long r = o / cols;
      const int c = (int)(o % cols);
      if (dst_fmt == WD_I32) {
        ((int*)dst)[o] = (int)wc_int(src, enc, (row0 + r) * cols + c);
        continue;
      }
      const float v = wc_decode(src, enc, scale, scale_f32, sbr, sbc, mat_rows, row0 + r, cols, c);
      if (dst_fmt == WD_F32) ((float*)dst)[o] = v;
      else ((unsigned short*)dst)[o] = f32_to_bf16(v);
    }
    return;
  }
  if (dst_fmt == WD_FP8) {
    const int nbr = (rows + dbr - 1) / dbr, nbc = (cols + dbc - 1) / dbc;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (long long b = blockIdx.x; b < (long long)nbr * nbc; b += gridDim.x) {
      const int br = (int)(b / nbc), bc = (int)(b % nbc);
      const int r0 = br * dbr, c0 = bc * dbc;
      const int h = min(dbr, rows - r0), w = min(dbc, cols - c0);
      float amax = 0.0f;
      for (int k = threadIdx.x; k < h * w; k += blockDim.x) {
        const float v = wc_decode(src, enc, scale, scale_f32, sbr, sbc, mat_rows, row0 + r0 + k / w, cols, c0 + k % w);
        amax = fmaxf(amax, fabsf(v));
      }
      amax = warp_max(amax);
      if (lane == 0) red[warp] = amax;
      __syncthreads();
      if (warp == 0) {
        float m = lane < (int)(blockDim.x >> 5) ? red[lane] : 0.0f;
        m = warp_max(m);
        if (lane == 0) red[0] = m;
      }
      __syncthreads();
      const float s = ue8m0_scale(fmaxf(red[0], 1e-4f), DSV4_E4M3_MAX);
      if (threadIdx.x == 0) dst_scale[b] = s;
      for (int k = threadIdx.x; k < h * w; k += blockDim.x) {
        const int r = r0 + k / w, c = c0 + k % w;
        const float v = wc_decode(src, enc, scale, scale_f32, sbr, sbc, mat_rows, row0 + r, cols, c);
        ((unsigned char*)dst)[(long long)r * cols + c] =
            e4m3_encode(ref_clamp(__fdiv_rn(v, s), -DSV4_E4M3_MAX, DSV4_E4M3_MAX));
      }
      __syncthreads();  // red is reused by the next block
    }
    return;
  }
  // FP4: one warp per (row, 32-column group).
  const int groups = (cols + 31) / 32;
  const int lane = threadIdx.x & 31;
  const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
  const float floor4 = DSV4_E2M1_MAX * __int_as_float(0x00800000);  // 6 * 2^-126, exact
  for (long long t = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); t < (long long)rows * groups;
       t += warps) {
    const long long r = t / groups;
    const int c = (int)(t % groups) * 32 + lane;
    const bool have = c < cols;
    const float v = have ? wc_decode(src, enc, scale, scale_f32, sbr, sbc, mat_rows, row0 + r, cols, c) : 0.0f;
    const float amax = fmaxf(warp_max(fabsf(v)), floor4);
    const float s = ue8m0_scale(amax, DSV4_E2M1_MAX);
    if (lane == 0) dst_scale[t] = s;
    const unsigned nib = have ? e2m1_encode(ref_clamp(__fdiv_rn(v, s), -DSV4_E2M1_MAX, DSV4_E2M1_MAX)) : 0u;
    const unsigned hi = __shfl_down_sync(0xffffffffu, nib, 1);
    if (have && (lane & 1) == 0) ((unsigned char*)dst)[r * (cols / 2) + c / 2] = (unsigned char)(nib | (hi << 4));
  }
}

// dst[i] = scale element offset + i (UE8M0 bytes or f32), for i < n: the block scales of a
// stored-format source copied as they are (its codes are copied byte for byte).
extern "C" __global__ void wc_scales_kernel(const void* scale, int scale_f32, long long offset, long long n,
                                            float* dst) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x)
    dst[i] = wc_scale(scale, scale_f32, offset + i);
}
