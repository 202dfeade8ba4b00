// fast_moe_common.cuh — what both expert-GEMM families of the fast set share (fast_moe_gemm.cu, the decode
// path; fast_moe_wide.cu, the prefill path): the UE8M0 scale table's layout, the SwiGLU value of h and its
// per-128 FP8 codes. kernels/SPEC.md ## fast_moe_gemm.cu.
#pragma once

// Rust's f32::clamp(v, -l, l): NaN stays NaN.
DSV4_INLINE float fmoe_clamp_sym(float v, float l) { return v < -l ? -l : (v > l ? l : v); }

// h = bf16(silu(min(g, L)) · clamp(u, ±L) · w) from the bf16-rounded gate g and up u, given `silu_g`, the
// SiLU of the clamped gate (fmoe_gate); `routed`: times the routing weight w (the shared expert's h is not
// weighted). The hardware rounding: round_bf16's value except for a NaN's payload, and a NaN h of any
// payload gives the same code (e4m3x2_code_hw) and is skipped by the amax (fmaxf).
DSV4_INLINE float fmoe_gate(float g, float limit) { return limit > 0.0f ? fminf(g, limit) : g; }
DSV4_INLINE float fmoe_h_round(float silu_g, float u, float w, float limit, bool routed) {
  if (limit > 0.0f) u = fmoe_clamp_sym(u, limit);
  float h = silu_g * u;
  if (routed) h = h * w;
  return round_bf16_nonnan(h);
}

// h of one (g, u) pair (`limit` <= 0: no clamp), SiLU by silu_div_rn: fmoe_h_round(silu_div_rn(fmoe_gate(g,
// limit)), u, w, limit, routed), spelled out as it was so that the decode kernels compile to the SASS measured
// there (the composed form schedules differently).
DSV4_INLINE float fmoe_h_value(float g, float u, float w, float limit, bool routed) {
  if (limit > 0.0f) {
    g = fminf(g, limit);
    u = fmoe_clamp_sym(u, limit);
  }
  float h = silu_div_rn(g) * u;
  if (routed) h = h * w;
  return round_bf16_nonnan(h);
}

// h of 8 (g, u) pairs, fmoe_h_value's bits. The SiLUs by silu_newton, the same bits as silu_div_rn: the
// 8 values' instructions interleave (the up epilogue's h loop was a chain of dependent latencies, one value
// at a time); the rare group with a gate out of silu_newton's range is redone with silu_div_rn.
DSV4_INLINE void fmoe_h_values8(const float (&g)[8], const float (&u)[8], float w, float limit, bool routed,
                                float (&h)[8]) {
  bool ok = true;
#pragma unroll
  for (int c = 0; c < 8; ++c) h[c] = fmoe_h_round(silu_newton(fmoe_gate(g[c], limit), ok), u[c], w, limit, routed);
  if (!ok) {
#pragma unroll
    for (int c = 0; c < 8; ++c) h[c] = fmoe_h_value(g[c], u[c], w, limit, routed);
  }
}

// act_quant's scale of a 128-block of h whose largest |h| is `amax`.
DSV4_INLINE float fmoe_h_scale(float amax) { return ue8m0_scale(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX); }

// 1 / s for an act_quant scale s (a power of two, fmoe_h_scale): exact, so h / s is exactly h · (1 / s), one
// correctly rounded multiply instead of a division.
DSV4_INLINE float fmoe_h_inv(float s) { return 1.0f / s; }

// The e4m3 codes of 8 consecutive physical k of h (hv[c]: k 8·t8 + c) times inv = fmoe_h_inv(s), as the two
// words a 32-block holds them in (fp8_mma.cuh), .x at block + 4·t8 and .y at block + 16 + 4·t8, byte order:
// HALVES (the prefill path's halves order) .x elements 0..3, .y 4..7; else (the decode path's fragment order)
// .x the even elements 0, 2, 4, 6, .y the odd ones. The hardware conversion, two codes an instruction: it
// saturates at ±448 as act_quant's clamp does (smoke_roundtrip checks it against e4m3_encode on every bf16
// pattern).
template <bool HALVES>
DSV4_INLINE uint2 fmoe_h_words8(const float (&hv)[8], float inv) {
  const int o = HALVES ? 4 : 1, step = HALVES ? 1 : 2;  // .y's first element; elements a word apart
  uint2 w;
  w.x = e4m3x2_code_hw(hv[0] * inv, hv[step] * inv) | (e4m3x2_code_hw(hv[2 * step] * inv, hv[3 * step] * inv) << 16);
  w.y = e4m3x2_code_hw(hv[o] * inv, hv[o + step] * inv) |
        (e4m3x2_code_hw(hv[o + 2 * step] * inv, hv[o + 3 * step] * inv) << 16);
  return w;
}

// Stores fmoe_h_words8's words at their positions in a 32-block.
DSV4_INLINE void fmoe_store_h_words(unsigned char* block, int t8, uint2 w) {
  *reinterpret_cast<unsigned*>(block + 4 * t8) = w.x;
  *reinterpret_cast<unsigned*>(block + 16 + 4 * t8) = w.y;
}

// FP8 weights in a stage: rows of 128 bytes in the 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)).
// Thread (g, t)'s address at k32 step 0 in its row g (`row`: the row's shared address): bytes 8t .. 8t + 7,
// chunk t >> 1, half t & 1.
DSV4_INLINE unsigned fmoe_fp8_a_addr(unsigned row, int g, int t) {
  return row | ((unsigned)((t >> 1) ^ g) << 4) | (8u * (t & 1));
}

// The thread's A fragment of k32 step q from its address `la` (fmoe_fp8_a_addr): row g + 8 is 8 rows (1024
// bytes) on, and step q's 32 bytes are chunks 2q, 2q + 1 of the row: the swizzle XORs the chunk index, so
// step q XORs the address by q << 5. The row's bytes 8t .. 8t + 7 are a0 then a2 as loaded in the halves
// order (HALVES, fp8_mma.cuh); the fragment order takes their even and odd bytes (two byte permutes a word).
template <bool HALVES>
DSV4_INLINE void fmoe_fp8_a_frag(unsigned la, int q, unsigned (&a)[4]) {
  const uint2 u0 = lds_u64(la ^ (unsigned)(q << 5));
  const uint2 u8 = lds_u64((la + 1024u) ^ (unsigned)(q << 5));
  if (HALVES) {
    a[0] = u0.x, a[2] = u0.y;
    a[1] = u8.x, a[3] = u8.y;
  } else {
    a[0] = __byte_perm(u0.x, u0.y, 0x6420);
    a[2] = __byte_perm(u0.x, u0.y, 0x7531);
    a[1] = __byte_perm(u8.x, u8.y, 0x6420);
    a[3] = __byte_perm(u8.x, u8.y, 0x7531);
  }
}

// The per-32 scales of 128-block b of an FP4 stage for stage rows r (s0) and r + 8 (s8), from the slot's
// scales at `sc` (both families lay them out as 8 per row): UE8M0 bytes when `byte_scales` (byte e is
// 2^(e - 127), the f32 with exponent field e; the table holds only 1 <= e <= 254), else f32.
DSV4_INLINE void fmoe_fp4_scales(const float* sc, int r, int b, bool byte_scales, float (&s0)[4], float (&s8)[4]) {
  if (byte_scales) {
    const unsigned char* sb = reinterpret_cast<const unsigned char*>(sc);
    const unsigned w0 = *reinterpret_cast<const unsigned*>(sb + r * 8 + 4 * b);
    const unsigned w8 = *reinterpret_cast<const unsigned*>(sb + (r + 8) * 8 + 4 * b);
    s0[0] = __uint_as_float((w0 << 23) & 0x7f800000u), s8[0] = __uint_as_float((w8 << 23) & 0x7f800000u);
    s0[1] = __uint_as_float((w0 << 15) & 0x7f800000u), s8[1] = __uint_as_float((w8 << 15) & 0x7f800000u);
    s0[2] = __uint_as_float((w0 << 7) & 0x7f800000u), s8[2] = __uint_as_float((w8 << 7) & 0x7f800000u);
    s0[3] = __uint_as_float((w0 >> 1) & 0x7f800000u), s8[3] = __uint_as_float((w8 >> 1) & 0x7f800000u);
  } else {
    const float4 v0 = *reinterpret_cast<const float4*>(sc + r * 8 + 4 * b);
    const float4 v8 = *reinterpret_cast<const float4*>(sc + (r + 8) * 8 + 4 * b);
    s0[0] = v0.x, s0[1] = v0.y, s0[2] = v0.z, s0[3] = v0.w;
    s8[0] = v8.x, s8[1] = v8.y, s8[2] = v8.z, s8[3] = v8.w;
  }
}

// The producer/consumer ring's mbarriers (both families): at shared address `bars`, full[s] then empty[s],
// 8 bytes each. full[s] completes when the producer's first thread has arrived with the stage's TMA bytes and
// the copies each of the `producer_threads` threads issued by cp.async have landed; empty[s] when every
// consumer warp has released the slot.
DSV4_INLINE unsigned fmoe_ring_full(unsigned bars, int s) { return bars + 8 * s; }
DSV4_INLINE unsigned fmoe_ring_empty(unsigned bars, int stages, int s) { return bars + 8 * (stages + s); }
// The next ring position (slot and phase) of a ring of `stages` slots: the producer and the consumers each walk
// the ring in the same order.
DSV4_INLINE void fmoe_ring_advance(int& slot, unsigned& phase, int stages) {
  if (++slot == stages) {
    slot = 0;
    phase ^= 1;
  }
}

DSV4_INLINE void fmoe_ring_init(unsigned bars, int stages, int consumer_warps, int producer_threads) {
  for (int s = 0; s < stages; ++s) {
    mbar_init(fmoe_ring_full(bars, s), 1 + producer_threads);
    mbar_init(fmoe_ring_empty(bars, stages, s), consumer_warps);
  }
  fence_mbar_init();
}

// Stages of an item: FP4 256 k each (the last one 128 when K % 256 == 128), FP8 128 k each. A stage is
// 128 bytes of each weight row.
DSV4_INLINE int fmoe_stages(bool fp4, int K) { return fp4 ? (K + 255) / 256 : K / 128; }

// 128-blocks of K in stage kb.
DSV4_INLINE int fmoe_stage_blocks(bool fp4, int K, int kb) { return fp4 ? min(2, K / 128 - 2 * kb) : 1; }

// The UE8M0 scale table's layout (fmoe_scales8_kernel, fmoe_rows8_kernel): after a header of
// FMOE_SC8_HEADER bytes, per expert (the local ones, then the shared expert; a stride of fmoe_sc8_expert):
// - the blocks: the matrices w1 [I][D], w3 [I][D], w2 [D][I]; per matrix of R rows and K columns, per
//   128-row block rb and stage kb (256 k) 1 KiB: row rb·128 + r's 8 scales of k 256·kb .. at 8·r (those
//   past K read 127, i.e. 1.0);
// - the rows' largest exponents: one byte per row of w1, w3, then w2 (fmoe_sc8_rows);
// - per 128-row block of w1, w3, then w2, 1 when every row of the block has its exponents within
//   FMOE_FOLD_SPAN of its largest, else 0 (fmoe_sc8_row_flags): then the prefill GEMMs fold the
//   scales of the whole row into the codes, and the row's factor leaves the promotion.
// The header's ints: [0] 1 when every scale is exact (FMOE_SC8_EXACT), [1] 1 when moreover the four
// scales of every 128-block of a row are within 2^FMOE_FOLD_SPAN of each other (FMOE_SC8_FOLDABLE:
// fast_moe_wide.cu folds them into the e4m3 codes, the largest as value · 2^(FMOE_FOLD_TOP - 6), the
// others shifted down by their distance to it: fp4_table_shifted takes shifts 1 .. 12).
#define FMOE_SC8_HEADER 256
#define FMOE_SC8_EXACT 0
#define FMOE_SC8_FOLDABLE 1
#define FMOE_FOLD_SPAN 11
#define FMOE_FOLD_TOP 12
DSV4_INLINE long long fmoe_sc8_matrix(int R, int K) { return (long long)(R / 128) * fmoe_stages(true, K) * 1024; }
DSV4_INLINE long long fmoe_sc8_blocks(int D, int I) { return 2 * fmoe_sc8_matrix(I, D) + fmoe_sc8_matrix(D, I); }
// Matrix m's (0 w1, 1 w3, 2 w2) row exponents and block flags, from the expert's start.
DSV4_INLINE long long fmoe_sc8_rows(int D, int I, int m) { return fmoe_sc8_blocks(D, I) + (long long)m * I; }
DSV4_INLINE long long fmoe_sc8_row_flags(int D, int I, int m) {
  return fmoe_sc8_blocks(D, I) + 2LL * I + D + (long long)m * (I / 128);
}
DSV4_INLINE long long fmoe_sc8_expert(int D, int I) {
  return (fmoe_sc8_row_flags(D, I, 2) + D / 128 + 255) / 256 * 256;  // 256-aligned: bulk copies need 16
}

// The data of a UE8M0 scale table whose header says every scale is exact, else NULL.
DSV4_INLINE const unsigned char* fmoe_sc8_data(const unsigned char* table) {
  return table != nullptr && reinterpret_cast<const int*>(table)[FMOE_SC8_EXACT] != 0 ? table + FMOE_SC8_HEADER
                                                                                      : nullptr;
}

// Whether a table's scales can be folded (see above); false without a table.
DSV4_INLINE bool fmoe_sc8_foldable(const unsigned char* table) {
  return fmoe_sc8_data(table) != nullptr && reinterpret_cast<const int*>(table)[FMOE_SC8_FOLDABLE] != 0;
}

// The expert GEMMs' common arguments: both families' up and down kernels take the same parameters
// (FastMoeGemm launches either with one argument list) and turn them into this with fmoe_args.
struct FmoeArgs {
  const unsigned char* act;  // [rows][K] e4m3 codes in the family's order (fp8_mma.cuh)
  const float* act_s;        // [rows][K/128]
  int T, K, N, k;
  const int* rows;
  const int* tiles;
  int nrt;  // routed tiles (*ntiles)
  int e_begin, e_end;
  const unsigned char* maps;  // [e_end - e_begin + 1][FMOE_MAPS_PER_EXPERT] tensor maps, the shared expert last
  const unsigned long long *sa, *sb;  // FP8 block scale addresses of the local experts (up: W1, W3; down: W2)
  int fmt;
  int shared_fmt;  // 0: no shared expert
  const float *shared_sa, *shared_sb;
  // The layer's UE8M0 scale table's data when every scale in it is exact (fmoe_sc8_data), else NULL: the
  // FP4 scales are then read as f32 through the tensor maps.
  const unsigned char* sc8;
  bool fold;  // and its 128-blocks can be folded into the codes (fmoe_sc8_foldable; the prefill path's)
  int D, I;   // the layer's hidden and expert widths (the table's layout)
};

// The arguments of a GEMM of K columns and N weight rows: up K = D, N = I; down K = I, N = D. `table` is the
// layer's whole UE8M0 scale table (or NULL). ntiles NULL: the plan is not made yet (fmoe_route_experts_kernel,
// whose items do not read nrt).
DSV4_INLINE FmoeArgs fmoe_args(const unsigned char* act, const float* act_s, int T, int K, int N, int k,
                               const int* rows, const int* tiles, const int* ntiles, int e_begin, int e_end,
                               const unsigned char* maps, const unsigned long long* sa,
                               const unsigned long long* sb, int fmt, int shared_fmt, const float* shared_sa,
                               const float* shared_sb, const unsigned char* table, int D, int I) {
  return {act,        act_s,     T,         K,          N,    k,   rows,        tiles,
          ntiles != nullptr ? *ntiles : 0, e_begin,   e_end,     maps,       sa,   sb,  fmt,         shared_fmt,
          shared_sa,  shared_sb, fmoe_sc8_data(table), fmoe_sc8_foldable(table), D, I};
}

// A kernel family's trace log (the bench's `--trace`, src/bin/dsv4/moe_trace.rs): an event is two u64,
// %globaltimer (ns) then block << 48 | SM << 40 | kind << 32 | arg; *n counts the events, and those at or past
// `cap` are dropped. The host zeroes the log before the traced launch and reads the nonzero times. The families'
// FMOE_TRACE / FMW_TRACE builds log; their default builds never do.
DSV4_INLINE unsigned long long moe_trace_now(int arg) {
  unsigned long long t;
  // (arg an input of the timer's read: an arg made from loaded values is complete before the time is taken.)
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t) : "r"(arg));
  return t;
}
DSV4_INLINE void moe_trace_store(unsigned long long* log, unsigned cap, unsigned slot, unsigned long long t, int kind,
                                 int arg) {
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
  if (slot < cap) {
    log[2 * slot] = t;
    log[2 * slot + 1] = ((unsigned long long)(blockIdx.x & 0xffff) << 48) | ((unsigned long long)(sm & 0xff) << 40) |
                        ((unsigned long long)(kind & 0xff) << 32) | (unsigned)arg;
  }
}

// An event at the log's next free index (*n's old value): the thread waits for the atomic's round trip, ~0.5 µs
// under a GEMM's load, which the next interval it times then holds. FMOE_TRACE's events (per stage and warp) log
// so; where the caller knows each event's slot in advance, moe_trace_event_at does not wait.
DSV4_INLINE void moe_trace_event(unsigned* n, unsigned long long* log, unsigned cap, int kind, int arg) {
  const unsigned long long t = moe_trace_now(arg);
  moe_trace_store(log, cap, atomicAdd(n, 1u), t, kind, arg);
}

// An event at index `slot`, chosen by the caller; *n still counts it, by a reduction whose result the thread does
// not wait for. t: its time where the caller took it earlier (moe_trace_now), else 0 (now).
DSV4_INLINE void moe_trace_event_at(unsigned* n, unsigned long long* log, unsigned cap, unsigned slot, int kind,
                                    int arg, unsigned long long t = 0) {
  if (t == 0) t = moe_trace_now(arg);
  atomicAdd(n, 1u);
  moe_trace_store(log, cap, slot, t, kind, arg);
}
