//! Rust side of the `fast_dense` kernel family (kernels/fast_dense.cu): the fast set's dense
//! projections (wq_a, wq_b, wkv, grouped wo_a, wo_b, indexer wq_b, compressor and indexer
//! weights) at few tokens, bandwidth-bound: each weight byte is read once by a 16-byte load
//! into an f16 (FP8 weights) or bf16 (BF16 weights) tensor-core fragment, f32 accumulation
//! promoted per 128 of k. A call is two launches per FD_TOKENS tokens: `fd_act_kernel` (the
//! activations as 16-bit operands with a scale per 128, the official act_quant included), then
//! `fd_gemv_t{8,16,32,64}_kernel`. K is split into [`slices`] chosen from the weight's shape
//! only, so a token's sums do not depend on the batch it is in.
//!
//! Numerics (kernels/SPEC.md "fast_dense.cu"): the reference's operation up to f32 accumulation
//! order and the tensor core's accumulator; tests/gpu_fast_dense.rs derives and asserts the bound.

use super::linear::WeightDev;
use super::{need, to_i32};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::weights::format::StorageFormat;

/// Warps of a block (FD_WARPS); each owns 16 weight rows.
pub const WARPS: usize = 4;
/// Weight rows per block.
pub const ROWS: usize = 16 * WARPS;
/// Most tokens one launch takes (FD_TOKENS); a call loops over chunks of this many.
pub const TOKENS: usize = 64;
/// Blocks a launch aims for: K is split until the row tiles times the slices reach it (enough
/// 16-byte loads in flight on every SM), with slices of at least [`MIN_SLICE`] k.
pub const TARGET_BLOCKS: usize = 512;
/// Smallest slice of K a block sums (two 128-blocks: the loads of one overlap the MMAs of the other).
pub const MIN_SLICE: usize = 256;

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
    #[pdl(true)]
    fn fd_gemv_t8_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, act: *const u16,
        ascale: *const f32, t: i32, round_out: bool, y: *mut f32, ldy: i32,
        part: Option<*mut f32>, counters: Option<*mut u32>,
    );
    #[pdl(true)]
    fn fd_gemv_t16_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, act: *const u16,
        ascale: *const f32, t: i32, round_out: bool, y: *mut f32, ldy: i32,
        part: Option<*mut f32>, counters: Option<*mut u32>,
    );
    #[pdl(true)]
    fn fd_gemv_t32_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, act: *const u16,
        ascale: *const f32, t: i32, round_out: bool, y: *mut f32, ldy: i32,
        part: Option<*mut f32>, counters: Option<*mut u32>,
    );
    #[pdl(true)]
    fn fd_gemv_t64_kernel(
        w: *const u8, wscale: Option<*const f32>, n: i32, k: i32, fp8: bool, act: *const u16,
        ascale: *const f32, t: i32, round_out: bool, y: *mut f32, ldy: i32,
        part: Option<*mut f32>, counters: Option<*mut u32>,
    );
}

crate::launchers! {
    /// The fast_dense family's entry points, resolved from a loaded registry.
    pub struct FastDense {
        act: fd_act_kernel,
        t8: fd_gemv_t8_kernel,
        t16: fd_gemv_t16_kernel,
        t32: fd_gemv_t32_kernel,
        t64: fd_gemv_t64_kernel,
    }
}

/// Slices of K for a weight of `groups` x `n` rows and `k` columns: the smallest power of two
/// that gives [`TARGET_BLOCKS`] blocks, as long as slices stay multiples of 128 and at least
/// [`MIN_SLICE`] (or one slice when K is 128).
pub fn slices(n: usize, k: usize, groups: usize) -> usize {
    let tiles = n.div_ceil(ROWS) * groups;
    let mut s = 1;
    while tiles * s < TARGET_BLOCKS && k.is_multiple_of(2 * s * 128) && k / (2 * s) >= MIN_SLICE {
        s *= 2;
    }
    s
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
}

impl DenseOp {
    /// Rows per group.
    pub fn n(&self) -> usize {
        self.w.rows / self.groups.max(1)
    }
}

/// The family's workspace (the fast set's, declared at create by [`workspace_sizes`]).
#[derive(Clone, Copy, Debug)]
pub struct DenseWorkspace {
    /// `[TOKENS, max width]` 16-bit operands.
    pub act: DevicePtr,
    /// `[TOKENS, max width / 128]` f32.
    pub scale: DevicePtr,
    /// Partial sums of split launches.
    pub part: DevicePtr,
    /// One zeroed u32 per (group, row tile) of a split launch.
    pub counters: DevicePtr,
}

/// A projection's shape: `groups` x `n` rows of `k` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub n: usize,
    pub k: usize,
    pub groups: usize,
}

/// Element counts of [`DenseWorkspace`] (act u16, scale f32, part f32, counters u32) for the
/// largest of `shapes`.
pub fn workspace_sizes(shapes: &[Shape]) -> [usize; 4] {
    let width = shapes.iter().map(|s| s.k * s.groups).max().unwrap_or(0);
    let part = shapes
        .iter()
        .map(|s| {
            let sl = slices(s.n, s.k, s.groups);
            if sl > 1 {
                s.groups * sl * TOKENS * s.n
            } else {
                0
            }
        })
        .max()
        .unwrap_or(0);
    let counters = shapes
        .iter()
        .map(|s| s.groups * s.n.div_ceil(ROWS))
        .max()
        .unwrap_or(0);
    [TOKENS * width, TOKENS * width / 128, part, counters]
}

fn internal(msg: String) -> Error {
    Error::new(Status::Internal, msg)
}

impl FastDense {
    /// How the fast kernels run a weight stored as `w` (K = `w.cols`, `groups` groups of rows),
    /// with the official act_quant when `quant_act`; None when they cannot (the reference
    /// kernels run it): F32 and FP4 weights, FP8 blocks other than 128 x 128, K not a multiple
    /// of 128, rows not a multiple of 128 per group when grouped FP8.
    pub fn mode_for(w: &WeightDev, groups: usize, quant_act: bool) -> Option<ActMode> {
        if groups == 0 || !w.rows.is_multiple_of(groups) || w.rows == 0 {
            return None;
        }
        if !w.cols.is_multiple_of(128) || w.cols == 0 {
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

    /// Runs `op` (see [`DenseOp`]) in chunks of [`TOKENS`] tokens. `x` rows must be 16-byte
    /// aligned (`ldx` a multiple of 4, `x` 16-byte aligned); `x` and `y` must not overlap.
    pub fn run(
        &self,
        ctx: &Context,
        op: &DenseOp,
        ws: &DenseWorkspace,
        stream: BorrowedStream,
    ) -> Result<()> {
        const K: &str = "fd_gemv_kernel";
        let w = &op.w;
        let Some(mode) = Self::mode_for(w, op.groups, op.mode == ActMode::Quant) else {
            return Err(internal(format!(
                "{K}: a {:?} weight {}x{} (block {:?}) in {} groups is not covered",
                w.format, w.rows, w.cols, w.block, op.groups
            )));
        };
        if mode != op.mode {
            return Err(internal(format!(
                "{K}: activation mode {:?} for a {:?} weight",
                op.mode, w.format
            )));
        }
        w.validate()?;
        let (n, k, groups) = (op.n(), w.cols, op.groups);
        let width = groups * k;
        if op.ldx < width || op.ldy < groups * n || !op.ldx.is_multiple_of(4) {
            return Err(internal(format!(
                "{K}: strides ldx {} / ldy {} for width {width} / {} outputs",
                op.ldx,
                op.ldy,
                groups * n
            )));
        }
        if op.t == 0 {
            return Ok(());
        }
        if !op.x.addr().is_multiple_of(16) {
            return Err(internal(format!("{K}: x is not 16-byte aligned")));
        }
        need(
            K,
            "x",
            op.x,
            super::linear::strided_bytes(op.t, width, op.ldx),
        )?;
        need(
            K,
            "y",
            op.y,
            super::linear::strided_bytes(op.t, groups * n, op.ldy),
        )?;
        let sl = slices(n, k, groups);
        let tiles = n.div_ceil(ROWS);
        need(K, "act", ws.act, TOKENS * width * 2)?;
        need(K, "scale", ws.scale, TOKENS * width / 128 * 4)?;
        if sl > 1 {
            need(K, "part", ws.part, groups * sl * TOKENS * n * 4)?;
            need(K, "counters", ws.counters, groups * tiles * 4)?;
        }
        let (n32, k32, w32) = (
            to_i32(K, "N", n)?,
            to_i32(K, "K", k)?,
            to_i32(K, "width", width)?,
        );
        let (ldx32, ldy32) = (to_i32(K, "ldx", op.ldx)?, to_i32(K, "ldy", op.ldy)?);
        let fp8 = w.format == StorageFormat::Fp8;
        let wscale = if fp8 { w.scales } else { None };
        let (part, counters) = if sl > 1 {
            (Some(ws.part), Some(ws.counters))
        } else {
            (None, None)
        };
        let _g = ctx.enter()?;
        for t0 in (0..op.t).step_by(TOKENS) {
            let tc = (op.t - t0).min(TOKENS);
            let t32 = tc as i32;
            let x =
                op.x.slice(t0 * op.ldx * 4, op.x.bytes() - t0 * op.ldx * 4)?;
            let y =
                op.y.slice(t0 * op.ldy * 4, op.y.bytes() - t0 * op.ldy * 4)?;
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
            let grid = (tiles as u32, sl as u32, groups as u32);
            let block = (WARPS * 32) as u32;
            macro_rules! gemv {
                ($field:ident, $kernel:ident) => {
                    self.$field.launch(
                        grid,
                        block,
                        0,
                        stream,
                        $kernel::Args {
                            w: w.data,
                            wscale,
                            n: n32,
                            k: k32,
                            fp8,
                            act: ws.act,
                            ascale: ws.scale,
                            t: t32,
                            round_out: op.round,
                            y,
                            ldy: ldy32,
                            part,
                            counters,
                        },
                    )
                };
            }
            match tc {
                1..=8 => gemv!(t8, fd_gemv_t8_kernel)?,
                9..=16 => gemv!(t16, fd_gemv_t16_kernel)?,
                17..=32 => gemv!(t32, fd_gemv_t32_kernel)?,
                _ => gemv!(t64, fd_gemv_t64_kernel)?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_follow_the_weight_shape_only() {
        // Flash shapes: wq_a, wkv, wq_b, wo_b, wo_a (8 groups), indexer wq_b, compressor wkv.
        assert_eq!(slices(1024, 4096, 1), 16);
        assert_eq!(slices(512, 4096, 1), 16);
        assert_eq!(slices(32768, 1024, 1), 1);
        assert_eq!(slices(4096, 8192, 1), 8);
        assert_eq!(slices(1024, 4096, 8), 4);
        assert_eq!(slices(8192, 1024, 1), 4);
        // Slices stay multiples of 128 and at least 256 k; K = 128 is one slice.
        assert_eq!(slices(16, 128, 1), 1);
        assert_eq!(slices(16, 384, 1), 1);
        assert_eq!(slices(16, 512, 1), 2);
        for (n, k, g) in [(64, 4096, 1), (100, 1280, 3), (1, 128 * 96, 1)] {
            let s = slices(n, k, g);
            assert!(k.is_multiple_of(128 * s) && (s == 1 || k / s >= MIN_SLICE));
        }
    }

    #[test]
    fn workspace_holds_the_largest_split() {
        let shapes = [
            Shape {
                n: 4096,
                k: 8192,
                groups: 1,
            },
            Shape {
                n: 1024,
                k: 4096,
                groups: 8,
            },
            Shape {
                n: 32768,
                k: 1024,
                groups: 1,
            },
        ];
        let [act, scale, part, counters] = workspace_sizes(&shapes);
        assert_eq!(act, TOKENS * 32768);
        assert_eq!(scale, TOKENS * 256);
        assert_eq!(part, (8 * 4096).max(8 * 4 * 1024) * TOKENS);
        assert_eq!(counters, 32768 / ROWS);
    }
}
