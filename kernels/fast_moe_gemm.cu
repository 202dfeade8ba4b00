// fast_moe_gemm kernel family: the fast set's grouped expert GEMMs on Hopper's FP8 tensor cores (wgmma),
// kernels/SPEC.md ## fast_moe_gemm.cu, ../shared/KERNELS.md §1-3.
//
// fmoe_up_kernel:   hq, hs = act_quant(bf16(silu(min(bf16(W1 x), L)) · clamp(bf16(W3 x), ±L) · w))
// fmoe_down_kernel: y = bf16(W2 hq)
// fmoe_experts_kernel: both in one launch, the same items and bits (the fused decode path, 4-16 tokens; the two
// kernels run the other decode batches). Its down items wait for their tile's up items through counters in
// global memory.
//
// Work items. The plan (moe_plan_kernel, tile_rows = FMOE_TOKENS) lists (expert, start, count) tiles of at
// most FMOE_TOKENS routed assignments; the shared expert adds ceil(T / FMOE_TOKENS) tiles of consecutive
// tokens after them. Each tile is cut into row blocks of FMOE_ROWS = 256 weight rows: for up, FMOE_UP_J =
// 128 j as gate rows j.. then up rows j.. (so SwiGLU and the per-128 FP8 quantisation of h stay inside the
// block); for down, FMOE_DOWN_ROWS = 256 output rows. Blocks are persistent and take items blockIdx.x,
// + gridDim.x, ... in order (fmoe_experts_kernel: from a queue); an item's outputs depend only on the item, so
// they are deterministic bit for bit whichever block computes them.
//
// The pipeline. Each block has FMOE_WARPGROUPS consumer warpgroups and one producer warp, joined by a ring
// of FMOE_STAGES shared-memory slots with a "full" and an "empty" mbarrier each. The producer walks the
// block's items and their stages in order and fills a slot once its consumers have released it: the weight
// rows by TMA (tensor maps of each expert matrix, built at finalize: a few instructions per stage, 128-byte
// swizzled rows), FP4 scales by bulk copies of the layer's UE8M0 byte table (or TMA of the f32 scales when
// that table is not exact), the tokens' codes and scales (a gather over the plan's rows) and FP8 block
// scales by cp.async; the slot's full barrier completes when all of them have landed. So the next item's
// first stages load while the current item finishes, and no block-wide barrier stalls the stream. A stage is
// 128 bytes of each of the 256 weight rows (FP4: 256 k, two 128-blocks; FP8: 128 k), FP4's per-32 scales or
// FP8's block scales, and the item's FMOE_TOKENS activation rows over the same k (e4m3 codes, laid out as
// wgmma's K-major B operand: 16-byte core-matrix rows) with their per-128 scales.
//
// The math. Warpgroup w owns weight rows 64w .. 64w + 63 of the stage (one m64 wgmma tile). Per k32 step a
// thread loads its A fragment with ldmatrix (FP4) or 8-byte loads (FP8), re-encodes FP4 as e4m3 by the
// exact bit move (fp8_mma.cuh; the 2^-6 it leaves is folded into the scale) and issues
// wgmma.mma_async m64nNk32 e4m3 x e4m3 -> f32 (N = 8 or 16 tokens) with A from registers and the tokens
// from shared memory. Each step's product starts from zero and is added to the thread's f32 sums times the
// weight scale of its row and 32-block (promotion every k32: exact for the per-32 FP4 scales, and it keeps
// the tensor core's reduced-precision accumulation to one 32-term sum, ../shared/KERNELS.md §1). A 128-block's
// four steps are issued back to back, each into its own registers, and promoted after one wait: the tensor
// core pipelines them and the warp waits once a block (2-3.5% faster from B = 8 than two alternating steps,
// each waited for; decoding a stage's second block while the first one's wgmmas run needs more registers
// than the 17 warps leave, 96, and spilled: 3-5% slower). After each 128-block the sums are added times the
// tokens' activation scales.
//
// Activations are stored in "fragment order" (fp8_mma.cuh): within each 32 of K the codes are permuted so
// that the B rows a wgmma reads match the k of the A fragments the FP4 bit move produces.
#include "common.cuh"
#include "fp8_mma.cuh"
#include "fast_moe_common.cuh"
#include "fast_moe_route.cuh"  // fmoe_route_experts_kernel's router steps
#include "moe_plan.cuh"        // and its plan

// FMOE_TOKENS, FMOE_WARPGROUPS, FMOE_STAGES, FMOE_UP_J, FMOE_DOWN_ROWS, FMOE_SMEM_BYTES and the tensor map
// table's layout (FMOE_MAP_*) come from dsv4_consts.cuh (src/cuda/kernels/fast_moe_gemm.rs).
// FMOE_RING_SLOTS: the ring's slots, FMOE_STAGES (the host sizes the shared memory for those), or fewer in a
// diagnostic variant: fewer bytes in flight a block, and what that costs says how much the stream is bound by them.
#ifndef FMOE_RING_SLOTS
#define FMOE_RING_SLOTS FMOE_STAGES
#endif
static_assert(FMOE_RING_SLOTS >= 2 && FMOE_RING_SLOTS <= FMOE_STAGES, "fast_moe_gemm: FMOE_RING_SLOTS out of range");
#define FMOE_CONSUMERS (FMOE_WARPGROUPS * 128)
#define FMOE_THREADS (FMOE_CONSUMERS + 32)  // the consumer warpgroups, then the producer warp
#define FMOE_ROWS (FMOE_WARPGROUPS * 64)    // weight rows of an item (and of a stage)
// A stage holds FMOE_RB = 128 bytes of each of the item's 256 weight rows: 256 k of FP4 (two 128-blocks)
// or 128 k of FP8 (one), as two TMA boxes of 128 rows in the 128-byte swizzle (16-byte chunk c of row r at
// chunk c ^ (r % 8), so fragment loads of 8 rows hit distinct banks).
#define FMOE_RB 128
#define FMOE_BOX_ROWS 128
#define FMOE_SLOT_W (FMOE_ROWS * FMOE_RB)
#define FMOE_SLOT_S (FMOE_ROWS * 8 * 4)        // FP4: 8 per-32 scales a row (f32, or UE8M0 bytes in the first
                                               // 2 KiB); FP8: the two 128x128 block scales
#define FMOE_SLOT_A (16 * FMOE_TOKENS * 16)    // activation codes: 16 k16 chunks x FMOE_TOKENS x 16 bytes
#define FMOE_SLOT_AS 128                       // activation scales: 2 blocks x FMOE_TOKENS floats
// Slots stay 1024-byte aligned (the swizzle pattern's period).
#define FMOE_SLOT (((FMOE_SLOT_W + FMOE_SLOT_S + FMOE_SLOT_A + FMOE_SLOT_AS) + 1023) / 1024 * 1024)
// The up epilogue's gate and up values, [token][j] with rows padded by 4 floats so the stash's stores and
// the quantisation's loads spread over the banks; double-buffered by item parity (see fmoe_gemm).
#define FMOE_GU_STRIDE (FMOE_UP_J + 4)
#define FMOE_GU_FLOATS (2 * FMOE_TOKENS * FMOE_GU_STRIDE)
#define FMOE_BARS (FMOE_RING_SLOTS * FMOE_SLOT + 2 * FMOE_GU_FLOATS * 4)
#define FMOE_SMEM_USED (FMOE_BARS + 2 * FMOE_RING_SLOTS * 8)
static_assert(FMOE_SMEM_USED <= FMOE_SMEM_BYTES, "fast_moe_gemm: shared memory layout exceeds FMOE_SMEM_BYTES");
static_assert(FMOE_TOKENS == 16, "fast_moe_gemm: the B operand layout assumes 16-token tiles");
static_assert(FMOE_ROWS == 2 * FMOE_UP_J && FMOE_ROWS == FMOE_DOWN_ROWS && FMOE_ROWS == 2 * FMOE_BOX_ROWS,
              "fast_moe_gemm: items are two boxes of 128 weight rows");
static_assert(FMOE_MAP_BYTES == 128, "fast_moe_gemm: a CUtensorMap is 128 bytes");

// FMOE_TRACE 1 (a bench variant, `dsv4 bench moe --defines FMOE_TRACE=1 --trace DIR`): the fused decode kernels
// log what each block does and when, so a launch's critical path can be read off (scripts/fmoe-trace.py). Each
// event is two u64 in fmoe_trace_log: %globaltimer (ns), then block << 48 | SM << 40 | kind << 32 | arg (an
// item, fmoe_trace_item; a router job, -2 - job). The host zeroes fmoe_trace_n before the launch it traces
// (moe_trace.rs); events past the capacity are counted and dropped. Off (0, the default) it compiles to nothing.
#ifndef FMOE_TRACE
#define FMOE_TRACE 0
#endif
#ifndef FMOE_TRACE_CAP  // events the log holds (a trace of many tokens' launch may raise it)
#define FMOE_TRACE_CAP 65536
#endif
#define FMOE_TRACE_SHARED (1 << 29)
#define FMOE_TRACE_DOWN (1 << 30)
enum FmoeTraceKind {
  FMOE_EV_START = 1,         // producer: the block's first act
  FMOE_EV_TAKE = 2,          // producer: took an item or a router job (arg: which)
  FMOE_EV_WAIT = 3,          // producer: waits for an item's inputs (x's codes or an up tile), weights out
  FMOE_EV_WAITED = 4,        //   ... and they are there
  FMOE_EV_PLAN_WAIT = 5,     // producer: waits for the plan
  FMOE_EV_PLAN_WAITED = 6,   //   ... and it is published
  FMOE_EV_ISSUED = 7,        // producer: the item's last stage requested
  FMOE_EV_BEGIN = 8,         // consumers: an item's first stage is in
  FMOE_EV_END = 9,           // consumers: its outputs stored
  FMOE_EV_JOB = 10,          // consumers: a router job starts (arg: job)
  FMOE_EV_JOB_QUANT = 11,    //   ... x's codes of it stored
  FMOE_EV_JOB_LOGITS = 12,   //   ... its logit tiles stored (arg: 1 if it is the last, which makes the plan)
  FMOE_EV_PLAN = 13,         //   ... the plan published
  FMOE_EV_PUBLISH = 14,      // publishing warp: an up item counted in (arg: tile)
  FMOE_EV_DONE = 15,         // producer: the end posted
  FMOE_EV_SELECTED = 16,     // consumers: the last router job has selected every token
  FMOE_EV_PLANNED = 17,      //   ... and stored the plan (FMOE_EV_PLAN: once it is published)
  FMOE_EV_FULL_WAITS = 18,   // consumers (thread 0), an item's stages consumed: SM cycles spent waiting for them
  FMOE_EV_EMPTY_WAITS = 19,  // producer, an item's last stage requested: SM cycles spent waiting for free slots
};
// START and DONE carry the SM's clock (low 32 bits), so the cycles of the two waits convert to time.
// The SM's cycle counter where FMOE_TRACE is on (the waits' counts), else 0: the counting compiles away.
DSV4_INLINE long long fmoe_trace_clock() {
#if FMOE_TRACE
  return clock64();
#else
  return 0;
#endif
}

// An item's trace arg: its index among the up (or down) items, and whether it is the shared expert's.
DSV4_INLINE int fmoe_trace_item(bool up, int i, bool shared) {
  return (up ? 0 : FMOE_TRACE_DOWN) | (shared ? FMOE_TRACE_SHARED : 0) | i;
}
#if FMOE_TRACE
__device__ unsigned fmoe_trace_n;
__device__ unsigned long long fmoe_trace_log[2 * FMOE_TRACE_CAP];
#endif
DSV4_INLINE void fmoe_trace(int kind, int arg) {
#if FMOE_TRACE
  moe_trace_event(&fmoe_trace_n, fmoe_trace_log, FMOE_TRACE_CAP, kind, arg);
#else
  (void)kind;
  (void)arg;
#endif
}

// One work item.
struct FmoeItem {
  bool skip;                   // another rank's expert: nothing to load or compute (uniform over the block)
  bool shared;                 // the shared expert's tile
  bool fp4;                    // FP4 (per-32 scales) or FP8 (128x128 scales)
  int n;                       // tokens (assignments) in the tile, 1..FMOE_TOKENS
  int start;                   // first plan row (routed) or first token (shared)
  int row0;                    // first weight row of the block (up: first j)
  int nks;                     // stages (fmoe_stages)
  int rot;                     // the first stage it reads (fmoe_stage_at)
  const unsigned char* maps;   // the expert's FMOE_MAPS_PER_EXPERT tensor maps
  const float* sa;             // FP8 block scales ([rows/128][K/128]) of up: W1, down: W2
  const float* sb;             // up: W3, down: W2
  // FP4 with the UE8M0 byte scales of the layer's scale table (fmoe_scales8_kernel): the 1 KiB blocks of
  // stage 0 of the item's two 128-row boxes (sc8_b NULL when the second box is past N).
  bool s8;
  const unsigned char* sc8_a;
  const unsigned char* sc8_b;
};


DSV4_INLINE int fmoe_rblocks(bool up, int N) { return up ? N / FMOE_UP_J : (N + FMOE_DOWN_ROWS - 1) / FMOE_DOWN_ROWS; }

// Shared tiles (token tiles of the shared expert): after the plan's routed ones, or first (SHARED_FIRST).
DSV4_INLINE int fmoe_shared_tiles(const FmoeArgs& a) {
  return a.shared_fmt != 0 ? (a.T + FMOE_TOKENS - 1) / FMOE_TOKENS : 0;
}

// Work item wi: tile wi / (row blocks), row block wi % (row blocks). The tiles are the plan's routed ones, then
// the shared expert's, or with SHARED_FIRST (fmoe_route_experts_kernel) the shared ones first: those items are
// then known before the plan is.
template <bool UP, bool SHARED_FIRST = false>
DSV4_INLINE FmoeItem fmoe_item(const FmoeArgs& a, int wi) {
  const int rb_n = fmoe_rblocks(UP, a.N);
  const int tile = wi / rb_n, rb = wi - tile * rb_n;
  const int nsh = SHARED_FIRST ? fmoe_shared_tiles(a) : 0;
  const bool routed = SHARED_FIRST ? tile >= nsh : tile < a.nrt;
  const int rt = tile - nsh;                           // the routed tile's index in the plan
  const int st = SHARED_FIRST ? tile : tile - a.nrt;  // the shared token tile's
  FmoeItem it;
  it.skip = false;
  it.row0 = rb * (UP ? FMOE_UP_J : FMOE_DOWN_ROWS);
  it.sa = it.sb = nullptr;
  it.s8 = false;
  it.sc8_a = it.sc8_b = nullptr;
  const int nloc = a.e_end - a.e_begin;
  int x = nloc;  // the item's entry in the per-expert tables
  if (routed) {
    const int e = a.tiles[3 * rt];
    it.skip = e < a.e_begin || e >= a.e_end;
    it.start = a.tiles[3 * rt + 1];
    it.n = a.tiles[3 * rt + 2];
    it.shared = false;
    it.fp4 = a.fmt == WFMT_FP4;
    // The tables hold the local experts only (possibly none): read them for those.
    const int le = it.skip ? 0 : e - a.e_begin;
    x = le;
    it.maps = a.maps + (long long)le * (FMOE_MAPS_PER_EXPERT * FMOE_MAP_BYTES);
    if (!it.skip && !it.fp4) {
      it.sa = reinterpret_cast<const float*>(a.sa[le]);
      it.sb = reinterpret_cast<const float*>(a.sb[le]);
    }
  } else {
    it.start = st * FMOE_TOKENS;
    it.n = min(FMOE_TOKENS, a.T - it.start);
    it.shared = true;
    it.fp4 = a.shared_fmt == WFMT_FP4;
    it.maps = a.maps + (long long)nloc * (FMOE_MAPS_PER_EXPERT * FMOE_MAP_BYTES);
    it.sa = a.shared_sa;
    it.sb = a.shared_sb;
  }
  if (it.fp4 && !it.skip && a.sc8 != nullptr) {
    it.s8 = true;
    const unsigned char* ex = a.sc8 + (long long)x * fmoe_sc8_expert(a.D, a.I);
    const long long per_rb = (long long)fmoe_stages(true, a.K) * 1024;  // bytes of a row block
    const unsigned char* ma = ex + (UP ? 0 : 2 * fmoe_sc8_matrix(a.I, a.D));  // W1 or W2
    const unsigned char* mb = ex + (UP ? fmoe_sc8_matrix(a.I, a.D) : 2 * fmoe_sc8_matrix(a.I, a.D));  // W3 or W2
    const int rb = it.row0 / 128;
    it.sc8_a = ma + rb * per_rb;
    if (UP)
      it.sc8_b = mb + rb * per_rb;
    else if (it.row0 + FMOE_BOX_ROWS < a.N)
      it.sc8_b = mb + (rb + 1) * per_rb;
  }
  it.nks = fmoe_stages(it.fp4, a.K);
  it.rot = rb % it.nks;
  return it;
}

// The stage an item reads i-th: stage (i + rot) mod nks, its row block's offset. Without it, every block of
// a small batch starts at stage 0 and walks K in step with the others, so at any moment all of them read
// the same 128-byte column of rows a fixed stride apart, which the DRAM address map puts in a few channels
// (the layer at B = 1: 90 -> 72 us on the H200). Keyed by the row block alone, the order in which a row's
// 128-blocks are summed does not depend on the batch or on which tile holds the token.
DSV4_INLINE int fmoe_stage_at(const FmoeItem& it, int i) {
  const int kb = i + it.rot;
  return kb < it.nks ? kb : kb - it.nks;
}

// Activation row of token column c (column 0's for c >= n: the producer's lanes of those columns form an
// address and copy nothing, fmoe_produce). Up reads x rows (one per token), down reads h rows (one per
// (token, slot), the output row of the assignment).
template <bool UP>
DSV4_INLINE int fmoe_act_row(const FmoeArgs& a, const FmoeItem& it, int c) {
  const int i = c < it.n ? c : 0;
  if (it.shared) return UP ? it.start + i : a.T * a.k + it.start + i;
  const int r = a.rows[it.start + i];
  return UP ? r / a.k : r;
}

// Output row (of hq / y) of token column c < n.
DSV4_INLINE int fmoe_out_row(const FmoeArgs& a, const FmoeItem& it, int c) {
  return it.shared ? a.T * a.k + it.start + c : a.rows[it.start + c];
}

// The ring's barriers (fmoe_ring_*), after the slots and the epilogue buffers.
DSV4_INLINE unsigned fmoe_full(unsigned smem, int s) { return fmoe_ring_full(smem + FMOE_BARS, s); }
DSV4_INLINE unsigned fmoe_empty(unsigned smem, int s) {
  return fmoe_ring_empty(smem + FMOE_BARS, FMOE_RING_SLOTS, s);
}

// The fused kernel's item header: the item's index at the end of its first stage's slot (the producer's lane 0
// stores it before its arrival on the slot's full barrier, so the consumers read it after their wait), or -1:
// no more items.
#define FMOE_SLOT_HDR (FMOE_SLOT_W + FMOE_SLOT_S + FMOE_SLOT_A + FMOE_SLOT_AS)
static_assert(FMOE_SLOT_HDR + 4 <= FMOE_SLOT, "fast_moe_gemm: the item header fits in the slot's padding");
DSV4_INLINE void fmoe_store_header(unsigned slot_addr, int header) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(slot_addr + FMOE_SLOT_HDR), "r"(header) : "memory");
}
DSV4_INLINE int fmoe_load_header(unsigned slot_addr) {
  int h;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(h) : "r"(slot_addr + FMOE_SLOT_HDR) : "memory");
  return h;
}

// Token columns past an item's n are computed and never stored, so they are not gathered (copying column 0 into
// all 16, as this did, had every block of a one-token batch read the same lines 16 times a stage: the stream then
// ran at 1.6 of the 3.9 TB/s its weights alone reach). They hold what an earlier stage left, or these zeros
// (the producer warp's first act): finite codes and scales either way.
DSV4_INLINE void fmoe_zero_token_slots(unsigned smem) {
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < FMOE_RING_SLOTS * (FMOE_SLOT_A + FMOE_SLOT_AS) / 16; i += 32) {
    const int per_slot = (FMOE_SLOT_A + FMOE_SLOT_AS) / 16;
    st_shared_zero16(smem + (i / per_slot) * FMOE_SLOT + FMOE_SLOT_W + FMOE_SLOT_S + 16 * (i % per_slot));
  }
  fence_proxy_async_shared();  // the wgmmas read the zeros through the async proxy
}

// The u32 at `flag`, with acquire semantics: the copies issued after it see what the writers published before
// their release.
DSV4_INLINE unsigned fmoe_load_acquire(const unsigned* flag) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}
// The u32 at `flag`, relaxed at GPU scope (from L2, without invalidating the SM's L1 as an acquire does).
DSV4_INLINE unsigned fmoe_load_relaxed(const unsigned* flag) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
  return v;
}

// Waits (every calling thread) until the u32 at `flag` reaches `target`, with acquire semantics: every poll an
// acquire (FMOE_POLL_ACQUIRE 1, the measured default), or relaxed polls and one acquire after them (0, a variant
// not yet measured: an acquire invalidates the SM's L1 (SASS CCTL.IVALL), so a warp polling with acquires makes
// the other warps of its SM miss L1, local memory included). A wait that cannot end (a bug) traps after ~2^22
// polls (seconds) instead of hanging the device.
#ifndef FMOE_POLL_ACQUIRE
#define FMOE_POLL_ACQUIRE 1
#endif
DSV4_INLINE void fmoe_wait_count(const unsigned* flag, unsigned target) {
  for (unsigned polls = 0;; ++polls) {
    if ((FMOE_POLL_ACQUIRE ? fmoe_load_acquire(flag) : fmoe_load_relaxed(flag)) >= target) break;
    if (polls > (1u << 22)) __trap();
    __nanosleep(64);
  }
  if (!FMOE_POLL_ACQUIRE) fmoe_load_acquire(flag);
}

// FMOE_PROBE_FLAT 1 (a bench probe, wrong outputs: `dsv4 bench moe --defines FMOE_PROBE_FLAT=1` also rewrites the
// layer's tensor maps, fast_moe_gemm::probe_flat_tensor_maps): each weight box is 16 KiB of consecutive bytes (the
// matrix seen as rows of 128 bytes) instead of 128 bytes of each of 128 rows a row apart. The same bytes a stage,
// the same ring and items: it times the decode stream as a stage-contiguous derived layout would read it (at one
// token the up phase streams at ~2.3 TB/s against the read probe's 3.0).
#ifndef FMOE_PROBE_FLAT
#define FMOE_PROBE_FLAT 0
#endif

// FMOE_PROBE_NO_MATH 1 (a bench probe, wrong outputs: `dsv4 bench moe --defines FMOE_PROBE_NO_MATH=1`): the consumers
// wait for each stage and release it without computing (acc stays zero; the epilogues, the publishing and the down
// items' waits run as usual). The same stream, items and queue: the launch's time without the consumers' math, so
// against the real kernel it says how much of the layer the math holds up (where the producer waits for free slots)
// rather than the weights' stream.
#ifndef FMOE_PROBE_NO_MATH
#define FMOE_PROBE_NO_MATH 0
#endif

// One item's stages into the ring, in the order the consumers read them (the producer warp). Per stage, lane 0
// announces the TMA bytes and issues the weight (and FP4 scale) boxes: rows 0..127 of the stage from matrix A
// (up: W1 j = row0 ..; down: W2 rows row0 ..), rows 128..255 from matrix B (up: W3 j = row0 ..; down: W2 rows
// row0 + 128 .., zeros past N as TMA fills out-of-range rows, as it fills the k past K of a half FP4 stage).
// Every lane gathers tokens by cp.async: lane L copies the k16 chunks L / 16, L / 16 + 2, ... of token column
// L % 16, and its scale of block L / 16; lanes 0 and 1 copy FP8's two block scales. The slot's full barrier
// expects lane 0's arrival with the TMA bytes and one cp.async arrival per lane.
// `header` >= 0: stored as the item's header in its first slot (the fused kernel). `ready` non-NULL: the item's
// activations are complete once *ready reaches `target` (the fused kernel's down items wait for their tile's up
// items); the weights of its first FMOE_STAGES stages are requested before that wait, their tokens after it.
// `trace`: the item's arg in FMOE_TRACE's log.
// `wait_pdl` (fmoe_experts_kernel under FMOE_SHARED_EARLY, `ready` NULL): the same, with the kernel's programmatic
// wait (dsv4_pdl_wait: the kernels before it have finished) in place of the counter.
template <bool UP>
DSV4_INLINE void fmoe_produce_item(const FmoeArgs& a, const FmoeItem& it, unsigned smem, int& slot, unsigned& phase,
                                   int header, const unsigned* ready, unsigned target, int trace = 0,
                                   bool wait_pdl = false) {
  const int lane = threadIdx.x & 31, col = lane & 15, half = lane >> 4;
  const int K = a.K;
  const bool gather = col < it.n;  // this lane's token column is one of the item's
  const int kbytes = it.fp4 ? 256 : 128;  // k of a full stage
  const long long arow = fmoe_act_row<UP>(a, it, col);
  const unsigned char* act = a.act + arow * K;
  const float* as = a.act_s + arow * (K / 128) + half;
  const unsigned char* map_a = it.maps + (UP ? FMOE_MAP_W1 : FMOE_MAP_W2) * FMOE_MAP_BYTES;
  const unsigned char* map_b = it.maps + (UP ? FMOE_MAP_W3 : FMOE_MAP_W2) * FMOE_MAP_BYTES;
  const unsigned char* smap_a = it.maps + (UP ? FMOE_MAP_S1 : FMOE_MAP_S2) * FMOE_MAP_BYTES;
  const unsigned char* smap_b = it.maps + (UP ? FMOE_MAP_S3 : FMOE_MAP_S2) * FMOE_MAP_BYTES;
  const int row_b = UP ? it.row0 : it.row0 + FMOE_BOX_ROWS;
  // FP8 block scale of lane 0 (rows 0..127) or lane 1 (rows 128..255) at k 0.
  const float* fs = nullptr;
  if (!it.fp4 && lane < 2) {
    const int grow = (lane == 0 || UP) ? it.row0 : min(row_b, a.N - 1);
    fs = (lane == 0 ? it.sa : it.sb) + (long long)(grow / 128) * (K / 128);
  }
  const unsigned tx = FMOE_SLOT_W + (!it.fp4 ? 0 : !it.s8 ? FMOE_SLOT_S : it.sc8_b != nullptr ? 2048 : 1024);
  // The weights of stage i (the item's i-th) into slot s, once the consumers have freed it.
  long long slot_waits = 0;  // FMOE_TRACE: cycles waited for free slots
  auto weights = [&](int i, int s, unsigned ph) {
    const int kb = fmoe_stage_at(it, i);
    const long long c0 = fmoe_trace_clock();
    mbar_wait(fmoe_empty(smem, s), ph ^ 1);
    slot_waits += fmoe_trace_clock() - c0;
    const unsigned st = smem + s * FMOE_SLOT, full = fmoe_full(smem, s);
    if (lane == 0) {
      if (i == 0 && header >= 0) fmoe_store_header(st, header);
      mbar_arrive_expect_tx(full, tx);
      if (FMOE_PROBE_FLAT) {  // box (row block, stage) of the maps of 128-byte rows: 16 KiB in a row
        tma_load_2d(st, map_a, 0, ((it.row0 / FMOE_BOX_ROWS) * it.nks + kb) * FMOE_BOX_ROWS, full);
        tma_load_2d(st + FMOE_BOX_ROWS * FMOE_RB, map_b, 0, ((row_b / FMOE_BOX_ROWS) * it.nks + kb) * FMOE_BOX_ROWS,
                    full);
      } else {
        tma_load_2d(st, map_a, kb * FMOE_RB, it.row0, full);
        tma_load_2d(st + FMOE_BOX_ROWS * FMOE_RB, map_b, kb * FMOE_RB, row_b, full);
      }
      if (it.s8) {
        bulk_load(st + FMOE_SLOT_W, it.sc8_a + kb * 1024, 1024, full);
        if (it.sc8_b != nullptr) bulk_load(st + FMOE_SLOT_W + 1024, it.sc8_b + kb * 1024, 1024, full);
      } else if (it.fp4) {
        tma_load_2d(st + FMOE_SLOT_W, smap_a, kb * 8, it.row0, full);
        tma_load_2d(st + FMOE_SLOT_W + FMOE_BOX_ROWS * 32, smap_b, kb * 8, row_b, full);
      }
    }
    if (fs != nullptr) cp_async_4(st + FMOE_SLOT_W + 4 * lane, fs + kb);
  };
  // The tokens of stage i into slot s, then the lane's arrival.
  auto tokens = [&](int i, int s) {
    const int kb = fmoe_stage_at(it, i);
    const unsigned st = smem + s * FMOE_SLOT;
    const int blocks = fmoe_stage_blocks(it.fp4, K, kb);
    const unsigned adst = st + FMOE_SLOT_W + FMOE_SLOT_S;
    // Chunks half, half + 2, ...: constant offsets from one address each, so every copy is one instruction.
    const unsigned dst0 = adst + half * (FMOE_TOKENS * 16) + col * 16;
    const unsigned char* src0 = act + (long long)kb * kbytes + 16 * half;
    if (gather) {
      if (blocks == 2) {
#pragma unroll
        for (int c = 0; c < 8; ++c) cp_async_16(dst0 + 2 * c * (FMOE_TOKENS * 16), src0 + 32 * c);
      } else {
#pragma unroll
        for (int c = 0; c < 4; ++c) cp_async_16(dst0 + 2 * c * (FMOE_TOKENS * 16), src0 + 32 * c);
      }
      if (half < blocks) cp_async_4(adst + FMOE_SLOT_A + lane * 4, as + kb * (kbytes / 128));
    }
    cp_async_mbar_arrive(fmoe_full(smem, s));
  };
  int i = 0;
  if (ready != nullptr || wait_pdl) {
    const int early = min(it.nks, FMOE_RING_SLOTS);
    int s = slot;
    unsigned ph = phase;
    for (; i < early; ++i) {
      weights(i, s, ph);
      fmoe_ring_advance(s, ph, FMOE_RING_SLOTS);
    }
    if (lane == 0) fmoe_trace(FMOE_EV_WAIT, trace);
    if (wait_pdl)
      dsv4_pdl_wait();
    else
      fmoe_wait_count(ready, target);
    if (lane == 0) fmoe_trace(FMOE_EV_WAITED, trace);
    for (int j = 0; j < early; ++j) {
      tokens(j, slot);
      fmoe_ring_advance(slot, phase, FMOE_RING_SLOTS);
    }
  }
  for (; i < it.nks; ++i) {
    weights(i, slot, phase);
    tokens(i, slot);
    fmoe_ring_advance(slot, phase, FMOE_RING_SLOTS);
  }
  if (lane == 0) {
    fmoe_trace(FMOE_EV_ISSUED, trace);
    fmoe_trace(FMOE_EV_EMPTY_WAITS, (int)min(slot_waits, 0x7fffffffLL));
  }
}

// FMOE_TAKE_EARLY 1: the fused kernels' producers take their next item from the queue as they start an item (the
// atomic's latency hidden behind the item's stream), so each holds two. At B = 1 that left down items queued
// behind others' waits on blocks that were busy while other blocks idled at the launch's end (FMOE_TRACE). 0: a
// producer takes its next item once it has asked for the last stage of this one; the ring's stages still cover
// the atomic.
#ifndef FMOE_TAKE_EARLY
#define FMOE_TAKE_EARLY 0
#endif

// The fused kernels' queue: its next entry (lane 0's atomicAdd at `head`), to every lane of the producer warp.
DSV4_INLINE int fmoe_take(unsigned* head) {
  int v = 0;
  if ((threadIdx.x & 31) == 0) v = (int)atomicAdd(head, 1u);
  return __shfl_sync(0xffffffffu, v, 0);
}

// The producer warp of the two-kernel path: every stage of the block's items (blockIdx.x + n · gridDim.x).
template <bool UP>
DSV4_INLINE void fmoe_produce(const FmoeArgs& a, unsigned smem, int my_items) {
  int slot = 0;
  unsigned phase = 0;
  fmoe_zero_token_slots(smem);
  for (int n = 0; n < my_items; ++n) {
    const FmoeItem it = fmoe_item<UP>(a, blockIdx.x + n * gridDim.x);
    if (!it.skip) fmoe_produce_item<UP>(a, it, smem, slot, phase, -1, nullptr, 0);
  }
  cp_async_wait_all();  // the copies land before the warp exits
}

// One m64nNk32 step: d = A · B (from zero), A = the thread's e4m3 fragment registers, B = 8·NT8 tokens at
// `desc`.
template <int NT8>
DSV4_INLINE void fmoe_wgmma(float (&d)[8], const unsigned (&a)[4], unsigned long long desc) {
  if (NT8 == 1) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %9, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1; }\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
  } else {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, "
        "1, 1; }\n"
        : WGMMA_ACC8(d, 0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(0));
  }
}

// blk += d · (s0 for row g, s8 for row g + 8) over the thread's 4·NT8 values (layout: fmoe_gemm).
template <int NT8>
DSV4_INLINE void fmoe_promote(float (&blk)[8], const float (&d)[8], float s0, float s8) {
#pragma unroll
  for (int j = 0; j < NT8; ++j) {
    blk[4 * j + 0] = fmaf(d[4 * j + 0], s0, blk[4 * j + 0]);
    blk[4 * j + 1] = fmaf(d[4 * j + 1], s0, blk[4 * j + 1]);
    blk[4 * j + 2] = fmaf(d[4 * j + 2], s8, blk[4 * j + 2]);
    blk[4 * j + 3] = fmaf(d[4 * j + 3], s8, blk[4 * j + 3]);
  }
}

// The thread's A fragment of k32 step q of its warp's 16 rows, e4m3 codes in the order fmoe's activations
// use. FP4: `frag` holds the ldmatrix words of steps q & ~1 and q | 1. FP8: fmoe_fp8_a_frag.
template <bool FP4>
DSV4_INLINE void fmoe_a_frag(unsigned la, const unsigned (&frag)[4], int q, unsigned (&a)[4]) {
  if (FP4) {
    const int h = (q & 1) * 2;
    e2m1x8_to_e4m3_eo(frag[h], a[0], a[2]);      // row g: k 4t.. (even elements), 16 + 4t.. (odd)
    e2m1x8_to_e4m3_eo(frag[h + 1], a[1], a[3]);  // row g + 8
  } else {
    fmoe_fp8_a_frag<false>(la, q, a);
  }
}

// acc += 128-block b of the stage (see the file comment), in three parts that fmoe_compute_stage runs in
// order. The thread is (warpgroup w, warp q of it, g, t); d[4j + c]: row 16q + g + 8·(c >> 1) of the
// warpgroup's tile, token 8j + 2t + (c & 1).
//
// 1. The thread's A fragments of the block's four k32 steps. `la`: this lane's address (FP4: its ldmatrix
//    row, chunk bits for k32 step 0 of block 0; FP8: fmoe_fp8_a_addr). FP4 steps q, q + 1 of block b are
//    chunks 4b + q and 4b + q + 1 of the rows (one x4 load covers both; the swizzle XORs the chunk index).
template <bool FP4>
DSV4_INLINE void fmoe_block_frags(unsigned la, int b, unsigned (&af)[4][4]) {
  unsigned frag[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (FP4 && (q & 1) == 0) ldmatrix_x4(la ^ (unsigned)((4 * b + q) << 4), frag);
    fmoe_a_frag<FP4>(la, frag, q, af[q]);
  }
}

// 2. The four steps' wgmmas back to back, each from zero into its own registers d[q], one commit group:
//    the tensor core pipelines them, and the warp waits once a block instead of once a step. `act`: the
//    block's tokens (the descriptor's address field counts 16-byte units, so the steps add constant
//    offsets; only the low word changes, and it cannot carry into the LBO field as shared addresses stay
//    below 256 KiB).
template <int NT8>
DSV4_INLINE void fmoe_block_issue(const unsigned (&af)[4][4], const unsigned char* act, float (&d)[4][8]) {
  const unsigned long long desc0 = wgmma_desc_noswizzle(act, FMOE_TOKENS * 16, 128);
  wgmma_fence();
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const unsigned long long desc = ((unsigned long long)(unsigned)(desc0 >> 32) << 32) |
                                    ((unsigned)desc0 + (unsigned)(q * 2 * (FMOE_TOKENS * 16) / 16));
    fmoe_wgmma<NT8>(d[q], af[q], desc);
  }
  wgmma_commit();
}

// 3. Waits for the block's wgmmas, then acc += Σ_q d[q] · (s0[q] for row g, s8[q] for row g + 8) (the
//    per-32 weight scales: promotion every k32) times the tokens' activation scales `as` (FP4: times 2^6,
//    the bit move's 2^-6).
template <bool FP4, int NT8>
DSV4_INLINE void fmoe_block_finish(float (&d)[4][8], const float (&s0)[4], const float (&s8)[4], const float* as,
                                   float (&acc)[8]) {
  const int t = threadIdx.x & 3;
  wgmma_wait<0>();
  float blk[8];
#pragma unroll
  for (int v = 0; v < 8; ++v) blk[v] = 0.0f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    wgmma_fence_operand(d[q]);
    fmoe_promote<NT8>(blk, d[q], s0[q], s8[q]);
  }
  const float fold = FP4 ? 64.0f : 1.0f;
#pragma unroll
  for (int j = 0; j < NT8; ++j) {
    const float sa0 = as[8 * j + 2 * t] * fold, sa1 = as[8 * j + 2 * t + 1] * fold;
    acc[4 * j + 0] = fmaf(blk[4 * j + 0], sa0, acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(blk[4 * j + 1], sa1, acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(blk[4 * j + 2], sa0, acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(blk[4 * j + 3], sa1, acc[4 * j + 3]);
  }
}

// acc += stage kb of an item in the slot at `st` (its one or two 128-blocks); FP4 scales as UE8M0 bytes when
// `byte_scales`, else f32. The step products start from zero in the wgmma (scale-d = 0), but ptxas
// serialises wgmmas whose accumulator registers hold no defined value (C7511): d is defined here.
template <bool FP4, int NT8>
DSV4_INLINE void fmoe_compute_stage(const unsigned char* st, int K, int kb, bool byte_scales, float (&acc)[8]) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r16 = (tid >> 5) * 16;  // the warp's first stage row
  const unsigned char* act = st + FMOE_SLOT_W + FMOE_SLOT_S;
  const float* as = reinterpret_cast<const float*>(act + FMOE_SLOT_A);
  const float* sc = reinterpret_cast<const float*>(st + FMOE_SLOT_W);
  float d[4][8];
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int v = 0; v < 8; ++v) d[q][v] = 0.0f;
  unsigned af[4][4];
  // A row's 16-byte chunk c sits at chunk c ^ (row % 8) (the TMA's 128-byte swizzle; slots are
  // 1024-byte aligned, so row % 8 is the address's bits 7-9).
  if (FP4) {
    // ldmatrix x4 of two k32 steps: lane L addresses row (L & 7) + 8·((L >> 3) & 1), chunk L >> 4 (+ the
    // step's chunks, fmoe_block_frags).
    const unsigned row = smem_addr(st) + (r16 + (lane & 7) + 8 * ((lane >> 3) & 1)) * FMOE_RB;
    const unsigned la = row | ((unsigned)((lane >> 4) ^ (lane & 7)) << 4);
    const int blocks = fmoe_stage_blocks(true, K, kb);
    float s0[4], s8[4];
    fmoe_block_frags<true>(la, 0, af);
    fmoe_block_issue<NT8>(af, act, d);
    fmoe_fp4_scales(sc, r16 + g, 0, byte_scales, s0, s8);
    fmoe_block_finish<true, NT8>(d, s0, s8, as, acc);
    if (blocks == 2) {
      fmoe_block_frags<true>(la, 1, af);
      fmoe_block_issue<NT8>(af, act + 8 * FMOE_TOKENS * 16, d);
      fmoe_fp4_scales(sc, r16 + g, 1, byte_scales, s0, s8);
      fmoe_block_finish<true, NT8>(d, s0, s8, as + FMOE_TOKENS, acc);
    }
  } else {
    const unsigned la = fmoe_fp8_a_addr(smem_addr(st) + (r16 + g) * FMOE_RB, g, t);
    const float sw = sc[r16 >= 128 ? 1 : 0];  // the 128x128 block scale of the warp's rows
    const float s0[4] = {sw, sw, sw, sw};
    fmoe_block_frags<false>(la, 0, af);
    fmoe_block_issue<NT8>(af, act, d);
    fmoe_block_finish<false, NT8>(d, s0, s0, as, acc);
  }
}

DSV4_INLINE void fmoe_compute(const unsigned char* st, const FmoeItem& it, int K, int kb, float (&acc)[8]) {
  const bool two = it.n > 8;  // uniform over the block
  if (it.fp4) {
    if (two)
      fmoe_compute_stage<true, 2>(st, K, kb, it.s8, acc);
    else
      fmoe_compute_stage<true, 1>(st, K, kb, it.s8, acc);
  } else {
    if (two)
      fmoe_compute_stage<false, 2>(st, K, kb, false, acc);
    else
      fmoe_compute_stage<false, 1>(st, K, kb, false, acc);
  }
}

// Up epilogue, part 1: the thread's bf16-rounded gate or up values into gv / uv [token][FMOE_GU_STRIDE].
DSV4_INLINE void fmoe_up_stash(const FmoeItem& it, const float (&acc)[8], float* gv, float* uv) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r = (tid >> 5) * 16 + g;  // stage row of d[0]
  float* dst = r < FMOE_UP_J ? gv : uv;
  const int j0 = r & (FMOE_UP_J - 1);
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int j = j0 + 8 * ((c >> 1) & 1), tok = 8 * (c >> 2) + 2 * t + (c & 1);
    dst[tok * FMOE_GU_STRIDE + j] = round_bf16(acc[c]);
  }
}

// Up epilogue, part 2 (threads 0..255, after a barrier): h of token tid / 16, j 8·(tid % 16) .. + 7, its
// per-128 act_quant (amax over the 16 threads of the token) and the codes in fragment order.
DSV4_INLINE void fmoe_up_quant(const FmoeArgs& a, const FmoeItem& it, const float* gv, const float* uv,
                               const float* route_w, float limit, unsigned char* out_q, float* out_s) {
  const int tid = threadIdx.x;
  if (tid >= FMOE_TOKENS * 16) return;  // whole warps
  const int i = tid >> 4, c16 = tid & 15;
  const float wt = (!it.shared && route_w != nullptr && i < it.n) ? route_w[fmoe_out_row(a, it, i)] : 1.0f;
  const float4* g4 = reinterpret_cast<const float4*>(gv + i * FMOE_GU_STRIDE + 8 * c16);
  const float4* u4 = reinterpret_cast<const float4*>(uv + i * FMOE_GU_STRIDE + 8 * c16);
  const float4 ga = g4[0], gb = g4[1], ua = u4[0], ub = u4[1];
  const float gs[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
  const float us[8] = {ua.x, ua.y, ua.z, ua.w, ub.x, ub.y, ub.z, ub.w};
  // One value at a time (fmoe_h_value; the same bits as fmoe_h_values8, which measured 1.5-1.8% slower at
  // B = 64 and 256 in these 96-register kernels, where a thread makes 8 h values an item: one A/B, 2 rounds).
  float hv[8];
  float m = 0.0f;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    hv[c] = fmoe_h_value(gs[c], us[c], wt, limit, !it.shared);
    m = fmaxf(m, fabsf(hv[c]));
  }
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o, 16));
  if (i < it.n) {
    const float s = fmoe_h_scale(m);
    const long long orow = fmoe_out_row(a, it, i);
    unsigned char* dst = out_q + orow * a.N + it.row0 + 32 * (c16 >> 2);
    fmoe_store_h_words(dst, c16 & 3, fmoe_h_words8<false>(hv, fmoe_h_inv(s)));
    if (c16 == 0) out_s[orow * (a.N / 128) + it.row0 / 128] = s;
  }
}

// Down epilogue: y[out row][weight row] = bf16(acc).
DSV4_INLINE void fmoe_down_store(const FmoeArgs& a, const FmoeItem& it, const float (&acc)[8], bf16_t* y) {
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int r = it.row0 + (tid >> 5) * 16 + g;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int row = r + 8 * ((c >> 1) & 1), tok = 8 * (c >> 2) + 2 * t + (c & 1);
    if (tok < it.n && row < a.N) y[(long long)fmoe_out_row(a, it, tok) * a.N + row] = f32_to_bf16(acc[c]);
  }
}

// Builds a layer's UE8M0 scale table (layout: fmoe_sc8_expert) from the f32 per-32 scales of its FP4
// experts: s1/s3/s2 the local experts' scale addresses ([nloc]), sh1/sh3/sh2 the shared expert's (NULL
// when it has none or it is not FP4). One thread per (expert, matrix, row, stage): 8 bytes. A scale that
// is not exactly 2^(e - 127) with 1 <= e <= 254 clears the header's FMOE_SC8_EXACT flag (the GEMMs then
// read the f32 scales); a 128-block whose four exponents span more than FMOE_FOLD_SPAN clears
// FMOE_SC8_FOLDABLE (the prefill GEMMs then promote every k32). The caller sets both to 1 first.
// Deterministic: every byte has one writer, the flags only fall.
extern "C" __global__ void fmoe_scales8_kernel(const unsigned long long* s1, const unsigned long long* s3,
                                               const unsigned long long* s2, int nloc, const float* sh1,
                                               const float* sh3, const float* sh2, int D, int I,
                                               unsigned char* table) {
  const int SD = fmoe_stages(true, D), SI = fmoe_stages(true, I);
  const long long per_w13 = (long long)I * SD, per_w2 = (long long)D * SI;  // (row, stage) pairs
  const long long per_expert = 2 * per_w13 + per_w2;
  const int nex = nloc + (sh1 != nullptr ? 1 : 0);
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= nex * per_expert) return;
  const int x = (int)(idx / per_expert);
  long long rest = idx - x * per_expert;
  const int m = rest < per_w13 ? 0 : rest < 2 * per_w13 ? 1 : 2;  // w1, w3, w2
  rest -= m * per_w13;
  const int K = m < 2 ? D : I, S = m < 2 ? SD : SI;
  const int row = (int)(rest / S), kb = (int)(rest % S);
  const float* src;
  if (x < nloc) {
    const unsigned long long* tab = m == 0 ? s1 : m == 1 ? s3 : s2;
    src = reinterpret_cast<const float*>(tab[x]);
  } else {
    src = m == 0 ? sh1 : m == 1 ? sh3 : sh2;
  }
  src += (long long)row * (K / 32) + 8 * kb;
  unsigned char* dst = table + FMOE_SC8_HEADER + x * fmoe_sc8_expert(D, I) + m * fmoe_sc8_matrix(I, D) +
                       ((long long)(row / 128) * S + kb) * 1024 + (row % 128) * 8;
  unsigned bytes[2] = {0u, 0u};
  bool exact = true, foldable = true;
  unsigned lo = 255, hi = 0;  // the exponents of the current 128-block
#pragma unroll
  for (int s = 0; s < 8; ++s) {
    unsigned e = 127;
    if (8 * kb + s < K / 32) {
      const unsigned bits = __float_as_uint(src[s]);
      e = bits >> 23;
      if ((bits & 0x807fffffu) != 0 || e == 0 || e == 255) {
        exact = false;
        e = 127;
      }
      lo = min(lo, e);
      hi = max(hi, e);
    }
    bytes[s / 4] |= e << (8 * (s % 4));
    if (s % 4 == 3) {
      if (hi >= lo && hi - lo > FMOE_FOLD_SPAN) foldable = false;
      lo = 255, hi = 0;
    }
  }
  *reinterpret_cast<uint2*>(dst) = make_uint2(bytes[0], bytes[1]);
  int* flags = reinterpret_cast<int*>(table);
  if (!exact) atomicAnd(flags + FMOE_SC8_EXACT, 0);
  if (!foldable) atomicAnd(flags + FMOE_SC8_FOLDABLE, 0);
}

// The row exponents and row-block fold flags of a layer's UE8M0 scale table (layout: fast_moe_common.cuh),
// from its blocks (fmoe_scales8_kernel runs first, on the same stream). One thread per (expert, matrix,
// 128-row block): each row's largest exponent over its K / 32 scales, and whether every row of the block
// has all of them within FMOE_FOLD_SPAN of it. nex: the table's experts. Deterministic: one writer a byte.
extern "C" __global__ void fmoe_rows8_kernel(int nex, int D, int I, unsigned char* table) {
  const int rb_i = I / 128, per_expert = 2 * rb_i + D / 128;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= nex * per_expert) return;
  const int x = idx / per_expert, rest = idx - x * per_expert;
  const int m = rest < rb_i ? 0 : rest < 2 * rb_i ? 1 : 2;  // w1, w3, w2
  const int rb = rest - m * rb_i;
  const int K = m < 2 ? D : I, S = fmoe_stages(true, K);
  unsigned char* ex = table + FMOE_SC8_HEADER + (long long)x * fmoe_sc8_expert(D, I);
  const unsigned char* blocks = ex + m * fmoe_sc8_matrix(I, D) + (long long)rb * S * 1024;
  unsigned char* rows = ex + fmoe_sc8_rows(D, I, m) + rb * 128;
  bool foldable = true;
  for (int r = 0; r < 128; ++r) {
    unsigned lo = 255, hi = 0;
    for (int kb = 0; kb < S; ++kb) {
      const unsigned char* e = blocks + (long long)kb * 1024 + r * 8;
      for (int q = 0; q < 8 && 8 * kb + q < K / 32; ++q) {
        lo = min(lo, (unsigned)e[q]);
        hi = max(hi, (unsigned)e[q]);
      }
    }
    rows[r] = (unsigned char)hi;
    if (hi - lo > FMOE_FOLD_SPAN) foldable = false;
  }
  ex[fmoe_sc8_row_flags(D, I, m) + rb] = foldable ? 1 : 0;
}

// The consumers' part of one item: every stage from the ring into acc (from zero).
template <bool UP>
DSV4_INLINE void fmoe_consume_item(const FmoeArgs& a, const FmoeItem& it, unsigned smem, int& slot, unsigned& phase,
                                   float (&acc)[8]) {
  extern __shared__ __align__(1024) unsigned char fmoe_smem[];
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int v = 0; v < 8; ++v) acc[v] = 0.0f;
  long long data_waits = 0;  // FMOE_TRACE: cycles thread 0 waited for the stages
  for (int i = 0; i < it.nks; ++i) {
    const int kb = fmoe_stage_at(it, i);
    const long long c0 = fmoe_trace_clock();
    mbar_wait(fmoe_full(smem, slot), phase);
    data_waits += fmoe_trace_clock() - c0;
    // The tokens arrived by cp.async (generic proxy); wgmma reads them through the async proxy.
    fence_proxy_async_shared();
    if (!FMOE_PROBE_NO_MATH) fmoe_compute(fmoe_smem + slot * FMOE_SLOT, it, a.K, kb, acc);
    // The warp's wgmmas and loads of the slot are done (fmoe_block_finish waited for them): release it.
    __syncwarp();
    if (lane == 0) mbar_arrive(fmoe_empty(smem, slot));
    fmoe_ring_advance(slot, phase, FMOE_RING_SLOTS);
  }
  if (FMOE_TRACE && threadIdx.x == 0) fmoe_trace(FMOE_EV_FULL_WAITS, (int)min(data_waits, 0x7fffffffLL));
}

// The up epilogue of an item (all consumer threads): SwiGLU, the routing weight and h's FP8 quantisation.
// `parity` picks the gate / up value buffers: they alternate by item, so a thread writes item n + 2's values
// only after the barrier of item n + 1, which every thread reaches after its part of item n's quantisation.
// The barrier between the stash and the quantisation is over `stash_threads` (the consumers, and in the fused
// kernel its publishing warp).
DSV4_INLINE void fmoe_up_epilogue(const FmoeArgs& a, const FmoeItem& it, const float (&acc)[8], int parity,
                                  const float* route_w, float limit, unsigned char* out_q, float* out_s,
                                  unsigned stash_threads) {
  extern __shared__ __align__(1024) unsigned char fmoe_smem[];
  float* gv = reinterpret_cast<float*>(fmoe_smem + FMOE_RING_SLOTS * FMOE_SLOT) + parity * FMOE_GU_FLOATS;
  float* uv = gv + FMOE_TOKENS * FMOE_GU_STRIDE;
  fmoe_up_stash(it, acc, gv, uv);
  named_barrier(1, stash_threads);
  fmoe_up_quant(a, it, gv, uv, route_w, limit, out_q, out_s);
}

// Block setup of both paths: the 1024-byte aligned slots the swizzle addressing needs (fmoe_compute_stage),
// and the ring's barriers.
DSV4_INLINE unsigned fmoe_block_init() {
  extern __shared__ __align__(1024) unsigned char fmoe_smem[];
  const unsigned smem = smem_addr(fmoe_smem);
  if ((smem & 1023u) != 0) __trap();
  if (threadIdx.x == 0) fmoe_ring_init(smem + FMOE_BARS, FMOE_RING_SLOTS, FMOE_CONSUMERS / 32, 32);
  __syncthreads();
  return smem;
}

// Body of the two-kernel path's kernels. UP: K = D, weight rows j of W1/W3 (N = I of them), act = xq [T][D]
// with xs; out hq [T*k + T][I] codes in fragment order and hs [T*k + T][I/128]. DOWN: K = I, rows of W2 (N =
// D), act = hq with hs; out y [T*k + T][D] bf16. Block b takes items b, b + gridDim.x, ...
template <bool UP>
DSV4_INLINE void fmoe_gemm(const FmoeArgs& a, const float* route_w, float limit, unsigned char* out_q, float* out_s,
                           bf16_t* out_y) {
  const unsigned smem = fmoe_block_init();
  const int total = (a.nrt + fmoe_shared_tiles(a)) * fmoe_rblocks(UP, a.N);
  const int my_items = blockIdx.x < total ? (total - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  if (threadIdx.x >= FMOE_CONSUMERS) {
    fmoe_produce<UP>(a, smem, my_items);
    return;
  }
  // Consumers: the same (item, stage) sequence as the producer.
  int slot = 0;
  unsigned phase = 0;
  float acc[8];
  for (int n = 0; n < my_items; ++n) {
    const FmoeItem it = fmoe_item<UP>(a, blockIdx.x + n * gridDim.x);
    if (it.skip) continue;
    fmoe_consume_item<UP>(a, it, smem, slot, phase, acc);
    if (UP)
      fmoe_up_epilogue(a, it, acc, n & 1, route_w, limit, out_q, out_s, FMOE_CONSUMERS);
    else
      fmoe_down_store(a, it, acc, out_y);
  }
}

// The fused kernel's synchronisation words (`sync`, u32). First the start ticket (FMOE_SHARED_EARLY): each block
// takes the next one as it starts, before the programmatic wait, so the plan cannot clear it; zero between
// launches (the workspace starts so, and the block taking the launch's last ticket resets it: every other block
// has taken its ticket by then). Then, zero at each launch's start (the layer's plan, moe_plan_kernel, clears them
// just before): the queue's head, then per tile the up items whose h rows are stored. (The last block out had
// reset those at the kernel's end: every block's fence and atomic, and the last one's stores, before the launch
// could end; at one token the launch lost the second launch it saved, BENCHMARKS.md, issue 11 fifteenth version.)
// Every item a block holds was taken once the block had started, from the queue or by its ticket: an item given
// to a block by its index could wait, unstarted, for an SM that blocks spinning on its up items hold (another
// stream's kernels or MPS can leave fewer SMs than the grid).
#define FMOE_SYNC_TICKET 0
#define FMOE_SYNC_NEXT 1
#define FMOE_SYNC_TILES 2

// Makes this block's h stores (published to this thread through a barrier) visible at GPU scope, then counts
// one more finished up item of the tile.
DSV4_INLINE void fmoe_count_ready(unsigned* flag) {
  asm volatile("fence.acq_rel.gpu;\nred.relaxed.gpu.global.add.u32 [%0], 1;\n" ::"l"(flag) : "memory");
}

// The fused kernels' block: the two-kernel path's warps, then the publishing warp.
#define FMOE_FUSED_THREADS (FMOE_THREADS + 32)

// The publishing warp of the fused kernels: after each up item's h stores (warps 0-7, fmoe_up_quant), makes
// them visible at GPU scope and counts the item in at its tile's word. Its fence stalls it for a while: done by
// a consumer warp, that stall held up the ring (the layer 1-3% slower than without the fence). It joins each up
// item's stash barrier, so it reads the item's tile there (pub_tile[n & 1] for the consumers' n-th up item, -1:
// no more), and no consumer passes the next item's stash barrier before it has published this one.
DSV4_INLINE void fmoe_publish(unsigned* tile_ready, const volatile int* pub_tile) {
  const int lane = threadIdx.x & 31;
  for (int n = 0;; ++n) {
    named_barrier(1, FMOE_CONSUMERS + 32);
    const int tile = pub_tile[n & 1];
    if (tile < 0) break;
    named_barrier(2, 256 + 32);
    if (lane == 0) {
      fmoe_count_ready(tile_ready + tile);
      fmoe_trace(FMOE_EV_PUBLISH, tile);
    }
    __syncwarp();
  }
}

// The consumers' part of a fused kernel's up item `it` of tile `tile`, their n-th up item: the GEMM, the tile
// handed to the publisher, the epilogue, then warps 0-7 (which stored h) let the publisher go on.
DSV4_INLINE void fmoe_fused_up_item(const FmoeArgs& a, const FmoeItem& it, int tile, int n, unsigned smem, int& slot,
                                    unsigned& phase, float (&acc)[8], const float* route_w, float limit,
                                    unsigned char* hq, float* hs, volatile int* pub_tile) {
  fmoe_consume_item<true>(a, it, smem, slot, phase, acc);
  if (threadIdx.x == 0) pub_tile[n & 1] = tile;
  fmoe_up_epilogue(a, it, acc, n & 1, route_w, limit, hq, hs, FMOE_CONSUMERS + 32);
  if ((threadIdx.x >> 5) < 8) asm volatile("bar.arrive 2, 288;\n" ::: "memory");
}

// Posts header `header` (-1: no more items; fmoe_route_experts_kernel's router jobs) in the ring's next slot,
// with no data: every producer lane arrives on its full barrier as for a stage.
DSV4_INLINE void fmoe_post_header(unsigned smem, int slot, unsigned phase, int header) {
  const int lane = threadIdx.x & 31;
  mbar_wait(fmoe_empty(smem, slot), phase ^ 1);
  const unsigned full = fmoe_full(smem, slot);
  if (lane == 0) {
    fmoe_store_header(smem + slot * FMOE_SLOT, header);
    mbar_arrive(full);
  }
  cp_async_mbar_arrive(full);
}

// FMOE_SHARED_EARLY 1 (the default): fmoe_experts_kernel triggers the next launch first and the first n blocks to
// start (FMOE_SYNC_TICKET) each take one of the shared expert's n up items (shared tiles numbered first,
// fmoe_item's SHARED_FIRST) without the queue, asking for its first stages' weights before the programmatic
// wait: they do not depend on the routing, so they stream while the plan kernel before runs (HBM idles then)
// instead of after it, and the shared expert (the one-token launch's critical path: FMOE_TRACE) starts earlier.
// The queue's first down items are then the shared ones too, whose first weights the blocks left over at B = 1
// ask for while they wait for their tile. The plan's tile count, the queue and the sync words are read after each
// thread's wait. H100, µs a layer (BENCHMARKS.md 2026-12-06, by block index, before the start ticket): B = 1
// 65.9 -> 60.3, B = 2 91.4 -> 84.8, B = 4-16 1-2% less. 0 (a diagnostic variant): every item from the queue
// after the wait.
#ifndef FMOE_SHARED_EARLY
#define FMOE_SHARED_EARLY 1
#endif
// FMOE_SPREAD_SHARED 1 (the default): once the shared expert's up items outnumber the blocks (more than 128 tokens at
// Flash shapes: 16 row blocks a 16-token tile), the queue no longer hands them all out first. In shared-first order at
// 512 tokens every block spent the launch's first ~75 µs on the shared expert's 512 up items and the down phase's
// first ~47 µs on its 512 down items (FMOE_TRACE), its 24 MB of weights read over and over from L2 while HBM idled.
// So past the first round (the start tickets' items) its up items are spread over the first half of the routed up
// items, and its down items over the first half of the routed down items (all its tiles' up items are done by then),
// row block by row block: the tiles of one row block go out together, so the blocks taking them read the same weights
// at about the same time (L2). Only the order changes: an item's outputs depend on the item alone. H100, the layer at
// Flash shapes, uniform routing, µs shared-first / spread (best of two rounds, one call; forty-second session): B = 1
// 61.0 / 61.2 (not active), 256 1262.4 / 1245.0, 384 1318.5 / 1283.6, 512 1406.4 / 1378.8, 576 1478.4 / 1485.3.
// 0 (a diagnostic variant): the shared items first.
#ifndef FMOE_SPREAD_SHARED
#define FMOE_SPREAD_SHARED 1
#endif

// The item (fmoe_item's SHARED_FIRST numbering: the nsh shared tiles' rb_n row blocks each, then R routed items)
// that queue position q of a phase hands out under FMOE_SPREAD_SHARED: positions below `lead` take shared items;
// the other shared items go at evenly spaced positions among the first R / 2 routed ones (at most one a
// position, so the map is one to one), each shared one in row-block-major order.
DSV4_INLINE int fmoe_spread_item(int q, int lead, int nsh, int rb_n, int R) {
  const int S = nsh * rb_n;
  const long long rest = S - lead;
  int j = q;  // the shared item's ordinal, row block major
  if (q >= lead) {
    if (rest == 0) return q;
    const long long m = rest + R / 2, p = q - lead;
    const long long c = min(rest, (p + 1) * rest / m), c0 = min(rest, p * rest / m);  // shared ones to p, before p
    if (c == c0) return S + (int)(p - c);
    j = lead + (int)c - 1;
  }
  return (j % nsh) * rb_n + j / nsh;
}

extern "C" __global__ void __launch_bounds__(FMOE_FUSED_THREADS, 1)
    fmoe_experts_kernel(const unsigned char* xq, const float* xs, int T, int D, int I, int k, const int* rows,
                        const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned char* maps,
                        const unsigned long long* s1, const unsigned long long* s3, const unsigned long long* s2,
                        int fmt, int fmt2, int shared_fmt, int shared_fmt2, const float* shared_s1,
                        const float* shared_s3, const float* shared_s2, const unsigned char* sc8,
                        const float* route_w, float limit, unsigned char* hq, float* hs, unsigned short* y,
                        unsigned* sync) {
  dsv4_pdl_trigger();
  if (!FMOE_SHARED_EARLY) dsv4_pdl_wait();
  // Under FMOE_SHARED_EARLY the plan's tile count is read after each thread's wait (below).
  FmoeArgs up = fmoe_args(xq, xs, T, D, I, k, rows, tiles, FMOE_SHARED_EARLY ? nullptr : ntiles, e_begin, e_end,
                          maps, s1, s3, fmt, shared_fmt, shared_s1, shared_s3, sc8, D, I);
  FmoeArgs dn = fmoe_args(hq, hs, T, I, D, k, rows, tiles, FMOE_SHARED_EARLY ? nullptr : ntiles, e_begin, e_end,
                          maps, s2, s2, fmt2, shared_fmt2, shared_s2, shared_s2, sc8, D, I);
  const unsigned smem = fmoe_block_init();
  const int nsh = fmoe_shared_tiles(up);
  const int rb_up = fmoe_rblocks(true, I), rb_dn = fmoe_rblocks(false, D);
  // FMOE_SHARED_EARLY: the blocks with start tickets 0 .. nstatic - 1 take the shared expert's up items 0 ..
  // nstatic - 1 (the shared-first order) without the queue; the rest of the items come from the queue after them.
  const int nstatic = FMOE_SHARED_EARLY ? min((int)gridDim.x, nsh * rb_up) : 0;
  // FMOE_SPREAD_SHARED: queue positions hand out items in the spread order (fmoe_spread_item), else in order.
  const bool spread = FMOE_SPREAD_SHARED && FMOE_SHARED_EARLY && nsh * rb_up > (int)gridDim.x;
  unsigned* next = sync + FMOE_SYNC_NEXT;
  unsigned* tile_ready = sync + FMOE_SYNC_TILES;
  const int lane = threadIdx.x & 31;
  // The plan's routed tiles, once this thread has waited for the kernels before (FMOE_SHARED_EARLY).
  auto plan_tiles = [&] {
    if (FMOE_SHARED_EARLY) up.nrt = dn.nrt = *ntiles;
  };
  // The tile of up item n (n counted by the consumers) at pub_tile[n & 1], or -1: no more up items.
  __shared__ volatile int pub_tile[2];
  if (threadIdx.x >= FMOE_THREADS) {
    if (FMOE_SHARED_EARLY) dsv4_pdl_wait();  // the plan zeroes tile_ready
    fmoe_publish(tile_ready, pub_tile);
  } else if (threadIdx.x >= FMOE_CONSUMERS) {
    // The producer: items in the order the queue hands them out (any block may take any item: an item's
    // outputs depend on it alone).
    int slot = 0;
    unsigned phase = 0;
    fmoe_zero_token_slots(smem);
    if (lane == 0) fmoe_trace(FMOE_EV_START, (int)(unsigned)fmoe_trace_clock());
    // This block's place in the launch's start order (FMOE_SHARED_EARLY); the last block to start zeroes the
    // ticket word for the next launch.
    const int ticket = FMOE_SHARED_EARLY ? fmoe_take(sync + FMOE_SYNC_TICKET) : nstatic;
    if (FMOE_SHARED_EARLY && lane == 0 && ticket == (int)gridDim.x - 1) atomicExch(sync + FMOE_SYNC_TICKET, 0u);
    if (ticket < nstatic) {
      // A shared up item, known before the plan: its first stages' weights go out before the wait (the model's
      // weights, which no kernel before writes: kernels/common.cuh), its tokens after it.
      const int w = spread ? fmoe_spread_item(ticket, nstatic, nsh, rb_up, 0) : ticket;  // (below nstatic)
      const FmoeItem it = fmoe_item<true, true>(up, w);
      const int tr = fmoe_trace_item(true, w, true);
      if (lane == 0) fmoe_trace(FMOE_EV_TAKE, tr);
      fmoe_produce_item<true>(up, it, smem, slot, phase, w, nullptr, 0, tr, true);
    } else if (FMOE_SHARED_EARLY) {
      dsv4_pdl_wait();
    }
    plan_tiles();
    const int nup = (up.nrt + nsh) * rb_up, total = nup + (up.nrt + nsh) * rb_dn;
    int w = fmoe_take(next) + nstatic;
    while (w < total) {
      const int w_next = FMOE_TAKE_EARLY ? fmoe_take(next) + nstatic : 0;
      // The slot headers carry the items (the consumers' numbering), not the queue positions.
      if (w < nup) {
        const int wi = spread ? fmoe_spread_item(w, nstatic, nsh, rb_up, up.nrt * rb_up) : w;
        const FmoeItem it = fmoe_item<true, FMOE_SHARED_EARLY>(up, wi);
        const int tr = fmoe_trace_item(true, wi, it.shared);
        if (lane == 0) fmoe_trace(FMOE_EV_TAKE, tr);
        if (!it.skip) fmoe_produce_item<true>(up, it, smem, slot, phase, wi, nullptr, 0, tr);
      } else {
        const int wd = spread ? fmoe_spread_item(w - nup, 0, nsh, rb_dn, dn.nrt * rb_dn) : w - nup;
        const FmoeItem it = fmoe_item<false, FMOE_SHARED_EARLY>(dn, wd);
        const int tr = fmoe_trace_item(false, wd, it.shared);
        if (lane == 0) fmoe_trace(FMOE_EV_TAKE, tr);
        const unsigned* ready = tile_ready + wd / rb_dn;
        // Usually the tile's up items are long done: one look while the ring still holds the last item's
        // stages, and the item streams as any other. Else its first weights go out before the wait (waiting
        // for each item's tokens behind its weights cost ~1.5 us a down item).
        if (fmoe_load_acquire(ready) >= (unsigned)rb_up) ready = nullptr;
        if (!it.skip)
          fmoe_produce_item<false>(dn, it, smem, slot, phase, spread ? nup + wd : w, ready, (unsigned)rb_up, tr);
      }
      w = FMOE_TAKE_EARLY ? w_next : fmoe_take(next) + nstatic;
    }
    fmoe_post_header(smem, slot, phase, -1);  // the end
    if (lane == 0) fmoe_trace(FMOE_EV_DONE, (int)(unsigned)fmoe_trace_clock());
    cp_async_wait_all();
  } else {
    // The consumers: each item's header in its first slot says what it is.
    if (FMOE_SHARED_EARLY) dsv4_pdl_wait();
    plan_tiles();
    const int nup = (up.nrt + nsh) * rb_up;
    int slot = 0;
    unsigned phase = 0;
    float acc[8];
    int nup_done = 0;
    for (;;) {
      mbar_wait(fmoe_full(smem, slot), phase);
      const int w = fmoe_load_header(smem + slot * FMOE_SLOT);
      if (w < 0) break;
      if (w < nup) {
        const FmoeItem it = fmoe_item<true, FMOE_SHARED_EARLY>(up, w);
        const int tr = fmoe_trace_item(true, w, it.shared);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_BEGIN, tr);
        fmoe_fused_up_item(up, it, w / rb_up, nup_done++, smem, slot, phase, acc, route_w, limit, hq, hs, pub_tile);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_END, tr);
      } else {
        const FmoeItem it = fmoe_item<false, FMOE_SHARED_EARLY>(dn, w - nup);
        const int tr = fmoe_trace_item(false, w - nup, it.shared);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_BEGIN, tr);
        fmoe_consume_item<false>(dn, it, smem, slot, phase, acc);
        fmoe_down_store(dn, it, acc, y);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_END, tr);
      }
    }
    if (threadIdx.x == 0) pub_tile[nup_done & 1] = -1;
    named_barrier(1, FMOE_CONSUMERS + 32);
  }
}

// ------------------------------------------------------------------ the router and both GEMMs in one launch
//
// fmoe_route_experts_kernel: fmoe_logits_kernel, fmoe_select_kernel, moe_plan_kernel and fmoe_experts_kernel in
// one launch, for few tokens (at most FMOE_TOKENS; opt-in: fast_moe_gemm.rs ROUTED_MAX_TOKENS), the same
// functions on the same data: the same bits. What it buys: the shared expert's up items (a quarter of a
// one-token layer's bytes at Flash shapes) need no routing, so they stream from the launch's start while other
// blocks compute the logits, the selection and the plan; the routed items start as soon as the plan is
// published instead of after three more launches.
//
// The queue (as fmoe_experts_kernel's) hands out, in order: R router jobs, then the shared expert's up items,
// the routed up items, then the down items (shared tiles first; fmoe_item's SHARED_FIRST numbering). A block's
// producer posts a router job to its consumers as an item header of -2 - job (no data in the slot), then goes
// on taking items; the consumers run the job (fmoe_router_job) and then the items behind it. So every wait is
// for work that a running block holds (router jobs are taken before any item): no block waits on one that may
// not be resident. The waits, through the synchronisation words:
// - up items: x's codes, when the launch makes them (x_made 0): the first nq router jobs quantise x and count
//   in at FMOE_RSYNC_X; the producer requests an item's first weight stages before it waits;
// - routed items: the plan (FMOE_RSYNC_PLAN), published by the router job that finishes its logits last (its
//   count at FMOE_RSYNC_LOGITS is R - 1): it selects every token and makes the plan, then counts it in;
// - down items: their tile's up items, as in fmoe_experts_kernel.
#define FMOE_RSYNC_NEXT 0    // the queue's head
#define FMOE_RSYNC_X 1       // router jobs that have stored their part of x's codes
#define FMOE_RSYNC_LOGITS 2  // router jobs done with their logit tiles
#define FMOE_RSYNC_PLAN 3    // 1 once the selection and the plan are stored
#define FMOE_RSYNC_TILES 4   // per tile (shared tiles first): its up items done
// Item headers (fmoe_store_header): router job j, down item i (up items: their index; the end: -1). The
// consumers then tell an item's kind without the plan's tile count.
#define FMOE_ROUTER_HEADER(j) (-2 - (j))
#define FMOE_DOWN_HEADER (1 << 30)
static_assert(FMOE_LOGIT_WARPS * 64 == FMOE_CONSUMERS, "fast_moe_gemm: a router job is two logit tiles at once");
static_assert((9 * 32 * FMOE_MAX_EPL + 1) * 4 <= 2 * FMOE_GU_FLOATS * 4,
              "fast_moe_gemm: the router's plan fits in the up epilogue's buffers");

// What the router steps read and write (fmoe_route_experts_kernel's arguments).
struct FmoeRouter {
  const float* x;  // [T][D], the MoE's input
  int T, D, E, k;
  const float* gate;
  int scoring;
  const float* bias;      // may be NULL
  const int* tid2eid;     // hash layers: [vocab][k], else NULL
  const int* tokens;      // hash layers: [T]
  int renorm;
  float route_scale;
  float* scores;          // [T][E]
  int* ids;               // [T][k]
  float* weights;         // [T][k]
  bool x_made;            // xq / xs hold x's codes already (the input's norm made them)
  unsigned char* xq;
  float* xs;
  int *offsets, *rows, *tiles, *ntiles;  // the plan (tile_rows FMOE_TOKENS)
};

// Router jobs of a launch: two logit tiles a job (one a half of the consumer warps) over the blocks that do not
// take a shared up item first, at least one.
// FMOE_ROUTER_JOBS_MAX > 0: at most that many (a measured variant).
#ifndef FMOE_ROUTER_JOBS_MAX
#define FMOE_ROUTER_JOBS_MAX 0
#endif
DSV4_INLINE int fmoe_router_jobs(const FmoeRouter& r, int shared_up_items) {
  const int tiles = (r.E + FMOE_LOGIT_EXPERTS - 1) / FMOE_LOGIT_EXPERTS *
                    ((r.T + FMOE_LOGIT_TOKENS - 1) / FMOE_LOGIT_TOKENS);
  const int jobs = max(1, min((tiles + 1) / 2, (int)gridDim.x - shared_up_items));
  return FMOE_ROUTER_JOBS_MAX > 0 ? min(jobs, FMOE_ROUTER_JOBS_MAX) : jobs;
}

// FMOE_ROUTER_HOLD 1: a producer that posted a router job takes its next item only once its consumers have run
// the job (named barrier 6): it takes no second job (taking the next entry at once, producers took up to two
// and the last job to finish, which makes the plan, started at 13 us instead of 2: FMOE_TRACE, B = 1), and no
// item whose stream would wait for the consumers. 0: it goes on taking items (the measured first version).
#ifndef FMOE_ROUTER_HOLD
#define FMOE_ROUTER_HOLD 1
#endif

// Router jobs that quantise x (each takes 16 of its (token tile, 128-block) pairs at a time), or 0 when x_made.
DSV4_INLINE int fmoe_router_quant_jobs(const FmoeRouter& r, int jobs) {
  if (r.x_made) return 0;
  const int pairs = (r.T + FMOE_LOGIT_TOKENS - 1) / FMOE_LOGIT_TOKENS * (r.D / 128);
  return min(jobs, (pairs + 15) / 16);
}

// Step 3 of a router job, by the consumer threads of the job counted in last: every token's selection
// (fmoe_select_token, warp w the tokens w, w + 16, ...), the plan (moe_plan_block on warps 0-7), then FMOE_RSYNC_PLAN.
// A call of its own, so that its registers are not the job's: inlined into fmoe_router_job, the selection's
// per-lane scores went to local memory, whose loads missed the L1 that the block's shared memory leaves small
// (FMOE_TRACE, B = 1: the selection took 7 us, the plan 6).
static __device__ __noinline__ void fmoe_router_plan(const FmoeRouter& r, int job, unsigned* sync,
                                                     unsigned char* scratch) {
  __shared__ int wsum[32];
  const int tid = threadIdx.x, warp = tid >> 5;
  for (int t = warp; t < r.T; t += FMOE_CONSUMERS / 32)
    fmoe_select_token(r.scores, t, r.E, r.k, r.bias, r.tid2eid, r.tokens, r.scoring, r.renorm, r.route_scale,
                      r.ids, r.weights);
  named_barrier(3, FMOE_CONSUMERS);
  if (tid == 0) fmoe_trace(FMOE_EV_SELECTED, job);
  if (warp < 8)
    moe_plan_block<8>(r.ids, r.T, r.k, r.E, FMOE_TOKENS, r.offsets, r.rows, r.tiles, r.ntiles,
                      reinterpret_cast<int*>(scratch), wsum, PlanSync{4u, 256u});
  named_barrier(3, FMOE_CONSUMERS);
  if (tid == 0) {
    fmoe_trace(FMOE_EV_PLANNED, job);
    fmoe_count_ready(sync + FMOE_RSYNC_PLAN);
    fmoe_trace(FMOE_EV_PLAN, job);
  }
}

// Router job `job` of `jobs`, by the block's consumer threads (warps 0-15; `scratch`: the up epilogue's buffers,
// free between items):
// 1. x's codes (unless made): pairs (token tile, 128-block) job·16 + warp, + 16·jobs, ... (fmoe_quant_x_block,
//    the fragment order of the decode GEMMs), then counted in at FMOE_RSYNC_X;
// 2. logit tiles 2·job + half, + 2·jobs, ... (fmoe_logits_tile; half = warp / 8), then counted in at
//    FMOE_RSYNC_LOGITS;
// 3. the job counted in last: fmoe_router_plan.
static __device__ __noinline__ void fmoe_router_job(const FmoeRouter& r, int job, int jobs, int quant_jobs,
                                                    unsigned* sync, unsigned char* scratch) {
  __shared__ int is_last;
  const int tid = threadIdx.x, warp = tid >> 5, half = warp >> 3;
  const int tg = (r.T + FMOE_LOGIT_TOKENS - 1) / FMOE_LOGIT_TOKENS;
  named_barrier(3, FMOE_CONSUMERS);  // every warp is done with the last item's epilogue (the scratch)
  if (tid == 0) fmoe_trace(FMOE_EV_JOB, job);
  if (job < quant_jobs) {
    const int nb = r.D / 128, pairs = tg * nb;
    for (int j = job * 16 + warp; j < pairs; j += jobs * 16) {
      const int t0 = (j / nb) * FMOE_LOGIT_TOKENS;
      fmoe_quant_x_block(r.x, t0, min(FMOE_LOGIT_TOKENS, r.T - t0), r.D, j % nb, false, r.xq, r.xs);
    }
    named_barrier(3, FMOE_CONSUMERS);
    if (tid == 0) {
      fmoe_count_ready(sync + FMOE_RSYNC_X);
      fmoe_trace(FMOE_EV_JOB_QUANT, job);
    }
  }
  float(*part_sum)[FMOE_LOGIT_TOKENS] =
      reinterpret_cast<float(*)[FMOE_LOGIT_TOKENS]>(scratch) + half * FMOE_LOGIT_WARPS;
  const int nbx = (r.E + FMOE_LOGIT_EXPERTS - 1) / FMOE_LOGIT_EXPERTS;
  auto half_sync = [half] { named_barrier(4 + half, FMOE_LOGIT_WARPS * 32); };
  for (int v = 2 * job + half; v < nbx * tg; v += 2 * jobs) {
    fmoe_logits_tile<1>(r.x, r.T, r.D, r.E, r.gate, r.scoring, r.scores, v % nbx, v / nbx, tid & 255, part_sum,
                        half_sync);
    half_sync();  // the parts are read before the next tile writes them
  }
  named_barrier(3, FMOE_CONSUMERS);
  if (tid == 0) {
    // Release this job's scores; the last job's acquire sees every job's.
    unsigned before;
    asm volatile("fence.acq_rel.gpu;\natom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n"
                 : "=r"(before)
                 : "l"(sync + FMOE_RSYNC_LOGITS)
                 : "memory");
    is_last = before == (unsigned)(jobs - 1);
    fmoe_trace(FMOE_EV_JOB_LOGITS, is_last);
  }
  named_barrier(3, FMOE_CONSUMERS);
  if (is_last) fmoe_router_plan(r, job, sync, scratch);
}

// The consumers' router job, then (FMOE_ROUTER_HOLD) their producer let go.
DSV4_INLINE void fmoe_run_router_job(const FmoeRouter& r, int job, int jobs, int quant_jobs, unsigned* sync,
                                     unsigned char* scratch) {
  fmoe_router_job(r, job, jobs, quant_jobs, sync, scratch);
  if (FMOE_ROUTER_HOLD) asm volatile("bar.arrive 6, %0;\n" ::"n"(FMOE_CONSUMERS + 32) : "memory");
}

// The plan's routed tiles, once FMOE_RSYNC_PLAN says it is stored (every calling thread waits and acquires).
DSV4_INLINE int fmoe_wait_plan(const unsigned* sync, const int* ntiles) {
  fmoe_wait_count(sync + FMOE_RSYNC_PLAN, 1u);
  return (int)fmoe_load_acquire(reinterpret_cast<const unsigned*>(ntiles));
}

// The router and both expert GEMMs of T tokens (see above). The router's arguments as fmoe_logits_kernel's and
// fmoe_select_kernel's (x_made: xq / xs hold x's codes, in the fragment order; else the launch makes them), the
// plan's as moe_plan_kernel's with tile_rows FMOE_TOKENS, the GEMMs' as fmoe_experts_kernel's. `sync`: the
// FMOE_RSYNC_* words, zero when the launch starts (the layer's combine zeroes them after it). Requires E <= 32 *
// FMOE_MAX_EPL, k <= 32, D % 128 == 0, D % (4 * FMOE_LOGIT_SPLIT) == 0, I % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_FUSED_THREADS, 1)
    fmoe_route_experts_kernel(const float* x, int T, int D, int I, int k, int E, const float* gate, int scoring,
                              const float* bias, const int* tid2eid, const int* tokens, int renorm,
                              float route_scale, float* scores, int* ids, float* route_w, int x_made,
                              unsigned char* xq, float* xs, int* offsets, int* rows, int* tiles, int* ntiles,
                              int e_begin, int e_end, const unsigned char* maps, const unsigned long long* s1,
                              const unsigned long long* s3, const unsigned long long* s2, int fmt, int fmt2,
                              int shared_fmt, int shared_fmt2, const float* shared_s1, const float* shared_s3,
                              const float* shared_s2, const unsigned char* sc8, float limit, unsigned char* hq,
                              float* hs, unsigned short* y, unsigned* sync) {
  dsv4_pdl_begin();
  const FmoeRouter router = {x,      T,        D,     E,          k,        gate,  scoring, bias,
                             tid2eid, tokens,  renorm, route_scale, scores, ids,   route_w, x_made != 0,
                             xq,     xs,       offsets, rows,     tiles,    ntiles};
  // The router job (a call) reads its arguments through a reference: from shared memory, not from a copy in the
  // caller's local memory, whose lines the job's gate loads evict from the small L1 this block's shared memory
  // leaves (FMOE_TRACE, B = 1: the last job's selection took 7 us, its plan 6).
  __shared__ FmoeRouter router_s;
  if (threadIdx.x == 0) router_s = router;  // published by fmoe_block_init's barrier
  // No plan yet (nrt 0): the SHARED_FIRST items never read nrt.
  const FmoeArgs up = fmoe_args(xq, xs, T, D, I, k, rows, tiles, nullptr, e_begin, e_end, maps, s1, s3, fmt, shared_fmt,
                          shared_s1, shared_s3, sc8, D, I);
  const FmoeArgs dn = fmoe_args(hq, hs, T, I, D, k, rows, tiles, nullptr, e_begin, e_end, maps, s2, s2, fmt2,
                          shared_fmt2, shared_s2, shared_s2, sc8, D, I);
  const unsigned smem = fmoe_block_init();
  const int nsh = fmoe_shared_tiles(up);
  const int rb_up = fmoe_rblocks(true, I), rb_dn = fmoe_rblocks(false, D);
  const int sh_up = nsh * rb_up;  // the shared up items: known before the plan
  const int jobs = fmoe_router_jobs(router, sh_up), quant_jobs = fmoe_router_quant_jobs(router, jobs);
  unsigned* next = sync + FMOE_RSYNC_NEXT;
  unsigned* tile_ready = sync + FMOE_RSYNC_TILES;
  const int lane = threadIdx.x & 31;
  __shared__ volatile int pub_tile[2];
  if (threadIdx.x >= FMOE_THREADS) {
    fmoe_publish(tile_ready, pub_tile);
  } else if (threadIdx.x >= FMOE_CONSUMERS) {
    // The producer: router jobs and items in the order the queue hands them out.
    int slot = 0;
    unsigned phase = 0;
    fmoe_zero_token_slots(smem);
    int nup = -1, total = -1;  // up items and all items, once the plan is known
    bool x_ready = quant_jobs == 0;
    if (lane == 0) fmoe_trace(FMOE_EV_START, (int)(unsigned)fmoe_trace_clock());
    int w = fmoe_take(next);
    for (;;) {
      const int q = w - jobs;  // the item (q >= 0)
      if (q >= sh_up && total < 0) {
        if (lane == 0) fmoe_trace(FMOE_EV_PLAN_WAIT, q);
        const int nrt = fmoe_wait_plan(sync, ntiles);
        if (lane == 0) fmoe_trace(FMOE_EV_PLAN_WAITED, q);
        nup = (nrt + nsh) * rb_up;
        total = nup + (nrt + nsh) * rb_dn;
      }
      if (total >= 0 && q >= total) break;
      const int w_next = FMOE_TAKE_EARLY ? fmoe_take(next) : 0;
      if (q < 0) {
        if (lane == 0) fmoe_trace(FMOE_EV_TAKE, FMOE_ROUTER_HEADER(w));
        fmoe_post_header(smem, slot, phase, FMOE_ROUTER_HEADER(w));  // a router job
        fmoe_ring_advance(slot, phase, FMOE_RING_SLOTS);
        if (FMOE_ROUTER_HOLD) named_barrier(6, FMOE_CONSUMERS + 32);
      } else if (q < (nup < 0 ? sh_up : nup)) {
        const FmoeItem it = fmoe_item<true, true>(up, q);
        const int tr = fmoe_trace_item(true, q, it.shared);
        if (lane == 0) fmoe_trace(FMOE_EV_TAKE, tr);
        const unsigned* ready = nullptr;
        if (!x_ready) {
          x_ready = fmoe_load_acquire(sync + FMOE_RSYNC_X) >= (unsigned)quant_jobs;
          if (!x_ready) ready = sync + FMOE_RSYNC_X;
        }
        if (!it.skip) {
          fmoe_produce_item<true>(up, it, smem, slot, phase, q, ready, (unsigned)quant_jobs, tr);
          x_ready = true;  // (it waited for them)
        }
      } else {
        const FmoeItem it = fmoe_item<false, true>(dn, q - nup);
        const int tr = fmoe_trace_item(false, q - nup, it.shared);
        if (lane == 0) fmoe_trace(FMOE_EV_TAKE, tr);
        const unsigned* ready = tile_ready + (q - nup) / rb_dn;
        if (fmoe_load_acquire(ready) >= (unsigned)rb_up) ready = nullptr;
        if (!it.skip)
          fmoe_produce_item<false>(dn, it, smem, slot, phase, FMOE_DOWN_HEADER | (q - nup), ready, (unsigned)rb_up,
                                   tr);
      }
      w = FMOE_TAKE_EARLY ? w_next : fmoe_take(next);
    }
    fmoe_post_header(smem, slot, phase, -1);  // the end
    if (lane == 0) fmoe_trace(FMOE_EV_DONE, (int)(unsigned)fmoe_trace_clock());
    cp_async_wait_all();
  } else {
    // The consumers: router jobs, then items, each announced by its header. A producer's pulls from the queue
    // only grow, so a block's router jobs (the queue's first) come before its first item: the jobs run here,
    // outside the items' loop (a call inside it had the loop keep its ring phase in local memory).
    extern __shared__ __align__(1024) unsigned char fmoe_smem[];
    int slot = 0;
    unsigned phase = 0;
    int h;
    for (;;) {
      mbar_wait(fmoe_full(smem, slot), phase);
      h = fmoe_load_header(smem + slot * FMOE_SLOT);
      if (h >= -1) break;
      __syncwarp();
      if (lane == 0) mbar_arrive(fmoe_empty(smem, slot));
      fmoe_ring_advance(slot, phase, FMOE_RING_SLOTS);
      fmoe_run_router_job(router_s, -2 - h, jobs, quant_jobs, sync, fmoe_smem + FMOE_RING_SLOTS * FMOE_SLOT);
    }
    // A routed item's plan (tiles, rows, weights) is visible here: its producer acquired it before it posted
    // the item, and the slot's barrier orders the consumers after the producer.
    float acc[8];
    int nup_done = 0;
    for (; h != -1; mbar_wait(fmoe_full(smem, slot), phase), h = fmoe_load_header(smem + slot * FMOE_SLOT)) {
      if (h < FMOE_DOWN_HEADER) {
        const FmoeItem it = fmoe_item<true, true>(up, h);
        const int tr = fmoe_trace_item(true, h, it.shared);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_BEGIN, tr);
        fmoe_fused_up_item(up, it, h / rb_up, nup_done++, smem, slot, phase, acc, route_w, limit, hq, hs, pub_tile);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_END, tr);
      } else {
        const FmoeItem it = fmoe_item<false, true>(dn, h - FMOE_DOWN_HEADER);
        const int tr = fmoe_trace_item(false, h - FMOE_DOWN_HEADER, it.shared);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_BEGIN, tr);
        fmoe_consume_item<false>(dn, it, smem, slot, phase, acc);
        fmoe_down_store(dn, it, acc, y);
        if (threadIdx.x == 0) fmoe_trace(FMOE_EV_END, tr);
      }
    }
    if (threadIdx.x == 0) pub_tile[nup_done & 1] = -1;
    named_barrier(1, FMOE_CONSUMERS + 32);
  }
}

// GEMM1 of every routed tile and of the shared expert (see fmoe_gemm). xq [T][D] e4m3 codes in fragment
// order (fp8_mma.cuh) with their scales xs [T][D/128]; maps: the layer's tensor map table ([e_end -
// e_begin + 1][FMOE_MAPS_PER_EXPERT], the shared expert last); s1/s3: device arrays of the local experts'
// scale addresses ([e_end - e_begin]; FP8 experts read their block scales through them); shared_fmt 0
// when the layer has no shared expert. Requires D % 128 == 0, I % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_THREADS, 1)
    fmoe_up_kernel(const unsigned char* xq, const float* xs, int T, int D, int I, int k, const int* rows,
                   const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned char* maps,
                   const unsigned long long* s1, const unsigned long long* s3, int fmt, int shared_fmt,
                   const float* shared_s1, const float* shared_s3, const unsigned char* sc8,
                   const float* route_w, float limit, unsigned char* hq, float* hs) {
  dsv4_pdl_begin();
  const FmoeArgs a = fmoe_args(xq, xs, T, D, I, k, rows, tiles, ntiles, e_begin, e_end, maps, s1, s3, fmt,
                               shared_fmt, shared_s1, shared_s3, sc8, D, I);
  fmoe_gemm<true>(a, route_w, limit, hq, hs, nullptr);
}

// GEMM2 (see fmoe_gemm): hq [T*k + T][I] (fragment order) with hs -> y [T*k + T][D] bf16. Requires
// I % 128 == 0, D % 128 == 0.
extern "C" __global__ void __launch_bounds__(FMOE_THREADS, 1)
    fmoe_down_kernel(const unsigned char* hq, const float* hs, int T, int I, int D, int k, const int* rows,
                     const int* tiles, const int* ntiles, int e_begin, int e_end, const unsigned char* maps,
                     const unsigned long long* s2, int fmt, int shared_fmt, const float* shared_s2,
                     const unsigned char* sc8, unsigned short* y) {
  dsv4_pdl_begin();
  const FmoeArgs a = fmoe_args(hq, hs, T, I, D, k, rows, tiles, ntiles, e_begin, e_end, maps, s2, s2, fmt,
                               shared_fmt, shared_s2, shared_s2, sc8, D, I);
  fmoe_gemm<false>(a, nullptr, 0.0f, nullptr, nullptr, y);
}
