//! Rust side of the `fast_moe_wide` kernel family (kernels/fast_moe_wide.cu): the prefill path of the
//! fast set's expert GEMMs, for many tokens per expert. Items of up to [`TOKENS`] tokens and 128
//! weight rows; the FP4 per-32 scales of a 128-block are folded into the e4m3 codes so the tensor
//! core's sums are promoted once per 128 of K. Same operands and outputs as the decode kernels
//! ([`super::fast_moe_gemm`], whose [`FastMoeGemm`](super::fast_moe_gemm::FastMoeGemm) launches both
//! and picks the path: [`GemmPath`](super::fast_moe_gemm::GemmPath)).

use super::fast_moe_gemm::{MAP_BYTES, TensorElem, encode_2d};
use crate::error::Result;

/// Tokens per work item (FMW_TOKENS): the plan's `tile_rows` on this path, and the largest N of
/// its wgmma (m64nNk32; a folded FP4 pass runs N = its tile's tokens rounded up to 8).
pub const TOKENS: usize = 128;
/// Weight rows per pass of an item: one TMA box, two warpgroups of 64.
pub const ROWS: usize = 128;
/// Threads of a block: two consumer warpgroups and a producer warpgroup (its thread 0 issues
/// every copy; the warpgroup gives most of its registers to the consumers).
pub const THREADS: usize = 3 * 128;
/// Slots of the shared-memory ring (FMW_STAGES).
pub const STAGES: usize = 3;
/// Dynamic shared memory of a block (FMW_SMEM_BYTES; kernels/fast_moe_wide.cu checks its layout
/// fits): the ring of 1024-byte aligned slots (128 weight rows of 128 bytes, their FP4 scales as
/// f32, the tokens' codes over 256 k and their scales), the epilogue's bf16 buffer (up: the gate and
/// up values of the item's 128 j for its tokens), the tile's routing weights and the mbarriers.
pub const SMEM_BYTES: usize = {
    let slot = (ROWS * 128 + ROWS * 32 + 16 * TOKENS * 16 + 2 * TOKENS * 4).div_ceil(1024) * 1024;
    STAGES * slot + 2 * TOKENS * ROWS * 2 + TOKENS * 4 + 2 * STAGES * 8
};
const _: () = assert!(
    SMEM_BYTES <= 227 * 1024,
    "an sm_90 block takes at most 227 KiB"
);
/// Tokens from which a layer runs this path: where it measured faster than the decode path's one
/// launch ([`super::fast_moe_gemm::FUSED_TOKENS`], which takes every count below). At Flash shapes,
/// µs fused decode / prefill, best of two rounds, uniform and skewed routing (H100, fortieth
/// session): B = 512 1513.8 / 1607.0 (skewed 1532.1 / 1607.4), 576 1609.2 / 1646.9 (1622.9 /
/// 1637.9), 640 1711.4 / 1676.0 (1737.1 / 1676.2), 704 1870.4 / 1707.2 (1866.6 / 1699.7); 608 is
/// between the last two measured. Measured again with the spread shared items and the split router
/// on the fused launch (forty-second session; the prefill path with the unsplit router): 576
/// 1464.2 / 1527.1 (1479.5 / 1514.6), 640 1569.3 / 1527.2 (1590.6 / 1534.9), 768 1817.2 / 1556.6
/// (1827.9 / 1551.8): the crossover did not move. (Against the two-launch decode path it was 576,
/// and 768 before BENCHMARKS.md's issue 11 twenty-second version, 1024 before the producer's
/// row-address table, 1408 before the tile-sized wgmmas, 2048 before the up epilogue went through
/// shared memory, 3072 before that.)
pub const MIN_TOKENS: usize = 608;

/// Rows of the GEMMs' TMA boxes of their activations (FMW_HBOX): a tile of n tokens reads n
/// rounded up to it.
pub const ACT_BOX_ROWS: usize = 32;

/// Blocks per tile of `fmw_gather_x_kernel` (its grid's y).
pub const GATHER_Y: usize = 4;

/// Where this path keeps both GEMMs' activations, x (`fmw_gather_x_kernel` makes it) and h
/// (kernels/SPEC.md): a routed tile's rows at their plan rows (`rows[start + c]`'s position
/// `start + c`, so a tile's rows are consecutive and a TMA box reads them), the shared expert's
/// at `T*k + token`; and the scales tile by tile. This is the index of the scale of column `c`
/// (0..[`TOKENS`]) of tile `tile` (the plan's routed tiles, then the shared expert's
/// `ceil(T / TOKENS)`), 128-block `block` of `blocks` (= K / 128), in the consumers' order
/// (fmw_scale_pos: 16-byte words of tokens {8j + 2t, + 1} for j = 2i, 2i + 1 at 16i + 4t).
pub fn act_scale_index(tile: usize, block: usize, blocks: usize, c: usize) -> usize {
    let pos = (c >> 4) * 16 + ((c >> 1) & 3) * 4 + ((c >> 3) & 1) * 2 + (c & 1);
    (tile * blocks + block) * TOKENS + pos
}

/// Tiles this path may see for up to `t` tokens (`k` slots, `experts` experts): every routed
/// tile the plan can make, then the shared expert's.
pub fn act_tiles(t: usize, k: usize, experts: usize) -> usize {
    crate::cuda::kernels::moe::max_tiles(t * k, TOKENS, experts) + t.div_ceil(TOKENS)
}

/// Floats of an activation's scales in this path's layout for up to `t` tokens (`width` = K of
/// the GEMM that reads them): [`TOKENS`] a tile and 128-block.
pub fn act_scale_floats(t: usize, k: usize, experts: usize, width: usize) -> usize {
    act_tiles(t, k, experts) * width
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

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_moe_wide", include_str!("../../../kernels/fast_moe_wide.cu");

    /// x's codes and scales (by token) in this path's layout ([`act_scale_index`]): grid
    /// ([`act_tiles`], [`GATHER_Y`]), 256 threads.
    #[pdl(true)]
    fn fmw_gather_x_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, has_shared: bool,
        xq_plan: *mut u8, xs_plan: *mut f32,
    );
    /// GEMM1 + SwiGLU + routing weight + FP8 quantisation of h: fmoe_up_kernel's operands, x in
    /// this path's layout (`xs` its scales, `x_map` a tensor map over its codes; `xq` is not
    /// read), h likewise.
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmw_up_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, i: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s1: *const u64, s3: *const u64, fmt: i32, shared_fmt: i32,
        shared_s1: Option<*const f32>, shared_s3: Option<*const f32>, sc8: Option<*const u8>,
        route_w: *const f32, limit: f32, x_map: *const u8, hq: *mut u8, hs: *mut f32,
    );
    /// GEMM2 into bf16 rows per (token, slot): fmoe_down_kernel's operands, h in this path's
    /// layout ([`act_scale_index`]) and `h_map`, a tensor map over `hq` ([`act_tensor_map`]).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmw_down_kernel(
        hq: *const u8, hs: *const f32, t: i32, i: i32, d: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s2: *const u64, fmt: i32, shared_fmt: i32, shared_s2: Option<*const f32>,
        sc8: Option<*const u8>, h_map: *const u8, y: *mut u16,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scales of a tile's 128-block fill its TOKENS slots, one column each (the kernel's
    /// fmw_scale_pos is the same formula; gpu_fast_moe reads the device's layout through it).
    #[test]
    fn act_scale_index_places_each_column_of_a_block_once() {
        let blocks = 16;
        let mut seen = [false; TOKENS];
        for c in 0..TOKENS {
            let at = act_scale_index(3, 5, blocks, c);
            assert_eq!(at / TOKENS, 3 * blocks + 5, "column {c} left its block");
            assert!(!seen[at % TOKENS], "column {c} shares a slot");
            seen[at % TOKENS] = true;
        }
    }
}
