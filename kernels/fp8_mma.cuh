// fp8_mma.cuh — tensor-core building blocks of the fast kernel set (sm_90a; ../shared/KERNELS.md
// §1-2): the exact FP4 e2m1 -> FP8 e4m3 bit move, the "fragment order" of FP8 activations, wgmma
// (descriptors, fences, waits), ldmatrix, cp.async and the BF16 mma.sync. Include after
// common.cuh. Inline PTX only: NVRTC has no CUDA include
// directory (no cuda_fp8.h).
//
// Why wgmma: on sm_90 `mma.sync` has no FP8 form in hardware (ptxas emulates m16n8k32.e4m3 with F2FP
// conversions and f16 HMMAs); Hopper's FP8 tensor cores are reachable only through wgmma.mma_async.
// tests/gpu_wgmma_probe.rs confirms the fragment, descriptor and accumulator layouts used here.
#pragma once

// ---------------------------------------------------------------------------------------------------------
// FP4 -> FP8 and the fragment order.
//
// A wgmma A fragment (m64 x k32, e4m3, registers) gives thread (g = lane / 4, t = lane % 4) of each warp
// four words: a0 = row g, k 4t .. 4t+3; a1 = row g + 8, same k; a2 = row g, k 16 + 4t ..; a3 = row g + 8,
// k 16 + 4t ... The FP4 bit move of the thread's 8 stored values of a row (physical k 8t .. 8t+7 of a
// 32-block, one ldmatrix word) yields their even and odd elements without byte permutes; they become a0
// and a2. So the k a wgmma sees ("logical" k) is a fixed permutation of the stored k within each 32:
//   logical 4t + i      <- physical 8t + 2i       (i = 0..3)
//   logical 16 + 4t + i <- physical 8t + 2i + 1
// Activations (the B operand) are stored in this fragment order: position 4t + i + 16h of each 32-block
// holds the code of physical k 8t + 2i + h. Any permutation of k within a 32-block leaves the dot product
// unchanged, as long as A and B agree. (The indexer's keys and the fast MoE's decode path use this order;
// its prefill path, fast_moe_wide.cu, the halves order below.)

// Eight packed e2m1 codes (byte i holds element 2i in its low nibble, 2i+1 in its high nibble) -> e4m3
// codes of exactly value · 2^-6: sign bit 3 -> bit 7, the two exponent bits and the mantissa bit -> bits
// 4..2 (the biases differ by 6; the subnormal 0.5 lands on the e4m3 subnormal 2^-7). `even` holds elements
// 0, 2, 4, 6 (one per byte, in order), `odd` elements 1, 3, 5, 7. 7 integer ops; callers fold 2^6 into
// the scale.
DSV4_INLINE void e2m1x8_to_e4m3_eo(unsigned w, unsigned& even, unsigned& odd) {
  even = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
  odd = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}

// PTX prmt in its default mode: bytes of {b, a} picked by the four selector nibbles of sel[15:0] (a
// nibble with bit 3 set replicates the picked byte's sign bit). __byte_perm clears bit 3 of every nibble
// first, one LOP3 per call in the SASS; callers of this one keep it clear themselves.
DSV4_INLINE unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Byte q (0..3) of w, as an integer: one byte permute.
DSV4_INLINE unsigned byte_of(unsigned w, int q) { return prmt(w, 0u, 0x4440u | (unsigned)q); }

// ---------------------------------------------------------------------------------------------------------
// The halves order (the fast MoE's prefill path, kernels/SPEC.md): the same A fragment built from the
// thread's 8 stored values of a row with their order kept, a0 = physical 8t .. 8t+3, a2 = 8t+4 .. 8t+7:
//   logical 4t + i      <- physical 8t + i        (i = 0..3)
//   logical 16 + 4t + i <- physical 8t + 4 + i
// so position 4t + i + 16h of each 32-block holds the code of physical k 8t + 4h + i. Why not the fragment
// order: an FP8 row's 8 bytes are then a0 and a2 as loaded (no byte permutes), and the FP4 decode reads a0's
// four magnitudes straight from the word's low nibbles as a byte-permute selector (e2m1x8_to_e4m3_halves):
// 9 integer ops per 8 values where the even/odd split of the shifted bit move took 12-13 (the prefill GEMMs'
// folded FP4 loop: 200 -> 154 ALU-pipe instructions a stage). In that loop the split's PRMT, LOP3, SHF and
// LEA drew half of the stall samples, mostly waiting for the ALU pipe (ncu). It pays only since the
// producer's copies left the consumers more issue slots (BENCHMARKS.md, issue 11 eighteenth version; before,
// it measured 1-5% slower). (The plain bit move, e2m1x8_to_e4m3_eo, needs no table: the decode path keeps the
// fragment order, where it costs fewer instructions than e2m1x8_to_e4m3_halves.)

// A magnitude table of the e2m1 -> e4m3 decode: byte c (0..7) of {lo, hi} is the e4m3 code (sign clear) of
// e2m1 magnitude code c (0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^(t - 6).
struct Fp4Table {
  unsigned lo, hi;
};

// t = 0, the plain bit move (value · 2^-6, callers fold 2^6 into the scale): code c << 2 (0.5 lands on the
// subnormal 2^-7, code 0x04).
DSV4_INLINE Fp4Table fp4_table_plain() { return {0x0C080400u, 0x1C181410u}; }

// 1 <= t <= 12, the bit move with a power of two folded in (value · 2^(t - 6); 6 · 2^6 = 384 is the largest,
// below e4m3's 448): every nonzero value is then normal, magnitude code c becomes exponent field
// t + (c >> 1) - 1 + [c == 1] with mantissa 4·(c & 1)·[c >= 2], so the table depends on t only through 8t
// added to its nonzero entries. (t = 0 would need code 1 on the subnormal 0x04: the fold keeps t >= 1,
// FMOE_FOLD_SPAN.) Two IMADs.
DSV4_INLINE Fp4Table fp4_table_shifted(unsigned t) {
  return {t * 0x08080800u + 0x0C080000u, t * 0x08080808u + 0x1C181410u};
}

// Eight packed e2m1 codes as stored (element j in nibble j: magnitude bits 4j .. 4j+2, sign bit 4j+3) -> e4m3
// codes in the halves order: a0 byte i = element i, a2 byte i = element 4 + i, magnitudes looked up in `tab`.
// 9 integer ops (LOP3, two shifts, four PRMT, two LOP3 merging the signs), all on the ALU pipe but a shift
// ptxas may give to the FMA pipe (IMAD.SHL). (Both shifts as multiplies, to keep them off the ALU pipe,
// measured 3% slower than as shifts: BENCHMARKS.md, issue 11 seventeenth version.)
// A stored layout with the signs moved (element i's on bit 8i + 7, element 4 + i's on bit 8i + 3) would make this
// 7 ops: timed with wrong signs, it took 0.6 / 3.1 / 2.3% off the prefill layer at 1024 / 2048 / 4096 tokens (H100;
// no decode at all: 2.5 / 7.0 / 7.9%), but it breaks the decode path's bit move (e2m1x8_to_e4m3_eo) and changes
// every FP4 reader's layout, so it is not built (BENCHMARKS.md, issue 11, fiftieth session).
DSV4_INLINE void e2m1x8_to_e4m3_halves(unsigned w, Fp4Table tab, unsigned& a0, unsigned& a2) {
  // A byte permute reads only its selector's low 16 bits, a nibble per output byte, and a nibble with bit 3
  // set would replicate a sign: clear the signs once; the high half, moved down, selects a2's.
  const unsigned sel = w & 0x77777777u;
  const unsigned sel_hi = sel >> 16;
  // Element j's sign (bit 4j + 3) is bit 7 of byte j / 2 of w for odd j, of w << 4 for even j: one byte
  // permute of {w, w << 4} puts each of a0's (a2's) four signs on its byte's bit 7.
  const unsigned w4 = w << 4;
  const unsigned s0 = prmt(w, w4, 0x1504u), s2 = prmt(w, w4, 0x3726u);
  a0 = prmt(tab.lo, tab.hi, sel) | (s0 & 0x80808080u);
  a2 = prmt(tab.lo, tab.hi, sel_hi) | (s2 & 0x80808080u);
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

// ---------------------------------------------------------------------------------------------------------
// Shared memory, ldmatrix, cp.async.

// The shared-space address of a generic pointer into shared memory.
DSV4_INLINE unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 s; cvta.to.shared.u64 s, %1; cvt.u32.u64 %0, s; }" : "=r"(a) : "l"(p));
  return a;
}

// Thread-block clusters: the barrier (every thread of every block arrives once; release / acquire:
// shared-memory writes before the arrive are visible to the cluster after the wait) and distributed
// shared memory (another block's shared memory by its rank). A block must not exit while another may
// still read its shared memory: every block arrives after its last remote read and waits before exit.
DSV4_INLINE void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
DSV4_INLINE void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
DSV4_INLINE void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// Block `rank`'s shared-space address of this block's shared-space address `addr` (smem_addr).
DSV4_INLINE unsigned cluster_map(unsigned addr, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

// The f32 / s32 at a cluster_map address. Volatile: in program order with the barriers; a caller
// that wants several loads in flight issues them all before using any.
DSV4_INLINE float ld_cluster_f32(unsigned remote) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
DSV4_INLINE float4 ld_cluster_f32x4(unsigned remote) {  // (16-byte aligned)
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}
// This block's rank in its cluster, and the cluster's block count (1 without a cluster launch).
DSV4_INLINE unsigned cluster_rank() {
  unsigned r;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
DSV4_INLINE unsigned cluster_blocks() {
  unsigned n;
  asm("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}
DSV4_INLINE int ld_cluster_s32(unsigned remote) {
  int v;
  asm volatile("ld.shared::cluster.s32 %0, [%1];\n" : "=r"(v) : "r"(remote) : "memory");
  return v;
}

// 8 bytes at shared-space address `addr` (smem_addr).
DSV4_INLINE uint2 lds_u64(unsigned addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

// Four 8x8 b16 matrices (8 rows of 16 bytes each); lane L gives the address of row L % 8 of matrix L / 8
// and receives word m = bytes 4·(lane % 4) .. + 3 of row lane / 4 of matrix m.
// `addr`: a shared-space address (smem_addr).
DSV4_INLINE void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same four matrices transposed: lane L receives the words of column lane / 4 (two rows each):
// the B fragment of a k x n operand stored n-fastest (rows = k).
DSV4_INLINE void ldmatrix_x4_trans(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Stores four 8x8 b16 matrices transposed (ldmatrix_x4_trans's inverse): word m of lane L holds row L / 4,
// columns 2·(L % 4) and + 1 of matrix m (an mma accumulator fragment's layout, low half first); lane L
// gives the address of stored row L % 8 of matrix L / 8, which receives that matrix's column L % 8 (16
// bytes). `addr`: a shared-space address (smem_addr), 16-byte aligned.
DSV4_INLINE void stmatrix_x4_trans(unsigned addr, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// ---------------------------------------------------------------------------------------------------------
// BF16 mma.sync (the sparse attention and the indexer: operands decoded exactly to BF16).

// d += a (16x16 bf16, row) * b (16x8 bf16, col), f32 accumulators.
DSV4_INLINE void mma_bf16_16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 16-byte asynchronous global -> shared copy (L2 only: streamed data bypasses L1) to the shared-space
// address `dst` (smem_addr).
DSV4_INLINE void cp_async_16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}

// cp_async_16 when `copy`, else nothing: a predicated copy, no branch (the address need not be valid when
// not copying).
DSV4_INLINE void cp_async_16_if(unsigned dst, const void* src, bool copy) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %2, 0;\n"
      "@p cp.async.cg.shared.global [%0], [%1], 16; }\n" ::"r"(dst),
      "l"(src), "r"((int)copy));
}

// Sixteen zero bytes at shared-space address `dst` (16-byte aligned).
DSV4_INLINE void st_shared_zero16(unsigned dst) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0) : "memory");
}

// 4-byte asynchronous copy (through L1).
DSV4_INLINE void cp_async_4(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}

// cp_async_4 when `copy`, else nothing (cp_async_16_if).
DSV4_INLINE void cp_async_4_if(unsigned dst, const void* src, bool copy) {
  asm volatile(
      "{ .reg .pred p; setp.ne.b32 p, %2, 0;\n"
      "@p cp.async.ca.shared.global [%0], [%1], 4; }\n" ::"r"(dst),
      "l"(src), "r"((int)copy));
}

DSV4_INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
DSV4_INLINE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Makes this thread's generic-proxy shared-memory writes (stores, cp.async) visible to the async proxy
// (wgmma operand reads); a barrier then publishes them to the other threads.
DSV4_INLINE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// ---------------------------------------------------------------------------------------------------------
// mbarriers and TMA (a producer warp fills a ring of shared-memory slots that consumer warpgroups read).

// mbarrier at shared-space address `bar` expecting `count` arrivals per phase.
DSV4_INLINE void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the mbarrier initialisations visible to the async proxy (TMA completes transactions on them).
DSV4_INLINE void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }

// One arrival.
DSV4_INLINE void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Announces `bytes` more bytes of asynchronous transactions this phase, without an arrival: copies issued before
// the phase's arrivals (its tx-count may go below zero meanwhile; the phase completes only with its arrivals).
DSV4_INLINE void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One arrival that also announces `bytes` more bytes of asynchronous transactions (TMA) this phase.
DSV4_INLINE void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// One arrival, made when this thread's earlier cp.async copies have landed (.noinc: the barrier's
// expected count already includes it).
DSV4_INLINE void cp_async_mbar_arrive(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// One arrival on the mbarrier at this block's shared address `bar` in block `rank` of the cluster, released at
// cluster scope (this thread's earlier shared-memory reads come before what the arrival lets another block do).
// The cluster scope costs a MEMBAR.ALL.GPU before the arrival in the SASS (ptxas 13.0), which waits for the
// thread's memory traffic to reach the GPU: as the release of a ring slot another block refills, once a stage,
// it made a pair of fast_moe_wide blocks 64% slower (fifty-third session); a slot whose reads were the warp's
// completed wgmmas needs only the block's scope (mbarrier.arrive.shared::cluster, as CUTLASS's cluster barrier
// arrives). fast_fp8_gemm's pair kernel (not the fast set's GEMM) still takes this form.
DSV4_INLINE void mbar_arrive_cluster(unsigned bar, unsigned rank) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(cluster_map(bar, rank))
               : "memory");
}

// Waits until the phase of parity `parity` has completed (a fresh barrier counts parity 1 as complete).
// CLUSTER: acquire at cluster scope, for a barrier other blocks of the cluster arrive on (mbar_arrive_cluster).
template <bool CLUSTER = false>
DSV4_INLINE void mbar_wait(unsigned bar, unsigned parity) {
  if constexpr (CLUSTER)
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
  else
    asm volatile(
        "{ .reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// Asks the SM's L1 for the line holding p (global memory) without waiting and without a register: a hint for a
// load that another thread of the block makes later (fast_moe_wide.cu fmw_prefetch_tile, fmw_prefetch_rows).
DSV4_INLINE void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p)); }

// Waits for all of this thread's cp.async copies.
DSV4_INLINE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// TMA: the box at element coordinates (x, y) of the 2-D tensor map at generic address `map` (global
// memory, 64-byte aligned) into shared-space address `dst`; completes its bytes on mbarrier `bar`.
DSV4_INLINE void tma_load_2d(unsigned dst, const void* map, int x, int y, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// tma_load_2d into the same shared-space address of every block of the cluster in `mask`, completing its bytes on
// each one's mbarrier at `bar`.
DSV4_INLINE void tma_load_2d_multicast(unsigned dst, const void* map, int x, int y, unsigned bar,
                                       unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(x), "r"(y), "r"(bar), "h"(mask)
      : "memory");
}

// 1-D bulk copy (TMA without a tensor map) of `bytes` (a multiple of 16) from global `src` (16-byte aligned)
// to shared-space address `dst`; completes its bytes on mbarrier `bar`.
DSV4_INLINE void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads (a multiple of 32).
DSV4_INLINE void named_barrier(unsigned id, unsigned threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---------------------------------------------------------------------------------------------------------
// wgmma.

// Matrix descriptor of a shared-memory operand, K-major without swizzle (PTX ISA "matrix descriptor"):
// start address >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4 in 32-45, base offset 0, swizzle mode 0.
// The operand is made of core matrices of 8 rows x 16 bytes (128 contiguous bytes); `lbo` is the step
// between the two 16-byte halves of a k32 e4m3 row, `sbo` the step between groups of 8 rows.
// The general form: `swizzle` is the descriptor's mode (0 none, 1 128-byte, 2 64-byte, 3 32-byte).
DSV4_INLINE unsigned long long wgmma_desc(const void* smem, unsigned lbo, unsigned sbo, unsigned swizzle) {
  const unsigned long long a = smem_addr(smem);
  return ((a & 0x3FFFFull) >> 4) | ((unsigned long long)((lbo & 0x3FFFFu) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFFu) >> 4) << 32) | ((unsigned long long)swizzle << 62);
}
DSV4_INLINE unsigned long long wgmma_desc_noswizzle(const void* smem, unsigned lbo, unsigned sbo) {
  return wgmma_desc(smem, lbo, sbo, 0);
}

// Matrix descriptor of a K-major shared-memory operand of rows of 128 bytes in the 128-byte swizzle (16-byte
// chunk c of row r at c ^ (r % 8), as TMA's SWIZZLE_128B writes it), from its first row, 1024-byte aligned:
// groups of 8 rows 1024 bytes apart in SBO, LBO unused (1), base offset 0, swizzle mode 1 in bits 62-63.
// k32 step q of e4m3 starts 32 bytes on along the rows: add 2q to the descriptor (the hardware swizzles the
// addresses it forms; shared addresses stay below 256 KiB, so the address field cannot carry).
DSV4_INLINE unsigned long long wgmma_desc_sw128(const void* smem) {
  const unsigned long long a = smem_addr(smem);
  return ((a & 0x3FFFFull) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// The "+f" operands d[o] .. d[o + 7] of a wgmma's accumulator list (an asm operand list has to name each
// register; a wgmma of N tokens takes N / 2 of them, so its list is N / 16 of these).
#define WGMMA_ACC8(d, o)                                                                                  \
  "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), \
      "+f"(d[o + 7])

// Required before a wgmma whose accumulator or A registers other instructions wrote.
DSV4_INLINE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

DSV4_INLINE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most N of the warpgroup's committed wgmma groups are pending.
template <int N>
DSV4_INLINE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Pins accumulator registers at this point of the program: the compiler cannot see that a wgmma writes
// them asynchronously, so reads after wgmma_wait must not be hoisted above it (CUTLASS's
// warpgroup_fence_operand).
template <int N>
DSV4_INLINE void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for fragments kept as [R][4] (an m16n8 tile's four values a row of the array).
template <int R>
DSV4_INLINE void wgmma_fence_operand(float (&d)[R][4]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])::"memory");
}
