//! `dsv4 bench dense --projection output_chain` (and the default run, after the groups): the
//! attention's output projection of many tokens, wo_a (8 groups of 1024 x 4096, BF16 einsum of
//! FP8 weights) then wo_b (4096 x 8192, FP8 with the official act_quant) on wo_a's output, as
//! the GEMM path runs the pair. One JSON line per (T, path):
//! - `chained`: `fast_dense_gemm::run_gemm_chain`, wo_b's act_quant made by the pass that
//!   finishes wo_a from its unrounded sums (no rounding pass over wo_a's output, no operand pass
//!   of wo_b's own);
//! - `two_calls`: `run_gemm` on wo_a then on wo_b, each with its own passes (the fast set today);
//! - each also with wo_b's GEMM through our FP8 kernel (`_own_fp8` suffix).
//!
//! The time is the pair's, the TFLOP/s both GEMMs' FLOPs over it. Timing as bench_dense.rs's
//! (graph replay over copies of both weights, together at least 256 MB).

use std::io::Write;

use crate::bench_dense::{FLASH, Projection, block_scales, weight_data};
use crate::bench_util::{Rng, alloc, e, time_graph};
use dsv4::cuda::DevicePtr;
use dsv4::cuda::arena;
use dsv4::cuda::blockscaled_gemm::BlockScaledGemm;
use dsv4::cuda::context::Context;
use dsv4::cuda::kernels::fast_dense::{self, DenseOp, DenseWorkspace, FastDense};
use dsv4::cuda::kernels::fast_dense_gemm::{self, GemmWorkspace};
use dsv4::cuda::kernels::fast_fp8_gemm::FastFp8Gemm;
use dsv4::cuda::kernels::linear::WeightDev;
use dsv4::cuda::stream::BorrowedStream;

/// The projection of [`FLASH`] named `name`.
fn flash(name: &str) -> Result<&'static Projection, String> {
    FLASH
        .iter()
        .find(|p| p.name == name)
        .ok_or_else(|| format!("bench dense: no {name} among the Flash projections"))
}

/// Times the pair at every T of `tokens` the chain takes (see the module doc).
#[allow(clippy::too_many_arguments)]
pub fn run(
    ctx: &Context,
    dense: &FastDense,
    ws: &DenseWorkspace,
    (gemm, gws): (&BlockScaledGemm, &GemmWorkspace),
    own: &FastFp8Gemm,
    s: BorrowedStream,
    rng: &mut Rng,
    tokens: &[usize],
) -> Result<(), String> {
    let (pa, pb) = (flash("wo_a")?, flash("wo_b")?);
    let (width, mid, outs) = (pa.groups * pa.k, pa.rows(), pb.n);
    let tokens: Vec<usize> = tokens
        .iter()
        .copied()
        .filter(|&t| t >= fast_dense_gemm::GROUPED_MIN_TOKENS)
        .collect();
    let Some(tmax) = tokens.iter().copied().max() else {
        return Ok(());
    };
    let (a_codes, a_scales) = (weight_data(rng, pa), block_scales(rng, pa));
    let (b_codes, b_scales) = (weight_data(rng, pb), block_scales(rng, pb));
    let wbytes = pa.weight_bytes() + pb.weight_bytes();
    let copies = (256usize << 20).div_ceil(wbytes).clamp(2, 64);
    // Per copy wo_a's and wo_b's codes; then their scales, x, wo_a's output z, wo_b's output.
    let mut sizes = Vec::new();
    for _ in 0..copies {
        sizes.extend([a_codes.len(), b_codes.len()]);
    }
    sizes.extend([
        a_scales.len() * 4,
        b_scales.len() * 4,
        tmax * width * 4,
        tmax * mid * 4,
        tmax * outs * 4,
    ]);
    let (_arena, bufs) = alloc(ctx, "bench_dense_chain", &sizes)?;
    for c in 0..copies {
        arena::copy_to_device_sync(bufs[2 * c], &a_codes, s).map_err(e)?;
        arena::copy_to_device_sync(bufs[2 * c + 1], &b_codes, s).map_err(e)?;
    }
    let rest = 2 * copies;
    let (a_sc, b_sc, x, z, y) = (
        bufs[rest],
        bufs[rest + 1],
        bufs[rest + 2],
        bufs[rest + 3],
        bufs[rest + 4],
    );
    arena::copy_to_device_sync(a_sc, &a_scales, s).map_err(e)?;
    arena::copy_to_device_sync(b_sc, &b_scales, s).map_err(e)?;
    let xs: Vec<f32> = (0..tmax * width)
        .map(|_| half::bf16::from_f32(rng.unit() * 4.0 - 2.0).to_f32())
        .collect();
    arena::copy_to_device_sync(x, &xs, s).map_err(e)?;
    let weight =
        |p: &Projection, codes: DevicePtr, bytes: usize, sc: DevicePtr, nsc: usize| WeightDev {
            format: p.format,
            data: codes.slice(0, bytes).unwrap(),
            scales: Some(sc.slice(0, nsc * 4).unwrap()),
            block: [128, 128],
            rows: p.rows(),
            cols: p.k,
        };
    let ops = |copy: usize, t: usize| {
        let first = DenseOp {
            x,
            ldx: width,
            t,
            w: weight(pa, bufs[2 * copy], a_codes.len(), a_sc, a_scales.len()),
            groups: pa.groups,
            mode: pa.mode,
            round: pa.round,
            y: z,
            ldy: mid,
            fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
            warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
        };
        let second = DenseOp {
            x: z,
            ldx: mid,
            w: weight(pb, bufs[2 * copy + 1], b_codes.len(), b_sc, b_scales.len()),
            groups: pb.groups,
            mode: pb.mode,
            round: pb.round,
            y,
            ldy: outs,
            ..first
        };
        (first, second)
    };
    // wo_a's BF16 FLOPs and wo_b's FP8 ones (bench/dense_baseline.py puts each on its peak).
    let flops_bf16 = |t: usize| 2.0 * t as f64 * (mid * pa.k) as f64;
    let flops_fp8 = |t: usize| 2.0 * t as f64 * (outs * pb.k) as f64;
    let flops = |t: usize| flops_bf16(t) + flops_fp8(t);
    for &t in &tokens {
        for (chained, o) in [
            (true, None),
            (false, None),
            (true, Some(own)),
            (false, Some(own)),
        ] {
            let declined = |what: &str| {
                dsv4::Error::new(
                    dsv4::Status::Internal,
                    format!("output chain at T={t}: {what} declined"),
                )
            };
            let call = |copy: usize| -> dsv4::Result<()> {
                let (first, second) = ops(copy, t);
                if chained {
                    if !fast_dense_gemm::run_gemm_chain(
                        dense, gemm, o, ctx, &first, None, &second, gws, ws, s,
                    )? {
                        return Err(declined("the chain"));
                    }
                    return Ok(());
                }
                for op in [&first, &second] {
                    if !fast_dense_gemm::run_gemm(dense, gemm, o, ctx, op, gws, ws, s)? {
                        return Err(declined("the GEMM path"));
                    }
                }
                Ok(())
            };
            let replays = 21;
            let timing = time_graph(s, copies, replays, call)?;
            let sec = timing.device_s;
            let path = match (chained, o.is_some()) {
                (true, false) => "chained",
                (false, false) => "two_calls",
                (true, true) => "chained_own_fp8",
                (false, true) => "two_calls_own_fp8",
            };
            println!(
                "{{\"bench\": \"dense_chain\", \"chain\": \"wo_a -> wo_b\", \"T\": {t}, \"path\": \"{path}\", \"time_us\": {:.2}, \"host_time_us\": {:.2}, \"weight_bytes\": {wbytes}, \"flops\": {:.4e}, \"flops_bf16\": {:.4e}, \"flops_fp8\": {:.4e}, \"tflop_per_s\": {:.2}, \"calls_timed\": {}}}",
                sec * 1e6,
                timing.host_s * 1e6,
                flops(t),
                flops_bf16(t),
                flops_fp8(t),
                flops(t) / sec / 1e12,
                replays * copies,
            );
            std::io::stdout().flush().ok();
        }
    }
    Ok(())
}
