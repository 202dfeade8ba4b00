//! Rust side of the `fast_dense` kernel family (kernels/fast_dense.cu): the fast set's dense
//! projections (wq_a, wq_b, wkv, grouped wo_a, wo_b, indexer wq_b, compressor and indexer
//! weights) at few tokens, bandwidth-bound: each weight byte is read once by a 16-byte load
//! into an f16 (FP8 weights) or bf16 (BF16 weights) tensor-core fragment, f32 accumulation
//! promoted per 128 of k. A call is one launch of `fd_gemv_t{8,16,32,64}_kernel` per
//! [`TOKENS`] tokens, each block making its activation operands (the official act_quant
//! included) itself up to [`FUSED_ACT_MAX_T`] tokens; above, `fd_act_kernel` makes them once
//! first (two launches). K is split into [`slices`] chosen from the weight's shape only, so a
//! token's sums do not depend on the batch it is in; a row tile's slices either are one
//! thread-block cluster that adds its partial sums through distributed shared memory, or (where
//! [`split_by_counter`] says) write them to the workspace and the last to finish adds them, in
//! the same order, or (where [`warp_split`] says: few tokens, many-block clusters) the slices
//! are warps of one block that add them through shared memory, in the same order again. Up to
//! [`GROUP_MAX_T`]
//! tokens, [`FastDense::run_group`] runs up to [`GROUP_MAX`] projections of the same input in one
//! launch of `fd_group_t{8,16}_kernel` (a decode step's attention sub-block reads u seven times
//! and q_lora twice; one launch each costs ~4.5 µs however small the weight).
//!
//! Numerics (kernels/SPEC.md "fast_dense.cu"): the reference's operation up to f32 accumulation
//! order and the tensor core's accumulator; tests/gpu_fast_dense.rs derives and asserts the bound.

use super::linear::WeightDev;
use super::norm_rope::{RMSNORM_ROWS_THREADS, RmsNorm, RmsnormBlock, register_block};
use super::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::weights::format::StorageFormat;

/// Warps of a block (FD_WARPS); each owns 16 weight rows.
pub const WARPS: usize = 8;
/// (token, 128-block) items a warp of `fd_lt_operand_kernel` makes, its loads all issued first.
pub const LT_ITEMS: usize = 4;
/// Weight rows per block.
pub const ROWS: usize = 16 * WARPS;
/// Most tokens one launch takes (FD_TOKENS); a call loops over chunks of this many.
pub const TOKENS: usize = 64;
/// Blocks a launch aims for: K is split until the row tiles times the slices reach it (enough
/// 16-byte loads in flight on every SM), with slices of at least [`MIN_SLICE`] k. One block an SM
/// suffices: measured (bench dense, H200, T <= 8) each further slice costs more than its loads
/// win (the cluster's barrier and the reduction over its blocks' shared memory): indexer.wq_b took
/// 6.5 us at 2 slices against 10.3 at 4, the u group 13.7 at 4 against 14.1 at 8 (T = 1).
pub const TARGET_BLOCKS: usize = 128;
/// Smallest slice of K a block sums (two 128-blocks: the loads of one overlap the MMAs of the other).
pub const MIN_SLICE: usize = 256;
/// Largest slice of K a block sums (its activations for [`TOKENS`] tokens fill shared memory).
pub const MAX_SLICE: usize = 1024;
/// Most slices of a row tile (FD_MAX_SLICES): one thread-block cluster, at most the 8 blocks a
/// cluster may portably hold.
pub const MAX_SLICES: usize = 8;
/// Most blocks (row tiles x slices) of a launch whose K split meets through the workspace
/// instead of a cluster ([`split_by_counter`]): two a streaming multiprocessor on an H200. It
/// sizes [`DenseWorkspace::split_part`].
pub const COUNTER_SPLIT_BLOCKS: usize = 264;
/// Fewest slices of a launch split through the workspace.
pub const COUNTER_SPLIT_MIN_SLICES: usize = 4;
/// Fewest row tiles of a launch split through the workspace.
pub const COUNTER_SPLIT_MIN_TILES: usize = 32;
/// Most tokens whose activation operands each block makes itself from x (above, one
/// `fd_act_kernel` launch makes them once for all blocks). Measured (bench dense, H200): at 1 and
/// 2 tokens making them in the gemv saves the extra launch (0.3-1.1 µs a call); from 4 tokens the
/// large projections lose more (wq_b 16.1 against 14.1 µs, wo_b 24.2 against 20.2 at 4 tokens).
pub const FUSED_ACT_MAX_T: usize = 2;
/// Most tokens whose K split may run inside each block (a warp a slice, the partial sums added
/// through shared memory: [`warp_split`]) instead of across blocks. Measured (bench dense, H200,
/// `gemv` against `gemv_cross_split`, µs): the head (4 slices in clusters) 240.9 / 247.9 at one
/// token, 246.9 / 250.1 at 4, 265.1 / 255.1 at 8; indexer.wq_b (2 slices in clusters) 5.36 /
/// 6.05 at 1, 6.32 / 6.90 at 4, 8.05 / 7.26 at 8. Each block stages the operands of all of K,
/// not of one slice, so the gain shrinks with the tokens.
pub const WARP_SPLIT_MAX_T: usize = 4;

/// Most projections one grouped launch takes (FD_GROUP_MAX; `fd_group_t*_kernel` have a
/// parameter set for each).
pub const GROUP_MAX: usize = 7;
/// Most tokens a grouped launch takes (its entry points cover 8 and 16); above, the projections
/// run one launch each.
pub const GROUP_MAX_T: usize = 16;

/// Dynamic shared memory of a gemv block of `nt` token tiles over a slice of `s` k (kernels/
/// fast_dense.cu lays it out): activations (FP8 rows padded by 8 halves, BF16 by 32), their
/// scales per 128, and the partial sums when `split`.
pub const fn smem_bytes(nt: usize, s: usize, fp8: bool, split: bool) -> usize {
    let rows = 8 * nt;
    let stride = s + if fp8 { 8 } else { 32 };
    2 * rows * stride + 4 * rows * (s / 128) + if split { 4 * rows * ROWS } else { 0 }
}

/// Dynamic shared memory of a warp-split gemv block ([`warp_split`]) of `t` tokens over all `k`:
/// the operands of the t tokens (padded as [`smem_bytes`]), the scales and the partial sums of a
/// tile of 8 tokens.
pub const fn warp_split_smem_bytes(t: usize, k: usize, fp8: bool) -> usize {
    let stride = k + if fp8 { 8 } else { 32 };
    2 * t * stride + 4 * 8 * (k / 128) + 4 * 8 * ROWS
}

/// Whether a launch of `t` tokens (one chunk, at most [`TOKENS`]) of `tiles` row tiles (all
/// groups') in `slices` slices of K = `k` splits K inside its blocks (kernels/fast_dense.cu
/// fd_gemv, warp_slices): at most 8 and `max_t` tokens, operands of all of K within
/// [`MAX_SMEM`], and where the split across blocks would be a cluster of at least
/// [`TARGET_BLOCKS`] blocks. The sums are the same bits as the cross-block splits' (slices added
/// in order). Measured (bench dense, H200, one token, µs, in the block / across): it wins where
/// the cross split is clusters over many blocks (the head 240.9 / 247.9, indexer.wq_b 5.36 /
/// 6.05) and loses where it goes through the workspace (wo_b 12.46 / 12.03, wo_a 11.57 / 11.13)
/// or the launch has few tiles (wq_a 5.39 / 5.04, wkv 5.04 / 4.58): there each block's staging of
/// all of K (8x a slice's) is on the critical path.
pub fn warp_split(
    t: usize,
    tiles: usize,
    slices: usize,
    k: usize,
    fp8: bool,
    max_t: usize,
) -> bool {
    slices > 1
        && t <= 8
        && t <= max_t
        && !split_by_counter(tiles, slices, 1)
        && tiles * slices >= TARGET_BLOCKS
        && warp_split_smem_bytes(t, k, fp8) <= MAX_SMEM
}

/// The most any launch takes (the registry raises the kernels' limit to it).
pub const MAX_SMEM: usize = smem_bytes(TOKENS / 8, MAX_SLICE, false, true);

/// How the activations become 16-bit MMA operands (FD_ACT_*; kernels/fast_dense.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActMode {
    /// FP8 weights, the official act_quant: e4m3 codes per 128 with UE8M0 scales.
    Quant = 0,
    /// FP8 weights without act_quant (wo_a's BF16 einsum): f16 with a power-of-two scale per 128.
    F16 = 1,
    /// BF16 weights: bf16 values.
    Bf16 = 2,
}

crate::kernel_family! {
    /// The family as the registry compiles and loads it.
    pub const SOURCE = "fast_dense", include_str!("../../../kernels/fast_dense.cu");

    /// `mode` is an [`ActMode`] code.
    #[pdl(true)]
    fn fd_act_kernel(
        x: *const f32, ldx: i32, t: i32, k: i32, mode: i32, act: *mut u16, scale: *mut f32,
    );
    /// `mode` is [`ActMode::Quant`] or [`ActMode::Bf16`]; `round_in` only with Quant.
    #[pdl(true)]
    fn fd_lt_operand_kernel(
        x: *const f32, ldx: i32, t: i32, k: i32, mode: i32, round_in: bool, codes: *mut u8,
        scale: Option<*mut f32>,
    );
    /// RMSNorm rows in place and the operands of the first `m` ([`NormOperands`]), on
    /// `rmsnorm_rows_kernel`'s block.
    #[pdl(true)]
    fn fd_norm_operands_kernel(
        x: *mut f32, rows: i32, dim: i32, ld: i32, weight: Option<*const f32>, eps: f32,
        round_out: bool, m: i32, codes: Option<*mut u8>, scale: Option<*mut f32>,
        bf16: Option<*mut u16>, act: Option<*mut u16>, act_scale: Option<*mut f32>,
    );
    /// The same on `rmsnorm_kernel`'s block (fewer rows).
    #[pdl(true)]
    fn fd_norm_operands_row_kernel(
        x: *mut f32, rows: i32, dim: i32, ld: i32, weight: Option<*const f32>, eps: f32,
        round_out: bool, m: i32, codes: Option<*mut u8>, scale: Option<*mut f32>,
        bf16: Option<*mut u16>, act: Option<*mut u16>, act_scale: Option<*mut f32>,
    );
    #[pdl(true)]
    fn fd_round_bf16_kernel(y: *mut f32, ldy: i32, t: i32, n: i32);
    #[pdl(true)]
    fn fd_dequant_bf16_kernel(w: *const u8, wscale: *const f32, n: i32, k: i32, out: *mut u16);
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fd_gemv_t8_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, x: Option<*const f32>,
        ldx: i32, mode: i32, fused: bool, act: Option<*const u16>, ascale: Option<*const f32>,
        t: i32, round_out: bool, y: *mut f32, ldy: i32, split_part: Option<*mut f32>,
        split_count: Option<*mut u32>, warp_slices: i32,
    );
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fd_gemv_t16_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, x: Option<*const f32>,
        ldx: i32, mode: i32, fused: bool, act: Option<*const u16>, ascale: Option<*const f32>,
        t: i32, round_out: bool, y: *mut f32, ldy: i32, split_part: Option<*mut f32>,
        split_count: Option<*mut u32>, warp_slices: i32,
    );
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fd_gemv_t32_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, x: Option<*const f32>,
        ldx: i32, mode: i32, fused: bool, act: Option<*const u16>, ascale: Option<*const f32>,
        t: i32, round_out: bool, y: *mut f32, ldy: i32, split_part: Option<*mut f32>,
        split_count: Option<*mut u32>, warp_slices: i32,
    );
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fd_gemv_t64_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, x: Option<*const f32>,
        ldx: i32, mode: i32, fused: bool, act: Option<*const u16>, ascale: Option<*const f32>,
        t: i32, round_out: bool, y: *mut f32, ldy: i32, split_part: Option<*mut f32>,
        split_count: Option<*mut u32>, warp_slices: i32,
    );
    /// Up to [`GROUP_MAX`] projections of the same x in one launch (members past the group's have
    /// no weight and `m = 0`); `m` packs a member's geometry (`member_meta`).
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fd_group_t8_kernel(
        x: *const f32, ldx: i32, t: i32, k: i32,
        w0: *const u8, s0: Option<*const f32>, y0: *mut f32, m0: i64,
        w1: Option<*const u8>, s1: Option<*const f32>, y1: Option<*mut f32>, m1: i64,
        w2: Option<*const u8>, s2: Option<*const f32>, y2: Option<*mut f32>, m2: i64,
        w3: Option<*const u8>, s3: Option<*const f32>, y3: Option<*mut f32>, m3: i64,
        w4: Option<*const u8>, s4: Option<*const f32>, y4: Option<*mut f32>, m4: i64,
        w5: Option<*const u8>, s5: Option<*const f32>, y5: Option<*mut f32>, m5: i64,
        w6: Option<*const u8>, s6: Option<*const f32>, y6: Option<*mut f32>, m6: i64,
        split_part: Option<*mut f32>, split_count: Option<*mut u32>,
    );
    #[smem(MAX_SMEM as u32)]
    #[pdl(true)]
    fn fd_group_t16_kernel(
        x: *const f32, ldx: i32, t: i32, k: i32,
        w0: *const u8, s0: Option<*const f32>, y0: *mut f32, m0: i64,
        w1: Option<*const u8>, s1: Option<*const f32>, y1: Option<*mut f32>, m1: i64,
        w2: Option<*const u8>, s2: Option<*const f32>, y2: Option<*mut f32>, m2: i64,
        w3: Option<*const u8>, s3: Option<*const f32>, y3: Option<*mut f32>, m3: i64,
        w4: Option<*const u8>, s4: Option<*const f32>, y4: Option<*mut f32>, m4: i64,
        w5: Option<*const u8>, s5: Option<*const f32>, y5: Option<*mut f32>, m5: i64,
        w6: Option<*const u8>, s6: Option<*const f32>, y6: Option<*mut f32>, m6: i64,
        split_part: Option<*mut f32>, split_count: Option<*mut u32>,
    );
}

crate::launchers! {
    /// The fast_dense family's entry points, resolved from a loaded registry.
    pub struct FastDense {
        act: fd_act_kernel,
        lt_operand: fd_lt_operand_kernel,
        norm_operands: fd_norm_operands_kernel,
        norm_operands_row: fd_norm_operands_row_kernel,
        round_bf16: fd_round_bf16_kernel,
        dequant_bf16: fd_dequant_bf16_kernel,
        t8: fd_gemv_t8_kernel,
        t16: fd_gemv_t16_kernel,
        t32: fd_gemv_t32_kernel,
        t64: fd_gemv_t64_kernel,
        group_t8: fd_group_t8_kernel,
        group_t16: fd_group_t16_kernel,
    }
}

/// Whether a launch of `tiles` row tiles (all groups' or members' together) in `slices` slices of
/// K, with `nt` tiles of 8 tokens, meets its slices through the workspace (each block writes its
/// partial sums, the last of a row tile to finish adds them in slice order) instead of a
/// thread-block cluster. The sums are the same either way. Measured (bench dense, H200, the
/// cluster against the workspace, µs at T = 1 / 8, operands made in the gemv): wo_b (32 tiles,
/// 8 slices) 18.95 / 32.69 against 13.18 / 21.53; wo_a (64 tiles, 4 slices) 17.35 / 24.14
/// against 12.18 / 16.79; the u group 12.91 against 12.18 at T = 1. But launches of few tiles
/// (wq_a, wkv: 4-8 tiles) lost 0.4-1.7 µs (their blocks' partial writes and the counter's round
/// trip are not hidden by other tiles' loads), and the workspace holds
/// [`COUNTER_SPLIT_BLOCKS`] blocks' partials of 8 tokens.
pub fn split_by_counter(tiles: usize, slices: usize, nt: usize) -> bool {
    nt == 1
        && slices >= COUNTER_SPLIT_MIN_SLICES
        && tiles >= COUNTER_SPLIT_MIN_TILES
        && tiles * slices <= COUNTER_SPLIT_BLOCKS
}

/// Slices of K for a weight of `groups` x `n` rows and `k` columns: the smallest power of two
/// that keeps a slice within [`MAX_SLICE`] and gives [`TARGET_BLOCKS`] blocks, as long as slices
/// stay multiples of 128, at least [`MIN_SLICE`] (or one slice when K is 128) and at most
/// [`MAX_SLICES`] of them. None when K needs more (the kernels do not cover it).
pub fn slices(n: usize, k: usize, groups: usize) -> Option<usize> {
    slices_for_tiles(n.div_ceil(ROWS) * groups, k)
}

/// [`slices`] for `tiles` row tiles of K = `k` (a grouped launch: its members' tiles together).
pub fn slices_for_tiles(tiles: usize, k: usize) -> Option<usize> {
    let mut s = 1;
    while (k / s > MAX_SLICE || tiles * s < TARGET_BLOCKS)
        && s < MAX_SLICES
        && k.is_multiple_of(2 * s * 128)
        && k / (2 * s) >= MIN_SLICE
    {
        s *= 2;
    }
    (k / s <= MAX_SLICE).then_some(s)
}

/// One projection: `y[t, gi*n + j] = Σ_c a[t, gi*K + c] · W[gi*n + j, c]` for `t < t`, group
/// `gi < groups`, `j < n` (`w` has `groups * n` rows of K = `w.cols`), BF16-rounded if `round`.
#[derive(Clone, Copy, Debug)]
pub struct DenseOp {
    /// `[t, groups * K]` f32, row stride `ldx`.
    pub x: DevicePtr,
    pub ldx: usize,
    pub t: usize,
    pub w: WeightDev,
    pub groups: usize,
    pub mode: ActMode,
    pub round: bool,
    /// `[t, groups * n]` f32, row stride `ldy`.
    pub y: DevicePtr,
    pub ldy: usize,
    /// Most tokens whose operands the gemv blocks make themselves ([`FUSED_ACT_MAX_T`]; the
    /// bench compares others).
    pub fused_act_max_t: usize,
    /// Most tokens whose K split runs inside the blocks ([`WARP_SPLIT_MAX_T`]; the bench
    /// compares 0).
    pub warp_split_max_t: usize,
}

impl DenseOp {
    /// Rows per group.
    pub fn n(&self) -> usize {
        self.w.rows / self.groups.max(1)
    }
}

/// The family's workspace (the fast set's, declared at create by [`workspace_sizes`]):
/// `fd_act_kernel`'s output, and the K split's partial sums and counters
/// ([`split_by_counter`]).
#[derive(Clone, Copy, Debug)]
pub struct DenseWorkspace {
    /// `[TOKENS, max width]` 16-bit operands.
    pub act: DevicePtr,
    /// `[TOKENS, max width / 128]` f32.
    pub scale: DevicePtr,
    /// `[COUNTER_SPLIT_BLOCKS, 8, ROWS]` f32: a block's partial sums of 8 tokens.
    pub split_part: DevicePtr,
    /// `[COUNTER_SPLIT_BLOCKS / COUNTER_SPLIT_MIN_SLICES]` u32, zero between launches (the
    /// arena is zeroed at create; the last block of a row tile puts its counter back).
    pub split_count: DevicePtr,
}

/// A projection's shape: `groups` x `n` rows of `k` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub n: usize,
    pub k: usize,
    pub groups: usize,
}

/// Element counts of [`DenseWorkspace`] (act u16, scale f32, split_part f32, split_count u32)
/// for the widest of `shapes`.
pub fn workspace_sizes(shapes: &[Shape]) -> [usize; 4] {
    let width = shapes.iter().map(|s| s.k * s.groups).max().unwrap_or(0);
    [
        TOKENS * width,
        TOKENS * width / 128,
        COUNTER_SPLIT_BLOCKS * 8 * ROWS,
        COUNTER_SPLIT_BLOCKS / COUNTER_SPLIT_MIN_SLICES,
    ]
}

/// The workspace arguments of a launch of `tiles` row tiles in `sl` slices, `nt` token tiles:
/// the split's partials and counters when [`split_by_counter`] (checked against `ws`), else
/// none (one slice, or a cluster).
fn split_args(
    kname: &str,
    ws: &DenseWorkspace,
    tiles: usize,
    sl: usize,
    nt: usize,
) -> Result<(Option<DevicePtr>, Option<DevicePtr>)> {
    if !split_by_counter(tiles, sl, nt) {
        return Ok((None, None));
    }
    need(
        kname,
        "split_part",
        ws.split_part,
        tiles * sl * 8 * ROWS * 4,
    )?;
    need(kname, "split_count", ws.split_count, tiles * 4)?;
    Ok((Some(ws.split_part), Some(ws.split_count)))
}

fn internal(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

impl FastDense {
    /// How the fast kernels run a weight stored as `w` (K = `w.cols`, `groups` groups of rows),
    /// with the official act_quant when `quant_act`; None when they cannot (the reference
    /// kernels run it): F32 and FP4 weights, FP8 blocks other than 128 x 128, K not a multiple
    /// of 128 or above [`MAX_SLICES`] x [`MAX_SLICE`], rows not a multiple of 128 per group
    /// when grouped FP8.
    pub fn mode_for(w: &WeightDev, groups: usize, quant_act: bool) -> Option<ActMode> {
        if groups == 0 || !w.rows.is_multiple_of(groups) || w.rows == 0 {
            return None;
        }
        if !w.cols.is_multiple_of(128) || slices(w.rows / groups, w.cols, groups).is_none() {
            return None;
        }
        match w.format {
            StorageFormat::Fp8 => {
                let n = w.rows / groups;
                if w.block != [128, 128] || (groups > 1 && !n.is_multiple_of(128)) {
                    return None;
                }
                Some(if quant_act {
                    ActMode::Quant
                } else {
                    ActMode::F16
                })
            }
            StorageFormat::Bf16 => Some(ActMode::Bf16),
            StorageFormat::F32 | StorageFormat::Fp4 => None,
        }
    }

    /// Checks `op` for a launch of kernel `kname`: the weight covered in `op.mode`, strides, and
    /// for `op.t > 0` x's alignment and both buffers' extents.
    fn check(op: &DenseOp, kname: &str) -> Result<()> {
        let w = &op.w;
        let Some(mode) = Self::mode_for(w, op.groups, op.mode == ActMode::Quant) else {
            return Err(internal(format!(
                "{kname}: a {:?} weight {}x{} (block {:?}) in {} groups is not covered",
                w.format, w.rows, w.cols, w.block, op.groups
            )));
        };
        if mode != op.mode {
            return Err(internal(format!(
                "{kname}: activation mode {:?} for a {:?} weight",
                op.mode, w.format
            )));
        }
        w.validate()?;
        let (n, k, groups) = (op.n(), w.cols, op.groups);
        let width = groups * k;
        if op.ldx < width || op.ldy < groups * n || !op.ldx.is_multiple_of(4) {
            return Err(internal(format!(
                "{kname}: strides ldx {} / ldy {} for width {width} / {} outputs",
                op.ldx,
                op.ldy,
                groups * n
            )));
        }
        if op.t == 0 {
            return Ok(());
        }
        if !op.x.addr().is_multiple_of(16) {
            return Err(internal(format!("{kname}: x is not 16-byte aligned")));
        }
        need(
            kname,
            "x",
            op.x,
            super::linear::strided_bytes(op.t, width, op.ldx),
        )?;
        need(
            kname,
            "y",
            op.y,
            super::linear::strided_bytes(op.t, groups * n, op.ldy),
        )
    }

    /// Runs `op` (see [`DenseOp`]) in chunks of [`TOKENS`] tokens. `x` rows must be 16-byte
    /// aligned (`ldx` a multiple of 4, `x` 16-byte aligned); `x` and `y` must not overlap.
    pub fn run(
        &self,
        ctx: &Context,
        op: &DenseOp,
        ws: &DenseWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        self.run_on(ctx, op, ws, false, stream)
    }

    /// [`Self::run`] from x's operands already in `ws.act` / `ws.scale` (`fd_act_kernel`'s
    /// layout for `op.mode`, `[t, K]` and `[t, K / 128]`: made by the norm that made x,
    /// [`NormOperands::gemv`]): no operand launch and no operands made in the blocks, the same
    /// bits. At most [`TOKENS`] tokens (one launch's).
    pub fn run_from_act(
        &self,
        ctx: &Context,
        op: &DenseOp,
        ws: &DenseWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        if op.t > TOKENS {
            return Err(internal(format!(
                "fd_gemv_kernel: {} tokens from made operands (at most {TOKENS})",
                op.t
            )));
        }
        self.run_on(ctx, op, ws, true, stream)
    }

    /// [`Self::run`], its operands in `ws` already where `act_made`.
    fn run_on(
        &self,
        ctx: &Context,
        op: &DenseOp,
        ws: &DenseWorkspace,
        act_made: bool,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fd_gemv_kernel";
        Self::check(op, K)?;
        if op.t == 0 {
            return Ok(());
        }
        let w = &op.w;
        let mode = op.mode;
        let (n, k, groups) = (op.n(), w.cols, op.groups);
        let width = groups * k;
        let sl =
            slices(n, k, groups).ok_or_else(|| internal(format!("{K}: K = {k} is too wide")))?;
        let tiles = n.div_ceil(ROWS);
        need(K, "act", ws.act, TOKENS * width * 2)?;
        need(K, "scale", ws.scale, TOKENS * width / 128 * 4)?;
        let (n32, k32, w32) = (
            to_i32(K, "N", n)?,
            to_i32(K, "K", k)?,
            to_i32(K, "width", width)?,
        );
        let (ldx32, ldy32) = (to_i32(K, "ldx", op.ldx)?, to_i32(K, "ldy", op.ldy)?);
        let fp8 = w.format == StorageFormat::Fp8;
        let wscale = if fp8 { w.scales } else { None };
        let _g = ctx.enter()?;
        for t0 in (0..op.t).step_by(TOKENS) {
            let tc = (op.t - t0).min(TOKENS);
            let t32 = tc as i32;
            let x =
                op.x.slice(t0 * op.ldx * 4, op.x.bytes() - t0 * op.ldx * 4)?;
            let y =
                op.y.slice(t0 * op.ldy * 4, op.y.bytes() - t0 * op.ldy * 4)?;
            let fused = !act_made && tc <= op.fused_act_max_t;
            if !fused && !act_made {
                let items = tc * width / 128;
                self.act.launch(
                    items.div_ceil(WARPS) as u32,
                    (WARPS * 32) as u32,
                    0,
                    stream,
                    fd_act_kernel::Args {
                        x,
                        ldx: ldx32,
                        t: t32,
                        k: w32,
                        mode: mode as i32,
                        act: ws.act,
                        scale: ws.scale,
                    },
                )?;
            }
            let nt = tc.div_ceil(8).next_power_of_two();
            // (Grouped weights keep the split across blocks: the only grouped one, wo_a, splits
            // through the workspace, and no test runs a grouped weight split inside the blocks.)
            let in_block = groups == 1 && warp_split(tc, tiles, sl, k, fp8, op.warp_split_max_t);
            let (split_part, split_count) = if in_block {
                (None, None)
            } else {
                split_args(K, ws, tiles * groups, sl, nt)?
            };
            let cluster = !in_block && sl > 1 && split_part.is_none();
            let (smem, grid) = if in_block {
                let tile_rows = 16 * (WARPS / sl);
                (
                    warp_split_smem_bytes(tc, k, fp8) as u32,
                    (n.div_ceil(tile_rows) as u32, 1, groups as u32),
                )
            } else {
                (
                    smem_bytes(nt, k / sl, fp8, cluster) as u32,
                    (tiles as u32, sl as u32, groups as u32),
                )
            };
            let block = (WARPS * 32) as u32;
            macro_rules! gemv {
                ($field:ident, $kernel:ident) => {{
                    let args = $kernel::Args {
                        w: w.data,
                        wscale,
                        n: n32,
                        k: k32,
                        fp8,
                        x: fused.then_some(x),
                        ldx: ldx32,
                        mode: mode as i32,
                        fused,
                        act: (!fused).then_some(ws.act),
                        ascale: (!fused).then_some(ws.scale),
                        t: t32,
                        round_out: op.round,
                        y,
                        ldy: ldy32,
                        split_part,
                        split_count,
                        warp_slices: if in_block { sl as i32 } else { 1 },
                    };
                    if cluster {
                        self.$field.launch_clustered(
                            grid,
                            block,
                            smem,
                            stream,
                            args,
                            (1, sl as u32, 1),
                        )
                    } else {
                        self.$field.launch(grid, block, smem, stream, args)
                    }
                }};
            }
            match nt {
                1 => gemv!(t8, fd_gemv_t8_kernel)?,
                2 => gemv!(t16, fd_gemv_t16_kernel)?,
                4 => gemv!(t32, fd_gemv_t32_kernel)?,
                _ => gemv!(t64, fd_gemv_t64_kernel)?,
            }
        }
        Ok(())
    }
}

/// A grouped launch's member geometry as `fd_group_t*_kernel` unpack it: N in bits 0-23, ldy in
/// bits 24-47, FP8 weight bit 48, BF16-rounded output bit 49, activation mode bits 50-51.
fn member_meta(n: usize, ldy: usize, fp8: bool, round: bool, mode: ActMode) -> i64 {
    n as i64
        | (ldy as i64) << 24
        | i64::from(fp8) << 48
        | i64::from(round) << 49
        | (mode as i64) << 50
}

/// A grouped member's kernel arguments: weight, FP8 scales, output, packed geometry.
type MemberArgs = (DevicePtr, Option<DevicePtr>, DevicePtr, i64);

/// Largest N and ldy a grouped member's packed geometry holds.
const MEMBER_FIELD_MAX: usize = (1 << 24) - 1;

/// The K splits a launch of K = `k` may use: powers of two up to [`MAX_SLICES`] whose slices are
/// multiples of 128, at least [`MIN_SLICE`] (unless one slice) and at most [`MAX_SLICE`].
pub fn valid_slices(k: usize) -> impl Iterator<Item = usize> {
    (0..=MAX_SLICES.trailing_zeros())
        .map(|p| 1 << p)
        .filter(move |&s| {
            k.is_multiple_of(128 * s) && (s == 1 || k / s >= MIN_SLICE) && k / s <= MAX_SLICE
        })
}

/// The slices of a grouped launch of `ops`: one K split for all members, a function of the
/// members' shapes only: [`slices_for_tiles`] over their row tiles together, or more slices
/// where the launch then splits through the workspace ([`split_by_counter`] at 8 tokens: the
/// most slices whose blocks it holds). Measured against every other split (bench dense, H200,
/// `--projection groups`): at T = 1 a CSA layer's two projections of q_lora take 19.1 / 22.6 /
/// 33.0 us at 1 / 2 / 4 slices (1 chosen); its seven of u (33 row tiles) with the workspace
/// split 12.2 / 12.0 us at 4 / 8 slices at T = 1 and 17.2 / 14.0 at T = 8 (8 chosen; with
/// clusters, 8 slices were also faster at 16 tokens: 30.3 against 33.2 us).
pub fn group_slices(ops: &[DenseOp]) -> Option<usize> {
    let k = ops.first()?.w.cols;
    let tiles = ops.iter().map(|o| o.n().div_ceil(ROWS)).sum();
    let s = slices_for_tiles(tiles, k)?;
    let wider = valid_slices(k).filter(|&w| w > s && split_by_counter(tiles, w, 1));
    Some(wider.max().unwrap_or(s))
}

impl FastDense {
    /// Whether [`Self::run_group`] takes `ops` (so the caller may fall back to one [`Self::run`]
    /// each): 1 to [`GROUP_MAX`] ungrouped projections of one x (same pointer, `ldx`, `t` and K)
    /// with at most [`GROUP_MAX_T`] tokens, each covered in its mode ([`Self::mode_for`]).
    pub fn group_covers(ops: &[DenseOp]) -> bool {
        let Some(first) = ops.first() else {
            return false;
        };
        ops.len() <= GROUP_MAX
            && first.t <= GROUP_MAX_T
            && group_slices(ops).is_some()
            && ops.iter().all(|o| {
                o.groups == 1
                    && o.x == first.x
                    && o.ldx == first.ldx
                    && o.t == first.t
                    && o.w.cols == first.w.cols
                    && o.w.rows <= MEMBER_FIELD_MAX
                    && o.ldy <= MEMBER_FIELD_MAX
                    && Self::mode_for(&o.w, 1, o.mode == ActMode::Quant) == Some(o.mode)
            })
    }

    /// Whether one grouped launch of `ops` (covered: [`Self::group_covers`]) beats one call per
    /// member: when K is split. A grouped block makes its slice's operands of every token
    /// itself, which one call per member leaves to `fd_act_kernel` from 3 tokens; that pays
    /// while K is split (a block makes K / slices of a token) and costs more than the saved
    /// launches when it is not. Measured (bench dense, H200, µs grouped / separate): a CSA
    /// layer's seven projections of u (K = 4096, 8 slices through the workspace) 12.0 / 40.5 at
    /// T = 1, 14.0 / 45.9 at 8 (in clusters, 30.2 / 60.1 at 16); its two of q_lora (K = 1024,
    /// one slice) 19.4 / 16.9 at T = 1 and 33.5 / 20.8 at 8 (2026-12-02; before wq_b's gemv
    /// took 11.4 us at one token the group won at 1 and 2 tokens: 19.9 / 24.4 at 1).
    pub fn group_pays(ops: &[DenseOp]) -> bool {
        group_slices(ops).is_some_and(|s| s > 1)
    }

    /// Runs every projection of `ops` (see [`DenseOp`]; [`Self::group_covers`] must hold) in one
    /// launch: the members' row tiles in order, one K split ([`group_slices`]), the operands
    /// made in the blocks from x. Each member's outputs are those of [`Self::run`] up to the
    /// summation order of its slices. Outputs must not overlap x or each other.
    pub fn run_group(
        &self,
        ctx: &Context,
        ops: &[DenseOp],
        ws: &DenseWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        let sl = group_slices(ops).unwrap_or(0);
        self.run_group_sliced(ctx, ops, ws, sl, stream)
    }

    /// [`Self::run_group`] with K split in `sl` slices (one of [`valid_slices`]; the bench
    /// compares them).
    pub fn run_group_sliced(
        &self,
        ctx: &Context,
        ops: &[DenseOp],
        ws: &DenseWorkspace,
        sl: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fd_group_kernel";
        if !Self::group_covers(ops) {
            return Err(internal(format!(
                "{K}: {} projections are not one group of at most {GROUP_MAX} of the same x, \
                 at most {GROUP_MAX_T} tokens and K, each covered in its mode",
                ops.len()
            )));
        }
        for op in ops {
            Self::check(op, K)?;
        }
        let first = &ops[0];
        if first.t == 0 {
            return Ok(());
        }
        let k = first.w.cols;
        if !valid_slices(k).any(|s| s == sl) {
            return Err(internal(format!("{K}: {sl} slices of K = {k}")));
        }
        let tiles: usize = ops.iter().map(|o| o.n().div_ceil(ROWS)).sum();
        // The largest of the members' layouts: BF16's padded activation rows.
        let nt = first.t.div_ceil(8).next_power_of_two();
        let (split_part, split_count) = split_args(K, ws, tiles, sl, nt)?;
        let cluster = sl > 1 && split_part.is_none();
        let smem = smem_bytes(nt, k / sl, false, cluster) as u32;
        let (x, ldx, t) = (first.x, to_i32(K, "ldx", first.ldx)?, first.t as i32);
        let k32 = to_i32(K, "K", k)?;
        // Each member's kernel arguments; None past the group.
        let m: [Option<MemberArgs>; GROUP_MAX] = std::array::from_fn(|i| {
            ops.get(i).map(|o| {
                let fp8 = o.w.format == StorageFormat::Fp8;
                let meta = member_meta(o.n(), o.ldy, fp8, o.round, o.mode);
                (o.w.data, if fp8 { o.w.scales } else { None }, o.y, meta)
            })
        });
        let m0 = m[0].expect("group_covers: at least one member");
        // Members 1.. as the kernel's optional arguments (none / 0 past the group).
        let member = |i: usize| {
            let a = m[i];
            (
                a.map(|m| m.0),
                a.and_then(|m| m.1),
                a.map(|m| m.2),
                a.map_or(0, |m| m.3),
            )
        };
        let ((w1, s1, y1, m1), (w2, s2, y2, m2), (w3, s3, y3, m3)) =
            (member(1), member(2), member(3));
        let ((w4, s4, y4, m4), (w5, s5, y5, m5), (w6, s6, y6, m6)) =
            (member(4), member(5), member(6));
        let grid = (tiles as u32, sl as u32);
        let block = (WARPS * 32) as u32;
        let _g = ctx.enter()?;
        macro_rules! group {
            ($field:ident, $kernel:ident) => {{
                let args = $kernel::Args {
                    x,
                    ldx,
                    t,
                    k: k32,
                    w0: m0.0,
                    s0: m0.1,
                    y0: m0.2,
                    m0: m0.3,
                    w1,
                    s1,
                    y1,
                    m1,
                    w2,
                    s2,
                    y2,
                    m2,
                    w3,
                    s3,
                    y3,
                    m3,
                    w4,
                    s4,
                    y4,
                    m4,
                    w5,
                    s5,
                    y5,
                    m5,
                    w6,
                    s6,
                    y6,
                    m6,
                    split_part,
                    split_count,
                };
                if cluster {
                    self.$field
                        .launch_clustered(grid, block, smem, stream, args, (1, sl as u32, 1))
                } else {
                    self.$field.launch(grid, block, smem, stream, args)
                }
            }};
        }
        if nt == 1 {
            group!(group_t8, fd_group_t8_kernel)
        } else {
            group!(group_t16, fd_group_t16_kernel)
        }
    }
}

/// The activation operand of a cuBLASLt GEMM ([`crate::cuda::blockscaled_gemm`]) for `t` tokens of
/// `x` (`[t, k]` f32, row stride `ldx`): [`ActMode::Quant`] writes the official act_quant's e4m3
/// codes `[t, k]` into `codes` and their scales `[k / 128, t]` (token-fastest) into `scale`;
/// [`ActMode::Bf16`] writes `bf16(x)` `[t, k]` into `codes` (exact for BF16 values).
#[derive(Clone, Copy, Debug)]
pub struct LtOperand {
    pub x: DevicePtr,
    pub ldx: usize,
    pub t: usize,
    pub k: usize,
    pub mode: ActMode,
    /// [`ActMode::Quant`] of `bf16(x)`: x holds a projection's unrounded f32 sums whose official
    /// values are their BF16 roundings, so the operand is that of the rounded x, bit for bit,
    /// without a rounding pass over x first (wo_a's output for wo_b: `run_gemm_chain`).
    pub round_in: bool,
    pub codes: DevicePtr,
    pub scale: DevicePtr,
}

/// An RMSNorm (`norm`), made as [`NormRope::rmsnorm`] makes it (the same bits: one row code,
/// kernels/norm_row.cuh, on the same block), together with the operands its first `m` rows'
/// readers would make of them: for cuBLASLt ([`FastDense::lt_operand`]'s), `fp8` the official
/// act_quant's codes `[m, dim]` and scales `[dim / 128, m]`, `bf16` the BF16 values `[m, dim]`
/// (16-bit); for the gemv (`fd_act_kernel`'s, [`ActMode::Quant`]), `gemv` the f16 values of the
/// codes `[m, dim]` and their scales `[m, dim / 128]`. One launch of `fd_norm_operands_kernel`
/// (or its `_row` form), for [`norm_operands_cover`]ed shapes. Measured and not taken by the
/// fast set's forward (kernels/SPEC.md: slower at 4096-8192 tokens, and in the decode step):
/// `dsv4 bench dense` and gpu_fast_dense run it.
///
/// [`NormRope::rmsnorm`]: super::norm_rope::NormRope::rmsnorm
#[derive(Clone, Copy, Debug)]
pub struct NormOperands {
    pub norm: RmsNorm,
    pub m: usize,
    pub fp8: Option<(DevicePtr, DevicePtr)>,
    pub bf16: Option<DevicePtr>,
    pub gemv: Option<(DevicePtr, DevicePtr)>,
}

/// Whether `fd_norm_operands_kernel` takes a norm of `rows` rows of `dim` values: on the block
/// [`NormRope::rmsnorm`] gives them, holding the row in registers with whole 128-blocks of k
/// ([`register_block`]).
///
/// [`NormRope::rmsnorm`]: super::norm_rope::NormRope::rmsnorm
pub fn norm_operands_cover(rows: usize, dim: usize) -> bool {
    register_block(rows, dim).is_some()
}

/// Most rows one `fd_round_bf16_kernel` launch takes (its grid's y).
const ROUND_ROWS: usize = 65535;

/// Most blocks of an `fd_norm_operands_kernel` launch (a block a row, grid-stride beyond).
const NORM_OPERANDS_MAX_BLOCKS: usize = 1 << 20;

impl FastDense {
    /// Makes `op`'s operand (see [`LtOperand`]); one launch.
    pub fn lt_operand(&self, ctx: &Context, op: &LtOperand, stream: BorrowedStream) -> Result<()> {
        const K: &str = "fd_lt_operand_kernel";
        let quant = match op.mode {
            ActMode::Quant => true,
            ActMode::Bf16 => false,
            ActMode::F16 => return Err(internal(format!("{K}: no F16 operands"))),
        };
        if op.round_in && !quant {
            return Err(internal(format!("{K}: rounding x first is for act_quant")));
        }
        if op.t == 0 {
            return Ok(());
        }
        if !op.k.is_multiple_of(128)
            || op.ldx < op.k
            || !op.ldx.is_multiple_of(4)
            || !op.x.addr().is_multiple_of(16)
        {
            return Err(internal(format!(
                "{K}: K {} / ldx {} / x alignment",
                op.k, op.ldx
            )));
        }
        need(
            K,
            "x",
            op.x,
            super::linear::strided_bytes(op.t, op.k, op.ldx),
        )?;
        let esize = if quant { 1 } else { 2 };
        need(K, "codes", op.codes, op.t * op.k * esize)?;
        if quant {
            need(K, "scale", op.scale, op.t * op.k / 128 * 4)?;
        }
        let items = op.t * op.k / 128;
        let _g = ctx.enter()?;
        self.lt_operand.launch(
            items.div_ceil(WARPS * LT_ITEMS) as u32,
            (WARPS * 32) as u32,
            0,
            stream,
            fd_lt_operand_kernel::Args {
                x: op.x,
                ldx: to_i32(K, "ldx", op.ldx)?,
                t: to_i32(K, "T", op.t)?,
                k: to_i32(K, "K", op.k)?,
                mode: op.mode as i32,
                round_in: op.round_in,
                codes: op.codes,
                scale: quant.then_some(op.scale),
            },
        )
    }

    /// Runs `op` (see [`NormOperands`]); one launch.
    pub fn norm_operands(
        &self,
        ctx: &Context,
        op: &NormOperands,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fd_norm_operands_kernel";
        let n = &op.norm;
        let block = register_block(n.rows, n.dim);
        let Some(block) = block.filter(|_| n.ld >= n.dim && op.m <= n.rows) else {
            return Err(internal(format!(
                "{K}: rows {} / dim {} / ld {} / m {}",
                n.rows, n.dim, n.ld, op.m
            )));
        };
        need(
            K,
            "x",
            n.x,
            super::linear::strided_bytes(n.rows, n.dim, n.ld),
        )?;
        if let Some(w) = n.weight {
            need(K, "weight", w, n.dim * 4)?;
        }
        if let Some((codes, scale)) = op.fp8 {
            need(K, "codes", codes, op.m * n.dim)?;
            need(K, "scale", scale, op.m * n.dim / 128 * 4)?;
        }
        if let Some(bf16) = op.bf16 {
            need(K, "bf16", bf16, op.m * n.dim * 2)?;
        }
        if let Some((act, scale)) = op.gemv {
            need(K, "act", act, op.m * n.dim * 2)?;
            need(K, "act_scale", scale, op.m * n.dim / 128 * 4)?;
        }
        let _g = ctx.enter()?;
        let grid = n.rows.min(NORM_OPERANDS_MAX_BLOCKS) as u32;
        macro_rules! launch {
            ($field:ident, $kernel:ident, $threads:expr) => {
                self.$field.launch(
                    grid,
                    $threads,
                    0,
                    stream,
                    $kernel::Args {
                        x: n.x,
                        rows: to_i32(K, "rows", n.rows)?,
                        dim: to_i32(K, "dim", n.dim)?,
                        ld: to_i32(K, "ld", n.ld)?,
                        weight: n.weight,
                        eps: n.eps,
                        round_out: n.round_out,
                        m: to_i32(K, "m", op.m)?,
                        codes: op.fp8.map(|(codes, _)| codes),
                        scale: op.fp8.map(|(_, scale)| scale),
                        bf16: op.bf16,
                        act: op.gemv.map(|(act, _)| act),
                        act_scale: op.gemv.map(|(_, scale)| scale),
                    },
                )
            };
        }
        match block {
            RmsnormBlock::Rows => launch!(
                norm_operands,
                fd_norm_operands_kernel,
                RMSNORM_ROWS_THREADS as u32
            ),
            RmsnormBlock::Row { threads, .. } => {
                launch!(norm_operands_row, fd_norm_operands_row_kernel, threads)
            }
        }
    }

    /// `y[t, j] = bf16(y[t, j])` for `t < t`, `j < n` (row stride `ldy`), in place.
    /// `out` (`[rows, w.cols]` BF16) = rows `row0 .. row0 + rows` of the FP8 weight `w` (128 x 128
    /// f32 block scales) dequantized to BF16: `bf16(code · scale)`, exact for power-of-two scales
    /// (kernels/fast_dense.cu `fd_dequant_bf16_kernel`). `row0` a multiple of 128.
    pub fn dequant_bf16(
        &self,
        ctx: &Context,
        w: &WeightDev,
        row0: usize,
        rows: usize,
        out: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fd_dequant_bf16_kernel";
        let k = w.cols;
        let Some(scales) = w.scales else {
            return Err(internal(format!("{K}: an FP8 weight without scales")));
        };
        if w.format != StorageFormat::Fp8
            || w.block != [128, 128]
            || !row0.is_multiple_of(128)
            || !k.is_multiple_of(128)
            || row0 + rows > w.rows
        {
            return Err(internal(format!(
                "{K}: rows {row0}..{} of a {:?} {}x{k} weight (block {:?})",
                row0 + rows,
                w.format,
                w.rows,
                w.block
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let kb = k / 128;
        let data = w.data.slice(row0 * k, rows * k)?;
        let sc = scales.slice(row0 / 128 * kb * 4, rows.div_ceil(128) * kb * 4)?;
        need(K, "out", out, rows * k * 2)?;
        let _g = ctx.enter()?;
        self.dequant_bf16.launch(
            ((rows * k / 16).div_ceil(256) as u32, 1, 1),
            256,
            0,
            stream,
            fd_dequant_bf16_kernel::Args {
                w: data,
                wscale: sc,
                n: to_i32(K, "rows", rows)?,
                k: to_i32(K, "K", k)?,
                out,
            },
        )
    }

    pub fn round_bf16(
        &self,
        ctx: &Context,
        y: DevicePtr,
        ldy: usize,
        t: usize,
        n: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fd_round_bf16_kernel";
        if t == 0 || n == 0 {
            return Ok(());
        }
        need(K, "y", y, super::linear::strided_bytes(t, n, ldy))?;
        let (ldy32, n32) = (to_i32(K, "ldy", ldy)?, to_i32(K, "N", n)?);
        let _g = ctx.enter()?;
        for t0 in (0..t).step_by(ROUND_ROWS) {
            let rows = (t - t0).min(ROUND_ROWS);
            let yc = y.slice(t0 * ldy * 4, y.bytes() - t0 * ldy * 4)?;
            self.round_bf16.launch(
                (n.div_ceil(1024) as u32, rows as u32),
                256,
                0,
                stream,
                fd_round_bf16_kernel::Args {
                    y: yc,
                    ldy: ldy32,
                    t: rows as i32,
                    n: n32,
                },
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_follow_the_weight_shape_only() {
        // Flash shapes: wq_a, wkv, wq_b, wo_b, wo_a (8 groups), indexer wq_b, compressor wkv,
        // and a head-like one whose K must be split for shared memory alone.
        assert_eq!(slices(1024, 4096, 1), Some(8));
        assert_eq!(slices(512, 4096, 1), Some(8));
        assert_eq!(slices(32768, 1024, 1), Some(1));
        assert_eq!(slices(4096, 8192, 1), Some(8));
        assert_eq!(slices(1024, 4096, 8), Some(4));
        assert_eq!(slices(8192, 1024, 1), Some(2));
        assert_eq!(slices(129280, 4096, 1), Some(4));
        assert_eq!(slices(64, 4096, 1), Some(8));
        // Slices stay multiples of 128, at least 256 k and at most 1024; K = 128 is one slice.
        assert_eq!(slices(16, 128, 1), Some(1));
        assert_eq!(slices(16, 384, 1), Some(1));
        assert_eq!(slices(16, 512, 1), Some(2));
        assert_eq!(slices(16, 1152, 1), None);
        assert_eq!(slices(16, 16384, 1), None);
        for (n, k, g) in [(64, 4096, 1), (100, 1280, 3), (1, 128 * 8, 1)] {
            let s = slices(n, k, g).unwrap();
            assert!(k.is_multiple_of(128 * s) && (s == 1 || k / s >= MIN_SLICE));
            assert!(k / s <= MAX_SLICE && s <= MAX_SLICES);
        }
    }

    #[test]
    fn the_counter_split_takes_the_wide_flash_launches_and_fits_the_workspace() {
        let tiles = |n: usize, g: usize| n.div_ceil(ROWS) * g;
        // wo_b (32 tiles, 8 slices), wo_a (8 groups of 8 tiles, 4 slices), a CSA layer's seven
        // projections of u (33 tiles, 4 slices) at up to 8 tokens; not from 9 tokens.
        for (what, t, sl) in [
            ("wo_b", tiles(4096, 1), slices(4096, 8192, 1)),
            ("wo_a", tiles(1024, 8), slices(1024, 4096, 8)),
            (
                "u group",
                8 + 4 + 8 + 8 + 2 + 2 + 1,
                slices_for_tiles(33, 4096),
            ),
        ] {
            let sl = sl.unwrap();
            assert!(split_by_counter(t, sl, 1), "{what}: {t} tiles, {sl} slices");
            assert!(!split_by_counter(t, sl, 2), "{what} at 16 tokens");
        }
        // Few-tile launches keep the cluster (wq_a, wkv) or have one slice (wq_b).
        assert!(!split_by_counter(tiles(1024, 1), 8, 1));
        assert!(!split_by_counter(tiles(512, 1), 8, 1));
        assert!(!split_by_counter(tiles(32768, 1), 1, 1));
        // Whatever it takes fits the workspace: partials of every block, a counter per row tile.
        let [_, _, part, count] = workspace_sizes(&[]);
        for t in 1..=COUNTER_SPLIT_BLOCKS {
            for sl in [1, 2, 4, 8] {
                if split_by_counter(t, sl, 1) {
                    assert!(
                        t * sl * 8 * ROWS <= part && t <= count,
                        "{t} tiles, {sl} slices"
                    );
                }
            }
        }
    }

    #[test]
    fn the_warp_split_takes_many_block_clusters_of_few_tokens() {
        let tiles = |n: usize, g: usize| n.div_ceil(ROWS) * g;
        // The head (BF16, 4 slices) and indexer.wq_b (2 slices): clusters over >= 128 blocks.
        for (n, k, fp8) in [(129280, 4096, false), (8192, 1024, true)] {
            let (sl, tl) = (slices(n, k, 1).unwrap(), tiles(n, 1));
            for t in 1..=8 {
                let want = t <= WARP_SPLIT_MAX_T;
                assert_eq!(
                    warp_split(t, tl, sl, k, fp8, WARP_SPLIT_MAX_T),
                    want,
                    "{n}x{k} T={t}"
                );
                assert!(
                    !warp_split(t, tl, sl, k, fp8, t - 1),
                    "{n}x{k} T={t} above the most"
                );
            }
            assert!(!warp_split(9, tl, sl, k, fp8, TOKENS));
        }
        // Not: workspace splits (wo_b, wo_a), few-tile clusters (wq_a, wkv), one slice (wq_b).
        for (n, k, g) in [
            (4096, 8192, 1),
            (1024, 4096, 8),
            (1024, 4096, 1),
            (512, 4096, 1),
            (32768, 1024, 1),
        ] {
            let sl = slices(n, k, g).unwrap();
            assert!(
                !warp_split(1, tiles(n, g), sl, k, true, WARP_SPLIT_MAX_T),
                "{n}x{k}x{g}"
            );
        }
        // The widest K the kernels take, at 8 tokens: within the kernels' shared memory.
        let widest = MAX_SLICES * MAX_SLICE;
        assert!(warp_split_smem_bytes(8, widest, false) <= MAX_SMEM);
    }

    /// A weight record at a made-up address (host logic only: nothing is dereferenced).
    fn weight(format: StorageFormat, rows: usize, cols: usize, at: u64) -> WeightDev {
        let esize = if format == StorageFormat::Fp8 { 1 } else { 2 };
        // SAFETY: never dereferenced; group_covers / group_pays read the records only.
        let data = unsafe { DevicePtr::from_raw(at, rows * cols * esize) };
        let scales = (format == StorageFormat::Fp8)
            .then(|| unsafe { DevicePtr::from_raw(at + (1 << 30), rows * cols / 16384 * 4) });
        WeightDev {
            format,
            data,
            scales,
            block: [128, 128],
            rows,
            cols,
        }
    }

    /// Projections of one x (at a made-up address) of `t` tokens: (format, rows) each, K = `k`.
    fn group(t: usize, k: usize, members: &[(StorageFormat, usize)]) -> Vec<DenseOp> {
        // SAFETY: as in `weight`.
        let x = unsafe { DevicePtr::from_raw(1 << 40, t * k * 4) };
        members
            .iter()
            .enumerate()
            .map(|(i, &(format, n))| DenseOp {
                x,
                ldx: k,
                t,
                w: weight(format, n, k, (i as u64 + 1) << 32),
                groups: 1,
                mode: if format == StorageFormat::Fp8 {
                    ActMode::Quant
                } else {
                    ActMode::Bf16
                },
                round: true,
                y: unsafe { DevicePtr::from_raw((i as u64 + 100) << 32, t * n * 4) },
                ldy: n,
                fused_act_max_t: GROUP_MAX_T,
                warp_split_max_t: WARP_SPLIT_MAX_T,
            })
            .collect()
    }

    #[test]
    fn groups_cover_one_input_and_pay_where_measured() {
        use StorageFormat::{Bf16, Fp8};
        let u = [
            (Fp8, 1024),
            (Fp8, 512),
            (Bf16, 1024),
            (Bf16, 1024),
            (Bf16, 256),
            (Bf16, 256),
            (Bf16, 64),
        ];
        let q_lora = [(Fp8, 32768), (Fp8, 8192)];
        for t in [1, 2, 4, 8, 16] {
            let ops = group(t, 4096, &u);
            assert!(FastDense::group_covers(&ops), "u group at T = {t}");
            // 33 row tiles x 8 slices: the most the workspace split holds.
            assert_eq!(group_slices(&ops), Some(8));
            // K split: each block makes an eighth of K's operands: a group at every T.
            assert!(FastDense::group_pays(&ops), "u group at T = {t}");
            let ops = group(t, 1024, &q_lora);
            assert!(FastDense::group_covers(&ops), "q_lora group at T = {t}");
            assert_eq!(group_slices(&ops), Some(1));
            // One slice: measured slower than one call each at every T.
            assert!(!FastDense::group_pays(&ops), "q_lora group at T = {t}");
        }
        // Past 16 tokens, eight members, another x / K / mode, a grouped member: not covered.
        assert!(!FastDense::group_covers(&group(17, 4096, &u)));
        assert!(!FastDense::group_covers(&group(1, 4096, &[(Fp8, 128); 8])));
        assert!(!FastDense::group_covers(&[]));
        let mut ops = group(1, 4096, &u[..2]);
        ops[1].x = ops[0].y;
        assert!(!FastDense::group_covers(&ops), "another x");
        let mut ops = group(1, 4096, &u[..2]);
        ops[1].w = weight(Fp8, 512, 2048, 7 << 32);
        assert!(!FastDense::group_covers(&ops), "another K");
        let mut ops = group(1, 4096, &u[..2]);
        ops[1].mode = ActMode::Bf16;
        assert!(
            !FastDense::group_covers(&ops),
            "BF16 operands for an FP8 weight"
        );
        let mut ops = group(1, 4096, &u[..2]);
        ops[1].groups = 2;
        assert!(!FastDense::group_covers(&ops), "a member in groups");
    }

    #[test]
    fn valid_slices_keep_slices_whole_and_bounded() {
        assert_eq!(valid_slices(1024).collect::<Vec<_>>(), [1, 2, 4]);
        assert_eq!(valid_slices(4096).collect::<Vec<_>>(), [4, 8]);
        assert_eq!(valid_slices(8192).collect::<Vec<_>>(), [8]);
        assert_eq!(valid_slices(16384).count(), 0);
    }

    #[test]
    fn the_largest_launch_fits_shared_memory() {
        // 227 KiB is what an sm_90 block may opt into.
        const { assert!(MAX_SMEM <= 227 * 1024) };
        assert_eq!(
            workspace_sizes(&[Shape {
                n: 1024,
                k: 4096,
                groups: 8
            }]),
            [
                TOKENS * 32768,
                TOKENS * 256,
                COUNTER_SPLIT_BLOCKS * 8 * ROWS,
                COUNTER_SPLIT_BLOCKS / COUNTER_SPLIT_MIN_SLICES
            ]
        );
    }
}
