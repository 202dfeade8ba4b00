// rope.cu — rotary position embedding (kernels/SPEC.md "rope.cu"), bit for bit as
// src/model/rope.rs apply (+ the reference's bf16 rounding): ref_math.cuh ref_rope_pair (every
// f32 operation an explicit round-to-nearest intrinsic, sin and cos in double precision rounded
// once to f32 — never the float / fast intrinsics).
#include "common.cuh"
#include "ref_math.cuh"

// --------------------------------------------------------------------------------------- RoPE

// Every row r (stride ld) holds `heads` heads of `head_dim` values; the last 2*half_rope
// channels of each head rotate in interleaved pairs (k: channels 2k, 2k+1 of the tail):
// θ = f32(pos[r]) * inv_freq[k] (f32), c = f32(cos(f64 θ)), s = sign * f32(sin(f64 θ)),
// a' = a*c - b*s, b' = a*s + b*c (f32, every product rounded). With round_out the WHOLE head
// (nope channels too) is then rounded to bf16, as the reference's `prec.bf16` after
// `rope::apply` does (in the model the nope channels are already bf16 there, so this is a no-op
// on them). Rows over blockIdx.y, a row's work over blockIdx.x, both grid-stride. A thread takes
// pair k of ROPE_HEADS consecutive heads: θ depends on the row and k only, so one f64 cos and sin
// (long dependent chains) serve them all, 8 times fewer than a thread per pair and head. Measured
// (ncu, 4096 tokens, five calls): 9.3 ms with this alone, the launch then being bound by starting
// its blocks; 4.6 ms with norm_rope.rs's launch shape (a prefill now takes rope_rows_kernel below).
// At decode a call went 5.6 -> 9.6 us while a thread loaded its heads one after another after the
// cos / sin; it now loads them all first. (ROPE_HEADS: dsv4_consts.cuh, norm_rope.rs ROPE_HEADS.)
// With round_in the head is first rounded to bf16 as loaded (the rotated pairs before their rotation, the
// nope channels by the same pass as round_out's): the projection that wrote x may leave its official bf16
// rounding to this kernel, its first reader. With out_bf16 (non-null; round_out set) every value is also
// written as its bf16 bits to out_bf16 [rows, ld_out] (the heads at the same columns): a BF16 copy for a
// reader that takes BF16 (wo_a's grouped GEMM), so that it needs no conversion pass of its own.
extern "C" __global__ void rope_kernel(float* x, int rows, int ld, int heads, int head_dim, const int* pos,
                                       const float* inv_freq, int half_rope, float sign, int round_out,
                                       int round_in, unsigned short* out_bf16, int ld_out) {
  dsv4_pdl_begin();
  const int nope = head_dim - 2 * half_rope;
  const int items = half_rope * ((heads + ROPE_HEADS - 1) / ROPE_HEADS);
  const int first = blockIdx.x * blockDim.x + threadIdx.x, step = gridDim.x * blockDim.x;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    float* row = x + (long long)r * ld;
    const float p = __int2float_rn(pos[r]);
    for (int q = first; q < items; q += step) {
      const int hc = q / half_rope, k = q - hc * half_rope;
      const int nh = min(heads - hc * ROPE_HEADS, ROPE_HEADS);
      float* t0 = row + (long long)hc * ROPE_HEADS * head_dim + nope + 2 * k;
      // The heads' pairs are loaded first, so that their loads are in flight during the cos / sin.
      float a[ROPE_HEADS], b[ROPE_HEADS];
#pragma unroll
      for (int j = 0; j < ROPE_HEADS; ++j) {
        if (j < nh) {
          a[j] = round_in ? round_bf16(t0[(long long)j * head_dim]) : t0[(long long)j * head_dim];
          b[j] = round_in ? round_bf16(t0[(long long)j * head_dim + 1]) : t0[(long long)j * head_dim + 1];
        }
      }
      float c, s;
      ref_rope_cs(p, inv_freq[k], sign, c, s);
#pragma unroll
      for (int j = 0; j < ROPE_HEADS; ++j) {
        if (j < nh) {
          ref_rope_rotate(a[j], b[j], c, s, round_out);
          t0[(long long)j * head_dim] = a[j];
          t0[(long long)j * head_dim + 1] = b[j];
          if (out_bf16) {
            const long long o = (long long)r * ld_out + (long long)(hc * ROPE_HEADS + j) * head_dim + nope + 2 * k;
            *reinterpret_cast<unsigned*>(out_bf16 + o) = (unsigned)f32_to_bf16(a[j]) | ((unsigned)f32_to_bf16(b[j]) << 16);
          }
        }
      }
    }
    if ((round_out || round_in) && nope > 0) {
      for (int q = first; q < heads * nope; q += step) {
        const int h = q / nope, i = q - h * nope;
        float* v = row + (long long)h * head_dim + i;
        *v = round_bf16(*v);
        if (out_bf16) out_bf16[(long long)r * ld_out + (long long)h * head_dim + i] = f32_to_bf16(*v);
      }
    }
  }
}

// rope_kernel's operation for many rows (a prefill's), a block a row (grid-stride): the row's
// half_rope cos / sin computed once into shared memory (a thread a pair; every head of the row
// shares them, where rope_kernel computes one per ROPE_HEADS heads), then every (head, pair) rotated
// by ref_rope_rotate, then with round_out the nope channels rounded, a warp a head, four values a
// thread where the row layout allows a 16-byte access (vec4), else one. The same operations on
// every value as rope_kernel: the same bits, and the same BF16 copy with out_bf16 (vec4 then also asks
// ld_out and out_bf16 to allow 8-byte stores). half_rope <= ROPE_ROWS_MAX_PAIRS (dsv4_consts.cuh).
extern "C" __global__ void rope_rows_kernel(float* x, int rows, int ld, int heads, int head_dim, const int* pos,
                                            const float* inv_freq, int half_rope, float sign, int round_out,
                                            int round_in, unsigned short* out_bf16, int ld_out, int vec4) {
  dsv4_pdl_begin();
  __shared__ float cs[2 * ROPE_ROWS_MAX_PAIRS];
  const int nope = head_dim - 2 * half_rope;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  for (int r = blockIdx.x; r < rows; r += gridDim.x) {
    float* row = x + (long long)r * ld;
    __syncthreads();  // the previous row's cos / sin consumed
    if (threadIdx.x < half_rope) {
      float c, s;
      ref_rope_cs(__int2float_rn(pos[r]), inv_freq[threadIdx.x], sign, c, s);
      cs[2 * threadIdx.x] = c;
      cs[2 * threadIdx.x + 1] = s;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < heads * half_rope; i += blockDim.x) {
      const int h = i / half_rope, k = i - h * half_rope;
      float* t = row + (long long)h * head_dim + nope + 2 * k;
      float a = round_in ? round_bf16(t[0]) : t[0], b = round_in ? round_bf16(t[1]) : t[1];
      ref_rope_rotate(a, b, cs[2 * k], cs[2 * k + 1], round_out);
      t[0] = a;
      t[1] = b;
      if (out_bf16) {
        const long long o = (long long)r * ld_out + (long long)h * head_dim + nope + 2 * k;
        *reinterpret_cast<unsigned*>(out_bf16 + o) = (unsigned)f32_to_bf16(a) | ((unsigned)f32_to_bf16(b) << 16);
      }
    }
    if ((round_out || round_in) && nope > 0) {
      for (int h = warp; h < heads; h += nwarps) {
        float* v = row + (long long)h * head_dim;
        unsigned short* ob = out_bf16 ? out_bf16 + (long long)r * ld_out + (long long)h * head_dim : nullptr;
        if (vec4) {
          for (int c = 4 * lane; c < nope; c += 128) {
            float4 w = *(float4*)(v + c);
            w = make_float4(round_bf16(w.x), round_bf16(w.y), round_bf16(w.z), round_bf16(w.w));
            *(float4*)(v + c) = w;
            if (ob) {
              *reinterpret_cast<uint2*>(ob + c) =
                  make_uint2((unsigned)f32_to_bf16(w.x) | ((unsigned)f32_to_bf16(w.y) << 16),
                             (unsigned)f32_to_bf16(w.z) | ((unsigned)f32_to_bf16(w.w) << 16));
            }
          }
        } else {
          for (int c = lane; c < nope; c += 32) {
            v[c] = round_bf16(v[c]);
            if (ob) ob[c] = f32_to_bf16(v[c]);
          }
        }
      }
    }
  }
}
