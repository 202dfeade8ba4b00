//! Rust side of the `fast_moe_gemm` kernel family (kernels/fast_moe_gemm.cu): the fast set's grouped
//! expert GEMMs on Hopper's FP8 tensor cores: `wgmma` m64nNk32 e4m3 with the weights (FP4 re-encoded
//! exactly as e4m3 on chip, or FP8) from registers and the tokens from shared memory, f32 promotion every
//! k32. See kernels/SPEC.md and [`super::fast_moe`], which runs a whole layer with them.

use super::fast_moe::{FastMoeLayer, FastMoeWorkspace};
use super::{need, to_i32};
use crate::cuda::Context;
use crate::cuda::stream::BorrowedStream;
use crate::error::Result;

/// Tokens (routed assignments) per work item: the plan's `tile_rows` (FMOE_TOKENS); one wgmma's N
/// (8 when a tile has at most 8).
pub const TOKENS: usize = 16;
/// Warpgroups of a GEMM block (FMOE_WARPGROUPS): each owns one m64 tile of the item's rows.
pub const WARPGROUPS: usize = 4;
/// Threads of a GEMM block.
pub const THREADS: usize = WARPGROUPS * 128;
/// Slots of the cp.async ring (FMOE_STAGES); a stage is 128 bytes of each weight row (FP4: 256 k,
/// FP8: 128 k).
pub const STAGES: usize = 4;
/// j per up work item (FMOE_UP_J): gate rows j.. and up rows j.., so SwiGLU and the per-128 FP8
/// quantisation of h stay inside the block.
pub const UP_J: usize = WARPGROUPS * 64 / 2;
/// Output rows per down work item (FMOE_DOWN_ROWS).
pub const DOWN_ROWS: usize = WARPGROUPS * 64;

/// Dynamic shared memory of a GEMM block (FMOE_SMEM_BYTES; kernels/fast_moe_gemm.cu checks its layout
/// fits, and it must stay within the 227 KiB an sm_90 block may take): the ring of stages (the item's
/// 256 weight rows at the FP8 row stride, FP4 scales, the tokens' codes and scales) and the up
/// epilogue's gate and up values.
pub const SMEM_BYTES: usize = {
    let rows = WARPGROUPS * 64;
    let slot = rows * 160 + rows * 32 + 16 * TOKENS * 16 + 128;
    STAGES * slot + 2 * UP_J * TOKENS * 4
};

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_moe_gemm", include_str!("../../../kernels/fast_moe_gemm.cu");

    /// GEMM1 + SwiGLU + routing weight + FP8 quantisation of h, routed tiles and the shared expert.
    #[smem(SMEM_BYTES as u32)]
    fn fmoe_up_kernel(
        xq: *const u8, xs: *const f32, t: i32, d: i32, i: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, w1: *const u64,
        w3: *const u64, s1: *const u64, s3: *const u64, fmt: i32,
        shared_w1: Option<*const c_void>, shared_w3: Option<*const c_void>,
        shared_s1: Option<*const f32>, shared_s3: Option<*const f32>, shared_fmt: i32,
        route_w: *const f32, limit: f32, hq: *mut u8, hs: *mut f32,
    );
    /// GEMM2 into bf16 rows per (token, slot).
    #[smem(SMEM_BYTES as u32)]
    fn fmoe_down_kernel(
        hq: *const u8, hs: *const f32, t: i32, i: i32, d: i32, k: i32, rows: *const i32,
        tiles: *const i32, ntiles: *const i32, e_begin: i32, e_end: i32, w2: *const u64,
        s2: *const u64, fmt: i32, shared_w2: Option<*const c_void>,
        shared_s2: Option<*const f32>, shared_fmt: i32, y: *mut u16,
    );
}

use std::ffi::c_void;

crate::launchers! {
    /// The fast_moe_gemm family's entry points, resolved from a loaded registry.
    pub struct FastMoeGemm {
        up: fmoe_up_kernel,
        down: fmoe_down_kernel,
    }
}

/// Work items a GEMM may see for `t` tokens: every routed tile the plan can make, plus the shared
/// expert's token tiles, times the row tiles.
fn max_items(layer: &FastMoeLayer, t: usize, row_tiles: usize) -> usize {
    let routed = (t * layer.k).div_ceil(TOKENS) + layer.local.len();
    let shared = if layer.shared.is_some() {
        t.div_ceil(TOKENS)
    } else {
        0
    };
    (routed + shared) * row_tiles
}

/// Persistent grid: one block per SM (the ring fills most of its shared memory), never more
/// blocks than items.
fn grid(ctx: &Context, items: usize) -> u32 {
    items.clamp(1, ctx.info().multiprocessors.max(1) as usize) as u32
}

impl FastMoeGemm {
    /// `ws.hq`, `ws.hs` = GEMM1 of every routed tile of `ws`'s plan and of the shared expert.
    pub fn up(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_up_kernel";
        let (d, i, k) = (layer.d, layer.i, layer.k);
        let rows_out = t * k + t;
        need(K, "xq", ws.xq, t * d)?;
        need(K, "xs", ws.xs, t * d / 128 * 4)?;
        need(K, "hq", ws.hq, rows_out * i)?;
        need(K, "hs", ws.hs, rows_out * i / 128 * 4)?;
        need(K, "route_w", ws.weights, t * k * 4)?;
        let items = max_items(layer, t, i / UP_J);
        let sh = layer.shared.as_ref();
        let args = fmoe_up_kernel::Args {
            xq: ws.xq,
            xs: ws.xs,
            t: to_i32(K, "T", t)?,
            d: to_i32(K, "D", d)?,
            i: to_i32(K, "I", i)?,
            k: to_i32(K, "k", k)?,
            rows: ws.plan.rows,
            tiles: ws.plan.tiles,
            ntiles: ws.plan.ntiles,
            e_begin: to_i32(K, "e_begin", layer.local.start)?,
            e_end: to_i32(K, "e_end", layer.local.end)?,
            w1: layer.w1.ptrs,
            w3: layer.w3.ptrs,
            s1: layer.w1.scales,
            s3: layer.w3.scales,
            fmt: layer.w1.format.code(),
            shared_w1: sh.map(|s| s.w1.data),
            shared_w3: sh.map(|s| s.w3.data),
            shared_s1: sh.and_then(|s| s.w1.scales),
            shared_s3: sh.and_then(|s| s.w3.scales),
            shared_fmt: sh.map_or(0, |s| s.w1.format.code()),
            route_w: ws.weights,
            limit: layer.limit,
            hq: ws.hq,
            hs: ws.hs,
        };
        let _g = ctx.enter()?;
        self.up.launch(
            grid(ctx, items),
            THREADS as u32,
            SMEM_BYTES as u32,
            stream,
            args,
        )
    }

    /// `ws.y` = GEMM2 of every routed tile and of the shared expert, bf16 rows per (token, slot).
    pub fn down(
        &self,
        ctx: &Context,
        layer: &FastMoeLayer,
        t: usize,
        ws: &FastMoeWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fmoe_down_kernel";
        let (d, i, k) = (layer.d, layer.i, layer.k);
        let rows_out = t * k + t;
        need(K, "hq", ws.hq, rows_out * i)?;
        need(K, "hs", ws.hs, rows_out * i / 128 * 4)?;
        need(K, "y", ws.y, rows_out * d * 2)?;
        let items = max_items(layer, t, d.div_ceil(DOWN_ROWS));
        let sh = layer.shared.as_ref();
        let args = fmoe_down_kernel::Args {
            hq: ws.hq,
            hs: ws.hs,
            t: to_i32(K, "T", t)?,
            i: to_i32(K, "I", i)?,
            d: to_i32(K, "D", d)?,
            k: to_i32(K, "k", k)?,
            rows: ws.plan.rows,
            tiles: ws.plan.tiles,
            ntiles: ws.plan.ntiles,
            e_begin: to_i32(K, "e_begin", layer.local.start)?,
            e_end: to_i32(K, "e_end", layer.local.end)?,
            w2: layer.w2.ptrs,
            s2: layer.w2.scales,
            fmt: layer.w2.format.code(),
            shared_w2: sh.map(|s| s.w2.data),
            shared_s2: sh.and_then(|s| s.w2.scales),
            shared_fmt: sh.map_or(0, |s| s.w2.format.code()),
            y: ws.y,
        };
        let _g = ctx.enter()?;
        self.down.launch(
            grid(ctx, items),
            THREADS as u32,
            SMEM_BYTES as u32,
            stream,
            args,
        )
    }
}
