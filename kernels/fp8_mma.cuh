// fp8_mma.cuh — tensor-core building blocks of the fast kernel set (sm_90a; ../shared/KERNELS.md
// §1-2): the exact FP4 e2m1 -> FP8 e4m3 bit move, e4m3 -> f16 conversion, the f16 m16n8k16 MMA with f32
// accumulators, and cp.async. Inline PTX only: NVRTC has no CUDA include directory (no cuda_fp8.h).
//
// Why f16 MMAs: on sm_90 `mma.sync` has no FP8 form in hardware; ptxas emulates m16n8k32.e4m3 by
// converting both operands to f16 (F2FP) and issuing two HMMA.16816 (seen in the SASS), so converting
// once ourselves is cheaper. Hopper's FP8 tensor cores are reachable only through wgmma. e4m3 values are
// exact in f16, so an f16 MMA of e4m3 values with f32 accumulators is exact products summed in f32.
#pragma once

// The "MMA order" of 8 consecutive k: [0, 2, 4, 6, 1, 3, 5, 7]. A thread's FP4 word (8 codes, byte i =
// elements 2i, 2i+1) decodes into e4m3 words of the even and of the odd elements without byte permutes
// (e2m1x8_to_e4m3_eo), and activations are stored in this order as f16, so one 16-byte load gives the
// matching B fragments of two chained m16n8k16 MMAs (first the even elements, then the odd ones).

// Eight packed e2m1 codes (byte i holds element 2i in its low nibble, 2i+1 in its high nibble) -> e4m3
// codes of exactly value · 2^-6: sign bit 3 -> bit 7, the two exponent bits and the mantissa bit -> bits
// 4..2 (the biases differ by 6; the subnormal 0.5 lands on the e4m3 subnormal 2^-7). `even` holds elements
// 0, 2, 4, 6 (one per byte, in order), `odd` elements 1, 3, 5, 7. 7 integer ops; callers fold 2^6 into
// the scale.
DSV4_INLINE void e2m1x8_to_e4m3_eo(unsigned w, unsigned& even, unsigned& odd) {
  even = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
  odd = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}

// Four e4m3 codes (byte i) -> two f16x2 words: lo = (byte 0, byte 1), hi = (byte 2, byte 3), each with the
// first value in the low half. Exact.
DSV4_INLINE void e4m3x4_to_f16x4(unsigned w, unsigned& lo, unsigned& hi) {
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// d = a · b over k = 16 (+ c when `accumulate`), f16 operands, f32 accumulators. Fragments: thread
// (g = lane / 4, t = lane % 4) holds a0 = row g, k slots 2t, 2t+1 (f16x2); a1 = row g+8, same k; a2 = row
// g, k 2t+8, 2t+9; a3 = row g+8, k 2t+8..; b0 = column g, k 2t, 2t+1; b1 = column g, k 2t+8..; d0, d1 =
// row g, columns 2t, 2t+1; d2, d3 = row g+8 (PTX ISA, mma.m16n8k16).
DSV4_INLINE void mma_f16_m16n8k16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                  unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

DSV4_INLINE void mma_f16_m16n8k16_zero(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                       unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(0.0f));
}

// The shared-space address of a generic pointer into shared memory.
DSV4_INLINE unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
  return a;
}

// 16-byte asynchronous global -> shared copy (L2 only: streamed data bypasses L1).
DSV4_INLINE void cp_async_16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}

DSV4_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
DSV4_INLINE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

DSV4_INLINE unsigned lds_u32(const unsigned char* p) { return *reinterpret_cast<const unsigned*>(p); }

DSV4_INLINE uint2 lds_u64(const unsigned char* p) { return *reinterpret_cast<const uint2*>(p); }

// Two e4m3 codes (low byte first) -> their f16x2 (exact).
DSV4_INLINE unsigned e4m3x2_to_f16x2(unsigned codes) {
  unsigned r;
  asm("{ .reg .b16 l; cvt.u16.u32 l, %1; cvt.rn.f16x2.e4m3x2 %0, l; }" : "=r"(r) : "r"(codes));
  return r;
}

// Eight e4m3 codes of consecutive k (c[0] first) as f16 in MMA order: one 16-byte store.
DSV4_INLINE uint4 e4m3x8_to_f16_mma_order(const unsigned (&c)[8]) {
  return make_uint4(e4m3x2_to_f16x2(c[0] | (c[2] << 8)), e4m3x2_to_f16x2(c[4] | (c[6] << 8)),
                    e4m3x2_to_f16x2(c[1] | (c[3] << 8)), e4m3x2_to_f16x2(c[5] | (c[7] << 8)));
}

// The e4m3fn code of x rounded to nearest, ties to even, for |x| <= 448 (callers clamp first); NaN -> 0x7f,
// -0 keeps its sign bit. The same code as common.cuh's e4m3_encode, by integer rounding of the f32 bits.
DSV4_INLINE unsigned e4m3_code_rn(float x) {
  const float a = fabsf(x);
  if (a != a) return 0x7fu;
  const unsigned sign = (__float_as_uint(x) >> 24) & 0x80u;
  unsigned code;
  if (a < 0.015625f) {  // below 2^-6: code m for m · 2^-9 (m = 8 is the smallest normal)
    code = (unsigned)__float2int_rn(a * 512.0f);
  } else {
    const unsigned b = __float_as_uint(a);
    code = ((b + 0x7ffffu + ((b >> 20) & 1u)) >> 20) - (120u << 3);  // 3 mantissa bits, ties to even
  }
  return sign | code;
}
