// kv_pages.cuh — the device layout of the KV state: rows in f32 (exact numerics) or in the
// official precision's codes, in pages of KV_PAGE rows reached through a per-slot block table.
// src/cuda/kv_pages.rs owns the layout (its module doc says why it is lossless); the sizes here
// are the same formulas. Included by every kernel that reads or writes the state (attention,
// compressor, indexer and their fast versions).
//
// KV_PAGE, KV_FP8_BLOCK, KV_FP4_BLOCK, KV_ROW_ALIGN, KV_SCALE_ALIGN: dsv4_consts.cuh.
#pragma once
#include "common.cuh"

// One kind of row: a KV vector (`nope` e4m3 channels with a UE8M0 scale per KV_FP8_BLOCK, then
// BF16 RoPE channels) or an indexer key (e2m1 nibbles, low nibble = even channel, a UE8M0 scale
// per KV_FP4_BLOCK); `packed` = 0 stores dim f32 values instead.
struct KvRowFmt {
  int dim, nope, index, packed;
  int row_bytes, scale_bytes;
};

DSV4_INLINE int kv_round_up(int v, int m) { return (v + m - 1) / m * m; }

// kv_pages.rs KvRows::kv / index_keys with row_bytes and scale_bytes.
DSV4_INLINE KvRowFmt kv_fmt_kv(int dim, int nope, int official) {
  KvRowFmt f;
  f.dim = dim;
  f.nope = nope;
  f.index = 0;
  f.packed = official;
  f.row_bytes = kv_round_up(official ? nope + 2 * (dim - nope) : dim * 4, KV_ROW_ALIGN);
  f.scale_bytes = official ? kv_round_up((nope + KV_FP8_BLOCK - 1) / KV_FP8_BLOCK, KV_SCALE_ALIGN) : 0;
  return f;
}

DSV4_INLINE KvRowFmt kv_fmt_index(int dim, int official) {
  KvRowFmt f;
  f.dim = dim;
  f.nope = dim;
  f.index = 1;
  f.packed = official;
  f.row_bytes = kv_round_up(official ? (dim + 1) / 2 : dim * 4, KV_ROW_ALIGN);
  f.scale_bytes = official ? kv_round_up((dim + KV_FP4_BLOCK - 1) / KV_FP4_BLOCK, KV_SCALE_ALIGN) : 0;
  return f;
}

DSV4_INLINE long long kv_page_bytes(const KvRowFmt& f) {
  return (long long)KV_PAGE * (f.row_bytes + f.scale_bytes);
}

// Pages per slot of a window ring of W rows (no block table: slot s owns the next ones).
DSV4_INLINE int kv_ring_pages(int W) { return (W + KV_PAGE - 1) / KV_PAGE; }

// Row e of `slot` in a paged buffer: its value bytes and its scale record.
struct KvRowPtr {
  unsigned char* row;
  unsigned char* sc;
};

DSV4_INLINE KvRowPtr kv_row(const KvRowFmt& f, const unsigned char* pool, const int* table, int pps,
                            int slot, int e) {
  const long long i = (long long)slot * pps + e / KV_PAGE;
  const long long page = table != 0 ? (long long)table[i] : i;
  unsigned char* base = (unsigned char*)pool + page * kv_page_bytes(f);
  const int r = e % KV_PAGE;
  KvRowPtr p;
  p.row = base + (long long)r * f.row_bytes;
  p.sc = base + (long long)KV_PAGE * f.row_bytes + (long long)r * f.scale_bytes;
  return p;
}

// Value c of a row, exactly the f32 the reference stores: e4m3 * 2^k (KV nope), bf16 (RoPE),
// bf16(e2m1 * 2^k) (indexer key; the rounding is exact, kept to mirror the reference's steps).
DSV4_INLINE float kv_value(const KvRowFmt& f, const KvRowPtr& p, int c) {
  if (!f.packed) return ((const float*)p.row)[c];
  if (f.index) {
    const unsigned b = p.row[c >> 1];
    const unsigned nibble = (c & 1) ? (b >> 4) : (b & 15u);
    return round_bf16(__fmul_rn(e2m1_to_f32(nibble), e8m0_to_f32(p.sc[c / KV_FP4_BLOCK])));
  }
  if (c < f.nope) return __fmul_rn(e4m3_to_f32(p.row[c]), e8m0_to_f32(p.sc[c / KV_FP8_BLOCK]));
  return bf16_to_f32(((const bf16_t*)(p.row + f.nope))[c - f.nope]);
}

// Two e4m3 codes (low byte first) as f32, exactly: the hardware's e4m3 -> f16 conversion is
// exact (every e4m3 value is an f16), and so is f16 -> f32. NaN stays NaN.
DSV4_INLINE float2 kv_e4m3x2_to_f32(unsigned short codes) {
  unsigned h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(codes));
  float2 r;
  asm("{\n .reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;\n}\n"
      : "=f"(r.x), "=f"(r.y)
      : "r"(h2));
  return r;
}

// Values c, c + 1 of a KV row (c even; the same values as kv_value, two at a time). When nope
// is even a pair is two codes of one scale block or two BF16 values.
DSV4_INLINE float2 kv_value2(const KvRowFmt& f, const KvRowPtr& p, int c) {
  if (!f.packed) return *(const float2*)(p.row + 4 * c);
  if ((f.nope & 1) == 0) {
    if (c < f.nope) {
      const float s = e8m0_to_f32(p.sc[c / KV_FP8_BLOCK]);
      const float2 v = kv_e4m3x2_to_f32(*(const unsigned short*)(p.row + c));
      return make_float2(__fmul_rn(v.x, s), __fmul_rn(v.y, s));
    }
    const bf16_t* r = (const bf16_t*)(p.row + f.nope) + (c - f.nope);
    return make_float2(bf16_to_f32(r[0]), bf16_to_f32(r[1]));
  }
  return make_float2(kv_value(f, p, c), kv_value(f, p, c + 1));
}

// Values c .. c + 3 of a KV row (c % 4 == 0): two kv_value2.
DSV4_INLINE float4 kv_value4(const KvRowFmt& f, const KvRowPtr& p, int c) {
  const float2 a = kv_value2(f, p, c), b = kv_value2(f, p, c + 2);
  return make_float4(a.x, a.y, b.x, b.y);
}

// Stores `src` (f.dim floats any thread of the block may read, visible to all: the caller
// synchronises before) as row p. Block-wide: every thread calls (blockDim a multiple of 32).
// Packed rows: each block of a warp re-derives its scale from values that are codes times a
// power of two already (the official simulation ran), amax floors and all, and encodes
// value / scale, which is exact (kv_pages.rs module doc); pad bytes are written as zero.
DSV4_INLINE void kv_store_row(const KvRowFmt& f, const KvRowPtr& p, const float* src) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if (!f.packed) {
    for (int c = tid; c < f.dim; c += nt) ((float*)p.row)[c] = src[c];
    return;
  }
  const int lane = tid & 31, warp = tid >> 5, nwarps = nt >> 5;
  const int blk = f.index ? KV_FP4_BLOCK : KV_FP8_BLOCK;
  const int coded = f.index ? f.dim : f.nope;  // channels stored as codes
  const int nblk = (coded + blk - 1) / blk;
  for (int b = warp; b < nblk; b += nwarps) {
    const int c0 = b * blk, n = coded - c0 < blk ? coded - c0 : blk;
    float amax = 0.0f;
    bool nan = false;
    for (int i = lane; i < n; i += 32) {
      amax = fmaxf(amax, fabsf(src[c0 + i]));
      nan |= src[c0 + i] != src[c0 + i];
    }
    amax = warp_max(amax);
    ue8m0_t e;
    if (f.index) {
      // e2m1 has no NaN: a block holding one (a NaN anywhere in a key reaches every channel
      // through the Hadamard) gets the NaN scale 255, so it decodes as NaN.
      nan = __any_sync(0xffffffffu, nan);
      e = nan ? (ue8m0_t)255
              : ue8m0_code(fmaxf(amax, __fmul_rn(DSV4_E2M1_MAX, 1.17549435e-38f)), DSV4_E2M1_MAX);
    } else {
      e = ue8m0_code(fmaxf(amax, 1e-4f), DSV4_E4M3_MAX);
    }
    const float s = e == 255 ? 1.0f : e8m0_to_f32(e);
    if (f.index) {
      // Lane i of the block's 16 bytes packs channels c0 + 2i (low nibble) and c0 + 2i + 1.
      for (int i = lane; 2 * i < n; i += 32) {
        const int c = c0 + 2 * i;
        const float v0 = src[c];
        const float v1 = 2 * i + 1 < n ? src[c + 1] : 0.0f;
        const unsigned lo = (v0 != v0) ? 0u : e2m1_encode(__fdiv_rn(v0, s));
        const unsigned hi = (v1 != v1) ? 0u : e2m1_encode(__fdiv_rn(v1, s));
        p.row[c >> 1] = (unsigned char)(lo | (hi << 4));
      }
    } else {
      for (int i = lane; i < n; i += 32) p.row[c0 + i] = e4m3_encode(__fdiv_rn(src[c0 + i], s));
    }
    if (lane == 0) p.sc[b] = e;
  }
  // BF16 RoPE channels (KV rows), then the pad bytes of the row and of the scale record.
  const int tail = f.index ? 0 : f.dim - f.nope;
  bf16_t* rope = (bf16_t*)(p.row + f.nope);
  for (int c = tid; c < tail; c += nt) rope[c] = f32_to_bf16(src[f.nope + c]);
  const int used = f.index ? (f.dim + 1) / 2 : f.nope + 2 * tail;
  for (int i = used + tid; i < f.row_bytes; i += nt) p.row[i] = 0;
  for (int i = nblk + tid; i < f.scale_bytes; i += nt) p.sc[i] = 0;
}
