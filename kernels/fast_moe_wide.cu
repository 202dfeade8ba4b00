// fast_moe_wide kernel family: the prefill path of the fast set's grouped expert GEMMs (many tokens per
// expert), kernels/SPEC.md ## fast_moe_wide.cu, ../shared/KERNELS.md §3 "Prefill". Same inputs, outputs and
// numerics contract as fast_moe_gemm.cu (the decode path):
//
// fmw_gather_x_kernel: x's codes and scales in this path's layout (the tiles' rows consecutive)
// fmw_up_kernel:   hq, hs = act_quant(bf16(silu(min(bf16(W1 x), L)) · clamp(bf16(W3 x), ±L) · w))
// fmw_down_kernel: y = bf16(W2 hq)
//
// Why a second family. The decode kernels take 16 tokens per item and promote the tensor core's sums to f32
// every k32 (one FP4 scale per 32 weights): at a few tokens per expert the weight bytes set the time, but
// with ~100 tokens per expert the promotions and the FP4 decode, both repeated per 16 tokens, use every
// issue slot. Here an item is a tile of up to FMW_T = 128 (or 64: the tile shape, below) tokens, so a weight
// is decoded once per tile, and the per-32 scales of a 128-block are folded into the e4m3 codes, so the sums are promoted once
// per 128 of K (the DeepGEMM recipe; the issue's "at least every 128").
//
// The fold. Per weight row and 128-block the four UE8M0 exponents e_q have a maximum E; the codes of group
// q are re-encoded exactly as value · 2^(t_q - 6) with t_q = 12 - (E - e_q) (e2m1x8_to_e4m3_halves,
// exact for 1 <= t_q <= 12, so E - e_q <= FMOE_FOLD_SPAN = 11), so the block's product carries one factor
// 2^(E - 133) per row. Where every row of a 128-row block has all its exponents within 2^11 of its largest
// (the table's row-block flag), E is the row's largest over the whole row instead: the factor is then the
// same for every block, leaves the promotion (one FFMA per accumulator instead of FMUL + FFMA) and is
// applied once after the pass. A layer whose 128-blocks span more than FMOE_FOLD_SPAN (the table's
// FMOE_SC8_FOLDABLE flag, set at finalize and refit) or whose scales are read as f32 promotes every k32
// instead, with the plain bit move: slower, as exact.
//
// Tile-sized wgmmas. A folded FP4 pass (the routed experts of a released checkpoint) runs wgmma m64nNk32 with
// N = the tile's token count rounded up to 8 (fmw_tile_n): at ~100 tokens per expert (B = 4096) a quarter of
// a 128-column wgmma and of its promotion was spent on columns no token fills; at 24-48 (B = 1024-2048) over
// half. The decode, which does not depend on N, is the same. (Rounded up to 32, layer: 1408 tokens 2734 ->
// 2267 µs, 2048 2865 -> 2458, 4096 3449 -> 3322, 16384 12286 -> 12085: BENCHMARKS.md, issue 11 seventeenth
// version. Then to 8, since at ~96 tokens per expert about half the tiles held 97-120 and ran N = 128: 2048
// 1897 -> 1828, 4096 2619 -> 2538, 16384 10290 -> 10202; twenty-first version. To 16 gained half as much; to
// 32 with all sixteen shapes compiled measured as before, so the larger code costs nothing.)
//
// Work items. The plan (moe_plan_kernel, tile_rows = FMW_T) lists (expert, start, count) tiles; the
// shared expert adds ceil(T / FMW_T) tiles of consecutive tokens. A tile is cut into 128-row blocks
// rb: down, rows rb·128 .. of W2; up, j = rb·128 .. in two passes, W1's rows (gate) then W3's (up), so
// SwiGLU and the per-128 quantisation of h stay in the block. Blocks are persistent and take the items in
// order from a queue, a counter in global memory (fmw_take; the gather kernel zeroes both GEMMs' before the up
// GEMM starts), so a block that drew short items takes more of them: on a fixed round robin (blockIdx.x,
// + gridDim.x, ..) the blocks ended 825-865 µs into the up GEMM at 1024 tokens (fmw_trace), the items'
// lengths differing with their token counts. An item's outputs depend only on the item, not on which
// block takes it: deterministic.
//
// The pipeline (as fast_moe_gemm.cu): 2 consumer warpgroups and a producer warpgroup share a ring of
// FMW_NSTAGES slots with full/empty mbarriers; the producer warpgroup hands most of its registers to the
// consumers (setmaxnreg): a few addresses per thread are all it needs. A stage is 128 bytes of each of the
// pass's 128 weight rows (one TMA box: FP4 256 k, FP8 128 k) with their scales (UE8M0 bytes by a 1 KiB
// bulk copy, f32 by TMA, or FP8's block scale), and the tile's tokens over the same k in wgmma's K-major B
// layout (per 128-block, a row of 128 bytes per token in the 128-byte swizzle) with their per-128 scales.
// Both GEMMs' activations are in this path's own layout (fmw_act_row, fmw_act_scale_at: a tile's rows
// consecutive, its scales in the consumers' order): x's as fmw_gather_x_kernel copies them, h's as the up GEMM
// stores them. So one producer thread copies a stage's tokens by TMA and their scales by one bulk copy
// (fmw_produce; down first, layer B = 4096 2572 -> 2504 µs uniform, 16384 10091 -> 9825, twenty-second version;
// then up, where four producer warps had gathered x's rows by cp.async, 4096 2501 -> 2463: BENCHMARKS.md, issue
// 11). Token columns past the tile's count compute garbage that is never stored (wgmma's columns are
// independent).
//
// The math. Warpgroup w owns the pass's rows 64w .. 64w + 63 (one m64 tile). A 128-block's A fragments
// (ldmatrix then the shifted bit move for FP4; 8-byte loads for FP8; both in the halves order, fp8_mma.cuh,
// which the activations x and h of this path are stored in) are built for its four k32 steps, then
// four wgmma m64n128k32 e4m3 (A from registers, B = the 128 tokens) accumulate in the tensor core under one
// fence and commit; the block's sum is added to the f32 accumulators times (row factor) · (token's
// activation scale). Blocks are software-pipelined one deep: the next block is decoded while the current
// one's wgmmas run, and the other warpgroup's work fills the tensor core while this one promotes.
//
// What bounds it (H100, 4096 tokens, fifty-fourth session, BENCHMARKS.md): neither the stream nor the tensor core.
// Consumer thread 0 spends ~5% of an item's cycles waiting for full slots and ~2% for its wgmmas (FMW_TRACE's
// WFULL / WMMA); the rest is its own instruction stream, 4.5 cycles between a warp's instructions (ncu), whose
// samples are ~22% issuing, ~22% fixed-latency dependencies, ~17% shared-memory results (ldmatrix, exponents,
// scales). The consumers are latency-bound with two warps a scheduler. (The warpgroups in step is not the cause:
// one slept 150 or 400 ns at each pass start, so they ran out of step, layer 4096 tokens 2321 -> 2585 µs. Nor is
// ptxas's window: the stage loop below unrolled twice, no spills, took 4096 tokens 2324 -> 2468 µs.)
//
// The layer's combine stays a kernel of its own (fmoe_combine_kernel, at the HBM ceiling: 940 MB of y read at
// 16384 tokens). Made by the down GEMM instead (the shared expert's items last in the queue, each combining its
// tokens' 128 columns once a count says every routed item is done, the shared rows of y never stored; the same
// bits, tested), the layer was slower: 4096 tokens 2323 -> 2493 µs, 16384 8701 -> 9160 (H100, fifty-fifth
// session; without its L2 prefetch of the routed rows 2445 / 8988, with half the loads in flight 2496 / 9043).
// Likely (not traced): the shared items' epilogues wait on DRAM with a few loads in flight a thread, at the
// kernel's end, where the combine kernel streams with every SM's warps (BENCHMARKS.md; the patch is in
// bench/results/2026-12-07-fifty-fifth-calls.json).
#include "common.cuh"
#include "fp8_mma.cuh"
#include "fast_moe_common.cuh"
#include "moe_plan.cuh"  // the wide plan's place and tile counts, block_excl_scan (fmw_gather_x_kernel)

// The tile shape. This file compiles twice (src/cuda/kernels/fast_moe_wide.rs): as the family fast_moe_wide,
// tiles of FMW_TOKENS = 128 tokens with a ring of FMW_STAGES slots, and, with FMW_NARROW defined, as
// fast_moe_wide_narrow, tiles of FMW_NARROW_TOKENS = 64 with FMW_NARROW_STAGES slots: a slot's token panel is
// half as large, so the ring holds 5 x 16 KiB of weights a block instead of 3 x 16 KiB. Where the tiles hold
// few tokens (an expert's ~10-50 at 480-2048 tokens) the weights' stream sets the time, not the math (the
// FMW_PROBE_NO_MATH probe: at 768 tokens 1465 µs without the math against 1534 with it), and the deeper ring
// streams faster: layer 512 tokens 1462 -> 1324 µs, 768 1512 -> 1406, 1024 1564 -> 1477, 2048 1814 -> 1787;
// at 4096 (~100 tokens an expert) twice the items' decode and promotions lose, 2379 -> 3273 (H100,
// BENCHMARKS.md, issue 11 forty-third session). The layer takes the narrow tiles up to
// fast_moe_wide::NARROW_MAX_TOKENS tokens. FMW_T, FMW_NSTAGES and FMW_SMEM are the shape compiled here;
// these and FMW_HBOX (rows of the activations' TMA boxes, fmw_produce: a tile reads n rounded up to it; its
// tensor maps' box) come from dsv4_consts.cuh.
#if defined(FMW_NARROW)
#define FMW_T FMW_NARROW_TOKENS
#define FMW_NSTAGES FMW_NARROW_STAGES
#define FMW_SMEM FMW_NARROW_SMEM_BYTES
#else
#define FMW_T FMW_TOKENS
#define FMW_NSTAGES FMW_STAGES
#define FMW_SMEM FMW_SMEM_BYTES
#endif
#define FMW_CONSUMERS 256                 // two warpgroups
#define FMW_THREADS (FMW_CONSUMERS + 128)  // then the producer warpgroup
// Registers per thread after setmaxnreg: the producer warpgroup gives most of its share to the consumers
// (the block's 64 K: 256 · 240 + 128 · 24 = 64512; launch bounds alone allow 168 to all). At 224 / 56 the
// consumers spilled 3 (down) and 7 (up) values, reloaded in the folded mainloop just before its wgmmas; at
// 232 / 40, with the halves order's decode, one value in the N = 128 folded loop, and ptxas re-read threadIdx
// there (5 S2R a stage); at 240 / 24 neither side spills (the producer, then four warps gathering tokens,
// kept their row addresses in shared memory): layer 16384 tokens 11089 -> 10850 µs, 4096 2993 -> 2939
// (uniform; BENCHMARKS.md, issue 11 nineteenth version). The producer is one thread since (fmw_produce).
#define FMW_CONSUMER_REGS 240
#define FMW_PRODUCER_REGS 24
// FMW_PROBE_NO_MATH 1 (a bench probe, wrong outputs: `dsv4 bench moe --path prefill --defines FMW_PROBE_NO_MATH=1`):
// the consumers wait for each stage and release it without computing; the epilogues run as usual. The same
// stream and items: the GEMMs' time without their math, so against the real kernels it says whether the math or
// the stream (bytes in flight: FMW_NSTAGES slots of 16 KiB of weights a block) sets the prefill path's time where
// its tiles hold few tokens (~18 an expert at 768 tokens). Measured (128-token tiles, H100): the stream, 640 tokens
// 1453 µs without the math / 1515 with it, 768 1465 / 1534, 1024 1499 / 1584; hence the narrow shape.
#ifndef FMW_PROBE_NO_MATH
#define FMW_PROBE_NO_MATH 0
#endif
// FMW_PROBE_NO_EPI 1 (a bench probe, wrong outputs): the up epilogue stashes the up pass and meets the other
// warpgroup as usual, then stores nothing: h's rounds (fmw_up_h_quant's loop) are skipped. Against the real
// kernels, what making h costs the layer apart from the wait for the slower warpgroup (the trace's "epi", MATH
// -> DONE, holds both: 4.6 µs of a ~37 µs up item at 4096 tokens, H100).
#ifndef FMW_PROBE_NO_EPI
#define FMW_PROBE_NO_EPI 0
#endif
// FMW_PROBE_NO_DECODE 1 (a bench probe, wrong outputs): the folded FP4 blocks' A fragments are the stored words
// with each byte's high nibble cleared (small e4m3 values, never NaN), one op per 8 values and no tables: what the
// prefill GEMMs take with the decode's ALU work gone, the bound of any cheaper decode (H100, fiftieth session:
// 2.5 / 7.0 / 7.9% of the layer at 1024 / 2048 / 4096 tokens).
#ifndef FMW_PROBE_NO_DECODE
#define FMW_PROBE_NO_DECODE 0
#endif
// FMW_PROBE_NO_STREAM (a bench probe, wrong outputs): bit 0 set, the producer copies no activation codes (the
// tiles' TMA boxes), bit 1 set, no weight codes; the scales, records and barriers as usual, the ring's code
// bytes set once at the start (never NaN). Against the real kernels, what the L2 -> SM stream of each costs:
// at a 96-token tile the codes of a 128-block are 12 KiB of activations (from L2, each tile's rows read again by
// every row block) against 8 KiB of weights. Measured (=1, H100, fifty-third session): layer 4096 tokens 2248
// µs against ~2320, 16384 8002 against 8500-8668, so the activations' whole stream is 3-6% of the layer, and a
// pair of blocks sharing it by TMA multicast (built: clusters of two taking row blocks 2i and 2i + 1 of a tile,
// each block's producer copying half of its boxes into both slots) measured 7-8% slower at 2048-4096 tokens
// and 2-7% at 16384, the pair's lockstep and item mailbox costing more than the halved stream saves
// (BENCHMARKS.md; the patch is in bench/results/2026-12-07-fifty-third-calls.json).
#ifndef FMW_PROBE_NO_STREAM
#define FMW_PROBE_NO_STREAM 0
#endif
// FMW_TRACE 1 (a bench variant: `dsv4 bench moe --path prefill --defines FMW_TRACE=1 --trace DIR`, then
// scripts/fmw-trace.py): both GEMMs log each item's boundaries (fmw_trace; arg = the item's index, | FMW_TRACE_DOWN
// for the down GEMM): the producer thread when it starts the item (PRODUCE), and consumer thread 0 when it begins
// to wait for the item's record (START: the time taken before the wait, logged after it), when the record is in
// with the item's first stage (DATA), when its last pass's mainloop ends (MATH) and when its outputs are stored
// (DONE). So DONE -> START is the consumers' own work between items, START -> DATA waiting for the stream, and the
// producer's PRODUCE ahead of START its lead. With DONE, thread 0 also logs SM clock cycles as the events' times
// (cycles + 1): those it spent during the item in its full-slot waits (WFULL: the stream not ahead of the math)
// and in its wgmma waits (WMMA: the tensor core's queue, both warpgroups' blocks; FmwWaits), and the item's
// cycles from its record in to DONE (CYCLES), so the waits' shares need no clock rate. Off (0, the default) it compiles
// to nothing.
#ifndef FMW_TRACE
#define FMW_TRACE 0
#endif
#define FMW_TRACE_CAP 262144
#define FMW_TRACE_DOWN (1 << 30)
enum FmwTraceKind {
  FMW_EV_PRODUCE = 1,
  FMW_EV_START = 2,
  FMW_EV_DATA = 3,
  FMW_EV_MATH = 4,
  FMW_EV_DONE = 5,
  FMW_EV_WFULL = 6,
  FMW_EV_WMMA = 7,
  FMW_EV_CYCLES = 8
};
#define FMW_TRACE_SLOTS 8  // events an item
#if FMW_TRACE
__device__ unsigned fmw_trace_n;
__device__ unsigned long long fmw_trace_log[2 * FMW_TRACE_CAP];
#endif
// Event `kind` of the block's item number `local` (the local-th it takes from the queue): at a slot of its own,
// so the logging thread does not wait for an atomic (moe_trace_event_at): the up GEMM's in the log's first half,
// the down GEMM's in the second, each half cut into gridDim.x runs of FMW_TRACE_SLOTS slots an item. (With the
// atomic's index, each event delayed its thread ~0.5 µs: the item boundaries the trace times looked that much
// longer.)
// t: the event's time where taken before (else 0: now).
DSV4_INLINE void fmw_trace(int kind, int arg, int local, unsigned long long t = 0) {
#if FMW_TRACE
  const unsigned per_block = FMW_TRACE_CAP / 2 / gridDim.x;
  const unsigned at = FMW_TRACE_SLOTS * (unsigned)local + (unsigned)(kind - 1);
  const unsigned slot = (arg & FMW_TRACE_DOWN ? FMW_TRACE_CAP / 2 : 0) + blockIdx.x * per_block + at;
  moe_trace_event_at(&fmw_trace_n, fmw_trace_log, FMW_TRACE_CAP, at < per_block ? slot : FMW_TRACE_CAP, kind, arg, t);
#else
  (void)kind;
  (void)arg;
  (void)local;
  (void)t;
#endif
}
#define FMW_ROWS 128                      // weight rows of a pass: one TMA box
#define FMW_RB 128                        // bytes of a weight row per stage
#define FMW_SLOT_W (FMW_ROWS * FMW_RB)
#define FMW_SLOT_S (FMW_ROWS * 8 * 4)  // FP4: 8 per-32 scales a row (f32, or UE8M0 bytes in the first 1 KiB);
                                       // FP8: the block scale
#define FMW_B_PANEL (FMW_T * 128)  // one 128-k block of the tokens' codes: a row of 128 bytes a token
#define FMW_SLOT_A (2 * FMW_B_PANEL)     // a stage's token codes
#define FMW_SLOT_AS (2 * FMW_T * 4)  // their scales, [128-block][token]
#define FMW_SLOT (((FMW_SLOT_W + FMW_SLOT_S + FMW_SLOT_A + FMW_SLOT_AS) + 1023) / 1024 * 1024)
// Epilogue buffer (bf16). Up: two [token][128 j] matrices, the gate values then the up values of the item's
// 128 j (fmw_ep_index's swizzle), read by fmw_up_h_quant. Down: one [token][FMW_DOWN_STRIDE] block per
// warpgroup (its 64 rows) to write y in 16-byte pieces, the stride padded so that the 8 token rows a
// stmatrix writes at once (fmw_stash_pair; 144 bytes apart) fall in distinct banks.
#define FMW_UP_MATRIX (FMW_T * 128)  // elements of one up matrix
#define FMW_DOWN_STRIDE 72
#define FMW_EP_BYTES (2 * FMW_UP_MATRIX * 2)
#define FMW_WT (FMW_NSTAGES * FMW_SLOT + FMW_EP_BYTES)  // the tile's routing weights, FMW_T floats
#define FMW_BARS (FMW_WT + FMW_T * 4)
// Item records (fmw_put_record), one a ring slot: the record of an item sits beside its first stage's slot.
// [0, 16) the head: item, n, start, the expert's table entry; UE8M0 only, [16, 24) each pass's fold flag's byte
// in its line, and per pass p [32 + 16p, + 16) that 16-byte aligned line and [64 + 128p, + 128) the row block's
// largest exponents (fmoe_sc8_rows). [24, 32) of the first slot's record is the producer's (fmw_keep_item).
#define FMW_REC (FMW_BARS + 2 * FMW_NSTAGES * 8)
#define FMW_REC_ITEM 24
#define FMW_REC_BYTES 320
#define FMW_SMEM_USED (FMW_REC + FMW_NSTAGES * FMW_REC_BYTES)
static_assert(FMW_SMEM_USED <= FMW_SMEM, "fast_moe_wide: shared memory layout exceeds FMW_SMEM");
// A tile of 32, 64 or 128 tokens (the largest wgmma is m64n128k32; the down epilogue's copy-out takes 16 tokens
// a round; the activations' TMA boxes are FMW_HBOX rows; the scale words' head, fmw_scale_head, reads the first
// 32 tokens' scales).
static_assert(FMW_T % 32 == 0 && FMW_T <= 128, "fast_moe_wide: FMW_T is 32, 64 or 128");
static_assert(FMW_T % FMW_HBOX == 0, "fast_moe_wide: a tile is whole activation boxes");
static_assert((FMW_SLOT_W + FMW_SLOT_S) % 1024 == 0, "fast_moe_wide: the B blocks need the swizzle's 1024-byte alignment");
static_assert(2 * FMW_T * FMW_DOWN_STRIDE * 2 + 2 * FMW_T * 4 <= FMW_EP_BYTES,
              "fast_moe_wide: the down epilogue's buffers and output rows");
static_assert(FMOE_MAP_BYTES == 128, "fast_moe_wide: a CUtensorMap is 128 bytes");

// One work item: a token tile and a 128-row block.
struct FmwItem {
  bool skip;    // another rank's expert (uniform over the block)
  bool shared;  // the shared expert's tile
  bool fp4;
  bool s8;      // FP4 scales as UE8M0 bytes
  int n;        // tokens in the tile, 1..FMW_T
  int start;    // first plan row (routed) or first token (shared)
  int rb;       // row block: up, j = 128·rb ..; down, W2 rows 128·rb ..
  int tile;     // the item's tile: the plan's routed tiles, then the shared expert's (h's scales, fmw_act_scale_at)
  const unsigned char* maps;   // the expert's tensor maps
  const float* fs[2];          // FP8: block scales of pass 0 and 1 (up: W1, W3; down: W2)
  const unsigned char* sc8[2]; // UE8M0: the 1 KiB blocks of stage 0 of the passes' row block
  // UE8M0, the consumers' (from the item's record, fmw_item_of_record): the largest exponents of the thread's
  // rows g and g + 8 (bits 0-7, 8-15) in each pass's row block (fmoe_sc8_rows).
  unsigned rowe[2];
  bool rowfold[2];              // UE8M0: every row of the pass's block folds whole (fmoe_rows8_kernel)
};

DSV4_INLINE int fmw_passes(bool up) { return up ? 2 : 1; }

// The wgmmas' N for a tile of n tokens (1 .. FMW_T): n rounded up to a multiple of 8, wgmma's step (the
// dispatch in fmw_gemm has a case for each). Only the folded FP4 passes (the routed experts of a released
// checkpoint) take it: the shared expert's tiles are full but the last, and the other passes are fallbacks.
DSV4_INLINE int fmw_tile_n(int n) { return (n + 7) / 8 * 8; }

template <bool UP>
DSV4_INLINE int fmw_total_items(const FmoeArgs& a) {
  const int nsh = a.shared_fmt != 0 ? (a.T + FMW_T - 1) / FMW_T : 0;
  return (a.nrt + nsh) * (a.N / FMW_ROWS);
}

// The rest of item `it` from its tile (it.rb, tile, n, start, shared, skip set) and x, its expert's entry in the
// per-expert tables (e - e_begin; nloc for the shared expert): its format, scales and tensor maps.
template <bool UP>
DSV4_INLINE void fmw_item_tables(const FmoeArgs& a, FmwItem& it, int x) {
  it.s8 = false;
  it.fs[0] = it.fs[1] = nullptr;
  it.sc8[0] = it.sc8[1] = nullptr;
  it.rowe[0] = it.rowe[1] = 0u;
  it.rowfold[0] = it.rowfold[1] = false;
  it.fp4 = (it.shared ? a.shared_fmt : a.fmt) == WFMT_FP4;
  if (it.shared) {
    it.fs[0] = a.shared_sa;
    it.fs[1] = a.shared_sb;
  } else if (!it.skip && !it.fp4) {
    it.fs[0] = reinterpret_cast<const float*>(a.sa[x]);
    it.fs[1] = reinterpret_cast<const float*>(a.sb[x]);
  }
  it.maps = a.maps + (long long)x * (FMOE_MAPS_PER_EXPERT * FMOE_MAP_BYTES);
  if (it.fp4 && !it.skip && a.sc8 != nullptr) {
    it.s8 = true;
    const unsigned char* ex = a.sc8 + (long long)x * fmoe_sc8_expert(a.D, a.I);
    const long long at = (long long)it.rb * fmoe_stages(true, a.K) * 1024;
    const long long w13 = fmoe_sc8_matrix(a.I, a.D);
    it.sc8[0] = ex + (UP ? 0 : 2 * w13) + at;  // W1 or W2
    it.sc8[1] = ex + w13 + at;                 // W3 (up only)
  }
}

// Item wi from the plan (the producer's; the consumers take theirs from its record, fmw_item_of_record), and in
// *x its expert's entry in the per-expert tables.
template <bool UP>
DSV4_INLINE FmwItem fmw_item(const FmoeArgs& a, int wi, int* x) {
  const int rb_n = a.N / FMW_ROWS;
  const int tile = wi / rb_n;
  FmwItem it;
  it.rb = wi - tile * rb_n;
  it.tile = tile;
  it.skip = false;
  *x = a.e_end - a.e_begin;
  if (tile < a.nrt) {
    const int e = a.tiles[3 * tile];
    it.skip = e < a.e_begin || e >= a.e_end;
    it.start = a.tiles[3 * tile + 1];
    it.n = a.tiles[3 * tile + 2];
    it.shared = false;
    *x = it.skip ? 0 : e - a.e_begin;
  } else {
    it.start = (tile - a.nrt) * FMW_T;
    it.n = min(FMW_T, a.T - it.start);
    it.shared = true;
  }
  fmw_item_tables<UP>(a, it, *x);
  return it;
}

// The producer's record of item wi (expert entry x, the plan's item `it`) into `rec` (the shared address of the
// record of the item's first stage's slot, whose empty barrier it has passed; `full` that slot's full barrier):
// the head by stores, which the stage's expect_tx arrival (fmw_produce, after this) releases to the consumers,
// and UE8M0's row data by bulk copies onto the stage's full barrier, announced here (the copies may land before
// the stage's arrival). wi = -1: the end of the block's items (the consumers stop there). Why: the consumers made
// their item from the plan and the row table themselves, a chain of two global loads (~0.5 µs under the
// weights' stream, fmw_trace) at every item start while the ring's slots stood full; the producer makes it
// anyway, up to FMW_NSTAGES stages earlier. D, I and K are copied through an opaque asm: offsets made from the
// parameters are otherwise hoisted out of the producer's loop (or above the producer / consumer split, into the
// consumers' registers) and spill at 24 registers.
DSV4_INLINE void fmw_record_head(unsigned rec, int wi, int n, int start, int x) {
  asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(rec), "r"(wi), "r"(n), "r"(start), "r"(x) : "memory");
}
template <bool UP>
DSV4_INLINE void fmw_put_record(const FmoeArgs& a, const FmwItem& it, int wi, int x, unsigned rec, unsigned full) {
  fmw_record_head(rec, wi, it.n, it.start, x);
  if (!it.s8) return;
  int D, I, K;
  asm volatile("mov.b32 %0, %3;\n\tmov.b32 %1, %4;\n\tmov.b32 %2, %5;\n"
               : "=r"(D), "=r"(I), "=r"(K)
               : "r"(a.D), "r"(a.I), "r"(a.K));
  const unsigned char* ex =
      it.sc8[0] - (UP ? 0 : 2 * fmoe_sc8_matrix(I, D)) - (long long)it.rb * fmoe_stages(true, K) * 1024;
  mbar_expect_tx(full, fmw_passes(UP) * (128 + 16));
  unsigned foff[2] = {0u, 0u};
#pragma unroll
  for (int p = 0; p < fmw_passes(UP); ++p) {
    const unsigned char* flag = ex + fmoe_sc8_row_flags(D, I, UP ? p : 2) + it.rb;
    foff[p] = (unsigned)reinterpret_cast<unsigned long long>(flag) & 15u;
    bulk_load(rec + 32 + 16 * p, flag - foff[p], 16, full);
    bulk_load(rec + 64 + 128 * p, ex + fmoe_sc8_rows(D, I, UP ? p : 2) + it.rb * FMW_ROWS, 128, full);
  }
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(rec + 16), "r"(foff[0]), "r"(foff[1]) : "memory");
}

// The consumers' item from the record at `rec` (generic address; its first stage is full): its head, the tables
// (fmw_item_tables) and, UE8M0, the largest exponents of the thread's rows g and g + 8 of each pass's row block and
// its fold flag. Returns false at the end mark.
template <bool UP>
DSV4_INLINE bool fmw_item_of_record(const FmoeArgs& a, const unsigned char* rec, FmwItem& it) {
  const int4 head = *reinterpret_cast<const int4*>(rec);
  if (head.x < 0) return false;
  const int rb_n = a.N / FMW_ROWS;
  it.tile = head.x / rb_n;
  it.rb = head.x - it.tile * rb_n;
  it.n = head.y;
  it.start = head.z;
  it.shared = it.tile >= a.nrt;
  it.skip = false;
  fmw_item_tables<UP>(a, it, head.w);
  if (it.s8) {
    const int r = (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2);  // row g of the thread's warp
    const uint2 foff = *reinterpret_cast<const uint2*>(rec + 16);
    for (int p = 0; p < fmw_passes(UP); ++p) {
      it.rowe[p] = rec[64 + 128 * p + r] | (unsigned)rec[64 + 128 * p + r + 8] << 8;
      it.rowfold[p] = rec[32 + 16 * p + (p == 0 ? foff.x : foff.y)] != 0;
    }
  }
  return true;
}

// Output row (of y; up, of the routing weights) of token column c < n: one per (token, slot), then the
// shared expert's per token.
DSV4_INLINE long long fmw_out_row(const FmoeArgs& a, const FmwItem& it, int c) {
  return it.shared ? (long long)a.T * a.k + it.start + c : a.rows[it.start + c];
}

// The activations' row of token column c in this path's layout (x's, made by fmw_gather_x_kernel, and h's):
// a routed tile's at its plan rows, so that a tile's rows are consecutive and the producer reads them by TMA;
// the shared expert's at T·k + its token.
DSV4_INLINE long long fmw_act_row(const FmoeArgs& a, const FmwItem& it, int c) {
  return it.shared ? (long long)a.T * a.k + it.start + c : it.start + c;
}

// The ring's barriers (fmoe_ring_*).
DSV4_INLINE unsigned fmw_full(unsigned smem, int s) { return fmoe_ring_full(smem + FMW_BARS, s); }
DSV4_INLINE unsigned fmw_empty(unsigned smem, int s) { return fmoe_ring_empty(smem + FMW_BARS, FMW_NSTAGES, s); }

// Where token column p's activation scale sits among its block's FMW_T: thread t of the accumulator
// layout (d[4j + c] is token 8j + 2t + c) reads the scales of tokens 8j + 2t + {0, 1} for j = 2i, 2i + 1 as
// one 16-byte word at 16i + 4t, and the four t of a word's i are adjacent, so a warp's 16-byte loads touch
// 64 contiguous bytes: conflict-free, and half as many loads as 8-byte ones in token order.
DSV4_INLINE int fmw_scale_pos(int p) { return (p >> 4) * 16 + ((p >> 1) & 3) * 4 + ((p >> 3) & 1) * 2 + (p & 1); }

// The activations' scale of token column c and 128-block b (of `blocks` = K / 128) of the item's tile, in this
// path's layout: [tile][block][FMW_T] floats at fmw_scale_pos(c), the consumers' order, so the producer
// copies a stage's scales in one piece. (Slots of the tile's columns past its count are not written.)
DSV4_INLINE long long fmw_act_scale_at(const FmwItem& it, int blocks, int b, int c) {
  return ((long long)it.tile * blocks + b) * FMW_T + fmw_scale_pos(c);
}

// Where a pass's weights come from: the codes' tensor map (the f32 FP4 scales' map is FMOE_MAP_S1 -
// FMOE_MAP_W1 maps after it) and the scales' source by format: the UE8M0 bytes of the row block's stage 0, or
// FP8's block scales of the row block. Made once a pass, so that the stages hold two addresses, not the item's
// eight (the producer has 24 registers).
static_assert(FMOE_MAP_S1 - FMOE_MAP_W1 == FMOE_MAP_S3 - FMOE_MAP_W3 && FMOE_MAP_S1 - FMOE_MAP_W1 == FMOE_MAP_S2 - FMOE_MAP_W2,
              "fast_moe_wide: a matrix's scale map sits a fixed distance after its code map");
struct FmwPassSrc {
  const unsigned char* map;
  const void* scales;
};

template <bool UP>
DSV4_INLINE FmwPassSrc fmw_pass_src(const FmwItem& it, int pass, int K) {
  const int m = UP ? (pass == 0 ? FMOE_MAP_W1 : FMOE_MAP_W3) : FMOE_MAP_W2;
  // (Selects, not it.sc8[pass]: a dynamic index would put the item in local memory.)
  const void* scales;
  if (it.s8)
    scales = pass == 0 ? it.sc8[0] : it.sc8[1];
  else
    scales = (pass == 0 ? it.fs[0] : it.fs[1]) + (long long)it.rb * (K / 128);  // FP8 (unused for f32 FP4)
  return {it.maps + m * FMOE_MAP_BYTES, scales};
}

// A stage's weights for the producer thread: the weight box of the pass's 128 rows and, for FP4, their scales
// (UE8M0 bytes by a 1 KiB bulk copy, f32 by TMA) or, for FP8, the block scale by a 4-byte cp.async (the
// thread's cp.async arrival on the full barrier covers it). Bytes the TMA copies complete: fmw_weight_tx.
DSV4_INLINE void fmw_load_weights(const FmwItem& it, const FmwPassSrc& src, int kb, unsigned st, unsigned full) {
  if (!(FMW_PROBE_NO_STREAM & 2)) tma_load_2d(st, src.map, kb * FMW_RB, it.rb * FMW_ROWS, full);
  if (it.s8)
    bulk_load(st + FMW_SLOT_W, static_cast<const unsigned char*>(src.scales) + kb * 1024, 1024, full);
  else if (it.fp4)
    tma_load_2d(st + FMW_SLOT_W, src.map + (FMOE_MAP_S1 - FMOE_MAP_W1) * FMOE_MAP_BYTES, kb * 8, it.rb * FMW_ROWS, full);
  else
    cp_async_4(st + FMW_SLOT_W, static_cast<const float*>(src.scales) + kb);
}

DSV4_INLINE unsigned fmw_weight_tx(const FmwItem& it) {
  return FMW_SLOT_W + (!it.fp4 ? 0 : it.s8 ? 1024 : FMW_SLOT_S);
}

// What the block's item starts read from global memory, asked into the SM's L1 by the producer thread ahead of
// the reads: the plan's tile of the block's next item (the producer's own next fmw_item; asked for during the
// item before, once the queue has given its index, fmw_prefetch_tile) and the item's output rows
// (fmw_epilogue_read: the consumers read them at the item's start for its epilogue; asked for when the producer
// starts the item, up to FMW_NSTAGES stages before the consumers do, fmw_prefetch_rows). The consumers' row
// exponents come in the item's record (fmw_put_record). FMW_PREFETCH_ITEM: 2 both (the default), 1 the next
// tile only, 0 none (bench variants). (Measured before the records: these at item starts, layer 1.4-2.8% faster
// at 480-2048 tokens; a look-ahead of a whole item with the next expert's tensor maps, no faster: BENCHMARKS.md,
// issue 11 forty-fourth and forty-fifth sessions.)
#ifndef FMW_PREFETCH_ITEM
#define FMW_PREFETCH_ITEM 2
#endif
template <bool UP>
DSV4_INLINE void fmw_prefetch_tile(const FmoeArgs& a, int wi) {
  const int tile = wi / (a.N / FMW_ROWS);
  if (FMW_PREFETCH_ITEM >= 1 && tile < a.nrt) prefetch_l1(a.tiles + 3 * tile);
}
DSV4_INLINE void fmw_prefetch_rows(const FmoeArgs& a, const FmwItem& it) {
  if (FMW_PREFETCH_ITEM >= 2 && !it.shared) {  // two lines: a tile's rows span at most 512 bytes
    prefetch_l1(a.rows + it.start);
    prefetch_l1(a.rows + it.start + it.n - 1);
  }
}

// The producer's copy of the GEMM's arguments at each of its items, with the shape (D, I, K, N, T) passed
// through an opaque asm: values made from them (the tables' offsets, the items' division) are otherwise hoisted
// out of the producer's loop, or above the producer / consumer split, and spill at 24 registers (200-370 bytes).
DSV4_INLINE FmoeArgs fmw_opaque_shape(const FmoeArgs& a) {
  FmoeArgs o = a;
  asm volatile("mov.b32 %0, %0;\n\tmov.b32 %1, %1;\n\tmov.b32 %2, %2;\n\tmov.b32 %3, %3;\n\tmov.b32 %4, %4;\n"
               : "+r"(o.D), "+r"(o.I), "+r"(o.K), "+r"(o.N), "+r"(o.T));
  return o;
}

// The block's next item: the queue's head, taken by the producer thread (the consumers follow its records).
DSV4_INLINE int fmw_take(unsigned* queue) { return (int)atomicAdd(queue, 1u); }

// The producer's item indices in shared memory, in the first slot's record's free words (FMW_REC_ITEM: the
// current item, FMW_REC_ITEM + 4: the next one). Why not registers: an index read back from shared memory at a
// uniform address is uniform to ptxas, so the item's fields made from it live in the uniform registers, as
// they did when the items were blockIdx.x + i · gridDim.x; made from the atomic's result (one thread's), they
// took the producer's 24 registers and spilled 200-370 bytes.
DSV4_INLINE void fmw_keep_item(unsigned smem, int which, int wi) {
  asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(smem + FMW_REC + FMW_REC_ITEM + 4 * which), "r"(wi) : "memory");
}
DSV4_INLINE int fmw_kept_item(unsigned smem, int which) {
  int wi;
  asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(wi) : "r"(smem + FMW_REC + FMW_REC_ITEM + 4 * which) : "memory");
  return wi;
}

// The producer: one thread. Both GEMMs' activations (x for up, made by fmw_gather_x_kernel; h for down, by
// the up GEMM) are stored in this path's own layout (fmw_act_row, fmw_act_scale_at): a tile's rows consecutive,
// its scales in the consumers' order (but the shared expert's x codes, read where the router left them). So per
// stage and 128-block the thread copies the tile's codes by TMA (`act_map`: boxes of FMW_HBOX rows x 128 bytes
// in the 128-byte swizzle, the B tile's layout; ceil(n / FMW_HBOX) of them, rows past the tile's count are other
// tiles' or zeros past the map, computed and never stored) and their scales by one bulk copy of FMW_T floats,
// beside the weights (fmw_load_weights). The full barrier expects the thread's expect_tx arrival and its cp.async
// arrival (FP8's block scale).
// (Before, all four producer warps gathered the tokens' rows by cp.async, 8 threads a 128-byte line, and
// their 4-byte scales one per thread: 14% of the up GEMM's instructions, the scales one shared-memory
// wavefront each, and retries of the ring's waits; ncu, B = 4096.)
template <bool UP>
DSV4_INLINE void fmw_produce(const FmoeArgs& a, const unsigned char* act_map, unsigned smem, unsigned* queue) {
  if (threadIdx.x != FMW_CONSUMERS) return;
  int slot = 0;
  unsigned phase = 0;
  // The block's items from the queue (fmw_take), their indices kept in shared memory (fmw_keep_item: 0 the
  // current, 1 the next): the next one's taken when an item starts, and its tile asked into L1 once the item's
  // record is out (fmw_prefetch_tile).
  fmw_keep_item(smem, 0, fmw_take(queue));
  int local = 0;
  // One loop over (item, pass), the item made again for each pass: what a pass needs of it held across both
  // passes spilled at 24 registers.
  for (int pass = 0;;) {
    const FmoeArgs sa = fmw_opaque_shape(a);
    const int K = sa.K, wi = fmw_kept_item(smem, 0);
    if (wi >= fmw_total_items<UP>(sa)) break;
    int x;
    const FmwItem it = fmw_item<UP>(sa, wi, &x);
    if (it.skip) {  // another rank's expert
      fmw_keep_item(smem, 0, fmw_take(queue));
      continue;
    }
    if (pass == 0) {  // the item's start
      const int next = fmw_take(queue);
      fmw_prefetch_rows(sa, it);
      if (FMW_TRACE) fmw_trace(FMW_EV_PRODUCE, (UP ? 0 : FMW_TRACE_DOWN) | wi | (it.n < 0), local);
      // The item's record, beside its first stage (whose wait below then passes at once).
      mbar_wait(fmw_empty(smem, slot), phase ^ 1);
      fmw_put_record<UP>(sa, it, wi, x, smem + FMW_REC + slot * FMW_REC_BYTES, fmw_full(smem, slot));
      fmw_keep_item(smem, 1, next);  // (the take's round trip ran under the wait for the slot)
      fmw_prefetch_tile<UP>(sa, next);
    }
    const int nks = fmoe_stages(it.fp4, K);
    const int kbytes = it.fp4 ? 256 : 128;  // k of a full stage
    const int boxes = (it.n + FMW_HBOX - 1) / FMW_HBOX;
    // The up GEMM's shared items read x's codes where the router stored them, by token (the map after
    // act_map: fmw_gather_x_kernel copies only the routed tiles' rows); every other item its plan rows.
    const bool by_token = UP && it.shared;
    const unsigned char* map = by_token ? act_map + FMOE_MAP_BYTES : act_map;
    const int row0 = by_token ? it.start : (int)fmw_act_row(sa, it, 0);
    // (An offset of 32 bits, added to the kernel parameter at each stage: a pointer held across the stages
    // spilled at 24 registers. Below 2^32 for any T the workspace holds.)
    const unsigned scales = (unsigned)fmw_act_scale_at(it, K / 128, 0, 0);
    const FmwPassSrc src = fmw_pass_src<UP>(it, pass, K);
    for (int kb = 0; kb < nks; ++kb) {
      mbar_wait(fmw_empty(smem, slot), phase ^ 1);
      const unsigned st = smem + slot * FMW_SLOT, full = fmw_full(smem, slot);
      const int blocks = fmoe_stage_blocks(it.fp4, K, kb), k0 = kb * kbytes;
      const int act_boxes = (FMW_PROBE_NO_STREAM & 1) ? 0 : boxes;
      mbar_arrive_expect_tx(full, fmw_weight_tx(it) - ((FMW_PROBE_NO_STREAM & 2) ? FMW_SLOT_W : 0) +
                                      blocks * (act_boxes * FMW_HBOX * 128 + FMW_T * 4));
      fmw_load_weights(it, src, kb, st, full);
      const unsigned adst = st + FMW_SLOT_W + FMW_SLOT_S;
      for (int b = 0; b < blocks; ++b)
        for (int r = 0; r < act_boxes; ++r)
          tma_load_2d(adst + b * FMW_B_PANEL + r * (FMW_HBOX * 128), map, k0 + 128 * b, row0 + r * FMW_HBOX, full);
      bulk_load(adst + FMW_SLOT_A, sa.act_s + scales + (k0 / 128) * FMW_T, blocks * FMW_T * 4, full);
      cp_async_mbar_arrive(full);
      fmoe_ring_advance(slot, phase, FMW_NSTAGES);
    }
    if (++pass == fmw_passes(UP)) {  // the item's end
      pass = 0;
      ++local;
      fmw_keep_item(smem, 0, fmw_kept_item(smem, 1));
    }
  }
  // The end mark: a record with item -1 in the next slot, its stage full with no data.
  mbar_wait(fmw_empty(smem, slot), phase ^ 1);
  fmw_record_head(smem + FMW_REC + slot * FMW_REC_BYTES, -1, 0, 0, 0);
  mbar_arrive_expect_tx(fmw_full(smem, slot), 0u);
  cp_async_mbar_arrive(fmw_full(smem, slot));
  cp_async_wait_all();  // the copies land before the thread exits
}

// One wgmma m64nNk32 e4m3 (A from registers, B the first N tokens of the block's B tile): d[0 .. N/2) of the
// accumulator layout (d[4j + c]: token 8j + 2t + (c & 1), j < N/8). N any multiple of 8 up to 128: an item whose
// tile holds n tokens runs the smallest such N >= n (fmw_tile_n), so a partial tile's columns past N cost
// neither tensor-core time nor promotion.
//
// The asm's operands: an asm numbers its outputs first, so the A registers, the descriptor and the accumulate
// flag are passed as read-write operands %0 .. %5 ahead of the N / 2 accumulators (%6 ..): then the
// accumulator list of every N is a prefix of one sequence (FMW_ACC_Rn: n registers) and one template serves
// every shape. (The compiler keeps copies only of what is read after the asm: nothing here.)
#define FMW_ACC_R4 "%6, %7, %8, %9"
#define FMW_ACC_R8 FMW_ACC_R4 ", %10, %11, %12, %13"
#define FMW_ACC_R12 FMW_ACC_R8 ", %14, %15, %16, %17"
#define FMW_ACC_R16 FMW_ACC_R12 ", %18, %19, %20, %21"
#define FMW_ACC_R20 FMW_ACC_R16 ", %22, %23, %24, %25"
#define FMW_ACC_R24 FMW_ACC_R20 ", %26, %27, %28, %29"
#define FMW_ACC_R28 FMW_ACC_R24 ", %30, %31, %32, %33"
#define FMW_ACC_R32 FMW_ACC_R28 ", %34, %35, %36, %37"
#define FMW_ACC_R36 FMW_ACC_R32 ", %38, %39, %40, %41"
#define FMW_ACC_R40 FMW_ACC_R36 ", %42, %43, %44, %45"
#define FMW_ACC_R44 FMW_ACC_R40 ", %46, %47, %48, %49"
#define FMW_ACC_R48 FMW_ACC_R44 ", %50, %51, %52, %53"
#define FMW_ACC_R52 FMW_ACC_R48 ", %54, %55, %56, %57"
#define FMW_ACC_R56 FMW_ACC_R52 ", %58, %59, %60, %61"
#define FMW_ACC_R60 FMW_ACC_R56 ", %62, %63, %64, %65"
#define FMW_ACC_R64 FMW_ACC_R60 ", %66, %67, %68, %69"
// "+f" operands d[o] .. d[o + 3] (WGMMA_ACC8, fp8_mma.cuh: eight).
#define FMW_ACC4(d, o) "+f"(d[o]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3])
#define FMW_WGMMA_ASM(NN, REGS, ...)                                                                        \
  asm volatile("{ .reg .pred p; setp.ne.b32 p, %5, 0;\n"                                                  \
               "wgmma.mma_async.sync.aligned.m64n" #NN "k32.f32.e4m3.e4m3 "                                \
               "{" REGS "}, {%0, %1, %2, %3}, %4, p, 1, 1; }\n"                                          \
               : "+r"(a0), "+r"(a1), "+r"(a2), "+r"(a3), "+l"(desc), "+r"(accumulate), __VA_ARGS__)
template <int N>
DSV4_INLINE void fmw_wgmma(float (&d)[64], const unsigned (&a)[4], unsigned long long desc, int accumulate) {
  static_assert(N % 8 == 0 && N >= 8 && N <= 128, "fmw_wgmma: N");
  unsigned a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
  if constexpr (N == 8) {
    FMW_WGMMA_ASM(8, FMW_ACC_R4, FMW_ACC4(d, 0));
  } else if constexpr (N == 16) {
    FMW_WGMMA_ASM(16, FMW_ACC_R8, WGMMA_ACC8(d, 0));
  } else if constexpr (N == 24) {
    FMW_WGMMA_ASM(24, FMW_ACC_R12, WGMMA_ACC8(d, 0), FMW_ACC4(d, 8));
  } else if constexpr (N == 32) {
    FMW_WGMMA_ASM(32, FMW_ACC_R16, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8));
  } else if constexpr (N == 40) {
    FMW_WGMMA_ASM(40, FMW_ACC_R20, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), FMW_ACC4(d, 16));
  } else if constexpr (N == 48) {
    FMW_WGMMA_ASM(48, FMW_ACC_R24, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16));
  } else if constexpr (N == 56) {
    FMW_WGMMA_ASM(56, FMW_ACC_R28, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), FMW_ACC4(d, 24));
  } else if constexpr (N == 64) {
    FMW_WGMMA_ASM(64, FMW_ACC_R32, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24));
  } else if constexpr (N == 72) {
    FMW_WGMMA_ASM(72, FMW_ACC_R36, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  FMW_ACC4(d, 32));
  } else if constexpr (N == 80) {
    FMW_WGMMA_ASM(80, FMW_ACC_R40, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32));
  } else if constexpr (N == 88) {
    FMW_WGMMA_ASM(88, FMW_ACC_R44, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32), FMW_ACC4(d, 40));
  } else if constexpr (N == 96) {
    FMW_WGMMA_ASM(96, FMW_ACC_R48, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32), WGMMA_ACC8(d, 40));
  } else if constexpr (N == 104) {
    FMW_WGMMA_ASM(104, FMW_ACC_R52, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32), WGMMA_ACC8(d, 40), FMW_ACC4(d, 48));
  } else if constexpr (N == 112) {
    FMW_WGMMA_ASM(112, FMW_ACC_R56, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32), WGMMA_ACC8(d, 40), WGMMA_ACC8(d, 48));
  } else if constexpr (N == 120) {
    FMW_WGMMA_ASM(120, FMW_ACC_R60, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32), WGMMA_ACC8(d, 40), WGMMA_ACC8(d, 48), FMW_ACC4(d, 56));
  } else if constexpr (N == 128) {
    FMW_WGMMA_ASM(128, FMW_ACC_R64, WGMMA_ACC8(d, 0), WGMMA_ACC8(d, 8), WGMMA_ACC8(d, 16), WGMMA_ACC8(d, 24),
                  WGMMA_ACC8(d, 32), WGMMA_ACC8(d, 40), WGMMA_ACC8(d, 48), WGMMA_ACC8(d, 56));
  }
}

// The first two of a thread's 16-byte scale words of a block (fmw_scale_pos: j = 0..3), read ahead of the
// wgmma wait so their latency hides behind it (all eight would spill: the consumers are at 224 registers).
struct FmwScaleHead {
  float4 w0, w1;
};

DSV4_INLINE FmwScaleHead fmw_scale_head(const float* as) {
  const float4* as4 = reinterpret_cast<const float4*>(as) + (threadIdx.x & 3);
  return {as4[0], as4[4]};
}

// acc += d · (w0 for row g, w8 for row g + 8) · (the token's activation scale), over the thread's N / 2
// values (d[4j + c]: row 16·warp + g + 8·(c >> 1) of the pass, token 8j + 2t + (c & 1)). ROWS (whole-row
// fold): without w0, w8, whose row factors are applied once after the pass.
template <bool ROWS, int N>
DSV4_INLINE void fmw_promote(float (&acc)[64], const float (&d)[64], float w0, float w8, const float* as,
                             const FmwScaleHead& head) {
  const float4* as4 = reinterpret_cast<const float4*>(as) + (threadIdx.x & 3);
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    // fmw_scale_pos: tokens 8j + 2t, + 1 of j and j ^ 1
    const float4 s4 = j < 2 ? head.w0 : j < 4 ? head.w1 : as4[4 * (j >> 1)];
    const float2 s = (j & 1) ? make_float2(s4.z, s4.w) : make_float2(s4.x, s4.y);
    const float s0 = ROWS ? s.x : w0 * s.x, s1 = ROWS ? s.y : w0 * s.y;
    const float s8 = ROWS ? s.x : w8 * s.x, s9 = ROWS ? s.y : w8 * s.y;
    acc[4 * j + 0] = fmaf(d[4 * j + 0], s0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(d[4 * j + 1], s1, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(d[4 * j + 2], s8, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(d[4 * j + 3], s9, acc[4 * j + 3]);
  }
}

// The codes' common factor 2^(E - 127) · 2^(6 - FMOE_FOLD_TOP) · 2^-6 of a row whose largest exponent is E
// (the shifted bit move leaves value · 2^(t - 6) with t = FMOE_FOLD_TOP - (E - e); FMOE_FOLD_TOP = 12).
DSV4_INLINE float fmw_row_factor(unsigned emax) { return __uint_as_float(emax << 23) * 0.015625f; }

// What fmw_fold_shifts adds to a word of four exponent bytes whose maximum is E: (FMOE_FOLD_TOP - E) in
// every byte, mod 2^32.
DSV4_INLINE unsigned fmw_fold_base(unsigned emax) { return (FMOE_FOLD_TOP - emax) * 0x01010101u; }

// The fold shifts t_q = FMOE_FOLD_TOP - (E - e_q) of four exponent bytes e_q (one per byte), E at least each
// and at most FMOE_FOLD_SPAN above, from base = fmw_fold_base(E): one add, as no byte carries or borrows
// (each byte's result, 1 .. 12, is e_q - (E - FMOE_FOLD_TOP) with E - FMOE_FOLD_TOP <= e_q when E >= 12,
// and e_q + (FMOE_FOLD_TOP - E) <= FMOE_FOLD_TOP otherwise).
DSV4_INLINE unsigned fmw_fold_shifts(unsigned e, unsigned base) { return e + base; }

// The largest of four exponent bytes.
DSV4_INLINE unsigned fmw_max_byte(unsigned e) {
  return max(max(byte_of(e, 0), byte_of(e, 1)), max(byte_of(e, 2), byte_of(e, 3)));
}

// The thread's ldmatrix address for FP4 block 0, step 0 of the stage at `st` (as fast_moe_gemm.cu): lane L
// addresses row (L & 7) + 8·((L >> 3) & 1) of its warp's 16, chunk L >> 4, in the 128-byte swizzle (chunk c
// of row r at c ^ (r % 8)).
DSV4_INLINE unsigned fmw_fp4_addr(const unsigned char* st) {
  const int lane = threadIdx.x & 31, r16 = (threadIdx.x >> 5) * 16;
  const unsigned row = smem_addr(st) + (r16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * FMW_RB;
  return row | ((unsigned)((lane >> 4) ^ (lane & 7)) << 4);
}

// The B descriptor of step 0 of block b of the stage at `st`: the tokens' rows of 128 bytes in the 128-byte
// swizzle (wgmma_desc_sw128; step q adds 2q).
DSV4_INLINE unsigned long long fmw_desc(const unsigned char* st, int b) {
  return wgmma_desc_sw128(st + FMW_SLOT_W + FMW_SLOT_S + b * FMW_B_PANEL);
}

DSV4_INLINE unsigned long long fmw_desc_step(unsigned long long desc0, int q) { return desc0 + 2 * q; }

// A 128-block ready to run: the four steps' A fragments, the rows' factors and the tokens' scales.
struct FmwBlock {
  unsigned a[4][4];
  float w0, w8;              // rows g and g + 8: FP4 2^(E - 133) (folded codes), FP8 the block scale
  const float* as;           // the tokens' activation scales of the block
  unsigned long long desc;   // B of step 0
};

// Block b of the stage at `st`, folded (FP4 with UE8M0 scales that fold) or FP8. ROWS: FP4 folded against
// the rows' largest exponents over the whole row (base0, base8: their fmw_fold_base for rows g, g + 8; no
// factors), else against the block's.
template <bool FP4, bool ROWS>
DSV4_INLINE void fmw_load_block(const unsigned char* st, int b, unsigned base0, unsigned base8, FmwBlock& blk) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, r16 = (threadIdx.x >> 5) * 16;
  blk.as = reinterpret_cast<const float*>(st + FMW_SLOT_W + FMW_SLOT_S + FMW_SLOT_A) + b * FMW_T;
  blk.desc = fmw_desc(st, b);
  if (FP4) {
    const unsigned char* sb = st + FMW_SLOT_W;
    const unsigned e0 = *reinterpret_cast<const unsigned*>(sb + (r16 + g) * 8 + 4 * b);
    const unsigned e8 = *reinterpret_cast<const unsigned*>(sb + (r16 + g + 8) * 8 + 4 * b);
    unsigned tv0, tv8;
    if (ROWS) {
      tv0 = fmw_fold_shifts(e0, base0);
      tv8 = fmw_fold_shifts(e8, base8);
      blk.w0 = blk.w8 = 1.0f;  // unused
    } else {
      const unsigned m0 = fmw_max_byte(e0), m8 = fmw_max_byte(e8);
      tv0 = fmw_fold_shifts(e0, fmw_fold_base(m0));
      tv8 = fmw_fold_shifts(e8, fmw_fold_base(m8));
      blk.w0 = fmw_row_factor(m0);
      blk.w8 = fmw_row_factor(m8);
    }
    const unsigned la = fmw_fp4_addr(st);
#pragma unroll
    for (int q = 0; q < 4; q += 2) {
      unsigned frag[4];  // rows g, g + 8 of steps q and q + 1
      ldmatrix_x4(la ^ (unsigned)((4 * b + q) << 4), frag);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const Fp4Table tab0 = fp4_table_shifted(byte_of(tv0, q + h)), tab8 = fp4_table_shifted(byte_of(tv8, q + h));
#if FMW_PROBE_NO_DECODE
        blk.a[q + h][0] = blk.a[q + h][2] = frag[2 * h] & 0x0F0F0F0Fu;
        blk.a[q + h][1] = blk.a[q + h][3] = frag[2 * h + 1] & 0x0F0F0F0Fu;
        (void)tab0;
        (void)tab8;
#else
        e2m1x8_to_e4m3_halves(frag[2 * h], tab0, blk.a[q + h][0], blk.a[q + h][2]);
        e2m1x8_to_e4m3_halves(frag[2 * h + 1], tab8, blk.a[q + h][1], blk.a[q + h][3]);
#endif
      }
    }
  } else {
    const unsigned la = fmoe_fp8_a_addr(smem_addr(st) + (r16 + g) * FMW_RB, g, t);
#pragma unroll
    for (int q = 0; q < 4; ++q) fmoe_fp8_a_frag<true>(la, q, blk.a[q]);
    blk.w0 = blk.w8 = *reinterpret_cast<const float*>(st + FMW_SLOT_W);  // the rows' 128x128 block scale
  }
}

// A pass's tensor-core block sums, defined before its first wgmma (ptxas serialises wgmmas on undefined
// accumulators, C7511); every block's first wgmma overwrites them. Each pass has its own: a set shared by
// the passes of different N would keep the 64 registers live through the smaller wgmmas, and ptxas then
// serialises them for want of registers (C7511 again).
DSV4_INLINE void fmw_define(float (&d)[64]) {
#pragma unroll
  for (int v = 0; v < 64; ++v) d[v] = 0.0f;
}

// The block's four wgmmas, chained in the tensor core under one fence and one commit (a fence between
// chained wgmmas makes ptxas wait for each: WARPGROUP.DEPBAR 0).
template <int N>
DSV4_INLINE void fmw_issue(const FmwBlock& blk, float (&d)[64]) {
  wgmma_fence();
  fmw_wgmma<N>(d, blk.a[0], fmw_desc_step(blk.desc, 0), 0);
  fmw_wgmma<N>(d, blk.a[1], fmw_desc_step(blk.desc, 1), 1);
  fmw_wgmma<N>(d, blk.a[2], fmw_desc_step(blk.desc, 2), 1);
  fmw_wgmma<N>(d, blk.a[3], fmw_desc_step(blk.desc, 3), 1);
  wgmma_commit();
}

// FMW_TRACE: the SM clock cycles the thread spent in its waits during an item (the WFULL / WMMA events). The
// default build never writes them (every update is under `if (FMW_TRACE)`), so they compile away.
struct FmwWaits {
  unsigned full, mma;
};

DSV4_INLINE unsigned fmw_clock() {
  unsigned c = 0u;
  if (FMW_TRACE) asm volatile("mov.u32 %0, %%clock;\n" : "=r"(c));
  return c;
}

// The ring position of the consumers.
struct FmwRing {
  int slot;
  unsigned phase;
};

DSV4_INLINE void fmw_next(FmwRing& r) { fmoe_ring_advance(r.slot, r.phase, FMW_NSTAGES); }

// Waits for the slot's data. (No proxy fence: everything wgmma reads came by TMA, through the async proxy
// itself; the one generic copy, FP8's block scale, is read by ld.shared. When the tokens came by cp.async the
// fence was needed: without it, layer 1024 tokens 1.5% faster, 4096 0.6-1.1%, 16384 within its noise, -1 to
// +1%; BENCHMARKS.md, issue 11 twenty-second version.)
DSV4_INLINE const unsigned char* fmw_acquire(unsigned char* smem_base, unsigned smem, const FmwRing& r,
                                             FmwWaits& w) {
  const unsigned t0 = fmw_clock();
  mbar_wait(fmw_full(smem, r.slot), r.phase);
  if (FMW_TRACE) w.full += fmw_clock() - t0;
  return smem_base + r.slot * FMW_SLOT;
}

// The warp is done with the slot.
DSV4_INLINE void fmw_release(unsigned smem, const FmwRing& r) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(fmw_empty(smem, r.slot));
}

// Waits for the block's wgmmas and adds their sums to acc.
template <bool ROWS, int N>
DSV4_INLINE void fmw_finish(const FmwBlock& blk, float (&d)[64], float (&acc)[64], FmwWaits& w) {
  const FmwScaleHead head = fmw_scale_head(blk.as);
  const unsigned t0 = fmw_clock();
  wgmma_wait<0>();
  if (FMW_TRACE) w.mma += fmw_clock() - t0;
  wgmma_fence_operand(d);
  fmw_promote<ROWS, N>(acc, d, blk.w0, blk.w8, blk.as, head);
}

// acc += one folded FP4 pass (nks stages of two 128-blocks, the last one of one when K % 256 == 128),
// software-pipelined one block deep: while block 0's wgmmas run the warpgroup decodes block 1, while block
// 1's run it acquires the next stage and decodes its block 0; each block is promoted once its wgmmas are
// done, and the stage released after its last. N: the wgmmas' tokens (fmw_wgmma).
template <bool ROWS, int N>
DSV4_INLINE void fmw_pass_fp4(unsigned char* smem_base, unsigned smem, FmwRing& ring, int K, int nks, unsigned base0,
                              unsigned base8, float (&acc)[64], FmwWaits& w) {
  float d[64];
  fmw_define(d);
  FmwBlock b0, b1;
  const unsigned char* st = fmw_acquire(smem_base, smem, ring, w);
  fmw_load_block<true, ROWS>(st, 0, base0, base8, b0);
#pragma unroll 1
  for (int kb = 0; kb < nks; ++kb) {
    FmwRing next = ring;
    fmw_next(next);
    fmw_issue<N>(b0, d);
    if (fmoe_stage_blocks(true, K, kb) == 1) {  // a half stage: the pass's last
      fmw_finish<ROWS, N>(b0, d, acc, w);
    } else {
      fmw_load_block<true, ROWS>(st, 1, base0, base8, b1);
      fmw_finish<ROWS, N>(b0, d, acc, w);
      fmw_issue<N>(b1, d);
      if (kb + 1 < nks) {
        st = fmw_acquire(smem_base, smem, next, w);
        fmw_load_block<true, ROWS>(st, 0, base0, base8, b0);
      }
      fmw_finish<ROWS, N>(b1, d, acc, w);
    }
    fmw_release(smem, ring);
    ring = next;
  }
}

// acc += one FP8 pass (nks stages of one 128-block, the block scale as the rows' factor), pipelined the same
// way: while stage kb's wgmmas run, the warpgroup acquires stage kb + 1 and loads its fragments. Two stages
// per iteration, so blk[] is indexed by constants and stays in registers.
DSV4_INLINE void fmw_pass_fp8(unsigned char* smem_base, unsigned smem, FmwRing& ring, int nks, float (&acc)[64],
                             FmwWaits& w) {
  float d[64];
  fmw_define(d);
  FmwBlock blk[2];
  fmw_load_block<false, false>(fmw_acquire(smem_base, smem, ring, w), 0, 0u, 0u, blk[0]);
#pragma unroll 1
  for (int kb = 0; kb < nks; kb += 2) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (kb + i == nks) break;
      FmwRing next = ring;
      fmw_next(next);
      fmw_issue<FMW_T>(blk[i], d);
      if (kb + i + 1 < nks)
        fmw_load_block<false, false>(fmw_acquire(smem_base, smem, next, w), 0, 0u, 0u, blk[i ^ 1]);
      fmw_finish<false, FMW_T>(blk[i], d, acc, w);
      fmw_release(smem, ring);
      ring = next;
    }
  }
}

// acc += one FP4 pass whose scales do not fold (f32, or UE8M0 blocks spanning more than 2^FMOE_FOLD_SPAN):
// every k32 step is promoted with its own per-32 scale (times 2^6, the plain bit move). The fallback: correct
// for any scales, several times slower.
DSV4_INLINE void fmw_pass_unfolded(unsigned char* smem_base, unsigned smem, FmwRing& ring, const FmwItem& it,
                                   int K, int nks, float (&acc)[64], FmwWaits& w) {
  float d[64];
  fmw_define(d);
  const int lane = threadIdx.x & 31, g = lane >> 2, r16 = (threadIdx.x >> 5) * 16;
#pragma unroll 1
  for (int kb = 0; kb < nks; ++kb) {
    const unsigned char* st = fmw_acquire(smem_base, smem, ring, w);
    const float* sc = reinterpret_cast<const float*>(st + FMW_SLOT_W);
    const unsigned la = fmw_fp4_addr(st);
#pragma unroll 1
    for (int b = 0; b < fmoe_stage_blocks(true, K, kb); ++b) {
      float w0[4], w8[4];
      fmoe_fp4_scales(sc, r16 + g, b, it.s8, w0, w8);
#pragma unroll
      for (int q = 0; q < 4; ++q) w0[q] *= 64.0f, w8[q] *= 64.0f;  // the plain bit move's 2^-6
      const float* as = reinterpret_cast<const float*>(st + FMW_SLOT_W + FMW_SLOT_S + FMW_SLOT_A) + b * FMW_T;
      const unsigned long long desc = fmw_desc(st, b);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        unsigned frag[4], a[4];
        ldmatrix_x4(la ^ (unsigned)((4 * b + (q & ~1)) << 4), frag);
        const int h = (q & 1) * 2;
        e2m1x8_to_e4m3_halves(frag[h], fp4_table_plain(), a[0], a[2]);
        e2m1x8_to_e4m3_halves(frag[h + 1], fp4_table_plain(), a[1], a[3]);
        wgmma_fence();
        fmw_wgmma<FMW_T>(d, a, fmw_desc_step(desc, q), 0);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operand(d);
        fmw_promote<false, FMW_T>(acc, d, w0[q], w8[q], as, fmw_scale_head(as));
      }
    }
    fmw_release(smem, ring);
    fmw_next(ring);
  }
}

// The stash of a warp's accumulators into a [token][row] bf16 buffer, by stmatrix (fp8_mma.cuh): the
// accumulator layout is stmatrix's fragment layout with rows = the warp's 16 weight rows and columns =
// tokens, so the transposed store writes 8 rows of a token as 16 bytes. One instruction stores the tokens
// 16p .. 16p + 15 (pair p of 8-token groups: acc[8p .. 8p + 7]); lane L gives the address of token
// fmw_stash_token(p) and rows fmw_stash_row() .. + 7 of the warp's 16. Rounding: the hardware cvt
// (pack_bf16x2), f32_to_bf16's value except for a NaN's payload. (Before: one 2-byte store, and for y
// f32_to_bf16's ~8 instructions, a value.)
DSV4_INLINE int fmw_stash_token(int p) { return 16 * p + 8 * ((threadIdx.x >> 4) & 1) + (threadIdx.x & 7); }
DSV4_INLINE int fmw_stash_row() { return 8 * ((threadIdx.x >> 3) & 1); }
DSV4_INLINE void fmw_stash_pair(const float (&acc)[64], int p, unsigned addr) {
  stmatrix_x4_trans(addr, pack_bf16x2(acc[8 * p], acc[8 * p + 1]), pack_bf16x2(acc[8 * p + 2], acc[8 * p + 3]),
                    pack_bf16x2(acc[8 * p + 4], acc[8 * p + 5]), pack_bf16x2(acc[8 * p + 6], acc[8 * p + 7]));
}

// Element (tok, j) of an up matrix: token rows of 256 bytes whose 16-byte chunks (8 j) are XOR-swizzled by
// tok % 16. The fragment stash (fmw_up_stash: a warp's lanes write one chunk of 8 tokens 2 apart, 2 lanes a
// word) then spreads over all banks; the quantising threads' 16-byte chunk reads (fmw_up_h_quant: a quarter
// warp reads the even, then the odd chunks of one token) over half of them, two wavefronts a read.
DSV4_INLINE int fmw_ep_index(int tok, int j) { return tok * 128 + ((((j >> 3) ^ (tok & 15)) << 3) | (j & 7)); }

// bf16(acc) into an up matrix (fmw_stash_pair): the thread's warp's rows 16·warp .. + 15. The hardware
// rounding loses only a NaN's payload, and h, its codes and its scale are the same for every NaN of g or u
// (fminf and the clamp treat them alike). Only the pairs of 8-token groups that hold one of the tile's n: the
// quantisation reads no other.
DSV4_INLINE void fmw_up_stash(const float (&acc)[64], bf16_t* m, int n) {
  const unsigned base = smem_addr(m);
  const int j = (threadIdx.x >> 5) * 16 + fmw_stash_row();
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    if (16 * p >= n) break;  // uniform over the block
    fmw_stash_pair(acc, p, base + 2u * (unsigned)fmw_ep_index(fmw_stash_token(p), j));
  }
}

// Up, gate pass: the bf16 gate values into the first up matrix; the tile's routing weights into wt (thread
// tid < FMW_T gives token tid's, fmw_epilogue_read).
DSV4_INLINE void fmw_up_gate(const FmwItem& it, float route_w, const float (&acc)[64], bf16_t* ep, float* wt) {
  const int tid = threadIdx.x;
  named_barrier(1, FMW_CONSUMERS);  // the previous item's quantisation has read ep and wt
  if (tid < FMW_T) wt[tid] = route_w;
  fmw_up_stash(acc, ep, it.n);
}

// Up, up pass: the bf16 up values into the second matrix; then FMW_H_THREADS threads a token make h from the
// two matrices and the per-128 act_quant: codes in the halves order and the scale. Thread `sub` of a token takes
// its 16 j of 32-block sub / 2 (chunks 2·sub, + 1: 8 j each, fmw_ep_index), keeps h in registers, and the
// token's eight threads (adjacent lanes) join their largest |h| by shuffles. A 32-block leaves as two 16-byte
// words, word w holding .x (w = 0) or .y (w = 1) of its four chunks' fmoe_h_words8 (t8 = 0 .. 3): the pair of
// threads that hold the block swap one half of their words, and the even one stores word 0, the odd one
// word 1. A round covers FMW_CONSUMERS / FMW_H_THREADS = 32 tokens: at an expert's ~24 tokens (1024 tokens
// a layer) every thread makes 16 values where two threads a token left 208 of the 256 idle and made 64 values
// each, one after another, through an h buffer in shared memory: the epilogue was ~2.7 µs of a ~26 µs item,
// the weights' stream stopped (fmw_trace, forty-fifth session).
#define FMW_H_THREADS 8
DSV4_INLINE void fmw_up_h_quant(const FmoeArgs& a, const FmwItem& it, const float (&acc)[64], float limit, bf16_t* ep,
                                const float* wt, unsigned char* out_q, float* out_s) {
  fmw_up_stash(acc, ep + FMW_UP_MATRIX, it.n);
  named_barrier(1, FMW_CONSUMERS);  // both matrices and wt are written
  if (FMW_PROBE_NO_EPI) return;
  const int sub = threadIdx.x & (FMW_H_THREADS - 1), blk = sub >> 1, odd = sub & 1;
#pragma unroll 1
  for (int tok0 = 0; tok0 < it.n; tok0 += FMW_CONSUMERS / FMW_H_THREADS) {  // uniform over the block
    const int tok = tok0 + threadIdx.x / FMW_H_THREADS;
    const bool live = tok < it.n;
    unsigned hw[2][4];  // h as bf16 pairs (exact: fmoe_h_round's values), half the registers of f32
    float m = 0.0f;
    if (live) {
      const uint4* gate = reinterpret_cast<const uint4*>(ep + tok * 128);
      const uint4* up = reinterpret_cast<const uint4*>(ep + FMW_UP_MATRIX + tok * 128);
      const float w = wt[tok];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int chunk = (2 * sub + e) ^ (tok & 15);
        const uint4 g4 = gate[chunk], u4 = up[chunk];
        const unsigned gw[4] = {g4.x, g4.y, g4.z, g4.w}, uw[4] = {u4.x, u4.y, u4.z, u4.w};
        float gv[8], uv[8];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          gv[2 * c] = __uint_as_float(gw[c] << 16), gv[2 * c + 1] = __uint_as_float(gw[c] & 0xffff0000u);
          uv[2 * c] = __uint_as_float(uw[c] << 16), uv[2 * c + 1] = __uint_as_float(uw[c] & 0xffff0000u);
        }
        float hv[8];
        fmoe_h_values8(gv, uv, w, limit, !it.shared, hv);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          m = fmaxf(m, fmaxf(fabsf(hv[2 * c]), fabsf(hv[2 * c + 1])));
          hw[e][c] = (__float_as_uint(hv[2 * c]) >> 16) | (__float_as_uint(hv[2 * c + 1]) & 0xffff0000u);
        }
      }
    }
#pragma unroll
    for (int o = 1; o < FMW_H_THREADS; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const float s = fmoe_h_scale(m), inv = fmoe_h_inv(s);
    uint2 wd[2] = {{0u, 0u}, {0u, 0u}};  // chunks t8 = 2·odd, + 1 of the block
    if (live) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float hv[8];
#pragma unroll
        for (int c = 0; c < 4; ++c)
          hv[2 * c] = __uint_as_float(hw[e][c] << 16), hv[2 * c + 1] = __uint_as_float(hw[e][c] & 0xffff0000u);
        wd[e] = fmoe_h_words8<true>(hv, inv);
      }
    }
    const uint2 w0 = wd[0], w1 = wd[1];
    // The even thread gives its .y words and takes the odd one's .x words (all lanes shuffle).
    const unsigned r0 = __shfl_xor_sync(0xffffffffu, odd ? w0.x : w0.y, 1);
    const unsigned r1 = __shfl_xor_sync(0xffffffffu, odd ? w1.x : w1.y, 1);
    if (live) {
      unsigned char* dst = out_q + fmw_act_row(a, it, tok) * a.N + it.rb * FMW_ROWS + 32 * blk + 16 * odd;
      *reinterpret_cast<uint4*>(dst) = odd ? make_uint4(r0, r1, w0.y, w1.y) : make_uint4(w0.x, w1.x, r0, r1);
      if (sub == 0) out_s[fmw_act_scale_at(it, a.N / 128, it.rb, tok)] = s;
    }
  }
}

// Down: y[out row][row] = bf16(acc), staged per warpgroup so each token's 64 rows leave in 16-byte pieces.
// Thread l of a warpgroup gives token l's output row (fmw_epilogue_read; -1 past the tile's count) through
// shared memory to the threads that copy that token's pieces.
DSV4_INLINE void fmw_down_store(const FmoeArgs& a, const FmwItem& it, const float (&acc)[64], int my_row, bf16_t* ep,
                                bf16_t* y) {
  const int tid = threadIdx.x, wg = tid >> 7, l = tid & 127;
  bf16_t* buf = ep + wg * (FMW_T * FMW_DOWN_STRIDE);
  int* out_rows = reinterpret_cast<int*>(ep + 2 * FMW_T * FMW_DOWN_STRIDE) + wg * FMW_T;
  named_barrier(2 + wg, 128);  // the warpgroup's previous copy-out has read buf and out_rows
  if (l < FMW_T) out_rows[l] = my_row;
  const unsigned at = smem_addr(buf) + 2u * (unsigned)(((tid >> 5) & 3) * 16 + fmw_stash_row());
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    if (16 * p >= it.n) break;  // uniform over the block
    fmw_stash_pair(acc, p, at + 2u * (unsigned)(fmw_stash_token(p) * FMW_DOWN_STRIDE));
  }
  named_barrier(2 + wg, 128);
  // The thread copies 16 bytes of tokens l / 8 + 16 i.
  const int c8 = l & 7;
#pragma unroll
  for (int i = 0; i < FMW_T / 16; ++i) {
    const int tok = (l >> 3) + 16 * i;
    const int orow = out_rows[tok];
    if (orow >= 0)
      *reinterpret_cast<uint4*>(y + (long long)orow * a.N + it.rb * FMW_ROWS + 64 * wg + 8 * c8) =
          *reinterpret_cast<const uint4*>(buf + tok * FMW_DOWN_STRIDE + 8 * c8);
  }
}

// What an item's epilogue reads from global memory, read when the item starts so that the reads' latency
// hides under the mainloop (each read where the epilogue needed it cost the consumers a global round trip, two
// chained for the routing weight, per item): up, thread tid < FMW_T token tid's routing weight (1 for the
// shared expert and past the tile's count); down, thread l of each warpgroup token l's output row (-1 past the
// count).
struct FmwEpilogueRead {
  float route_w;
  int out_row;
};

template <bool UP>
DSV4_INLINE FmwEpilogueRead fmw_epilogue_read(const FmoeArgs& a, const FmwItem& it, const float* route_w) {
  const int tok = threadIdx.x & (FMW_T - 1);
  FmwEpilogueRead r = {1.0f, -1};
  if (UP) {
    if (threadIdx.x < FMW_T && !it.shared && route_w != nullptr && tok < it.n)
      r.route_w = route_w[fmw_out_row(a, it, tok)];
  } else if (tok < it.n) {
    r.out_row = (int)fmw_out_row(a, it, tok);
  }
  return r;
}

// Shared body of both kernels (see fast_moe_gemm.cu's fmoe_gemm for the operands).
template <bool UP>
DSV4_INLINE void fmw_gemm(const FmoeArgs& a, const float* route_w, float limit, unsigned char* out_q, float* out_s,
                          bf16_t* out_y, const unsigned char* act_map, unsigned* queue) {
  extern __shared__ __align__(1024) unsigned char fmw_smem[];
  const unsigned smem = smem_addr(fmw_smem);
  if ((smem & 1023u) != 0) __trap();  // the swizzle addressing needs 1024-byte aligned slots
  if (threadIdx.x == 0)  // the full barriers' cp.async arrivals: the producer thread's (fmw_produce)
    fmoe_ring_init(smem + FMW_BARS, FMW_NSTAGES, FMW_CONSUMERS / 32, 1);
  // The codes the probe does not copy: bytes 0x38 (e4m3 1.0; FP4 nibbles 1.5 and -0), not stale bytes (NaN
  // codes) and not zeros (with zeros the probe measured 13% slower than the real kernels at 4096 tokens, H100:
  // an all-zero h, not the stream, set its time; unexplained).
  if (FMW_PROBE_NO_STREAM) {
    for (int i = threadIdx.x; i < FMW_NSTAGES * FMW_SLOT / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(fmw_smem)[i] = make_uint4(0x38383838u, 0x38383838u, 0x38383838u, 0x38383838u);
    fence_proxy_async_shared();  // (before the TMA writes the copied parts)
  }
  __syncthreads();
  if (threadIdx.x >= FMW_CONSUMERS) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(FMW_PRODUCER_REGS));
    fmw_produce<UP>(a, act_map, smem, queue);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(FMW_CONSUMER_REGS));
  bf16_t* ep = reinterpret_cast<bf16_t*>(fmw_smem + FMW_NSTAGES * FMW_SLOT);
  float* wt = reinterpret_cast<float*>(fmw_smem + FMW_WT);
  FmwRing ring = {0, 0u};
  float acc[64];
#pragma unroll 1
  for (int n = 0;; ++n) {
    // The item comes in its first stage's record (fmw_put_record): the producer skips other ranks' items and
    // ends the block's with a mark.
    const unsigned long long t_start = FMW_TRACE ? moe_trace_now(n) : 0ull;
    mbar_wait(fmw_full(smem, ring.slot), ring.phase);  // the first stage, not consumed here
    FmwItem it;
    if (!fmw_item_of_record<UP>(a, fmw_smem + FMW_REC + ring.slot * FMW_REC_BYTES, it)) break;
    const int trace_arg = (UP ? 0 : FMW_TRACE_DOWN) | (it.tile * (a.N / FMW_ROWS) + it.rb);
    if (FMW_TRACE && threadIdx.x == 0) {
      fmw_trace(FMW_EV_START, trace_arg, n, t_start);  // the time it began to wait for the record
      fmw_trace(FMW_EV_DATA, trace_arg | (int)(it.rowe[0] == 0xffffffffu && it.n < 0), n);  // (made from the record)
    }
    const FmwEpilogueRead er = fmw_epilogue_read<UP>(a, it, route_w);
    const int nks = fmoe_stages(it.fp4, a.K);
    FmwWaits waits = {0u, 0u};
    const unsigned item_clock = fmw_clock();
    for (int pass = 0; pass < fmw_passes(UP); ++pass) {
#pragma unroll
      for (int v = 0; v < 64; ++v) acc[v] = 0.0f;
      if (FMW_PROBE_NO_MATH) {
        for (int kb = 0; kb < nks; ++kb) {  // each stage waited for and released, nothing computed
          fmw_acquire(fmw_smem, smem, ring, waits);
          fmw_release(smem, ring);
          fmw_next(ring);
        }
      } else if (!it.fp4) {
        fmw_pass_fp8(fmw_smem, smem, ring, nks, acc, waits);
      } else if (a.fold && it.s8 && (pass == 0 ? it.rowfold[0] : it.rowfold[1])) {
        const unsigned rowe = pass == 0 ? it.rowe[0] : it.rowe[1];
        const unsigned er0 = rowe & 0xffu, er8 = rowe >> 8;
        const unsigned base0 = fmw_fold_base(er0), base8 = fmw_fold_base(er8);
#define FMW_PASS_N(NN)                                                                                                \
  case NN:                                                                                                            \
    if constexpr (NN <= FMW_T) fmw_pass_fp4<true, NN>(fmw_smem, smem, ring, a.K, nks, base0, base8, acc, waits);      \
    break;
        switch (fmw_tile_n(it.n)) {  // uniform over the block
          FMW_PASS_N(8) FMW_PASS_N(16) FMW_PASS_N(24) FMW_PASS_N(32) FMW_PASS_N(40) FMW_PASS_N(48)
          FMW_PASS_N(56) FMW_PASS_N(64) FMW_PASS_N(72) FMW_PASS_N(80) FMW_PASS_N(88) FMW_PASS_N(96)
          FMW_PASS_N(104) FMW_PASS_N(112) FMW_PASS_N(120)
          default: fmw_pass_fp4<true, FMW_T>(fmw_smem, smem, ring, a.K, nks, base0, base8, acc, waits);
        }
#undef FMW_PASS_N
        const float w0 = fmw_row_factor(er0), w8 = fmw_row_factor(er8);  // exact: powers of two
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          acc[4 * j + 0] *= w0, acc[4 * j + 1] *= w0;
          acc[4 * j + 2] *= w8, acc[4 * j + 3] *= w8;
        }
      } else if (a.fold && it.s8) {
        fmw_pass_fp4<false, FMW_T>(fmw_smem, smem, ring, a.K, nks, 0u, 0u, acc, waits);
      } else {
        fmw_pass_unfolded(fmw_smem, smem, ring, it, a.K, nks, acc, waits);
      }
      if (FMW_TRACE && threadIdx.x == 0 && pass == fmw_passes(UP) - 1) fmw_trace(FMW_EV_MATH, trace_arg, n);
      if (!UP)
        fmw_down_store(a, it, acc, er.out_row, ep, out_y);
      else if (pass == 0)
        fmw_up_gate(it, er.route_w, acc, ep, wt);
      else
        fmw_up_h_quant(a, it, acc, limit, ep, wt, out_q, out_s);
    }
    if (FMW_TRACE && threadIdx.x == 0) {
      fmw_trace(FMW_EV_DONE, trace_arg, n);
      fmw_trace(FMW_EV_WFULL, trace_arg, n, waits.full + 1ull);  // (+ 1: a zero time means now)
      fmw_trace(FMW_EV_WMMA, trace_arg, n, waits.mma + 1ull);
      fmw_trace(FMW_EV_CYCLES, trace_arg, n, fmw_clock() - item_clock + 1ull);
    }
  }
}

// x's codes and scales (act_quant, as fmoe_select_kernel or the logits kernel stored them by token) in this
// path's layout for fmw_up_kernel (fmw_act_row, fmw_act_scale_at). A copy of x per assignment (T·k·D bytes,
// 100 MB at 4096 tokens of Flash) buys the up GEMM a producer of one thread (fmw_produce). The shared expert's
// tiles are x's rows in token order already, so their codes are not copied: the up GEMM reads them from xq (the
// map after x_map), and only their scales are put in the consumers' order here.
//
// By token: a warp takes a token, loads its row once and stores it at each of its assignments' plan rows, so x
// is read from DRAM once. (Copied by tile, block (b, y) taking tile b's rows y, y + 4, .., each wave of blocks
// touched all of x and read it again per assignment: 413 MB of DRAM reads for x's 67 MB at 16384 tokens, 317 µs
// of the layer, fifty-first session. The layer measured the same either way, 16384 tokens 8534 µs by token
// against 8521 by tile, 4096 2323 / 2325 (H100, fifty-second session, BENCHMARKS.md): kept for the bytes, not
// the time.) An assignment a = t·k + j of expert e has the plan row p the wide plan's place kernel gives it
// (moe_plan_place_kernel: offsets[e] + counts[a / PLAN_CHUNK][e] + ranks[a], the scratch the plan leaves), so
// this kernel needs the wide plan (FastMoe::experts_on makes it for every prefill-path batch) and its tile
// (the plan's tiles of FMW_T rows, in expert order) is the tiles of the experts before e plus (p - offsets[e]) /
// FMW_T. A warp a token; the blocks' warps stride over the tokens, so any grid does.
// FMW_GATHER_UNROLL: 16-byte loads a lane in flight before their stores (4 registers each). (Measured at 4 as a
// bench variant, 39 registers instead of 60, six blocks an SM instead of four: layer 4096 tokens 2297 µs against
// 2293, 16384 8553 / 8525; and x loaded with an L2 evict-last policy, the copies stored streaming: 2305 / 8577.
// No change either way: H100, fifty-third session, BENCHMARKS.md.)
#define FMW_GATHER_UNROLL 8

// Where assignment a's copy goes: its plan row and its tile's (index, column); row < 0 for an assignment this
// rank does not compute (an expert of another rank, or an id outside [0, E)). tile_base: the tiles of the
// experts before each expert (shared memory).
struct FmwPlace {
  int row, tile, col;
};
DSV4_INLINE FmwPlace fmw_place(int a, int E, int e_begin, int e_end, const int* ids, const int* ranks,
                               const int* counts, const int* offsets, const int* tile_base) {
  const int e = ids[a];
  if (ranks[a] < 0 || e < e_begin || e >= e_end) return {-1, 0, 0};
  const int within = plan_wide_within(a, e, E, counts, ranks);
  return {offsets[e] + within, tile_base[e] + within / FMW_T, within % FMW_T};
}

// tile_base[e] for e < E: the plan's tiles of experts 0 .. e - 1 (plan_tiles_of, as plan_offsets_and_tiles
// counts them). All the block's threads call; ends with a barrier.
DSV4_INLINE void fmw_tile_bases(const int* offsets, int E, int* tile_base, int* wsum) {
  const int C = (E + (int)blockDim.x - 1) / (int)blockDim.x, e0 = threadIdx.x * C;
  auto tiles_of = [&](int e) { return plan_tiles_of(offsets[e + 1] - offsets[e], FMW_T); };
  int mine = 0;
  for (int c = 0; c < C; ++c)
    if (e0 + c < E) mine += tiles_of(e0 + c);
  int total;
  int run = block_excl_scan(mine, wsum, &total, PlanSync{0u, (unsigned)blockDim.x});
  for (int c = 0; c < C; ++c)
    if (e0 + c < E) {
      tile_base[e0 + c] = run;
      run += tiles_of(e0 + c);
    }
  __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256)
    fmw_gather_x_kernel(const unsigned char* xq, const float* xs, int T, int D, int k, const int* ntiles,
                        int e_begin, int e_end, int has_shared, const int* ids, const int* ranks, const int* counts,
                        const int* offsets, int E, unsigned char* xq_plan, float* xs_plan, unsigned* queues) {
  dsv4_pdl_begin();
  // Both GEMMs' item queues (fmw_take) back to their first item: the up GEMM reads its queue only after its
  // programmatic wait, once this kernel has finished, and the down GEMM after the up GEMM's.
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x < 2) queues[threadIdx.x] = 0u;
  const int warps = blockDim.x >> 5, first = blockIdx.x * warps, step = gridDim.x * warps;
  if (first >= T) return;  // (whole block: no token)
  __shared__ int tile_base[PLAN_WIDE_MAX_EXPERTS];
  __shared__ int wsum[32];
  fmw_tile_bases(offsets, E, tile_base, wsum);
  const int nrt = *ntiles, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, blocks = D / 128;
  constexpr int U = FMW_GATHER_UNROLL;
  static_assert(ROUTER_MAX_K <= 32, "fmw_gather_x_kernel: a lane holds one assignment's place");
  for (int t = first + warp; t < T; t += step) {
    // Lane j < k holds the place of the token's assignment j; the warp reads them by shuffles.
    FmwPlace mine{-1, 0, 0};
    if (lane < k) mine = fmw_place(t * k + lane, E, e_begin, e_end, ids, ranks, counts, offsets, tile_base);
    // The codes: the row U·512 bytes at a time, stored at each assignment's plan row.
    const uint4* src = reinterpret_cast<const uint4*>(xq + (long long)t * D);
    for (int v0 = 0; v0 < D / 16; v0 += U * 32) {
      uint4 r[U];
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (v0 + 32 * u + lane < D / 16) r[u] = *(src + v0 + 32 * u + lane);
      for (int j = 0; j < k; ++j) {
        const int row = __shfl_sync(0xffffffffu, mine.row, j);
        if (row < 0) continue;
        uint4* dst = reinterpret_cast<uint4*>(xq_plan + (long long)row * D);
#pragma unroll
        for (int u = 0; u < U; ++u)
          if (v0 + 32 * u + lane < D / 16) *(dst + v0 + 32 * u + lane) = r[u];
      }
    }
    // The scales: a lane a 128-block, into each assignment's tile and column (fmw_act_scale_at's layout), and
    // the shared expert's tile (nrt + t / FMW_T, column t % FMW_T).
    for (int b0 = 0; b0 < blocks; b0 += 32) {
      const int b = b0 + lane;
      const float sc = b < blocks ? xs[(long long)t * blocks + b] : 0.0f;
      for (int j = 0; j < k; ++j) {
        const int row = __shfl_sync(0xffffffffu, mine.row, j), tile = __shfl_sync(0xffffffffu, mine.tile, j),
                  col = __shfl_sync(0xffffffffu, mine.col, j);
        if (row >= 0 && b < blocks) xs_plan[((long long)tile * blocks + b) * FMW_T + fmw_scale_pos(col)] = sc;
      }
      if (has_shared && b < blocks)
        xs_plan[((long long)(nrt + t / FMW_T) * blocks + b) * FMW_T + fmw_scale_pos(t % FMW_T)] = sc;
    }
  }
}

// GEMM1 + SwiGLU + routing weight + FP8 quantisation of h; fmoe_up_kernel's operands, with the plan made for
// FMW_T-token tiles, x in this path's layout (fmw_gather_x_kernel: xs, and x_map, a tensor map over its
// codes followed by one over xq's rows by token, the shared expert's; xq is not read).
extern "C" __global__ void __launch_bounds__(FMW_THREADS, 1)
    fmw_up_kernel(const unsigned char* xq, const float* xs, int T, int D, int I, int k, const int* rows,
                  const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned char* maps,
                  const unsigned long long* s1, const unsigned long long* s3, int fmt, int shared_fmt,
                  const float* shared_s1, const float* shared_s3, const unsigned char* sc8, const float* route_w,
                  float limit, const unsigned char* x_map, unsigned char* hq, float* hs, unsigned* queue) {
  dsv4_pdl_begin();
  const FmoeArgs a = fmoe_args(xq, xs, T, D, I, k, rows, tiles, ntiles, e_begin, e_end, maps, s1, s3, fmt,
                               shared_fmt, shared_s1, shared_s3, sc8, D, I);
  fmw_gemm<true>(a, route_w, limit, hq, hs, nullptr, x_map, queue);
}

// GEMM2: fmoe_down_kernel's operands, with the plan made for FMW_T-token tiles, h in this path's layout
// (the up kernel's) and h_map, a tensor map over hq's rows (fast_moe_wide::h_tensor_map).
extern "C" __global__ void __launch_bounds__(FMW_THREADS, 1)
    fmw_down_kernel(const unsigned char* hq, const float* hs, int T, int I, int D, int k, const int* rows,
                    const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned char* maps,
                    const unsigned long long* s2, int fmt, int shared_fmt, const float* shared_s2,
                    const unsigned char* sc8, const unsigned char* h_map, unsigned short* y, unsigned* queue) {
  dsv4_pdl_begin();
  const FmoeArgs a = fmoe_args(hq, hs, T, I, D, k, rows, tiles, ntiles, e_begin, e_end, maps, s2, s2, fmt,
                               shared_fmt, shared_s2, shared_s2, sc8, D, I);
  fmw_gemm<false>(a, nullptr, 0.0f, nullptr, nullptr, y, h_map, queue);
}
