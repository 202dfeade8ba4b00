//! Rust side of the `fast_moe_wide` kernel family (kernels/fast_moe_wide.cu): the prefill path of the
//! fast set's expert GEMMs, for many tokens per expert. Items of up to [`TOKENS`] tokens and 128
//! weight rows; the FP4 per-32 scales of a 128-block are folded into the e4m3 codes so the tensor
//! core's sums are promoted once per 128 of K. Same operands and outputs as the decode kernels
//! ([`super::fast_moe_gemm`], whose [`FastMoeGemm`](super::fast_moe_gemm::FastMoeGemm) launches both
//! and picks the path: [`GemmPath`](super::fast_moe_gemm::GemmPath)).

/// Tokens per work item (FMW_TOKENS): the plan's `tile_rows` on this path, and the largest N of
/// its wgmma (m64nNk32; a folded FP4 pass runs N = its tile's tokens rounded up to 8).
pub const TOKENS: usize = 128;
/// Weight rows per pass of an item: one TMA box, two warpgroups of 64.
pub const ROWS: usize = 128;
/// Threads of a block: two consumer warpgroups and a producer warpgroup (all four of its warps
/// gather tokens, thread 0 also issues the weights' TMA; it gives most of its registers to the
/// consumers).
pub const THREADS: usize = 3 * 128;
/// Slots of the shared-memory ring (FMW_STAGES).
pub const STAGES: usize = 3;
/// Dynamic shared memory of a block (FMW_SMEM_BYTES; kernels/fast_moe_wide.cu checks its layout
/// fits): the ring of 1024-byte aligned slots (128 weight rows of 128 bytes, their FP4 scales as
/// f32, the tokens' codes over 256 k and their scales), the epilogue's bf16 buffer (up: the gate and
/// up values of the item's 128 j for its tokens), the tile's routing weights, the producer's table
/// of the tile's activation row addresses and the mbarriers.
pub const SMEM_BYTES: usize = {
    let slot = (ROWS * 128 + ROWS * 32 + 16 * TOKENS * 16 + 2 * TOKENS * 4).div_ceil(1024) * 1024;
    STAGES * slot + 2 * TOKENS * ROWS * 2 + TOKENS * 4 + TOKENS * 8 + 2 * STAGES * 8
};
const _: () = assert!(
    SMEM_BYTES <= 227 * 1024,
    "an sm_90 block takes at most 227 KiB"
);
/// Tokens from which a layer runs this path. Measured with the producer's row-address table
/// (BENCHMARKS.md, issue 11 eighteenth version: both paths at Flash shapes, µs decode / prefill,
/// uniform and skewed routing): B = 512 1365 / 1806 (skewed 1446 / 1814), 768 1975 / 1910 (1946 /
/// 1937), 1024 2350 / 1890 (2353 / 1940). (It was 1024 before that table, 1408 before the
/// tile-sized wgmmas, 2048 before the up epilogue went through shared memory, 3072 before that.)
pub const MIN_TOKENS: usize = 768;

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_moe_wide", include_str!("../../../kernels/fast_moe_wide.cu");

    /// GEMM1 + SwiGLU + routing weight + FP8 quantisation of h (fmoe_up_kernel's operands).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmw_up_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, i: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s1: *const u64, s3: *const u64, fmt: i32, shared_fmt: i32,
        shared_s1: Option<*const f32>, shared_s3: Option<*const f32>, sc8: Option<*const u8>,
        route_w: *const f32, limit: f32, hq: *mut u8, hs: *mut f32,
    );
    /// GEMM2 into bf16 rows per (token, slot) (fmoe_down_kernel's operands).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmw_down_kernel(
        hq: *const u8, hs: *const f32, t: i32, i: i32, d: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s2: *const u64, fmt: i32, shared_fmt: i32, shared_s2: Option<*const f32>,
        sc8: Option<*const u8>, y: *mut u16,
    );
}
