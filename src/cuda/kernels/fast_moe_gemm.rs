//! Rust side of the `fast_moe_gemm` kernel family (kernels/fast_moe_gemm.cu): the fast set's grouped
//! expert GEMMs on Hopper's FP8 tensor cores: `wgmma` m64nNk32 e4m3 with the weights (FP4 re-encoded
//! exactly as e4m3 on chip, or FP8) from registers and the tokens from shared memory, f32 promotion every
//! k32. A producer warp streams the weights by TMA through the per-expert tensor maps [`tensor_maps`]
//! encodes (a derived table, built at finalize). This is the decode path; [`FastMoeGemm`] also
//! launches the prefill path's kernels ([`super::fast_moe_wide`]) and picks one by [`GemmPath`].
//! See kernels/SPEC.md and [`super::fast_moe`], which runs a whole layer with them.

use super::fast_moe::{FastMoeLayer, FastMoeWorkspace};
use super::fast_moe_wide::{self as wide, fmw_down_kernel, fmw_gather_x_kernel, fmw_up_kernel};
use super::{need, to_i32};
use crate::cuda::decl::Launcher;
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::weights::format::StorageFormat;

/// Tokens (routed assignments) per work item: the plan's `tile_rows` (FMOE_TOKENS); one wgmma's N
/// (8 when a tile has at most 8).
pub const TOKENS: usize = 16;
/// Warpgroups of a GEMM block (FMOE_WARPGROUPS): each owns one m64 tile of the item's rows.
pub const WARPGROUPS: usize = 4;
/// Threads of a GEMM block: the consumer warpgroups and one producer warp.
pub const THREADS: usize = WARPGROUPS * 128 + 32;
/// Threads of an `fmoe_experts_kernel` block: [`THREADS`] and a warp that publishes each up item's
/// h rows to the down items of other blocks.
pub const FUSED_THREADS: usize = THREADS + 32;
/// Slots of the shared-memory ring (FMOE_STAGES); a stage is 128 bytes of each weight row (FP4: 256 k,
/// FP8: 128 k).
pub const STAGES: usize = 4;
/// j per up work item (FMOE_UP_J): gate rows j.. and up rows j.., so SwiGLU and the per-128 FP8
/// quantisation of h stay inside the block.
pub const UP_J: usize = WARPGROUPS * 64 / 2;
/// Output rows per down work item (FMOE_DOWN_ROWS).
pub const DOWN_ROWS: usize = WARPGROUPS * 64;

/// Dynamic shared memory of a GEMM block (FMOE_SMEM_BYTES; kernels/fast_moe_gemm.cu checks its layout
/// fits, and it must stay within the 227 KiB an sm_90 block may take): the ring of 1024-byte aligned
/// slots (the item's 256 weight rows of 128 bytes, FP4 scales, the tokens' codes and scales), the up
/// epilogue's gate and up values for two items (rows of UP_J + 4 floats), and the ring's mbarriers.
pub const SMEM_BYTES: usize = {
    let rows = WARPGROUPS * 64;
    let slot = (rows * 128 + rows * 32 + 16 * TOKENS * 16 + 128).div_ceil(1024) * 1024;
    STAGES * slot + 2 * 2 * TOKENS * (UP_J + 4) * 4 + 2 * STAGES * 8
};

/// Bytes of one `CUtensorMap`.
pub const MAP_BYTES: usize = 128;
/// Tensor maps per expert in a layer's table ([`Map`]).
pub const MAPS_PER_EXPERT: usize = 6;

/// An expert's tensor maps, in table order: the codes of w1, w3, w2, then their FP4 per-32 scales
/// (zeros for FP8 experts, whose 128x128 block scales the kernels read directly).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Map {
    W1 = 0,
    W3 = 1,
    W2 = 2,
    S1 = 3,
    S3 = 4,
    S2 = 5,
}

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_moe_gemm", include_str!("../../../kernels/fast_moe_gemm.cu");

    /// GEMM1 + SwiGLU + routing weight + FP8 quantisation of h, routed tiles and the shared expert.
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmoe_up_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, i: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s1: *const u64, s3: *const u64, fmt: i32, shared_fmt: i32,
        shared_s1: Option<*const f32>, shared_s3: Option<*const f32>, sc8: Option<*const u8>,
        route_w: *const f32, limit: f32, hq: *mut u8, hs: *mut f32,
    );
    /// Both GEMMs in one launch (the fused decode path): up items, then down items, from one queue; a
    /// down item's tokens wait for its tile's up items (`sync`: [`sync_words`] u32, zero when the
    /// launch starts).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmoe_experts_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, i: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s1: *const u64, s3: *const u64, s2: *const u64, fmt: i32, fmt2: i32, shared_fmt: i32,
        shared_fmt2: i32, shared_s1: Option<*const f32>, shared_s3: Option<*const f32>,
        shared_s2: Option<*const f32>, sc8: Option<*const u8>, route_w: *const f32, limit: f32,
        hq: *mut u8, hs: *mut f32, y: *mut u16, sync: *mut u32,
    );
    /// The router (logits, selection, plan) and both GEMMs in one launch (the routed decode
    /// path): the same steps and bits as `fmoe_logits_kernel`, `fmoe_select_kernel`,
    /// `moe_plan_kernel` and `fmoe_experts_kernel` (`sync`: [`route_sync_words`] u32, zero when
    /// the launch starts; the layer's combine zeroes them after it).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmoe_route_experts_kernel(
        x: *const f32, t: i32, d: i32, i: i32, k: i32, e: i32, gate: *const f32, scoring: i32,
        bias: Option<*const f32>, tid2eid: Option<*const i32>, tokens: Option<*const i32>,
        renorm: bool, route_scale: f32, scores: *mut f32, ids: *mut i32, route_w: *mut f32,
        x_made: bool, xq: *mut u8, xs: *mut f32, offsets: *mut i32, rows: *mut i32,
        tiles: *mut i32, ntiles: *mut i32, e_begin: i32, e_end: i32, maps: *const u8,
        s1: *const u64, s3: *const u64, s2: *const u64, fmt: i32, fmt2: i32, shared_fmt: i32,
        shared_fmt2: i32, shared_s1: Option<*const f32>, shared_s3: Option<*const f32>,
        shared_s2: Option<*const f32>, sc8: Option<*const u8>, limit: f32, hq: *mut u8,
        hs: *mut f32, y: *mut u16, sync: *mut u32,
    );
    /// GEMM2 into bf16 rows per (token, slot).
    #[smem(SMEM_BYTES as u32)]
    #[pdl(true)]
    fn fmoe_down_kernel(
        hq: *const u8, hs: *const f32, t: i32, i: i32, d: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, maps: *const u8,
        s2: *const u64, fmt: i32, shared_fmt: i32, shared_s2: Option<*const f32>,
        sc8: Option<*const u8>, y: *mut u16,
    );
    /// The table's row exponents and row-block fold flags, from its blocks.
    fn fmoe_rows8_kernel(nex: i32, d: i32, i: i32, table: *mut u8);
    /// A layer's UE8M0 scale table from its FP4 experts' f32 scales ([`scales8_bytes`]).
    fn fmoe_scales8_kernel(
        s1: *const u64, s3: *const u64, s2: *const u64, nloc: i32, sh1: Option<*const f32>,
        sh3: Option<*const f32>, sh2: Option<*const f32>, d: i32, i: i32, table: *mut u8,
    );
}

crate::launchers! {
    /// The expert GEMMs' entry points (this family's and the prefill path's, fast_moe_wide, in
    /// its wide and narrow tiles' builds), resolved from a loaded registry.
    pub struct FastMoeGemm {
        up: fmoe_up_kernel,
        down: fmoe_down_kernel,
        experts: fmoe_experts_kernel,
        route_experts: fmoe_route_experts_kernel,
        wide_gather: fmw_gather_x_kernel,
        wide_up: fmw_up_kernel,
        wide_down: fmw_down_kernel,
        narrow_gather: fmw_gather_x_kernel in wide::NARROW_SOURCE.family,
        narrow_up: fmw_up_kernel in wide::NARROW_SOURCE.family,
        narrow_down: fmw_down_kernel in wide::NARROW_SOURCE.family,
        scales8: fmoe_scales8_kernel,
        rows8: fmoe_rows8_kernel,
    }
}

/// Which kernels run a layer's expert GEMMs: the same operands, outputs and error bounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmPath {
    /// This family: items of [`TOKENS`] tokens, promotion every k32; streams the touched experts'
    /// bytes at few tokens per expert. Two launches: `fmoe_up_kernel`, then `fmoe_down_kernel`.
    /// No batch takes it by default ([`GemmPath::for_tokens`]: the one launch measured faster at
    /// every count); the tests and `dsv4 bench moe --path decode` run it.
    Decode,
    /// The same items and sums, bit for bit, in one launch (`fmoe_experts_kernel`): a down item
    /// starts once its own tile's up items are done, and blocks take items from a queue.
    DecodeFused,
    /// The router (logits, selection, plan) and the fused decode GEMMs in one launch
    /// (`fmoe_route_experts_kernel`), the same bits as the router kernels and
    /// [`GemmPath::DecodeFused`]: the shared expert's up items stream while other blocks route,
    /// the routed items start once the plan is published. Takes the whole layer but the
    /// combine ([`super::fast_moe::FastMoe::route_and_experts`]); the f32 router only.
    DecodeRouted,
    /// fast_moe_wide: items of [`wide::tile_tokens`] tokens (64 up to
    /// [`wide::NARROW_MAX_TOKENS`], then 128), one promotion per 128 of K.
    Prefill,
}

/// Token counts that take [`GemmPath::DecodeFused`]: every count below the prefill path's
/// [`wide::MIN_TOKENS`], where it measured faster than the two launches (the layer at Flash
/// shapes, µs two / one launch, H100). Once the plan zeroed the one launch's words: B = 1 69.70 /
/// 68.26, 2 101.52 / 98.32, 3 139.76 / 124.25 (one call, BENCHMARKS.md 2026-12-06, thirty-fifth
/// session). With the start ticket, best of two rounds in one call (fortieth session): B = 32
/// 675.44 / 644.77, 64 981.17 / 935.51, 128 1222.80 / 1167.07, 256 1361.41 / 1300.78, and
/// uniform / skewed 320 1412.9 / 1340.9 (1427.6 / 1360.8), 448 1498.3 / 1441.9 (1522.2 /
/// 1467.2), 576 1622.6 / 1609.2 (1640.3 / 1622.9). (On the H200, before the shared up items went
/// first, it was 2.3% slower at 32 and within 1-2% from 64: issue 11 fifteenth version.)
pub const FUSED_TOKENS: std::ops::RangeInclusive<usize> = 1..=(wide::MIN_TOKENS - 1);

/// The most tokens [`GemmPath::DecodeRouted`] takes: one token tile of the shared expert. No
/// token count takes it by default ([`GemmPath::for_tokens`]): it measured slower than
/// [`GemmPath::DecodeFused`] (H100, B = 1 96.4 / 68.3 µs; BENCHMARKS.md 2026-12-06); the bench
/// (`--path decode-routed`) and the tests run it.
pub const ROUTED_MAX_TOKENS: usize = TOKENS;

impl GemmPath {
    /// The path for a batch of `t` tokens: prefill from [`wide::MIN_TOKENS`] on, the one-launch
    /// decode path for [`FUSED_TOKENS`].
    pub fn for_tokens(t: usize) -> GemmPath {
        if t >= wide::MIN_TOKENS {
            GemmPath::Prefill
        } else if FUSED_TOKENS.contains(&t) {
            GemmPath::DecodeFused
        } else {
            GemmPath::Decode
        }
    }

    /// Whether this path's kernels read their activations (x's and h's e4m3 codes) in the halves
    /// order, else in the fragment order (kernels/fp8_mma.cuh): the prefill path's FP4 decode and
    /// FP8 fragments are cheaper in the halves order, the decode path's plain FP4 bit move in the
    /// fragment order.
    pub fn halves_order(self) -> bool {
        self == GemmPath::Prefill
    }

    /// The plan's tile size on this path for a batch of `t` tokens: tokens per work item.
    pub fn tile_rows(self, t: usize) -> usize {
        match self {
            GemmPath::DecodeRouted | GemmPath::DecodeFused | GemmPath::Decode => TOKENS,
            GemmPath::Prefill => wide::tile_tokens(t),
        }
    }

    /// (grid, block threads, dynamic shared memory) of the up (`up`) or down GEMM of `t` tokens
    /// on this path.
    fn launch_shape(
        self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        up: bool,
    ) -> (u32, u32, u32) {
        let n = if up { layer.i } else { layer.d }; // weight rows (up: j)
        match self {
            GemmPath::DecodeRouted | GemmPath::DecodeFused | GemmPath::Decode => {
                let row_tiles = if up { n / UP_J } else { n.div_ceil(DOWN_ROWS) };
                let items = max_items(layer, t, TOKENS, row_tiles);
                (grid(ctx, items), THREADS as u32, SMEM_BYTES as u32)
            }
            GemmPath::Prefill => {
                let items = max_items(layer, t, wide::tile_tokens(t), n / wide::ROWS);
                let smem = wide::smem_bytes_for(t) as u32;
                (grid(ctx, items), wide::THREADS as u32, smem)
            }
        }
    }
}

/// A GEMM kernel's `Args` (both paths, up and down): the sizes, the plan and the layer's
/// expert tables every one of them takes, then the kernel's own fields. Size conversions fail
/// with `$who` named (`?` in the caller).
macro_rules! gemm_args {
    ($kernel:ident, $who:expr, $layer:expr, $ws:expr, $t:expr; $($field:ident: $value:expr),* $(,)?) => {
        $kernel::Args {
            t: to_i32($who, "T", $t)?,
            d: to_i32($who, "D", $layer.d)?,
            i: to_i32($who, "I", $layer.i)?,
            k: to_i32($who, "k", $layer.k)?,
            rows: $ws.plan.rows,
            tiles: $ws.plan.tiles,
            ntiles: $ws.plan.ntiles,
            e_begin: to_i32($who, "e_begin", $layer.local.start)?,
            e_end: to_i32($who, "e_end", $layer.local.end)?,
            maps: $layer.maps,
            sc8: $layer.scales8,
            $($field: $value),*
        }
    };
}

/// The fused decode kernels' `Args` (`fmoe_experts_kernel`, `fmoe_route_experts_kernel`):
/// [`gemm_args!`]'s fields, the three expert matrices' scales and formats (the shared expert's
/// too), the SwiGLU clamp and h / y, then the kernel's own fields.
macro_rules! fused_args {
    ($kernel:ident, $who:expr, $layer:expr, $ws:expr, $t:expr; $($field:ident: $value:expr),* $(,)?) => {
        gemm_args!($kernel, $who, $layer, $ws, $t;
            s1: $layer.w1.scales,
            s3: $layer.w3.scales,
            s2: $layer.w2.scales,
            fmt: $layer.w1.format.code(),
            fmt2: $layer.w2.format.code(),
            shared_fmt: $layer.shared.as_ref().map_or(0, |s| s.w1.format.code()),
            shared_fmt2: $layer.shared.as_ref().map_or(0, |s| s.w2.format.code()),
            shared_s1: $layer.shared.as_ref().and_then(|s| s.w1.scales),
            shared_s3: $layer.shared.as_ref().and_then(|s| s.w3.scales),
            shared_s2: $layer.shared.as_ref().and_then(|s| s.w2.scales),
            limit: $layer.limit,
            hq: $ws.hq,
            hs: $ws.hs,
            y: $ws.y,
            $($field: $value),*
        )
    };
}

/// Work items a GEMM may see for `t` tokens in tiles of `tile` tokens: every routed tile the plan
/// can make, plus the shared expert's token tiles, times the row tiles.
fn max_items(layer: &FastMoeLayer, t: usize, tile: usize, row_tiles: usize) -> usize {
    let routed = (t * layer.k).div_ceil(tile) + layer.local.len();
    let shared = if layer.shared.is_some() {
        t.div_ceil(tile)
    } else {
        0
    };
    (routed + shared) * row_tiles
}

/// u32 words of the decode path's synchronisation buffer for `t` tokens (`fmoe_experts_kernel`'s
/// `sync`, kernels/fast_moe_gemm.cu FMOE_SYNC_*): the blocks' start ticket, then the
/// [`plan_cleared_sync_words`]. The ticket is zero between launches (the workspace starts so; the
/// launch's last block to start resets it), since the blocks take it before the plan has run.
pub fn sync_words(t: usize, k: usize, experts: usize) -> usize {
    1 + plan_cleared_sync_words(t, k, experts)
}

/// The words after `sync`'s first: the item queue's head and per tile the plan can make (routed
/// and shared) a count of its up items done. They must be zero when the launch starts:
/// `FastMoe::experts_on` has the plan zero them (`Moe::plan_clearing`), the launch before.
pub fn plan_cleared_sync_words(t: usize, k: usize, experts: usize) -> usize {
    1 + (t * k).div_ceil(TOKENS) + experts + t.div_ceil(TOKENS)
}

/// The prefill path's item queues in the same buffer (kernels/fast_moe_wide.cu `fmw_take`): the up
/// GEMM's head at this word, the down GEMM's at the next. `fmw_gather_x_kernel`, the launch before
/// the up GEMM's, zeroes both. (The fused decode path's plan zeroes the same words before its own
/// launch; the start ticket, word 0, is not touched.)
pub const PREFILL_QUEUE_WORD: usize = 1;

/// The prefill path's two queue words (from [`PREFILL_QUEUE_WORD`]): the up GEMM's, then the
/// down GEMM's.
fn prefill_queues(who: &str, ws: &FastMoeWorkspace) -> Result<DevicePtr> {
    need(who, "sync", ws.sync, (PREFILL_QUEUE_WORD + 2) * 4)?;
    ws.sync.slice(PREFILL_QUEUE_WORD * 4, 8)
}

/// u32 words of the routed decode path's synchronisation buffer for `t` tokens
/// (`fmoe_route_experts_kernel`'s `sync`): the queue's head, the router's three counts (x's codes,
/// the logit tiles, the plan), then per tile a count of its up items done. Zero when the launch
/// starts: the workspace starts so, and the layer's combine zeroes them after each launch.
pub fn route_sync_words(t: usize, k: usize, experts: usize) -> usize {
    3 + plan_cleared_sync_words(t, k, experts)
}

/// Checks the buffers of `ws` that GEMM1 reads and writes for `t` tokens (`who`: the kernel, for
/// errors): x's codes and scales, h's, the routing weights.
fn need_up(
    who: &str,
    layer: &FastMoeLayer,
    t: usize,
    ws: &FastMoeWorkspace,
    path: GemmPath,
) -> Result<()> {
    let (d, k) = (layer.d, layer.k);
    need(who, "xq", ws.xq, t * d)?;
    need(who, "xs", ws.xs, t * d / 128 * 4)?;
    if path == GemmPath::Prefill {
        // x in the path's layout: its codes in y's buffer, its scales.
        need(who, "y", ws.y, (t * k + t) * d)?;
        need(
            who,
            "xs_plan",
            ws.xs_plan,
            wide::act_scale_floats(t, k, layer.experts, d) * 4,
        )?;
        // The wide plan's scratch, which the gather places x's rows from.
        let [counts, ranks] = crate::cuda::kernels::moe::plan_wide_scratch(t * k, layer.experts);
        need(who, "plan_counts", ws.plan_counts, counts * 4)?;
        need(who, "plan_ranks", ws.plan_ranks, ranks * 4)?;
        need(who, "ids", ws.ids, t * k * 4)?;
    }
    need_h(who, layer, t, ws, path)?;
    need(who, "route_w", ws.weights, t * k * 4)
}

/// GEMM2's likewise: h's codes and scales, y.
fn need_down(
    who: &str,
    layer: &FastMoeLayer,
    t: usize,
    ws: &FastMoeWorkspace,
    path: GemmPath,
) -> Result<()> {
    let rows_out = t * layer.k + t;
    need_h(who, layer, t, ws, path)?;
    need(who, "y", ws.y, rows_out * layer.d * 2)
}

/// h's codes and scales in `path`'s layout (and the prefill path's tensor map over them).
fn need_h(
    who: &str,
    layer: &FastMoeLayer,
    t: usize,
    ws: &FastMoeWorkspace,
    path: GemmPath,
) -> Result<()> {
    let (i, k) = (layer.i, layer.k);
    let rows_out = t * k + t;
    need(who, "hq", ws.hq, rows_out * i)?;
    let scales = match path {
        GemmPath::Prefill => {
            need(who, "act_maps", ws.act_maps, 3 * MAP_BYTES)?;
            wide::act_scale_floats(t, k, layer.experts, i)
        }
        GemmPath::Decode | GemmPath::DecodeFused | GemmPath::DecodeRouted => rows_out * i / 128,
    };
    need(who, "hs", ws.hs, scales * 4)
}

/// Persistent grid: one block per SM (the ring fills most of its shared memory), never more
/// blocks than items.
/// (grid, dynamic shared memory) of a fused decode launch of `t` tokens (`fmoe_experts_kernel`,
/// `fmoe_route_experts_kernel`): the larger of its up and down GEMMs' grids.
fn fused_grid(ctx: &Context, layer: &FastMoeLayer, t: usize) -> (u32, u32) {
    let (g_up, _, smem) = GemmPath::DecodeFused.launch_shape(ctx, layer, t, true);
    let (g_dn, _, _) = GemmPath::DecodeFused.launch_shape(ctx, layer, t, false);
    (g_up.max(g_dn), smem)
}

fn grid(ctx: &Context, items: usize) -> u32 {
    items.clamp(1, ctx.info().multiprocessors.max(1) as usize) as u32
}

impl FastMoeGemm {
    /// Builds `layer.scales8` (if any) from the f32 scales of its FP4 experts: sets the header's
    /// flag, then `fmoe_scales8_kernel` writes every byte and clears the flag if a scale is not
    /// an exact power of two (the GEMMs then read the f32 scales). Finalize and refit run it
    /// after the weights are written, on `stream`.
    pub fn derive_scales8(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_scales8_kernel";
        let Some(table) = layer.scales8 else {
            return Ok(());
        };
        let (d, i) = (layer.d, layer.i);
        let nloc = layer.local.len();
        let shared_fp4 = layer.shared.filter(|sh| sh.w1.format == StorageFormat::Fp4);
        let experts = nloc + usize::from(shared_fp4.is_some());
        need(K, "table", table, scales8_bytes(d, i, experts))?;
        let _g = ctx.enter()?;
        // The header's flags: every scale exact, and foldable (kernels/fast_moe_common.cuh).
        let flags = table.slice(0, 8)?;
        if layer.w1.format != StorageFormat::Fp4 {
            // Routed experts in FP8: the table is not built (an FP4 shared expert, if any,
            // reads its scales as f32).
            return crate::cuda::arena::copy_to_device_sync(flags, &[0i32, 0], stream);
        }
        crate::cuda::arena::copy_to_device_sync(flags, &[1i32, 1], stream)?;
        let threads = experts * (2 * i * d.div_ceil(256) + d * i.div_ceil(256));
        let args = fmoe_scales8_kernel::Args {
            s1: layer.w1.scales,
            s3: layer.w3.scales,
            s2: layer.w2.scales,
            nloc: to_i32(K, "nloc", nloc)?,
            sh1: shared_fp4.and_then(|s| s.w1.scales),
            sh3: shared_fp4.and_then(|s| s.w3.scales),
            sh2: shared_fp4.and_then(|s| s.w2.scales),
            d: to_i32(K, "D", d)?,
            i: to_i32(K, "I", i)?,
            table,
        };
        self.scales8
            .launch(threads.div_ceil(256) as u32, 256, 0, stream, args)?;
        let blocks = experts * (2 * i / 128 + d / 128);
        let args = fmoe_rows8_kernel::Args {
            nex: to_i32(K, "experts", experts)?,
            d: to_i32(K, "D", d)?,
            i: to_i32(K, "I", i)?,
            table,
        };
        self.rows8
            .launch(blocks.div_ceil(128) as u32, 128, 0, stream, args)
    }

    /// The prefill path's gather, up and down kernels for a batch of `t` tokens: the build of
    /// its tile size ([`wide::narrow_tiles`]: the narrow tiles' family, or the wide tiles').
    fn prefill_kernels(
        &self,
        t: usize,
    ) -> (
        Launcher<fmw_gather_x_kernel::Args>,
        Launcher<fmw_up_kernel::Args>,
        Launcher<fmw_down_kernel::Args>,
    ) {
        if wide::narrow_tiles(t) {
            (self.narrow_gather, self.narrow_up, self.narrow_down)
        } else {
            (self.wide_gather, self.wide_up, self.wide_down)
        }
    }

    /// `ws.hq`, `ws.hs` = GEMM1 of every routed tile of `ws`'s plan (made with `path`'s tile
    /// size) and of the shared expert.
    pub fn up(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        path: GemmPath,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_up_kernel";
        need_up(K, layer, t, ws, path)?;
        let sh = layer.shared.as_ref();
        // Both paths' kernels take the same arguments (the prefill path's x in its own layout).
        macro_rules! up_args {
            ($kernel:ident, $xs:expr $(, $field:ident: $value:expr)*) => {
                gemm_args!($kernel, K, layer, ws, t;
                    xq: ws.xq,
                    xs: $xs,
                    s1: layer.w1.scales,
                    s3: layer.w3.scales,
                    fmt: layer.w1.format.code(),
                    shared_fmt: sh.map_or(0, |s| s.w1.format.code()),
                    shared_s1: sh.and_then(|s| s.w1.scales),
                    shared_s3: sh.and_then(|s| s.w3.scales),
                    route_w: ws.weights,
                    limit: layer.limit,
                    hq: ws.hq,
                    hs: ws.hs,
                    $($field: $value),*
                )
            };
        }
        let _g = ctx.enter()?;
        let (g, b, sm) = path.launch_shape(ctx, layer, t, true);
        match path {
            GemmPath::DecodeRouted | GemmPath::DecodeFused | GemmPath::Decode => {
                self.up
                    .launch(g, b, sm, stream, up_args!(fmoe_up_kernel, ws.xs))
            }
            GemmPath::Prefill => {
                let gather = fmw_gather_x_kernel::Args {
                    xq: ws.xq,
                    xs: ws.xs,
                    t: to_i32(K, "T", t)?,
                    d: to_i32(K, "D", layer.d)?,
                    k: to_i32(K, "k", layer.k)?,
                    ntiles: ws.plan.ntiles,
                    e_begin: to_i32(K, "e_begin", layer.local.start)?,
                    e_end: to_i32(K, "e_end", layer.local.end)?,
                    has_shared: sh.is_some(),
                    ids: ws.ids,
                    ranks: ws.plan_ranks,
                    counts: ws.plan_counts,
                    offsets: ws.plan.offsets,
                    e: to_i32(K, "experts", layer.experts)?,
                    xq_plan: ws.y,
                    xs_plan: ws.xs_plan,
                    queues: prefill_queues(K, ws)?,
                };
                let blocks = t.div_ceil(wide::GATHER_TOKENS_PER_BLOCK);
                let grid = (to_i32(K, "gather blocks", blocks)? as u32, 1, 1);
                let (gather_k, up_k, _) = self.prefill_kernels(t);
                gather_k.launch(grid, 256, 0, stream, gather)?;
                let queue = prefill_queues(K, ws)?.slice(0, 4)?;
                let args = up_args!(fmw_up_kernel, ws.xs_plan, x_map: ws.x_map()?, queue: queue);
                up_k.launch(g, b, sm, stream, args)
            }
        }
    }

    /// The decode path's two GEMMs in one launch (`fmoe_experts_kernel`): `ws.hq` / `ws.hs` and
    /// `ws.y` as [`Self::up`] then [`Self::down`] on [`GemmPath::Decode`] make them, bit for bit.
    /// `ws.sync` must be zero ([`sync_words`]: the plan before zeroes all but the start ticket in
    /// the layer's sequence, `FastMoe::experts_on`; the ticket returns to zero by itself).
    pub(crate) fn up_down(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_experts_kernel";
        need_up(K, layer, t, ws, GemmPath::DecodeFused)?;
        need_down(K, layer, t, ws, GemmPath::DecodeFused)?;
        need(
            K,
            "sync",
            ws.sync,
            sync_words(t, layer.k, layer.experts) * 4,
        )?;
        let args = fused_args!(fmoe_experts_kernel, K, layer, ws, t;
            xq: ws.xq,
            xs: ws.xs,
            route_w: ws.weights,
            sync: ws.sync,
        );
        let _g = ctx.enter()?;
        let (grid, smem) = fused_grid(ctx, layer, t);
        let block = FUSED_THREADS as u32;
        self.experts.launch(grid, block, smem, stream, args)
    }

    /// The router and the decode path's two GEMMs in one launch (`fmoe_route_experts_kernel`):
    /// `ws.logits`, `ws.ids`, `ws.weights`, the plan, `ws.hq` / `ws.hs` and `ws.y` as the f32
    /// router ([`super::fast_moe::FastMoe::route_on`]), then [`Self::up_down`] make them, bit for
    /// bit; x's codes too unless `x_made` ([`super::fast_moe::FastMoe::norm_x`] made them in the
    /// fragment order). `ws.route_sync` must be zero ([`route_sync_words`]): the workspace starts
    /// so and the layer's combine zeroes it after each launch.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn route_up_down(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        x: DevicePtr,
        t: usize,
        x_made: bool,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_route_experts_kernel";
        let (e, k) = (layer.experts, layer.k);
        if t == 0 || t > ROUTED_MAX_TOKENS {
            return Err(Error::new(
                Status::Internal,
                format!("{K}: {t} tokens (the routed decode path takes 1..={ROUTED_MAX_TOKENS})"),
            ));
        }
        layer.check_router(K, x, t, ws)?;
        need_up(K, layer, t, ws, GemmPath::DecodeRouted)?;
        need_down(K, layer, t, ws, GemmPath::DecodeRouted)?;
        ws.plan.sized(t, TOKENS).validate(K)?;
        need(
            K,
            "route_sync",
            ws.route_sync,
            route_sync_words(t, k, e) * 4,
        )?;
        let (bias, tid2eid, tokens) = layer.selection.kernel_args(K, t, e, k)?;
        let r = &layer.router;
        let args = fused_args!(fmoe_route_experts_kernel, K, layer, ws, t;
            x: x,
            e: to_i32(K, "E", e)?,
            gate: layer.gate,
            scoring: super::moe::scoring_code(r.scoring),
            bias: bias,
            tid2eid: tid2eid,
            tokens: tokens,
            renorm: r.renorm,
            route_scale: r.route_scale,
            scores: ws.logits,
            ids: ws.ids,
            route_w: ws.weights,
            x_made: x_made,
            xq: ws.xq,
            xs: ws.xs,
            offsets: ws.plan.offsets,
            sync: ws.route_sync,
        );
        let _g = ctx.enter()?;
        let (grid, smem) = fused_grid(ctx, layer, t);
        let block = FUSED_THREADS as u32;
        self.route_experts.launch(grid, block, smem, stream, args)
    }

    /// `ws.y` = GEMM2 of every routed tile and of the shared expert, bf16 rows per (token, slot).
    pub fn down(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        path: GemmPath,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_down_kernel";
        need_down(K, layer, t, ws, path)?;
        let sh = layer.shared.as_ref();
        macro_rules! down_args {
            ($kernel:ident $(, $field:ident: $value:expr)*) => {
                gemm_args!($kernel, K, layer, ws, t;
                    hq: ws.hq,
                    hs: ws.hs,
                    s2: layer.w2.scales,
                    fmt: layer.w2.format.code(),
                    shared_fmt: sh.map_or(0, |s| s.w2.format.code()),
                    shared_s2: sh.and_then(|s| s.w2.scales),
                    y: ws.y,
                    $($field: $value),*
                )
            };
        }
        let _g = ctx.enter()?;
        let (g, b, sm) = path.launch_shape(ctx, layer, t, false);
        match path {
            GemmPath::DecodeRouted | GemmPath::DecodeFused | GemmPath::Decode => {
                self.down
                    .launch(g, b, sm, stream, down_args!(fmoe_down_kernel))
            }
            GemmPath::Prefill => {
                let queue = prefill_queues(K, ws)?.slice(4, 4)?;
                let args = down_args!(fmw_down_kernel, h_map: ws.h_map()?, queue: queue);
                self.prefill_kernels(t).2.launch(g, b, sm, stream, args)
            }
        }
    }
}

/// Header bytes of a UE8M0 scale table (FMOE_SC8_HEADER): its first `i32` is 1 when every scale
/// in it is exact.
pub const SCALES8_HEADER: usize = 256;

/// Bytes of a layer's UE8M0 scale table for `experts` experts (the local ones and the shared
/// expert) of hidden `d` and width `i` (kernels/fast_moe_common.cuh `fmoe_sc8_expert`): FP4's
/// per-32 scales as one byte each, in 1 KiB blocks of 128 rows x 8 scales per 256 k, so the
/// producer warp copies a stage's scales with two 1 KiB bulk copies; then each row's largest
/// exponent and a fold flag per 128-row block (the prefill path's whole-row fold); each expert's
/// part 256-byte aligned. A derived tensor: about a quarter of the f32 scales' bytes, and it cuts
/// the bytes an FP4 expert streams per step by 15% (the f32 scales add 3 bytes per 32 weights to
/// the 16 of codes and 1 of a UE8M0 scale).
pub fn scales8_bytes(d: usize, i: usize, experts: usize) -> usize {
    let rows = 2 * i + d;
    let expert = (scales8_blocks(d, i) + rows + rows / 128).next_multiple_of(256);
    SCALES8_HEADER + experts * expert
}

/// Bytes of an expert's 1 KiB scale blocks in the table (`fmoe_sc8_blocks`): per matrix, one per
/// 128 rows and 256 k.
fn scales8_blocks(d: usize, i: usize) -> usize {
    let matrix = |rows: usize, k: usize| rows / 128 * k.div_ceil(256) * 1024;
    2 * matrix(i, d) + matrix(d, i)
}

/// Offset in a layer's UE8M0 scale table of the whole-row fold flag of 128-row block `rb` of
/// matrix `m` (0 w1, 1 w3, 2 w2) of its `x`-th expert (kernels/fast_moe_common.cuh
/// `fmoe_sc8_row_flags`): 1 when every row of the block has its exponents within 2^11 of its
/// largest (`FMOE_FOLD_SPAN`).
pub fn scales8_row_flag_offset(d: usize, i: usize, x: usize, m: usize, rb: usize) -> usize {
    let expert = (scales8_bytes(d, i, 1) - SCALES8_HEADER) * x;
    SCALES8_HEADER + expert + scales8_blocks(d, i) + 2 * i + d + m * (i / 128) + rb
}

/// Device addresses of one expert's matrices, as its tensor maps describe them.
#[derive(Clone, Copy, Debug)]
pub struct ExpertMatrices {
    pub format: StorageFormat,
    /// Codes of w1 `[I, D]`, w3 `[I, D]` and w2 `[D, I]`.
    pub w1: u64,
    pub w3: u64,
    pub w2: u64,
    /// Their f32 per-32 scales (FP4; unused for FP8).
    pub s1: u64,
    pub s3: u64,
    pub s2: u64,
}

impl ExpertMatrices {
    /// No expert: its maps stay zeros.
    pub const NONE: ExpertMatrices = ExpertMatrices {
        format: StorageFormat::F32,
        w1: 0,
        w3: 0,
        w2: 0,
        s1: 0,
        s3: 0,
        s2: 0,
    };
}

/// A layer's tensor map table for the GEMMs' producer warp: [`MAPS_PER_EXPERT`] maps ([`Map`]
/// order) for each of `experts` (the local experts, then the shared expert), `MAP_BYTES` each. A map
/// describes a matrix's codes as a 2-D byte tensor (rows x stored row bytes) read in boxes of 128
/// bytes x 128 rows in the 128-byte swizzle, or its FP4 scales as rows x K/32 f32 in boxes of 8 x 128;
/// rows and k past the matrix read as zeros. Experts stored in another format get zeros (the fast set
/// runs the reference kernels for such layers). The maps hold addresses only, so a refit, which writes
/// the weights in place, leaves them valid; they are rebuilt with the other derived tensors anyway.
pub fn tensor_maps(d: usize, i: usize, experts: &[ExpertMatrices]) -> Result<Vec<u8>> {
    maps_table(d, i, experts, false)
}

/// [`tensor_maps`] for the bench probe FMOE_PROBE_FLAT (kernels/fast_moe_gemm.cu, `dsv4 bench moe
/// --defines FMOE_PROBE_FLAT=1`): each matrix's codes as rows of 128 bytes, so that a box of 128
/// of them is 16 KiB of consecutive bytes, the stage a stage-contiguous layout would give. The
/// kernels then read the same number of bytes from the same matrices, not the values they
/// multiply: timings only.
pub fn probe_flat_tensor_maps(d: usize, i: usize, experts: &[ExpertMatrices]) -> Result<Vec<u8>> {
    maps_table(d, i, experts, true)
}

fn maps_table(d: usize, i: usize, experts: &[ExpertMatrices], flat: bool) -> Result<Vec<u8>> {
    let mut table = vec![0u8; experts.len() * MAPS_PER_EXPERT * MAP_BYTES];
    for (x, e) in experts.iter().enumerate() {
        let fp4 = match e.format {
            StorageFormat::Fp4 => true,
            StorageFormat::Fp8 => false,
            StorageFormat::F32 | StorageFormat::Bf16 => continue,
        };
        // (map, address, rows, cols) of each matrix.
        let mats = [
            (Map::W1, e.w1, Map::S1, e.s1, i, d),
            (Map::W3, e.w3, Map::S3, e.s3, i, d),
            (Map::W2, e.w2, Map::S2, e.s2, d, i),
        ];
        for (m, addr, sm, saddr, rows, cols) in mats {
            let at = |m: Map| (x * MAPS_PER_EXPERT + m as usize) * MAP_BYTES;
            let row_bytes = if fp4 { cols / 2 } else { cols };
            let dims = if flat {
                [128, rows * row_bytes / 128]
            } else {
                [row_bytes, rows]
            };
            let codes = encode_2d(addr, TensorElem::U8, dims, [128, 128], true)?;
            table[at(m)..at(m) + MAP_BYTES].copy_from_slice(&codes);
            if fp4 {
                let sc = encode_2d(saddr, TensorElem::F32, [cols / 32, rows], [8, 128], false)?;
                table[at(sm)..at(sm) + MAP_BYTES].copy_from_slice(&sc);
            }
        }
    }
    Ok(table)
}

/// Element types of the tensor maps.
#[derive(Clone, Copy)]
pub(crate) enum TensorElem {
    U8,
    F32,
}

/// One 2-D tiled tensor map: `dims` = (elements of a row, rows), rows packed, boxes of `boxd`
/// elements; out-of-range elements read as zeros.
pub(crate) fn encode_2d(
    addr: u64,
    elem: TensorElem,
    dims: [usize; 2],
    boxd: [u32; 2],
    swizzle_128b: bool,
) -> Result<[u8; MAP_BYTES]> {
    use cudarc::driver::sys;
    let (dtype, size) = match elem {
        TensorElem::U8 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, 1),
        TensorElem::F32 => (sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4),
    };
    let global_dim = [dims[0] as u64, dims[1] as u64];
    let global_stride = [(dims[0] * size) as u64];
    let element_stride = [1u32, 1];
    let swizzle = if swizzle_128b {
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B
    } else {
        sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_NONE
    };
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer argument points at a live array of the length the rank (2) requires;
    // the map is written by the driver (a host-side encoding, no device access).
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            dtype,
            2,
            addr as *mut std::ffi::c_void,
            global_dim.as_ptr(),
            global_stride.as_ptr(),
            boxd.as_ptr(),
            element_stride.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::new(
            Status::Internal,
            format!("cuTensorMapEncodeTiled({dims:?} at {addr:#x}, box {boxd:?}) failed: {r:?}"),
        ));
    }
    // SAFETY: zero-initialised, then written by the driver; CUtensorMap is 128 plain bytes.
    let map = unsafe { map.assume_init() };
    let bytes: [u8; MAP_BYTES] = unsafe { std::mem::transmute(map) };
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The UE8M0 table holds one byte per 32 weights of w1, w3 and w2 when the widths are
    /// multiples of 256, plus a byte per row and per 128 rows (whole-row fold); a width that
    /// ends in a half stage (K % 256 == 128) pads that stage's 8 bytes a row; each expert's part
    /// is 256-byte aligned.
    #[test]
    fn scale_table_is_one_byte_per_32_weights_plus_row_bytes_and_padding() {
        let (d, i) = (4096, 2048);
        let rows = 2 * i + d;
        assert_eq!(
            scales8_bytes(d, i, 7) - SCALES8_HEADER,
            7 * (3 * d * i / 32 + rows + rows / 128).next_multiple_of(256),
            "Flash shapes: the UE8M0 bytes and the row bytes"
        );
        // 384 = one full and one half stage: 16 scale slots a row where 12 are used.
        let (d, i) = (384, 384);
        let expert = (3 * 384 * 16 + 3 * 384 + 3) as usize;
        assert_eq!(
            scales8_bytes(d, i, 2) - SCALES8_HEADER,
            2 * expert.next_multiple_of(256)
        );
        assert_eq!(scales8_bytes(d, i, 0), SCALES8_HEADER);
    }
}
