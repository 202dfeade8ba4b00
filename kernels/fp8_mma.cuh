// fp8_mma.cuh — tensor-core building blocks of the fast kernel set (sm_90a; ../shared/KERNELS.md
// §1-2): the FP8 m16n8k32 MMA, the exact FP4 e2m1 -> FP8 e4m3 bit move, and cp.async. Inline PTX
// only: NVRTC has no CUDA include directory (no cuda_fp8.h, no cuda/pipeline).
#pragma once

// d += a · b over k = 32: a is 16 x 32 e4m3 (row-major fragments a0..a3), b is 32 x 8 e4m3 (b0, b1),
// d is 16 x 8 f32. Thread (g = lane / 4, t = lane % 4) holds: a0 row g, k slots 4t..4t+3; a1 row g+8,
// same k; a2 row g, k slots 16+4t..; a3 row g+8, 16+4t..; b0 column g, k slots 4t..4t+3; b1 column g,
// 16+4t..; d0, d1 row g, columns 2t, 2t+1; d2, d3 row g+8 (PTX ISA, mma.m16n8k32 for 8-bit types).
// The MMA's internal accumulation keeps fewer bits than f32 (KERNELS.md §1), so callers start every
// k32 product from zero and promote it into f32 registers themselves.
DSV4_INLINE void mma_e4m3_m16n8k32(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Eight packed e2m1 codes (byte i holds element 2i in its low nibble, 2i+1 in its high nibble) ->
// eight e4m3 codes of exactly value · 2^-6: sign bit 3 -> bit 7, the two exponent bits and the
// mantissa bit -> bits 4..2 (the biases differ by 6; the subnormal 0.5 lands on the e4m3 subnormal
// 2^-7). `lo` holds elements 0..3, `hi` elements 4..7, one per byte in order. Callers fold 2^6 into
// the scale.
DSV4_INLINE void e2m1x8_to_e4m3(unsigned w, unsigned& lo, unsigned& hi) {
  const unsigned ev = w & 0x0F0F0F0Fu;         // elements 0, 2, 4, 6
  const unsigned od = (w >> 4) & 0x0F0F0F0Fu;  // elements 1, 3, 5, 7
  const unsigned e8 = ((ev & 0x08080808u) << 4) | ((ev & 0x07070707u) << 2);
  const unsigned o8 = ((od & 0x08080808u) << 4) | ((od & 0x07070707u) << 2);
  lo = __byte_perm(e8, o8, 0x5140);
  hi = __byte_perm(e8, o8, 0x7362);
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
