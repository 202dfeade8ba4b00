//! The fast dense projections of many tokens (prefill): cuBLASLt GEMMs
//! ([`crate::cuda::blockscaled_gemm`]) fed by `fd_lt_operand_kernel` (the official act_quant's
//! e4m3 codes and scales, or BF16 values) and followed by `fd_round_bf16_kernel` where the
//! model's output is BF16 (kernels/fast_dense.cu). Three launches a call (two without the
//! rounding), against one gemv launch per 64 tokens that re-reads the weight each time. The
//! projections of one input share their operand ([`run_gemm_group`]), which the RMSNorm that
//! makes that input can make in its own launch instead ([`norm_group_operands`],
//! [`run_gemm_group_from`]). An FP8 GEMM that our own kernel takes ([`FastFp8Gemm`],
//! kernels/fast_fp8_gemm.cu: the same operands, the rounding in its epilogue) runs there instead
//! of cuBLASLt when the caller passes it (`own`).
//!
//! wo_a then wo_b can run as one chain ([`run_gemm_chain`]): wo_b's operand made from wo_a's
//! unrounded output by the pass that would have rounded it.
//!
//! The same `DenseOp` as the gemv path; what this path cannot take (shapes cuBLASLt's block
//! scaling does not cover, m without a planned algorithm) it declines and the gemv runs it.
//! wo_a's grouped BF16 einsum of FP8 weights runs a group at a time: the group's weight
//! dequantized to BF16 (`fd_dequant_bf16_kernel`, into [`GemmWorkspace::weight`]), its BF16
//! operand, a BF16 GEMM — as the official model computes it. cuBLASLt takes the tokens in multiples
//! of [`M_GRANULE`] (its block-scaled algorithms refuse other m, the activation scales' rows being
//! 16-byte aligned: measured, tests/gpu_fast_dense.rs); the last `t % M_GRANULE` tokens of a call
//! run the gemv, in the same call.
//!
//! Numerics: the same products (e4m3 x e4m3 with the same scales, or BF16 x BF16; wo_a's weight
//! times its power-of-two scale is a BF16 value) summed by cuBLASLt's kernels in f32 (its order;
//! FP8 block-scaled GEMMs promote every 128 of k to apply the scales); tests/gpu_fast_dense.rs
//! states and asserts the bound.

use super::fast_dense::{ActMode, DenseOp, DenseWorkspace, FastDense, GROUP_MAX, LtOperand};
use super::fast_fp8_gemm::FastFp8Gemm;
use crate::cuda::blockscaled_gemm::{BlockScaledGemm, GemmCall, GemmKind, GemmOut, GemmShape};
use crate::cuda::stream::BorrowedStream;
use crate::cuda::{Context, DevicePtr};
use crate::error::{Error, Result, Status};
use crate::weights::format::StorageFormat;

/// Fewest tokens any projection runs through cuBLASLt ([`gemm_pays`] has the rule).
pub const GEMM_MIN_TOKENS: usize = 32;

/// Fewest tokens an FP8 weight under [`SMALL_FP8_BYTES`] runs through cuBLASLt.
pub const SMALL_FP8_MIN_TOKENS: usize = 128;

/// FP8 weights below this many bytes (Flash's wq_a, 4 MiB, and wkv, 2 MiB) keep the gemv longer.
pub const SMALL_FP8_BYTES: usize = 8 << 20;

/// Whether `t` tokens of `shape` run faster through the GEMM path than through the gemv, by the
/// crossover `dsv4 bench dense` measured on the H200 (BENCHMARKS.md, "cuBLASLt for many tokens";
/// whole calls, operand and rounding included): from 32 tokens the GEMM path wins on every
/// Flash projection but two, by 1.8-3.0x at 64; cuBLASLt's block-scaled FP8 kernels cost ~14 µs
/// however small the weight, so the small FP8 ones (wq_a, wkv: 9-15 µs through the gemv up to 64
/// tokens) switch at 128. At 16 tokens the gemv loses only where the weight is large (wo_b 25.1
/// against 19.8 µs) and wins on others (wq_b 17.2 against 19.9): 32 is the one threshold.
///
/// A grouped weight (wo_a: 8 GEMMs of one group each, with their dequantization and operand) from
/// [`GROUPED_MIN_TOKENS`].
pub fn gemm_pays(shape: &GemmShape, groups: usize, t: usize) -> bool {
    if groups > 1 {
        return t >= GROUPED_MIN_TOKENS;
    }
    let small_fp8 = shape.kind == GemmKind::Fp8BlockScaled
        && shape.n * shape.k * shape.operand_size() < SMALL_FP8_BYTES;
    t >= if small_fp8 {
        SMALL_FP8_MIN_TOKENS
    } else {
        GEMM_MIN_TOKENS
    }
}

/// Fewest tokens a grouped FP8 weight (wo_a) runs through cuBLASLt.
pub const GROUPED_MIN_TOKENS: usize = 128;

/// cuBLASLt runs the largest multiple of this many tokens of a call; the gemv the rest.
pub const M_GRANULE: usize = 4;

/// The activation operand of the GEMMs (declared at create by [`gemm_workspace_sizes`]).
#[derive(Clone, Copy, Debug)]
pub struct GemmWorkspace {
    /// `[max tokens, max K]` e4m3 codes, or BF16 values (2 bytes each).
    pub codes: DevicePtr,
    /// `[max K / 128, max tokens]` f32.
    pub scale: DevicePtr,
    /// One group of a grouped FP8 weight dequantized to BF16 (`gemm_weight_bytes`).
    pub weight: DevicePtr,
}

/// Bytes of [`GemmWorkspace::weight`] for projections of `(rows per group, k, groups)`: one
/// group of the largest grouped one in BF16 (0 without any).
pub fn gemm_weight_bytes(shapes: &[(usize, usize, usize)]) -> usize {
    shapes
        .iter()
        .filter(|&&(_, _, groups)| groups > 1)
        .map(|&(n, k, _)| n * k * 2)
        .max()
        .unwrap_or(0)
}

/// Bytes of [`GemmWorkspace::codes`] and elements of [`GemmWorkspace::scale`] for `shapes` at
/// up to `max_t` tokens: the largest operand of one shape, and for each K in `norm_ks` (the
/// widths of the norms whose groups read their output: the attention's u and q_lora) one operand
/// of each kind some shape of that K reads, side by side ([`norm_group_operands`]: u's FP8 and
/// BF16 operands, 12 KiB a token at Flash shapes, within the 16 KiB of wo_b's BF16 plan).
pub fn gemm_workspace_sizes(shapes: &[GemmShape], max_t: usize, norm_ks: &[usize]) -> [usize; 2] {
    let at_k = |k: usize, kind: GemmKind| shapes.iter().any(|o| o.k == k && o.kind == kind);
    let one = shapes.iter().map(|s| s.k * s.operand_size()).max();
    let side_by_side = norm_ks.iter().map(|&k| {
        let fp8 = at_k(k, GemmKind::Fp8BlockScaled);
        let bf16 = at_k(k, GemmKind::Bf16);
        k * (usize::from(fp8) + 2 * usize::from(bf16))
    });
    let codes = one.into_iter().chain(side_by_side).max().unwrap_or(0);
    let k = shapes.iter().map(|s| s.k).max().unwrap_or(0);
    [max_t * codes, max_t * k / 128]
}

/// The GEMM shape of a projection the GEMMs can take: one group, FP8 with 128 x 128 blocks and
/// the official act_quant, or BF16; or several groups of an FP8 weight with 128 x 128 blocks
/// without act_quant (wo_a's BF16 einsum, [`ActMode::F16`]): a BF16 GEMM a group, of
/// `rows / groups` rows (a multiple of 128).
pub fn gemm_shape(
    w_format: StorageFormat,
    block: [usize; 2],
    rows: usize,
    k: usize,
    groups: usize,
    mode: ActMode,
) -> Option<GemmShape> {
    if groups == 0 {
        return None;
    }
    if groups > 1 {
        let n = rows / groups;
        let grouped = w_format == StorageFormat::Fp8
            && mode == ActMode::F16
            && block == [128, 128]
            && rows.is_multiple_of(groups)
            && n.is_multiple_of(128);
        let s = GemmShape {
            kind: GemmKind::Bf16,
            n,
            k,
            out: GemmOut::F32,
        };
        return (grouped && s.supported()).then_some(s);
    }
    let kind = match (w_format, mode) {
        (StorageFormat::Fp8, ActMode::Quant) if block == [128, 128] => GemmKind::Fp8BlockScaled,
        (StorageFormat::Bf16, ActMode::Bf16) => GemmKind::Bf16,
        _ => return None,
    };
    let s = GemmShape {
        kind,
        n: rows,
        k,
        out: GemmOut::F32,
    };
    s.supported().then_some(s)
}

/// The single-group GEMM shape of `op` and the tokens cuBLASLt takes of it (`m`), or None
/// where it cannot run `op`: grouped weights ([`run_grouped`]), shapes cuBLASLt's block scaling
/// does not cover, or an `m` without a planned algorithm. (Whether the GEMM pays at `op`'s
/// tokens is [`gemm_pays`], the caller's rule.)
fn single_gemm(gemm: &BlockScaledGemm, op: &DenseOp) -> Option<(GemmShape, usize)> {
    let w = &op.w;
    let shape = gemm_shape(w.format, w.block, w.rows, w.cols, op.groups, op.mode)?;
    let m = op.t / M_GRANULE * M_GRANULE;
    (op.groups == 1 && m > 0 && gemm.covers(&shape, m)).then_some((shape, m))
}

/// `op`'s GEMM shape and tokens where it takes the GEMM path in a group ([`run_gemm_group`]):
/// cuBLASLt runs it ([`single_gemm`]) and that pays ([`gemm_pays`]).
fn member_plan(gemm: &BlockScaledGemm, op: &DenseOp) -> Option<(GemmShape, usize)> {
    single_gemm(gemm, op).filter(|(shape, _)| gemm_pays(shape, 1, op.t))
}

/// An operand as the GEMMs read it: the codes (or BF16 values) and, for FP8, the scales.
type OperandRef = (DevicePtr, Option<DevicePtr>);

/// Whether the workspace holds the activation operand of `m` tokens of `shape`.
fn operand_fits(ws: &GemmWorkspace, shape: &GemmShape, m: usize) -> bool {
    let fp8 = shape.kind == GemmKind::Fp8BlockScaled;
    ws.codes.bytes() >= m * shape.k * shape.operand_size()
        && (!fp8 || ws.scale.bytes() >= m * shape.k / 128 * 4)
}

/// The activation operand of `op`'s first `m` tokens in the workspace, made by one
/// `fd_lt_operand_kernel` launch: `(codes, scale)` (scale only for FP8), or None, having
/// launched nothing, where the workspace is too small. `round_in`: op's x holds unrounded sums
/// whose official values are their bf16 roundings ([`LtOperand::round_in`]).
#[allow(clippy::too_many_arguments)]
fn make_operand(
    dense: &FastDense,
    ctx: &Context,
    op: &DenseOp,
    shape: &GemmShape,
    m: usize,
    round_in: bool,
    ws: &GemmWorkspace,
    stream: BorrowedStream,
) -> Result<Option<OperandRef>> {
    let fp8 = shape.kind == GemmKind::Fp8BlockScaled;
    let codes_bytes = m * shape.k * shape.operand_size();
    let scale_bytes = m * shape.k / 128 * 4;
    if !operand_fits(ws, shape, m) {
        return Ok(None);
    }
    let codes = ws.codes.slice(0, codes_bytes)?;
    let scale = fp8.then(|| ws.scale.slice(0, scale_bytes)).transpose()?;
    dense.lt_operand(
        ctx,
        &LtOperand {
            x: op.x,
            ldx: op.ldx,
            t: m,
            k: shape.k,
            mode: op.mode,
            round_in,
            codes,
            scale: scale.unwrap_or(ws.scale),
        },
        stream,
    )?;
    Ok(Some((codes, scale)))
}

/// `op`'s GEMM from an operand [`make_operand`] made of the same x, then its rounding and its
/// last tokens through the gemv; false, having written nothing to y, where cuBLASLt declines
/// this exact m (the caller's gemv then runs `op`). An FP8 block-scaled GEMM that `own` (our
/// kernel, [`FastFp8Gemm`]) takes runs there instead of cuBLASLt, its rounding in its epilogue.
#[allow(clippy::too_many_arguments)]
fn gemm_from_operand(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    op: &DenseOp,
    (shape, m): (GemmShape, usize),
    (codes, scale): OperandRef,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<bool> {
    let call = GemmCall {
        shape,
        m,
        w: op.w.data,
        wscale: if scale.is_some() { op.w.scales } else { None },
        a: codes,
        lda: shape.k,
        ascale: scale,
        y: op.y,
        ldy: op.ldy,
    };
    if let Some((own, tile)) = own.zip(FastFp8Gemm::tile_for(&call)) {
        own.run(ctx, &call, tile, op.round, stream)?;
    } else {
        if !gemm.run(ctx, &call, stream)? {
            return Ok(false);
        }
        if op.round {
            dense.round_bf16(ctx, op.y, op.ldy, m, shape.n, stream)?;
        }
    }
    run_tail(dense, ctx, op, m, gemv_ws, stream)?;
    Ok(true)
}

/// Runs `op` through cuBLASLt, or our FP8 GEMM where `own` takes it (`gemm_from_operand`),
/// its last `t % M_GRANULE` tokens through the gemv (with `gemv_ws`), and returns true, or
/// returns false having run nothing that writes `y` (the caller's gemv runs it): see the module
/// doc for what is declined.
#[allow(clippy::too_many_arguments)]
pub fn run_gemm(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    op: &DenseOp,
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<bool> {
    if op.groups > 1 {
        return run_grouped_gemm(dense, gemm, ctx, op, None, ws, gemv_ws, stream);
    }
    let Some(plan) = single_gemm(gemm, op) else {
        return Ok(false);
    };
    let Some(operand) = make_operand(dense, ctx, op, &plan.0, plan.1, false, ws, stream)? else {
        return Ok(false);
    };
    // Declined only when the planned algorithm does not fit this exact m: the operand just
    // made is then unused (the workspace holds nothing else).
    gemm_from_operand(dense, gemm, own, ctx, op, plan, operand, gemv_ws, stream)
}

/// Runs `op` as the fast set runs a linear: through the GEMM path where that pays
/// ([`gemm_pays`]) and cuBLASLt's planner takes it (`lt`: the planner and its operand
/// workspace, None without cuBLASLt; `own`: our FP8 GEMM, [`run_gemm`]), else through the gemv.
pub fn run_linear(
    dense: &FastDense,
    lt: Option<(&BlockScaledGemm, &GemmWorkspace)>,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    op: &DenseOp,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<()> {
    let w = &op.w;
    if let Some((gemm, ws)) = lt
        && gemm_shape(w.format, w.block, w.rows, w.cols, op.groups, op.mode)
            .is_some_and(|shape| gemm_pays(&shape, op.groups, op.t))
        && run_gemm(dense, gemm, own, ctx, op, ws, gemv_ws, stream)?
    {
        return Ok(());
    }
    dense.run(ctx, op, gemv_ws, stream)
}

/// Whether [`run_grouped_gemm`] takes the grouped projection `op` (wo_a) at its tokens where
/// the caller offers x as BF16 too: where its GEMM pays ([`gemm_pays`]), cuBLASLt has an
/// algorithm for the tokens and the workspace holds a group's weight. (A caller that then made
/// the copy still passes x: where cuBLASLt refuses the copy's row stride, the call runs from x.)
pub fn grouped_reads_bf16(gemm: &BlockScaledGemm, ws: &GemmWorkspace, op: &DenseOp) -> bool {
    let w = &op.w;
    let m = op.t / M_GRANULE * M_GRANULE;
    op.groups > 1
        && m > 0
        && gemm_shape(w.format, w.block, w.rows, w.cols, op.groups, op.mode).is_some_and(|s| {
            gemm_pays(&s, op.groups, op.t)
                && gemm.covers(&s, m)
                && ws.weight.bytes() >= s.n * s.k * 2
        })
}

/// A grouped projection (wo_a) through cuBLASLt, as [`run_gemm`] runs it; with `x_bf16` (x's
/// values as BF16, `[t, ldx]` 16-bit, rows 16-byte aligned) each group's GEMM reads its
/// columns of that copy in place of an operand pass of its own (8 passes over o a layer, ~39
/// µs each at 4096 tokens, ncu), and falls back to the passes where cuBLASLt refuses the copy's
/// row stride. The same BF16 values either way, so the same bits.
#[allow(clippy::too_many_arguments)]
pub fn run_grouped_gemm(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    ctx: &Context,
    op: &DenseOp,
    x_bf16: Option<DevicePtr>,
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<bool> {
    grouped_gemm(dense, gemm, ctx, op, x_bf16, op.round, ws, gemv_ws, stream)
}

/// [`run_grouped_gemm`] with its first `m` tokens' rounding only where `round_out` (the tail's
/// gemv rounds as `op` says): without, they keep the unrounded sums ([`run_gemm_chain`]).
#[allow(clippy::too_many_arguments)]
fn grouped_gemm(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    ctx: &Context,
    op: &DenseOp,
    x_bf16: Option<DevicePtr>,
    round_out: bool,
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<bool> {
    let w = &op.w;
    let Some(shape) = gemm_shape(w.format, w.block, w.rows, w.cols, op.groups, op.mode) else {
        return Ok(false);
    };
    let m = op.t / M_GRANULE * M_GRANULE;
    if op.groups < 2 || m == 0 || !gemm.covers(&shape, m) {
        return Ok(false);
    }
    let aligned = |x: DevicePtr| x.addr().is_multiple_of(16) && (op.ldx * 2).is_multiple_of(16);
    let ran = match x_bf16.filter(|&x| aligned(x)) {
        Some(x) => run_grouped(
            dense,
            gemm,
            ctx,
            op,
            shape,
            m,
            Some(x),
            round_out,
            ws,
            stream,
        )?,
        None => false,
    };
    if !ran && !run_grouped(dense, gemm, ctx, op, shape, m, None, round_out, ws, stream)? {
        return Ok(false);
    }
    run_tail(dense, ctx, op, m, gemv_ws, stream).map(|()| true)
}

/// The members of a group of linears (`ops`, at most [`GROUP_MAX`]) that take the GEMM path
/// (where cuBLASLt runs them and [`gemm_pays`]), with one operand for all members of the same
/// input, K and mode: the attention sub-block's projections of u (wq_a and wkv: one FP8
/// operand; the compressors' wkv / wgate and weights_proj: one BF16 operand) and of the normed
/// q_lora (wq_b and the indexer's wq_b). One operand a member cost a 4096-token prefill ~70 µs
/// for u's FP8 operand and ~39 µs for each BF16 one (ncu). Each member gives the same bits as
/// [`run_gemm`] gives it (`own` as there). Returns which members ran; the caller runs the others.
#[allow(clippy::too_many_arguments)]
pub fn run_gemm_group(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    ops: &[DenseOp],
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<[bool; GROUP_MAX]> {
    gemm_group(dense, gemm, own, ctx, ops, None, ws, gemv_ws, stream)
}

/// The GEMM operands of a group's input made before the group runs, by the RMSNorm that made
/// that input (`fd_norm_operands_kernel`, [`norm_group_operands`]): of x's first `m` tokens at
/// K = `k`, the official act_quant's (`fp8`: codes and scales, as `fd_lt_operand_kernel` lays
/// them out) and the BF16 values (`bf16`), each where a member reads it.
#[derive(Clone, Copy, Debug)]
pub struct GroupOperands {
    pub x: DevicePtr,
    pub k: usize,
    pub m: usize,
    pub fp8: Option<(DevicePtr, DevicePtr)>,
    pub bf16: Option<DevicePtr>,
}

impl GroupOperands {
    /// The operand of member `op` planned as `plan` ([`member_plan`]), if made.
    fn of(&self, op: &DenseOp, (shape, m): &(GemmShape, usize)) -> Option<OperandRef> {
        if op.x.addr() != self.x.addr() || shape.k != self.k || *m != self.m {
            return None;
        }
        match (shape.kind, op.mode) {
            (GemmKind::Fp8BlockScaled, ActMode::Quant) => self.fp8.map(|(c, s)| (c, Some(s))),
            (GemmKind::Bf16, ActMode::Bf16) => self.bf16.map(|c| (c, None)),
            _ => None,
        }
    }
}

/// The operands of the group `ops`, whose every member reads `x` (`[t, k]` at row stride `ldx`:
/// the output of an RMSNorm `fd_norm_operands_kernel` can run), for that norm to make: one FP8
/// operand where a member taking the GEMM path ([`member_plan`]) is an act_quant FP8 one, one
/// BF16 operand where one is BF16, both in `ws` (the BF16 values first, the FP8 codes after
/// them, the scales in [`GemmWorkspace::scale`]). None where no member takes the GEMM path,
/// where one that does reads another operand (another x, row stride, K or token count), or
/// where `ws` is too small: the group then makes its operands itself ([`run_gemm_group`]).
pub fn norm_group_operands(
    gemm: &BlockScaledGemm,
    ws: &GemmWorkspace,
    ops: &[DenseOp],
    x: DevicePtr,
    ldx: usize,
    k: usize,
) -> Option<GroupOperands> {
    let kinds = ops
        .iter()
        .filter_map(|op| member_plan(gemm, op).map(|plan| (op, plan)))
        .map(|(op, (shape, m))| {
            let same_x = op.x.addr() == x.addr() && op.ldx == ldx && shape.k == k;
            let kind = match (shape.kind, op.mode) {
                (GemmKind::Fp8BlockScaled, ActMode::Quant) => Some(true),
                (GemmKind::Bf16, ActMode::Bf16) => Some(false),
                _ => None,
            };
            same_x.then_some(kind).flatten().map(|fp8| (fp8, m))
        });
    let (mut fp8, mut bf16, mut m) = (false, false, None);
    for kind in kinds {
        let (is_fp8, mt) = kind?;
        if *m.get_or_insert(mt) != mt {
            return None;
        }
        fp8 |= is_fp8;
        bf16 |= !is_fp8;
    }
    let m = m?;
    let bf16_bytes = if bf16 { m * k * 2 } else { 0 };
    let fp8_bytes = if fp8 { m * k } else { 0 };
    let scale_bytes = if fp8 { m * k / 128 * 4 } else { 0 };
    if ws.codes.bytes() < bf16_bytes + fp8_bytes || ws.scale.bytes() < scale_bytes {
        return None;
    }
    let fp8 = if fp8 {
        let codes = ws.codes.slice(bf16_bytes, fp8_bytes).ok()?;
        Some((codes, ws.scale.slice(0, scale_bytes).ok()?))
    } else {
        None
    };
    let bf16 = if bf16 {
        Some(ws.codes.slice(0, bf16_bytes).ok()?)
    } else {
        None
    };
    Some(GroupOperands { x, k, m, fp8, bf16 })
}

/// [`run_gemm_group`] from `operands` (made by the norm that made the members' x,
/// [`norm_group_operands`]): the members that take the GEMM path read them and no operand is
/// made here. The same bits as [`run_gemm_group`]'s, whose operand passes make the same values.
/// Returns which members ran; the caller runs the others.
#[allow(clippy::too_many_arguments)]
pub fn run_gemm_group_from(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    ops: &[DenseOp],
    operands: &GroupOperands,
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<[bool; GROUP_MAX]> {
    gemm_group(
        dense,
        gemm,
        own,
        ctx,
        ops,
        Some(operands),
        ws,
        gemv_ws,
        stream,
    )
}

/// The members of `ops` that take the GEMM path, one operand for all members of the same
/// input, K and mode: from `made` where given (a member whose operand it lacks is left to the
/// caller), else made here ([`make_operand`]).
#[allow(clippy::too_many_arguments)]
fn gemm_group(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    ops: &[DenseOp],
    made: Option<&GroupOperands>,
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<[bool; GROUP_MAX]> {
    let mut ran = [false; GROUP_MAX];
    let mut plans = [None; GROUP_MAX];
    for (plan, op) in plans.iter_mut().zip(ops) {
        *plan = member_plan(gemm, op);
    }

    let same_operand =
        |a: &DenseOp, pa: &(GemmShape, usize), b: &DenseOp, pb: &(GemmShape, usize)| {
            a.x.addr() == b.x.addr()
                && a.ldx == b.ldx
                && a.mode == b.mode
                && pa.0.k == pb.0.k
                && pa.0.kind == pb.0.kind
                && pa.1 == pb.1
        };
    for i in 0..ops.len().min(GROUP_MAX) {
        let Some(plan) = plans[i] else { continue };
        if ran[i] {
            continue;
        }
        let operand = match made {
            Some(made) => made.of(&ops[i], &plan),
            None => make_operand(dense, ctx, &ops[i], &plan.0, plan.1, false, ws, stream)?,
        };
        let Some(operand) = operand else {
            continue;
        };
        for j in i..ops.len().min(GROUP_MAX) {
            let Some(pj) = plans[j] else { continue };
            if !ran[j] && same_operand(&ops[i], &plan, &ops[j], &pj) {
                ran[j] = gemm_from_operand(
                    dense, gemm, own, ctx, &ops[j], pj, operand, gemv_ws, stream,
                )?;
                // A declined member is not offered the operand again.
                plans[j] = ran[j].then_some(pj);
            }
        }
    }
    Ok(ran)
}

/// second's GEMM shape and the tokens both GEMMs take (`m`), or None where [`run_gemm_chain`]
/// does not take its two projections (see there).
fn chain_plan(
    gemm: &BlockScaledGemm,
    first: &DenseOp,
    second: &DenseOp,
    ws: &GemmWorkspace,
) -> Option<(GemmShape, usize)> {
    let w = &first.w;
    let grouped = gemm_shape(w.format, w.block, w.rows, w.cols, first.groups, first.mode)?;
    let (shape, m) = single_gemm(gemm, second)?;
    let takes = first.groups > 1
        && first.round
        && gemm_pays(&grouped, first.groups, first.t)
        && gemm.covers(&grouped, m)
        && ws.codes.bytes() >= m * grouped.k * 2
        && ws.weight.bytes() >= grouped.n * grouped.k * 2
        && second.mode == ActMode::Quant
        && gemm_pays(&shape, 1, second.t)
        && operand_fits(ws, &shape, m)
        && second.t == first.t
        && second.x.addr() == first.y.addr()
        && second.ldx == first.ldy
        && shape.k == first.groups * grouped.n;
    takes.then_some((shape, m))
}

/// Two projections in sequence, the second reading the first's output, through the GEMM path:
/// the attention's output projection, wo_a (grouped, BF16 einsum, `first`) then wo_b (FP8 with
/// the official act_quant, `second`, whose x is first's y). wo_b's act_quant is made by the pass
/// that finishes wo_a in place of wo_a's rounding pass: one `fd_lt_operand_kernel` launch reads
/// wo_a's unrounded sums, rounds each to bf16 (wo_a's official output) and writes wo_b's e4m3
/// codes and scales ([`LtOperand::round_in`]). A 4096-token prefill so saves a pass over wo_a's
/// output (T x 8192 f32) each layer: before, the rounding pass read and wrote it and wo_b's operand
/// pass read it again. wo_b's GEMM then runs from that operand (`own` as in [`run_gemm`]), and
/// both projections give exactly the bits of [`run_gemm`] run on each in turn. `x_bf16`: first's
/// x as BF16, which its groups' GEMMs read where cuBLASLt takes the copy ([`run_grouped_gemm`]).
///
/// Afterwards first's y holds, for its first `m` tokens (the multiple of [`M_GRANULE`] the GEMMs
/// take), the unrounded sums, not wo_a's official values: a caller whose first y has another
/// reader must not chain. Its last `t - m` tokens run the gemv as in [`run_gemm`] (rounded), and
/// so do second's, from them.
///
/// Returns false, having written neither y, where the chain does not take the pair: first not
/// grouped or not rounded, second not FP8 with act_quant, second's x not first's y, either below
/// its crossover ([`gemm_pays`]), no planned algorithm for the tokens, a workspace too small, or
/// cuBLASLt declining first's exact m (as [`run_gemm`] declines it). The caller then runs each as
/// before. Where cuBLASLt declines second's exact m after first has
/// run, first's sums are rounded and the gemv runs second: true either way from there.
#[allow(clippy::too_many_arguments)]
pub fn run_gemm_chain(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    own: Option<&FastFp8Gemm>,
    ctx: &Context,
    first: &DenseOp,
    x_bf16: Option<DevicePtr>,
    second: &DenseOp,
    ws: &GemmWorkspace,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<bool> {
    let Some((shape, m)) = chain_plan(gemm, first, second, ws) else {
        return Ok(false);
    };
    if !grouped_gemm(dense, gemm, ctx, first, x_bf16, false, ws, gemv_ws, stream)? {
        return Ok(false);
    }
    let Some(operand) = make_operand(dense, ctx, second, &shape, m, true, ws, stream)? else {
        // (chain_plan checked the workspace.)
        return Err(Error::new(
            Status::Internal,
            "run_gemm_chain: no room for the operand chain_plan found room for".to_string(),
        ));
    };
    if !gemm_from_operand(
        dense,
        gemm,
        own,
        ctx,
        second,
        (shape, m),
        operand,
        gemv_ws,
        stream,
    )? {
        dense.round_bf16(ctx, first.y, first.ldy, m, shape.k, stream)?;
        dense.run(ctx, second, gemv_ws, stream)?;
    }
    Ok(true)
}

/// The tokens from `m` on of `op` through the gemv (fewer than [`M_GRANULE`]).
fn run_tail(
    dense: &FastDense,
    ctx: &Context,
    op: &DenseOp,
    m: usize,
    gemv_ws: &DenseWorkspace,
    stream: BorrowedStream,
) -> Result<()> {
    if op.t <= m {
        return Ok(());
    }
    let tail = DenseOp {
        x: op.x.slice(m * op.ldx * 4, op.x.bytes() - m * op.ldx * 4)?,
        y: op.y.slice(m * op.ldy * 4, op.y.bytes() - m * op.ldy * 4)?,
        t: op.t - m,
        ..*op
    };
    dense.run(ctx, &tail, gemv_ws, stream)
}

/// The first `m` tokens of a grouped projection (wo_a), a group at a time: group g's FP8 rows
/// dequantized to BF16 into `ws.weight`, its BF16 operand (columns g·K ..: of `x_bf16` where
/// given, else made into `ws.codes`), and a BF16 GEMM into y's columns g·n ..; then, with
/// `round_out`, y's BF16 rounding (without, y keeps the unrounded f32 sums: [`run_gemm_chain`]
/// rounds them as it quantizes them). Each step reuses the workspace after the stream has
/// finished the previous group's GEMM with it. Returns false, having written nothing to y, where
/// the workspace is too small or cuBLASLt declines this m (or, for `x_bf16`, its row stride).
#[allow(clippy::too_many_arguments)]
fn run_grouped(
    dense: &FastDense,
    gemm: &BlockScaledGemm,
    ctx: &Context,
    op: &DenseOp,
    shape: GemmShape,
    m: usize,
    x_bf16: Option<DevicePtr>,
    round_out: bool,
    ws: &GemmWorkspace,
    stream: BorrowedStream,
) -> Result<bool> {
    let (n, k) = (shape.n, shape.k);
    let codes_bytes = if x_bf16.is_some() { 0 } else { m * k * 2 };
    let weight_bytes = n * k * 2;
    if ws.codes.bytes() < codes_bytes || ws.weight.bytes() < weight_bytes {
        return Ok(false);
    }
    let weight = ws.weight.slice(0, weight_bytes)?;
    for g in 0..op.groups {
        dense.dequant_bf16(ctx, &op.w, g * n, n, weight, stream)?;
        let (a, lda) = match x_bf16 {
            Some(x) => (x.slice(g * k * 2, x.bytes() - g * k * 2)?, op.ldx),
            None => {
                let codes = ws.codes.slice(0, codes_bytes)?;
                dense.lt_operand(
                    ctx,
                    &LtOperand {
                        x: op.x.slice(g * k * 4, op.x.bytes() - g * k * 4)?,
                        ldx: op.ldx,
                        t: m,
                        k,
                        mode: ActMode::Bf16,
                        round_in: false,
                        codes,
                        scale: ws.scale,
                    },
                    stream,
                )?;
                (codes, k)
            }
        };
        let call = GemmCall {
            shape,
            m,
            w: weight,
            wscale: None,
            a,
            lda,
            ascale: None,
            y: op.y.slice(g * n * 4, op.y.bytes() - g * n * 4)?,
            ldy: op.ldy,
        };
        // The same shape and m for every group: only the first can be declined.
        if !gemm.run(ctx, &call, stream)? {
            return Ok(false);
        }
    }
    if round_out {
        dense.round_bf16(ctx, op.y, op.ldy, m, op.groups * n, stream)?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_crossover_follow_the_measurement() {
        let fp8 = |n, k| gemm_shape(StorageFormat::Fp8, [128, 128], n, k, 1, ActMode::Quant);
        let bf16 = |n, k| gemm_shape(StorageFormat::Bf16, [0, 0], n, k, 1, ActMode::Bf16);
        // Flash: wq_a and wkv switch at 128 tokens, the other projections at 32.
        for (s, at) in [
            (fp8(1024, 4096), 128),
            (fp8(512, 4096), 128),
            (fp8(32768, 1024), 32),
            (fp8(4096, 8192), 32),
            (fp8(8192, 1024), 32),
            (bf16(1024, 4096), 32),
            (bf16(64, 4096), 32),
            (bf16(129280, 4096), 32),
        ] {
            let s = s.expect("a GEMM shape");
            assert!(
                !gemm_pays(&s, 1, at - 1) && gemm_pays(&s, 1, at),
                "{s:?} at {at}"
            );
        }
        // wo_a's grouped einsum: its groups' BF16 GEMM, from GROUPED_MIN_TOKENS; its scratch
        // holds one group's BF16 weight.
        let wo_a = gemm_shape(StorageFormat::Fp8, [128, 128], 8192, 4096, 8, ActMode::F16);
        assert_eq!(wo_a, bf16(1024, 4096));
        let at = GROUPED_MIN_TOKENS;
        assert!(!gemm_pays(&wo_a.unwrap(), 8, at - 1) && gemm_pays(&wo_a.unwrap(), 8, at));
        assert_eq!(
            gemm_weight_bytes(&[(1024, 4096, 8), (32768, 1024, 1)]),
            1024 * 4096 * 2
        );
        assert_eq!(gemm_weight_bytes(&[(32768, 1024, 1)]), 0);
        // Declined: grouped with act_quant or parts of 128-row blocks, FP8 without act_quant,
        // other FP8 blocks, FP4.
        assert!(
            gemm_shape(
                StorageFormat::Fp8,
                [128, 128],
                8192,
                4096,
                8,
                ActMode::Quant
            )
            .is_none()
        );
        assert!(gemm_shape(StorageFormat::Fp8, [128, 128], 1536, 4096, 8, ActMode::F16).is_none());
        assert!(gemm_shape(StorageFormat::Fp8, [128, 128], 1024, 4096, 1, ActMode::F16).is_none());
        assert!(gemm_shape(StorageFormat::Fp8, [1, 128], 1024, 4096, 1, ActMode::Quant).is_none());
        assert!(gemm_shape(StorageFormat::Fp4, [1, 32], 1024, 4096, 1, ActMode::Quant).is_none());
        // The operand holds the widest K of either kind at the most tokens.
        let shapes = [fp8(4096, 8192).unwrap(), bf16(1024, 4096).unwrap()];
        assert_eq!(
            gemm_workspace_sizes(&shapes, 100, &[]),
            [100 * 8192, 100 * 64]
        );
        // A norm's K read by both kinds holds both operands side by side.
        let u = [fp8(1024, 4096).unwrap(), bf16(64, 4096).unwrap()];
        assert_eq!(
            gemm_workspace_sizes(&u, 100, &[4096]),
            [100 * 3 * 4096, 100 * 32]
        );
    }
}
