//! Rust side of the `fast_moe_wide` kernel family (kernels/fast_moe_wide.cu): the prefill path of the
//! fast set's expert GEMMs, for many tokens per expert. Items of up to [`TOKENS`] tokens and 128
//! weight rows; the FP4 per-32 scales of a 128-block are folded into the e4m3 codes so the tensor
//! core's sums are promoted once per 128 of K. Same operands and outputs as the decode kernels
//! ([`super::fast_moe_gemm`], whose [`FastMoeGemm`](super::fast_moe_gemm::FastMoeGemm) launches both
//! and picks the path: [`GemmPath`](super::fast_moe_gemm::GemmPath)).

use super::fast_moe_gemm::{MAP_BYTES, TensorElem, encode_2d};
use crate::cuda::registry::KernelSource;
use crate::error::Result;

/// Tokens per work item of the wide tiles (FMW_TOKENS): the plan's `tile_rows` on this path
/// above [`NARROW_MAX_TOKENS`] tokens, and the largest N of its wgmma (m64nNk32; a folded FP4
/// pass runs N = its tile's tokens rounded up to 8).
pub const TOKENS: usize = 128;
/// Weight rows per pass of an item: one TMA box, two warpgroups of 64.
pub const ROWS: usize = 128;
/// Threads of a block: two consumer warpgroups and a producer warpgroup (its thread 0 issues
/// every copy; the warpgroup gives most of its registers to the consumers).
pub const THREADS: usize = 3 * 128;
/// Slots of the wide tiles' shared-memory ring (FMW_STAGES).
pub const STAGES: usize = 3;
/// Dynamic shared memory of a block of the wide tiles (FMW_SMEM_BYTES; [`smem_bytes`]).
pub const SMEM_BYTES: usize = smem_bytes(TOKENS, STAGES);

/// Tokens per work item of the narrow tiles (FMW_NARROW_TOKENS): the family compiled again
/// ([`NARROW_SOURCE`]) with half the token panel a slot, so that its ring holds
/// [`NARROW_STAGES`] slots of weights instead of [`STAGES`]: where an expert's tiles hold few
/// tokens the weights' stream, not the math, sets the time (kernels/fast_moe_wide.cu, the tile
/// shape).
pub const NARROW_TOKENS: usize = 64;
/// Slots of the narrow tiles' ring (FMW_NARROW_STAGES).
pub const NARROW_STAGES: usize = 5;
/// Dynamic shared memory of a block of the narrow tiles (FMW_NARROW_SMEM_BYTES).
pub const NARROW_SMEM_BYTES: usize = smem_bytes(NARROW_TOKENS, NARROW_STAGES);

/// Batches up to which the layer takes the narrow tiles: layer µs wide / narrow at Flash shapes
/// (H100, uniform routing, forty-third session): 512 1462 / 1324, 640 1487 / 1381, 768 1512 /
/// 1406, 1024 1564 / 1477, 1536 1707 / 1615, 2048 1814 / 1787, 4096 2379 / 3273, 16384 8943 /
/// 11205; skewed 768 1543 / 1424, 4096 2404 / 3319. Between (forty-fourth session, wide / narrow,
/// best of two rounds): 2304 1903.2 / 1939.7, 2560 1941.0 / 2187.1, 2816 2024.7 / 2482.0, 3072
/// 2081.8 / 2789.6, 3584 2247.5 / 3092.0: the narrow tiles win up to 2048.
pub const NARROW_MAX_TOKENS: usize = 2048;

/// Whether a batch of `t` tokens on this path runs the narrow tiles' build ([`NARROW_SOURCE`]):
/// up to [`NARROW_MAX_TOKENS`]. The one place that decides; the tiles' size, the launch's shared
/// memory and the kernels launched follow it.
pub fn narrow_tiles(t: usize) -> bool {
    t <= NARROW_MAX_TOKENS
}

/// Tokens per tile for a batch of `t` tokens on this path: [`NARROW_TOKENS`] on the narrow tiles
/// ([`narrow_tiles`]), else [`TOKENS`].
pub fn tile_tokens(t: usize) -> usize {
    if narrow_tiles(t) {
        NARROW_TOKENS
    } else {
        TOKENS
    }
}

/// Dynamic shared memory of a block of this path for a batch of `t` tokens: its build's.
pub fn smem_bytes_for(t: usize) -> usize {
    if narrow_tiles(t) {
        NARROW_SMEM_BYTES
    } else {
        SMEM_BYTES
    }
}

/// Dynamic shared memory of a block of tiles of `tokens` tokens and a ring of `stages` slots
/// (kernels/fast_moe_wide.cu checks its layout fits): the ring of 1024-byte aligned slots (128
/// weight rows of 128 bytes, their FP4 scales as f32, the tokens' codes over 256 k and their
/// scales), the epilogue's bf16 buffer (up: the gate and up values of the item's 128 j for its
/// tokens), the tile's routing weights, the mbarriers and a slot's item record
/// ([`RECORD_BYTES`]) each.
pub const fn smem_bytes(tokens: usize, stages: usize) -> usize {
    let slot = (ROWS * 128 + ROWS * 32 + 16 * tokens * 16 + 2 * tokens * 4).div_ceil(1024) * 1024;
    stages * slot + 2 * tokens * ROWS * 2 + tokens * 4 + 2 * stages * 8 + stages * RECORD_BYTES
}
/// Bytes of an item's record beside a ring slot (kernels/fast_moe_wide.cu FMW_REC_BYTES, whose
/// layout static_assert checks against the shared memory given): what the producer hands the
/// consumers for an item's start (its head, and the UE8M0 row exponents and fold flags).
pub const RECORD_BYTES: usize = 320;
const _: () = assert!(
    SMEM_BYTES <= 227 * 1024 && NARROW_SMEM_BYTES <= 227 * 1024,
    "an sm_90 block takes at most 227 KiB"
);
/// Tokens from which a layer runs this path: where it measured faster than the decode path's one
/// launch ([`super::fast_moe_gemm::FUSED_TOKENS`], which takes every count below). At Flash shapes,
/// µs fused decode / prefill on the narrow tiles (H100, uniform routing, forty-third session, two
/// calls): 256 1242.7 / 1303.0, 384 1289.4 / 1325.5, 448 1314.2 / 1339.4, 512 1364.3 / 1324.1,
/// 576 1450.4 / 1362.5; 480 is between 448 and 512. (On the wide tiles it was 608: 576 1464.2 /
/// 1527.1, 640 1569.3 / 1527.2; against the two-launch decode path 576, and 768 before
/// BENCHMARKS.md's issue 11 twenty-second version, 1024 before the producer's row-address table,
/// 1408 before the tile-sized wgmmas, 2048 before the up epilogue went through shared memory, 3072
/// before that.)
pub const MIN_TOKENS: usize = 480;

/// Rows of the GEMMs' TMA boxes of their activations (FMW_HBOX): a tile of n tokens reads n
/// rounded up to it.
pub const ACT_BOX_ROWS: usize = 32;

/// Tokens per block of `fmw_gather_x_kernel` (a warp each; its blocks stride over the tokens,
/// so any grid works).
pub const GATHER_TOKENS_PER_BLOCK: usize = 8;

/// Where this path keeps both GEMMs' activations, x (`fmw_gather_x_kernel` makes it) and h
/// (kernels/SPEC.md): a routed tile's rows at their plan rows (`rows[start + c]`'s position
/// `start + c`, so a tile's rows are consecutive and a TMA box reads them), the shared expert's
/// at `T*k + token`; and the scales tile by tile. This is the index of the scale of column `c`
/// (0..`tile`, the batch's [`tile_tokens`]) of tile `tile_index` (the plan's routed tiles, then
/// the shared expert's `ceil(T / tile)`), 128-block `block` of `blocks` (= K / 128), in the
/// consumers' order (fmw_scale_pos: 16-byte words of tokens {8j + 2t, + 1} for j = 2i, 2i + 1
/// at 16i + 4t).
pub fn act_scale_index(
    tile_index: usize,
    block: usize,
    blocks: usize,
    c: usize,
    tile: usize,
) -> usize {
    let pos = (c >> 4) * 16 + ((c >> 1) & 3) * 4 + ((c >> 3) & 1) * 2 + (c & 1);
    (tile_index * blocks + block) * tile + pos
}

/// Tiles this path may see for `t` tokens (`k` slots, `experts` experts): every routed tile the
/// plan can make, then the shared expert's, of [`tile_tokens`]`(t)` tokens.
pub fn act_tiles(t: usize, k: usize, experts: usize) -> usize {
    let tile = tile_tokens(t);
    crate::cuda::kernels::moe::max_tiles(t * k, tile, experts) + t.div_ceil(tile)
}

/// Floats of an activation's scales in this path's layout for `t` tokens (`width` = K of the
/// GEMM that reads them): the batch's tile size a tile and 128-block. Grows with `t`, across
/// the switch to the wide tiles too (the plan's tiles leave at most one partial tile an expert,
/// so the floats are about (t·k + t + tile·experts)·width/128): a workspace sized for `t` holds
/// every smaller batch's.
pub fn act_scale_floats(t: usize, k: usize, experts: usize, width: usize) -> usize {
    act_tiles(t, k, experts) * (width / 128) * tile_tokens(t)
}

/// A GEMM's tensor map over its activations' codes at `addr` (`rows` rows of `width` bytes, the
/// workspace's capacity: rows past a batch's are read only into columns that are never stored):
/// boxes of 128 bytes x [`ACT_BOX_ROWS`] rows in the 128-byte swizzle, rows past `rows` read as
/// zeros.
pub fn act_tensor_map(addr: u64, rows: usize, width: usize) -> Result<[u8; MAP_BYTES]> {
    encode_2d(
        addr,
        TensorElem::U8,
        [width, rows],
        [128, ACT_BOX_ROWS as u32],
        true,
    )
}

/// The narrow tiles' family ([`NARROW_TOKENS`]): the same file and entry points compiled with
/// FMW_NARROW defined; its launchers are [`SOURCE`]'s resolved in it
/// ([`Launcher::in_family`](crate::cuda::decl::Launcher::in_family)).
pub const NARROW_SOURCE: KernelSource = KernelSource {
    family: "fast_moe_wide_narrow",
    source: concat!(
        "#define FMW_NARROW 1\n",
        include_str!("../../../kernels/fast_moe_wide.cu")
    ),
    functions: SOURCE.functions,
};

crate::kernel_family! {
    /// The family as the registry compiles and loads it: the wide tiles ([`TOKENS`]).
    pub const SOURCE = "fast_moe_wide", include_str!("../../../kernels/fast_moe_wide.cu");

    /// x's codes and scales (by token) in this path's layout ([`act_scale_index`]): a warp a
    /// token, [`GATHER_TOKENS_PER_BLOCK`] a block of 256 threads. Reads the wide plan's scratch (`ranks`,
    /// `counts` as [`Moe::plan_wide`](crate::cuda::kernels::moe::Moe::plan_wide) leaves them) to
    /// place each assignment, so the plan must be the wide one, of this family's tile size.
    #[pdl(true)]
    fn fmw_gather_x_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, k: i32, ntiles: *const i32, e_begin: i32,
        e_end: i32, has_shared: bool, ids: *const i32, ranks: *const i32, counts: *const i32,
        offsets: *const i32, e: i32, xq_plan: *mut u8, xs_plan: *mut f32, queues: *mut u32,
    );
    /// GEMM1 + SwiGLU + routing weight + FP8 quantisation of h: fmoe_up_kernel's operands, x in
    /// this path's layout (`xs` its scales, `x_map` two tensor maps: over the routed tiles' codes
    /// in it, then over `xq` by token, which the shared expert's tiles read; `xq` itself is not
    /// read), h likewise.
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmw_up_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, i: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s1: *const u64, s3: *const u64, fmt: i32, shared_fmt: i32,
        shared_s1: Option<*const f32>, shared_s3: Option<*const f32>, sc8: Option<*const u8>,
        route_w: *const f32, limit: f32, x_map: *const u8, hq: *mut u8, hs: *mut f32,
        queue: *mut u32,
    );
    /// GEMM2 into bf16 rows per (token, slot): fmoe_down_kernel's operands, h in this path's
    /// layout ([`act_scale_index`]) and `h_map`, a tensor map over `hq` ([`act_tensor_map`]).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmw_down_kernel(
        hq: *const u8, hs: *const f32, t: i32, i: i32, d: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s2: *const u64, fmt: i32, shared_fmt: i32, shared_s2: Option<*const f32>,
        sc8: Option<*const u8>, h_map: *const u8, y: *mut u16, queue: *mut u32,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scales of a tile's 128-block fill its slots, one column each, at both tile sizes (the
    /// kernel's fmw_scale_pos is the same formula; gpu_fast_moe reads the device's layout
    /// through it).
    #[test]
    fn act_scale_index_places_each_column_of_a_block_once() {
        let blocks = 16;
        for tile in [NARROW_TOKENS, TOKENS] {
            let mut seen = vec![false; tile];
            for c in 0..tile {
                let at = act_scale_index(3, 5, blocks, c, tile);
                assert_eq!(
                    at / tile,
                    3 * blocks + 5,
                    "column {c} of {tile} left its block"
                );
                assert!(!seen[at % tile], "column {c} of {tile} shares a slot");
                seen[at % tile] = true;
            }
        }
    }

    /// A workspace sized for a batch holds every smaller batch's scales, across the switch from
    /// the narrow tiles to the wide ones (Flash: 6 of 256 experts; and 2 of 8).
    #[test]
    fn the_scales_of_a_batch_cover_every_smaller_batch() {
        for (k, e) in [(6, 256), (2, 8)] {
            let w = 2048;
            let mut most = 0;
            for t in 1..=3 * NARROW_MAX_TOKENS {
                let need = act_scale_floats(t, k, e, w);
                assert!(
                    need >= most,
                    "B = {t} needs less than a smaller batch ({k} of {e})"
                );
                most = need;
            }
        }
    }
}
