//! The fast set's dense projections (kernels/fast_dense.cu) against the reference kernels on the
//! device (kernels/linear.cu: `act_quant_kernel` + `linear_kernel`, f64 sums), at Flash shapes
//! and odd ones, on fresh random weights and BF16-valued activations (seed printed;
//! `DSV4_TEST_SEED=<n>` repeats one), for 1 to 130 tokens, in the three activation modes:
//! FP8 weights with the official act_quant (wq_a, wq_b, wkv, wo_b, indexer wq_b), FP8 weights
//! without it in groups (wo_a's BF16 einsum), BF16 weights (compressor wkv / wgate,
//! weights_proj).
//!
//! The bound, per output, with A = Σ_k |a_k · w_k| (the reference kernels on |x| and |W|):
//! - Every product is exact (e4m3 codes, the f16 act values and BF16 values are exact in
//!   f16 / bf16 MMA operands, and their products in f32). A 128-block is summed by the tensor
//!   core in 8 MMA steps from zero (FP8: k 64-127 first, then k 0-63 onto them); each step is
//!   allowed one f32 ulp of the block's largest partial (truncating adders): ≤ 8 · 2^-23 ·
//!   A_block.
//! - The block sums are scaled by powers of two (exact) and added in f32, K/128 adds, then the
//!   slices' partial sums are added, `slices` adds: each ≤ 2^-24 of a partial ≤ A.
//! - So |fast - f32(exact)| ≤ E = (8 · 2^-23 + (K/128 + slices + 1) · 2^-24) · A, and the
//!   reference is f32(exact). With BF16 outputs both round: |Δ| ≤ E + 2^-8 (|fast| + |ref|)
//!   (one BF16 step apart at most, when a rounding boundary falls between them), and only
//!   outputs whose exact value lies within E of a rounding boundary may differ at all: at most
//!   1% of a case's outputs over its token counts (E is ~2^-17 of A, a BF16 step ~2^-8 of |y|).
//! - The F16 mode's activations carry ≤ amax · 2^-39 each (f16 subnormals; none here).
//!
//! Also: the operands made by `fd_act_kernel` and inside the gemv blocks, and K split across
//! blocks and inside them, give the same bits;
//! act_quant's values bit for bit (the f16 operands times the scales), bit-identical reruns,
//! a token's outputs alike alone and in a batch of 64 (the split depends on the shape only),
//! and nothing written outside the `[t, n]` outputs (strided y keeps its poison).
//!
//! The many-token path (cuBLASLt, and our own FP8 GEMM, kernels/fast_fp8_gemm.cu, every tile
//! shape against an exact host sum and through the GEMM path) has its bound further down.

mod common;

use common::gpu::{Dev, family_gpu, print_kernel_resources};
use common::rng::Rng;
use dsv4::cuda::DevicePtr;
use dsv4::cuda::kernels::fast_dense::{self, ActMode, DenseOp, DenseWorkspace, FastDense, Shape};
use dsv4::cuda::kernels::fast_fp8_gemm::{self, FastFp8Gemm, TileShape};
use dsv4::cuda::kernels::linear::{self, Linear, StorageFormat, WeightDev};
use dsv4::cuda::kernels::norm_rope::{self, NormRope, RmsNorm};
use std::sync::Mutex;

struct Kernels {
    dense: FastDense,
    lin: Linear,
    fp8: FastFp8Gemm,
    /// The reference RMSNorm, which `fd_norm_operands_kernel` must match bit for bit.
    nr: NormRope,
}

/// The device with the families, or None after the skip line. Tests share one device and run
/// one at a time (their timings and memory stay apart).
fn dev() -> Option<Dev<Kernels>> {
    let families: Vec<_> = [&linear::SOURCE, &fast_dense::SOURCE, &fast_fp8_gemm::SOURCE]
        .into_iter()
        .chain(norm_rope::FAMILIES)
        .collect();
    let g = family_gpu(&families)?;
    static PRINTED: std::sync::Once = std::sync::Once::new();
    PRINTED.call_once(|| print_kernel_resources(&g.reg));
    Some(Dev::new(
        g,
        Kernels {
            dense: FastDense::new(&g.reg).unwrap(),
            lin: Linear::new(&g.reg).unwrap(),
            fp8: FastFp8Gemm::new(&g.reg).unwrap(),
            nr: NormRope::new(&g.reg).unwrap(),
        },
    ))
}

static SERIAL: Mutex<()> = Mutex::new(());

/// The device turn; a test that failed holding it does not fail the others.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A weight of `groups * n` rows and `k` columns in host form: FP8 codes with power-of-two
/// 128 x 128 block scales, or BF16 bits.
struct HostWeight {
    format: StorageFormat,
    rows: usize,
    cols: usize,
    /// FP8 codes or BF16 bits as bytes.
    data: Vec<u8>,
    scales: Vec<f32>,
}

impl HostWeight {
    fn random(rng: &mut Rng, format: StorageFormat, rows: usize, cols: usize) -> HostWeight {
        let (data, scales) = match format {
            StorageFormat::Fp8 => {
                let data = (0..rows * cols)
                    .map(|_| {
                        loop {
                            let c = (rng.u64() & 0xff) as u8;
                            if c & 0x7f != 0x7f {
                                break c;
                            }
                        }
                    })
                    .collect();
                let nsc = rows.div_ceil(128) * cols.div_ceil(128);
                let scales = (0..nsc)
                    .map(|_| 2f32.powi(-(4 + rng.below(9) as i32)))
                    .collect();
                (data, scales)
            }
            StorageFormat::Bf16 => {
                let mut data = Vec::with_capacity(rows * cols * 2);
                for _ in 0..rows * cols {
                    let v = half::bf16::from_f32(rng.normal() * 0.05);
                    data.extend_from_slice(&v.to_bits().to_le_bytes());
                }
                (data, vec![])
            }
            f => panic!("no random {f:?} weights here"),
        };
        HostWeight {
            format,
            rows,
            cols,
            data,
            scales,
        }
    }

    /// The same weight with every value's sign cleared (for the bound's Σ|a·w|).
    fn abs(&self) -> HostWeight {
        let data = match self.format {
            StorageFormat::Fp8 => self.data.iter().map(|c| c & 0x7f).collect(),
            _ => self
                .data
                .chunks(2)
                .flat_map(|b| [b[0], b[1] & 0x7f])
                .collect(),
        };
        HostWeight {
            data,
            scales: self.scales.clone(),
            ..*self
        }
    }

    fn upload(&self, d: &Dev<Kernels>) -> (dsv4::cuda::arena::Arena, WeightDev) {
        let (a, p) = d.alloc(&[self.data.len(), self.scales.len() * 4]);
        d.put(p[0], &self.data);
        if !self.scales.is_empty() {
            d.put(p[1], &self.scales);
        }
        let w = WeightDev {
            format: self.format,
            data: p[0].slice(0, self.data.len()).unwrap(),
            scales: (self.format == StorageFormat::Fp8)
                .then(|| p[1].slice(0, self.scales.len() * 4).unwrap()),
            block: [128, 128],
            rows: self.rows,
            cols: self.cols,
        };
        (a, w)
    }
}

/// The dense workspace for `shapes` on its own arena.
fn workspace(d: &Dev<Kernels>, shapes: &[Shape]) -> (dsv4::cuda::arena::Arena, DenseWorkspace) {
    let [act, scale, part, count] = fast_dense::workspace_sizes(shapes);
    let (a, p) = d.alloc(&[act * 2, scale * 4, part * 4, count * 4]);
    (
        a,
        DenseWorkspace {
            act: p[0],
            scale: p[1],
            split_part: p[2],
            split_count: p[3],
        },
    )
}

/// One case: `t` tokens through `groups` groups of `n` rows x `k` columns.
struct Case {
    name: &'static str,
    format: StorageFormat,
    mode: ActMode,
    n: usize,
    k: usize,
    groups: usize,
    round: bool,
}

/// BF16-valued activations `[t, width]`, one in three 128-blocks scaled by 2^±6 so the
/// per-block scales differ.
fn activations(rng: &mut Rng, t: usize, width: usize) -> Vec<f32> {
    let mut x = vec![0f32; t * width];
    for (i, b) in x.chunks_mut(128).enumerate() {
        let f = match i % 3 {
            0 => 1.0,
            1 => 64.0,
            _ => 1.0 / 64.0,
        };
        for v in b {
            *v = half::bf16::from_f32(rng.normal() * f).to_f32();
        }
    }
    x
}

/// Outputs of the reference kernels: act_quant (Quant mode) then the f64 linear per group.
#[allow(clippy::too_many_arguments)]
fn reference(
    d: &Dev<Kernels>,
    c: &Case,
    w: &WeightDev,
    x: DevicePtr,
    t: usize,
    xq: DevicePtr,
    y: DevicePtr,
    round: bool,
) {
    let (n, k, g) = (c.n, c.k, c.groups);
    let (xin, ldx) = if c.mode == ActMode::Quant {
        d.k.lin
            .act_quant(d.ctx(), x, g * k, t, g * k, xq, d.s())
            .unwrap();
        (xq, g * k)
    } else {
        (x, g * k)
    };
    for gi in 0..g {
        let wg = w.rows(gi * n, n).unwrap();
        let xg = xin.slice(gi * k * 4, xin.bytes() - gi * k * 4).unwrap();
        let yg = y.slice(gi * n * 4, y.bytes() - gi * n * 4).unwrap();
        d.k.lin
            .linear(d.ctx(), xg, ldx, t, &wg, n, round, yg, g * n, d.s())
            .unwrap();
    }
}

/// Runs the fast kernels: `y` `[t, ldy]`, the gemv blocks making the activation operands
/// themselves up to `fused_act_max_t` tokens and splitting K inside the block up to
/// `warp_split_max_t`.
#[allow(clippy::too_many_arguments)]
fn fast(
    d: &Dev<Kernels>,
    c: &Case,
    w: &WeightDev,
    x: DevicePtr,
    t: usize,
    ws: &DenseWorkspace,
    y: DevicePtr,
    ldy: usize,
    fused_act_max_t: usize,
    warp_split_max_t: usize,
) {
    let op = DenseOp {
        x,
        ldx: c.groups * c.k,
        t,
        w: *w,
        groups: c.groups,
        mode: c.mode,
        round: c.round,
        y,
        ldy,
        fused_act_max_t,
        warp_split_max_t,
    };
    d.k.dense.run(d.ctx(), &op, ws, d.s()).unwrap();
}

/// Asserts output `at` = (token, column) `g` of a `t`-token run within the bound of the
/// reference `r`: `e_rel · a` (a = Σ|a·w|), plus a BF16 step of either when the case rounds.
/// Returns whether the two are equal.
fn within_bound(
    c: &Case,
    t: usize,
    at: (usize, usize),
    g: f64,
    r: f64,
    a: f64,
    e_rel: f64,
) -> bool {
    let e = e_rel * a;
    let bound = if c.round {
        e + 2f64.powi(-8) * (g.abs() + r.abs())
    } else {
        e
    };
    assert!(
        (g - r).abs() <= bound,
        "{}: T={t}: y[{}, {}] = {g} against the reference {r}: |Δ| {:.3e} above the bound {bound:.3e} (Σ|a·w| = {a:.4e})",
        c.name,
        at.0,
        at.1,
        (g - r).abs()
    );
    g == r
}

/// Compares a `t`-token run's outputs `got` (`[t, ldy]`: `[t, outs]` outputs, then padding that
/// must keep its poison) with the reference `want` and A = Σ|a·w| in `abs` (both `[t, outs]`),
/// each within the bound ([`within_bound`]). Returns how many outputs differ at all and the
/// largest |Δ| / A over the f32 (unrounded) outputs.
#[allow(clippy::too_many_arguments)]
fn compare(
    c: &Case,
    label: &str,
    t: usize,
    (outs, ldy): (usize, usize),
    got: &[f32],
    want: &[f32],
    abs: &[f32],
    e_rel: f64,
) -> (usize, f64) {
    let (mut differ, mut worst) = (0usize, 0f64);
    for ti in 0..t {
        for j in 0..ldy {
            let g = got[ti * ldy + j];
            if j >= outs {
                assert!(
                    g.to_bits() == u32::MAX,
                    "{label}: T={t}: y[{ti}, {j}] past the outputs was written ({g})"
                );
                continue;
            }
            let (r, a, g) = (
                want[ti * outs + j] as f64,
                abs[ti * outs + j] as f64,
                g as f64,
            );
            if !within_bound(c, t, (ti, j), g, r, a, e_rel) {
                differ += 1;
            }
            if a > 0.0 && !c.round {
                worst = worst.max((g - r).abs() / a);
            }
        }
    }
    (differ, worst)
}

/// Checks one case at every `ts` token count against the bound (module doc); returns the
/// largest error seen relative to A.
fn check_case(d: &Dev<Kernels>, rng: &mut Rng, c: &Case, ts: &[usize]) -> f64 {
    let hw = HostWeight::random(rng, c.format, c.groups * c.n, c.k);
    let (_wa, w) = hw.upload(d);
    let (_aa, wabs) = hw.abs().upload(d);
    assert_eq!(
        FastDense::mode_for(&w, c.groups, c.mode == ActMode::Quant),
        Some(c.mode),
        "{}: the mode the fast set would pick",
        c.name
    );
    let shape = Shape {
        n: c.n,
        k: c.k,
        groups: c.groups,
    };
    let (_ws_arena, ws) = workspace(d, &[shape]);
    let slices = fast_dense::slices(c.n, c.k, c.groups).unwrap();
    let (width, outs) = (c.groups * c.k, c.groups * c.n);
    let ldy = outs + 8;
    let tmax = *ts.iter().max().unwrap();
    let (_a, p) = d.alloc(&[
        tmax * width * 4,
        tmax * width * 4,
        tmax * width * 4,
        tmax * ldy * 4,
        tmax * outs * 4,
        tmax * outs * 4,
    ]);
    let (px, pxabs, pxq, py, pr, pabs) = (p[0], p[1], p[2], p[3], p[4], p[5]);
    let mut worst = 0f64;
    let (mut all_differ, mut all_total) = (0usize, 0usize);
    for &t in ts {
        let x = activations(rng, t, width);
        let xabs: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        d.put(px, &x);
        d.put(pxabs, &xabs);
        d.poison(py);
        d.poison(pr);
        // The operands made by fd_act_kernel with K split across blocks, made by fd_act_kernel
        // with K split inside the blocks (where `fast_dense::warp_split` takes the launch, at
        // up to 8 tokens), then made inside the gemv blocks with K split inside them: the same
        // bits.
        fast(d, c, &w, px, t, &ws, py, ldy, 0, 0);
        let first: Vec<f32> = d.get(py, t * ldy);
        d.poison(py);
        fast(d, c, &w, px, t, &ws, py, ldy, 0, 8);
        let in_block: Vec<f32> = d.get(py, t * ldy);
        common::assert_bits(
            &format!(
                "{}: T={t}: K split across blocks vs inside them ({slices} slices)",
                c.name
            ),
            &in_block,
            &first,
        );
        d.poison(py);
        fast(d, c, &w, px, t, &ws, py, ldy, fast_dense::TOKENS, 8);
        reference(d, c, &w, px, t, pxq, pr, c.round);
        reference(d, c, &wabs, pxabs, t, pxq, pabs, false);
        let got: Vec<f32> = d.get(py, t * ldy);
        common::assert_bits(
            &format!(
                "{}: T={t}: operands from fd_act_kernel vs made in the gemv",
                c.name
            ),
            &got,
            &first,
        );
        let want: Vec<f32> = d.get(pr, t * outs);
        let abs: Vec<f32> = d.get(pabs, t * outs);
        let e_rel = 8.0 * 2f64.powi(-23) + ((c.k / 128 + slices + 1) as f64) * 2f64.powi(-24);
        let (differ, w) = compare(c, c.name, t, (outs, ldy), &got, &want, &abs, e_rel);
        worst = worst.max(w);
        let total = t * outs;
        (all_differ, all_total) = (all_differ + differ, all_total + total);
        println!(
            "{}: T={t}: {differ} of {total} outputs differ from the reference",
            c.name
        );
    }
    // The share of flips is a rate over the case's outputs, not over one token count's: at T = 1
    // a projection may have 64, where a single flip would be 1.6%.
    if c.round {
        assert!(
            all_differ * 100 <= all_total,
            "{}: {all_differ} of {all_total} BF16 outputs differ from the reference (at most 1% may)",
            c.name
        );
    }
    println!(
        "{}: largest |Δ| / Σ|a·w| (f32 outputs) {worst:.3e}; bound {:.3e}",
        c.name,
        8.0 * 2f64.powi(-23) + ((c.k / 128 + slices + 1) as f64) * 2f64.powi(-24)
    );
    worst
}

const TOKENS: &[usize] = &[1, 3, 8, 16, 17, 64, 130];

#[test]
fn fp8_projections_with_act_quant_match_the_reference() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("fp8_projections_with_act_quant_match_the_reference");
    for (name, n, k) in [
        ("wq_a", 1024, 4096),
        ("wq_b", 32768, 1024),
        ("wkv", 512, 4096),
        ("wo_b", 4096, 8192),
        ("indexer wq_b", 8192, 1024),
        ("odd: 200 x 384", 200, 384),
        ("odd: 16 x 128", 16, 128),
        // K split inside the blocks up to 4 tokens, the last 64-row tile part past N.
        ("odd: 16040 x 1024", 16040, 1024),
    ] {
        let c = Case {
            name,
            format: StorageFormat::Fp8,
            mode: ActMode::Quant,
            n,
            k,
            groups: 1,
            round: true,
        };
        let ts: &[usize] = if n * k > 8 << 20 {
            &[1, 16, 64]
        } else {
            TOKENS
        };
        check_case(&d, &mut rng, &c, ts);
    }
}

#[test]
fn grouped_fp8_projection_without_act_quant_matches_the_reference() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("grouped_fp8_projection_without_act_quant_matches_the_reference");
    for (name, n, k, groups, round) in [
        ("wo_a (8 groups)", 1024, 4096, 8, true),
        ("3 groups of 128 x 512, f32 out", 128, 512, 3, false),
    ] {
        let c = Case {
            name,
            format: StorageFormat::Fp8,
            mode: ActMode::F16,
            n,
            k,
            groups,
            round,
        };
        check_case(&d, &mut rng, &c, &[1, 9, 64, 70]);
    }
}

#[test]
fn bf16_projections_match_the_reference() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("bf16_projections_match_the_reference");
    for (name, n, k, round) in [
        ("compressor wkv (f32 out)", 1024, 4096, false),
        ("weights_proj", 64, 4096, true),
        ("a head of 16384 rows (f32 out)", 16384, 4096, false),
        ("odd: 100 x 256, f32 out", 100, 256, false),
    ] {
        let c = Case {
            name,
            format: StorageFormat::Bf16,
            mode: ActMode::Bf16,
            n,
            k,
            groups: 1,
            round,
        };
        check_case(&d, &mut rng, &c, TOKENS);
    }
}

#[test]
fn act_quant_operands_are_the_reference_values_bit_for_bit() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("act_quant_operands_are_the_reference_values_bit_for_bit");
    let (t, k, n) = (37, 1024, 64);
    let shape = Shape { n, k, groups: 1 };
    let (_wsa, ws) = workspace(&d, &[shape]);
    let hw = HostWeight::random(&mut rng, StorageFormat::Fp8, n, k);
    let (_wa, w) = hw.upload(&d);
    // Wild magnitudes, zeros and one all-zero block (amax floor 1e-4), a huge value (clamp).
    let mut x: Vec<f32> = rng.values(t * k, true);
    x[5] = 0.0;
    x[3 * k + 7] = 3.0e30;
    for v in &mut x[2 * k + 128..2 * k + 256] {
        *v = 0.0;
    }
    let (_a, p) = d.alloc(&[t * k * 4, t * k * 4, t * n * 4]);
    d.put(p[0], &x);
    let c = Case {
        name: "act",
        format: StorageFormat::Fp8,
        mode: ActMode::Quant,
        n,
        k,
        groups: 1,
        round: true,
    };
    // The last chunk of a call leaves its operands in the workspace: one chunk here, made by
    // fd_act_kernel.
    fast(
        &d,
        &c,
        &w,
        p[0],
        t,
        &ws,
        p[2],
        n,
        0,
        fast_dense::WARP_SPLIT_MAX_T,
    );
    d.k.lin
        .act_quant(d.ctx(), p[0], k, t, k, p[1], d.s())
        .unwrap();
    let want: Vec<f32> = d.get(p[1], t * k);
    let ops: Vec<u16> = d.get(ws.act, t * k);
    let scales: Vec<f32> = d.get(ws.scale, t * k / 128);
    for ti in 0..t {
        for kk in 0..k {
            let v =
                half::f16::from_bits(ops[ti * k + kk]).to_f32() * scales[ti * k / 128 + kk / 128];
            let r = want[ti * k + kk];
            assert_eq!(
                v.to_bits(),
                r.to_bits(),
                "x[{ti}, {kk}] = {}: operand x scale {v} against act_quant {r}",
                x[ti * k + kk]
            );
        }
    }
    // cuBLASLt's operand (fd_lt_operand_kernel, several items a warp: 37 x 8 items leave the
    // last warp part of its share) holds the same values: e4m3 bytes [t, k], scales [k/128, t].
    let (_la, lp) = d.alloc(&[t * k, t * k / 128 * 4, t * k * 2]);
    let lt_operand_of = |mode, round_in, codes| {
        d.poison(codes);
        d.poison(lp[1]);
        let op = fast_dense::LtOperand {
            x: p[0],
            ldx: k,
            t,
            k,
            mode,
            round_in,
            codes,
            scale: lp[1],
        };
        d.k.dense.lt_operand(d.ctx(), &op, d.s()).unwrap();
    };
    let lt_operand = |mode, codes| lt_operand_of(mode, false, codes);
    lt_operand(ActMode::Quant, lp[0]);
    let codes: Vec<u8> = d.get(lp[0], t * k);
    let lt_scales: Vec<f32> = d.get(lp[1], t * k / 128);
    for ti in 0..t {
        for kk in 0..k {
            let v = dsv4::weights::dtype::e4m3_to_f32(codes[ti * k + kk])
                * lt_scales[kk / 128 * t + ti];
            let r = want[ti * k + kk];
            assert_eq!(
                v.to_bits(),
                r.to_bits(),
                "x[{ti}, {kk}] = {}: cuBLASLt operand x scale {v} against act_quant {r}",
                x[ti * k + kk]
            );
        }
    }
    // Its BF16 operand: bf16(x), nearest, ties to even.
    lt_operand(ActMode::Bf16, lp[2]);
    let bf: Vec<u16> = d.get(lp[2], t * k);
    for (i, (&b, &v)) in bf.iter().zip(&x).enumerate() {
        assert_eq!(
            b,
            half::bf16::from_f32(v).to_bits(),
            "x[{i}] = {v}: BF16 operand"
        );
    }
    // With round_in (the pass that finishes wo_a and makes wo_b's operand, run_gemm_chain), the
    // operand of unrounded f32 sums is that of their bf16 roundings, bit for bit: x with random
    // low mantissa bits (its zeros kept), through round_in, against its host rounding through the
    // plain operand.
    let unrounded: Vec<f32> = x
        .iter()
        .map(|&v| match v {
            0.0 => v,
            _ => f32::from_bits(v.to_bits() ^ (rng.u64() as u32 & 0xffff)),
        })
        .collect();
    let rounded: Vec<f32> = unrounded
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_f32())
        .collect();
    assert!(rounded.iter().all(|v| v.is_finite()));
    d.put(p[0], &rounded);
    lt_operand(ActMode::Quant, lp[0]);
    let (want_codes, want_scales): (Vec<u8>, Vec<f32>) =
        (d.get(lp[0], t * k), d.get(lp[1], t * k / 128));
    d.put(p[0], &unrounded);
    lt_operand_of(ActMode::Quant, true, lp[0]);
    let (got_codes, got_scales): (Vec<u8>, Vec<f32>) =
        (d.get(lp[0], t * k), d.get(lp[1], t * k / 128));
    assert!(
        got_codes == want_codes,
        "round_in: the codes differ from those of the rounded x"
    );
    common::assert_bits("round_in: scales", &got_scales, &want_scales);
    assert!(
        unrounded
            .iter()
            .zip(&rounded)
            .filter(|(u, r)| u != r)
            .count()
            > t * k / 2,
        "the unrounded x must differ from its rounding"
    );
}

#[test]
fn reruns_are_bit_identical_and_a_token_sums_alike_in_any_batch() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("reruns_are_bit_identical_and_a_token_sums_alike_in_any_batch");
    // wo_b's shape splits K through the workspace at one token and through a cluster at 64
    // (fast_dense.rs split_by_counter), indexer wq_b's inside the blocks at one token
    // (warp_split): a token's sums must still be the same bits.
    for (format, mode, n, k) in [
        (StorageFormat::Fp8, ActMode::Quant, 1024, 4096),
        (StorageFormat::Bf16, ActMode::Bf16, 512, 4096),
        (StorageFormat::Fp8, ActMode::Quant, 4096, 8192),
        (StorageFormat::Fp8, ActMode::Quant, 8192, 1024),
    ] {
        let c = Case {
            name: "batch",
            format,
            mode,
            n,
            k,
            groups: 1,
            round: false,
        };
        let (_wsa, ws) = workspace(&d, &[Shape { n, k, groups: 1 }]);
        let hw = HostWeight::random(&mut rng, format, n, k);
        let (_wa, w) = hw.upload(&d);
        let t = 64;
        let x = activations(&mut rng, t, k);
        let (_a, p) = d.alloc(&[t * k * 4, t * n * 4, t * n * 4, n * 4]);
        d.put(p[0], &x);
        d.poison(p[1]);
        d.poison(p[2]);
        let fused = fast_dense::FUSED_ACT_MAX_T;
        let split = fast_dense::WARP_SPLIT_MAX_T;
        fast(&d, &c, &w, p[0], t, &ws, p[1], n, fused, split);
        fast(&d, &c, &w, p[0], t, &ws, p[2], n, fused, split);
        let (a, b): (Vec<f32>, Vec<f32>) = (d.get(p[1], t * n), d.get(p[2], t * n));
        common::assert_bits("rerun", &b, &a);
        // Alone, K split as the default takes it (inside the blocks for indexer wq_b's shape) and
        // never inside them.
        for (tok, split) in [(0, split), (5, split), (63, split), (5, 0)] {
            let xt = p[0].slice(tok * k * 4, k * 4).unwrap();
            d.poison(p[3]);
            fast(&d, &c, &w, xt, 1, &ws, p[3], n, fused, split);
            let alone: Vec<f32> = d.get(p[3], n);
            common::assert_bits(
                &format!(
                    "{format:?} token {tok} alone (warp split up to {split} tokens) vs in a batch of {t}"
                ),
                &alone,
                &a[tok * n..(tok + 1) * n],
            );
        }
    }
}

// ---- Grouped launches: several projections of one input in one launch ----

/// Runs `members` (projections of one x `[t, k]`) as one grouped launch into `ys` (member i's
/// `[t, ldy_i]`, ldy_i = n_i + 8).
fn fast_group(
    d: &Dev<Kernels>,
    members: &[Case],
    ws: &[WeightDev],
    dws: &DenseWorkspace,
    x: DevicePtr,
    t: usize,
    ys: &[DevicePtr],
) -> dsv4::Result<()> {
    let ops: Vec<DenseOp> = members
        .iter()
        .zip(ws.iter().zip(ys))
        .map(|(c, (w, y))| DenseOp {
            x,
            ldx: c.k,
            t,
            w: *w,
            groups: 1,
            mode: c.mode,
            round: c.round,
            y: *y,
            ldy: c.n + 8,
            fused_act_max_t: fast_dense::GROUP_MAX_T,
            warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
        })
        .collect();
    d.k.dense.run_group(d.ctx(), &ops, dws, d.s())
}

/// Checks one group at every `ts` token count: each member within the bound (module doc, with the
/// group's K split) of the reference kernels, nothing written past its outputs, reruns
/// bit-identical. Returns the largest error seen relative to A over the f32 outputs.
fn check_group(d: &Dev<Kernels>, rng: &mut Rng, name: &str, members: &[Case], ts: &[usize]) -> f64 {
    let k = members[0].k;
    let hws: Vec<HostWeight> = members
        .iter()
        .map(|c| HostWeight::random(rng, c.format, c.n, c.k))
        .collect();
    let up: Vec<_> = hws.iter().map(|h| h.upload(d)).collect();
    let up_abs: Vec<_> = hws.iter().map(|h| h.abs().upload(d)).collect();
    let ws: Vec<WeightDev> = up.iter().map(|(_, w)| *w).collect();
    let tmax = *ts.iter().max().unwrap();
    let mut sizes = vec![tmax * k * 4; 3];
    for c in members {
        sizes.extend([
            tmax * (c.n + 8) * 4,
            tmax * (c.n + 8) * 4,
            tmax * c.n * 4,
            tmax * c.n * 4,
        ]);
    }
    let (_a, p) = d.alloc(&sizes);
    let (px, pxabs, pxq) = (p[0], p[1], p[2]);
    let ys: Vec<DevicePtr> = (0..members.len()).map(|i| p[3 + 4 * i]).collect();
    let reruns: Vec<DevicePtr> = (0..members.len()).map(|i| p[4 + 4 * i]).collect();
    let probe: Vec<DenseOp> = members
        .iter()
        .zip(&ws)
        .map(|(c, w)| DenseOp {
            x: px,
            ldx: k,
            t: 1,
            w: *w,
            groups: 1,
            mode: c.mode,
            round: c.round,
            y: ys[0],
            ldy: c.n,
            fused_act_max_t: 0,
            warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
        })
        .collect();
    assert!(
        FastDense::group_covers(&probe),
        "{name}: the group is covered"
    );
    let slices = fast_dense::group_slices(&probe).unwrap();
    let shapes: Vec<Shape> = members
        .iter()
        .map(|c| Shape {
            n: c.n,
            k,
            groups: 1,
        })
        .collect();
    let (_wsa, dws) = workspace(d, &shapes);
    let e_rel = 8.0 * 2f64.powi(-23) + ((k / 128 + slices + 1) as f64) * 2f64.powi(-24);
    let mut worst = 0f64;
    for &t in ts {
        let x = activations(rng, t, k);
        let xabs: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        d.put(px, &x);
        d.put(pxabs, &xabs);
        for y in ys.iter().chain(&reruns) {
            d.poison(*y);
        }
        // The rerun also checks the K split's counters were put back (fast_dense.rs
        // split_by_counter: the u group at T <= 8): else no block of it would write y.
        fast_group(d, members, &ws, &dws, px, t, &ys).unwrap();
        fast_group(d, members, &ws, &dws, px, t, &reruns).unwrap();
        for (i, c) in members.iter().enumerate() {
            let (pr, pabs) = (p[5 + 4 * i], p[6 + 4 * i]);
            reference(d, c, &ws[i], px, t, pxq, pr, c.round);
            reference(d, c, &up_abs[i].1, pxabs, t, pxq, pabs, false);
            let ldy = c.n + 8;
            let got: Vec<f32> = d.get(ys[i], t * ldy);
            let again: Vec<f32> = d.get(reruns[i], t * ldy);
            common::assert_bits(&format!("{name}: {}: T={t}: rerun", c.name), &again, &got);
            let want: Vec<f32> = d.get(pr, t * c.n);
            let abs: Vec<f32> = d.get(pabs, t * c.n);
            let label = format!("{name}: {}", c.name);
            let (differ, w) = compare(c, &label, t, (c.n, ldy), &got, &want, &abs, e_rel);
            worst = worst.max(w);
            if c.round {
                assert!(
                    differ * 100 <= (t * c.n).max(100),
                    "{name}: {}: T={t}: {differ} of {} BF16 outputs differ from the reference (at most 1% may)",
                    c.name,
                    t * c.n
                );
            }
            println!(
                "{name}: {}: T={t}: {differ} of {} outputs differ from the reference",
                c.name,
                t * c.n
            );
        }
    }
    println!(
        "{name}: {slices} slices; largest |Δ| / Σ|a·w| (f32 outputs) {worst:.3e}; bound {e_rel:.3e}"
    );
    worst
}

fn member(name: &'static str, format: StorageFormat, n: usize, k: usize, round: bool) -> Case {
    Case {
        name,
        format,
        mode: if format == StorageFormat::Fp8 {
            ActMode::Quant
        } else {
            ActMode::Bf16
        },
        n,
        k,
        groups: 1,
        round,
    }
}

#[test]
fn grouped_launches_match_the_reference() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("grouped_launches_match_the_reference");
    let (fp8, bf16) = (StorageFormat::Fp8, StorageFormat::Bf16);
    // A CSA layer's projections of its input u (Flash shapes), then of q_lora, then odd ones.
    let u_group = [
        member("wq_a", fp8, 1024, 4096, true),
        member("wkv", fp8, 512, 4096, true),
        member("compressor.wkv", bf16, 1024, 4096, false),
        member("compressor.wgate", bf16, 1024, 4096, false),
        member("indexer.compressor.wkv", bf16, 256, 4096, false),
        member("indexer.compressor.wgate", bf16, 256, 4096, false),
        member("indexer.weights_proj", bf16, 64, 4096, true),
    ];
    let qr_group = [
        member("wq_b", fp8, 32768, 1024, true),
        member("indexer.wq_b", fp8, 8192, 1024, true),
    ];
    let odd = [
        member("200 x 384 fp8", fp8, 200, 384, false),
        member("16 x 384 bf16", bf16, 16, 384, true),
        member("130 x 384 fp8", fp8, 130, 384, true),
    ];
    let ts = [1, 3, 8, 16];
    let w = check_group(&d, &mut rng, "u group", &u_group, &ts);
    assert!(
        w > 0.0,
        "u group: the f32 outputs were all equal to the f64 reference's"
    );
    check_group(&d, &mut rng, "q_lora group", &qr_group, &[1, 5, 16]);
    check_group(&d, &mut rng, "odd group", &odd, &ts);
}

#[test]
fn grouped_launches_decline_what_they_do_not_cover() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("grouped_launches_decline_what_they_do_not_cover");
    let hw = HostWeight::random(&mut rng, StorageFormat::Fp8, 128, 512);
    let (_wa, w) = hw.upload(&d);
    let hw2 = HostWeight::random(&mut rng, StorageFormat::Fp8, 128, 256);
    let (_wb, w2) = hw2.upload(&d);
    let (_a, p) = d.alloc(&[17 * 512 * 4, 17 * 512 * 4, 17 * 128 * 4]);
    let (_wsa, dws) = workspace(
        &d,
        &[Shape {
            n: 128,
            k: 512,
            groups: 1,
        }],
    );
    let op = DenseOp {
        x: p[0],
        ldx: 512,
        t: 1,
        w,
        groups: 1,
        mode: ActMode::Quant,
        round: true,
        y: p[2],
        ldy: 128,
        fused_act_max_t: 0,
        warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
    };
    assert!(FastDense::group_covers(&[op]));
    let other_x = DenseOp { x: p[1], ..op };
    let other_k = DenseOp {
        w: w2,
        ldx: 512,
        ..op
    };
    let many_tokens = DenseOp {
        t: fast_dense::GROUP_MAX_T + 1,
        ..op
    };
    let wrong_mode = DenseOp {
        mode: ActMode::Bf16,
        ..op
    };
    let grouped = DenseOp { groups: 2, w, ..op };
    let too_many = [op; fast_dense::GROUP_MAX + 1];
    for (what, ops) in [
        ("no member", &[][..]),
        ("another x", &[op, other_x][..]),
        ("another K", &[op, other_k][..]),
        ("17 tokens", &[many_tokens][..]),
        ("BF16 operands for an FP8 weight", &[wrong_mode][..]),
        ("a member in groups", &[grouped][..]),
        ("eight members", &too_many[..]),
    ] {
        assert!(!FastDense::group_covers(ops), "{what}: covered");
        d.poison(p[2]);
        let err = d.k.dense.run_group(d.ctx(), ops, &dws, d.s()).unwrap_err();
        assert_eq!(err.status, dsv4::Status::Internal, "{what}");
        assert!(
            err.message.contains("fd_group_kernel"),
            "{what}: {}",
            err.message
        );
        let y: Vec<f32> = d.get(p[2], 128);
        assert!(
            y.iter().all(|v| v.to_bits() == u32::MAX),
            "{what}: y was written"
        );
    }
    // A member whose y is too small for its outputs: the extents are checked before launching.
    let short_y = DenseOp {
        y: p[2].slice(0, 64 * 4).unwrap(),
        ..op
    };
    let err =
        d.k.dense
            .run_group(d.ctx(), &[op, short_y], &dws, d.s())
            .unwrap_err();
    assert!(err.message.contains("fd_group_kernel"), "{}", err.message);
}

// ---- The many-token path: cuBLASLt GEMMs (src/cuda/kernels/fast_dense_gemm.rs) ----
//
// The bound, per output, with A = Σ_k |a_k · w_k| as above:
// - The products are the same exact ones (e4m3 x e4m3 with the same power-of-two scales, or
//   BF16 x BF16). Hopper's FP8 tensor cores add a k = 32 step's products into the accumulator
//   with fewer bits than f32 (DeepSeek-V3 report §3.3.2: about 14): allowed 2^-10 of the sum of
//   |products| so far per step, as gpu_wgmma_probe bounds one step; 4 steps a 128-block:
//   2^-8 · A_block. The block sums are scaled (exact) and added in f32 (K/128 adds), plus at
//   most 4 more f32 adds for a split of K: (K/128 + 4) · 2^-24 · A.
//   FP8: E = (2^-8 + (K/128 + 4) · 2^-24) · A.
// - BF16: a k = 16 step's exact products added to an f32 accumulator, one f32 rounding each:
//   E = (K/16 + 4) · 2^-23 · A.
// - BF16 outputs: |Δ| ≤ E + 2^-8 (|fast| + |ref|), as above.

use dsv4::cuda::blockscaled_gemm::{self, BlockScaledGemm, GemmKind, GemmShape};
use dsv4::cuda::kernels::fast_dense_gemm::{self, GemmWorkspace};

/// A GEMM planner for `shapes` up to `max_t` tokens with its operand workspace (and room for one
/// group of a grouped weight of `grouped` = (rows per group, k, groups); for a norm's operands
/// at each K of `norm_ks`), on its own arena.
fn gemm_for(
    d: &Dev<Kernels>,
    shapes: &[GemmShape],
    grouped: &[(usize, usize, usize)],
    max_t: usize,
    norm_ks: &[usize],
) -> (dsv4::cuda::arena::Arena, BlockScaledGemm, GemmWorkspace) {
    let [codes, scale] = fast_dense_gemm::gemm_workspace_sizes(shapes, max_t, norm_ks);
    let weight = fast_dense_gemm::gemm_weight_bytes(grouped).max(1);
    let (a, p) = d.alloc(&[codes, scale * 4, blockscaled_gemm::WORKSPACE_BYTES, weight]);
    let g = BlockScaledGemm::new(d.ctx(), shapes, max_t, p[2])
        .expect("cuBLASLt 12.9+ on this CUDA machine (the fast set's prefill projections use it)");
    (
        a,
        g,
        GemmWorkspace {
            codes: p[0],
            scale: p[1],
            weight: p[3],
        },
    )
}

/// Checks one case through the GEMM path at every `ts` (each must be taken by it) against the
/// bound above; returns the largest error relative to A (f32 outputs) and the largest fraction of
/// BF16 outputs that differ. A grouped case (wo_a) runs a BF16 GEMM a group on its dequantized
/// weight: BF16 products (the weights' power-of-two scales keep them exact), the BF16 bound.
/// `own`: the FP8 GEMMs through our kernel ([`FastFp8Gemm`], where it takes them) instead of
/// cuBLASLt; the same bound holds (see `own_fp8_gemm_matches_a_host_sum`).
fn check_gemm_case(
    d: &Dev<Kernels>,
    rng: &mut Rng,
    c: &Case,
    ts: &[usize],
    own: bool,
) -> (f64, f64) {
    let (width, outs) = (c.groups * c.k, c.groups * c.n);
    let hw = HostWeight::random(rng, c.format, outs, c.k);
    let (_wa, w) = hw.upload(d);
    let (_aa, wabs) = hw.abs().upload(d);
    let shape = fast_dense_gemm::gemm_shape(c.format, [128, 128], outs, c.k, c.groups, c.mode)
        .unwrap_or_else(|| panic!("{}: not a GEMM shape", c.name));
    let tmax = *ts.iter().max().unwrap();
    let (_ga, gemm, gws) = gemm_for(d, &[shape], &[(c.n, c.k, c.groups)], tmax, &[]);
    let (_wsa, dws) = workspace(
        d,
        &[Shape {
            n: c.n,
            k: c.k,
            groups: c.groups,
        }],
    );
    let ldy = outs + 8;
    let (_a, p) = d.alloc(&[
        tmax * width * 4,
        tmax * width * 4,
        tmax * width * 4,
        tmax * ldy * 4,
        tmax * outs * 4,
        tmax * outs * 4,
        tmax * ldy * 4,
    ]);
    let (px, pxabs, pxq, py, pr, pabs, py2) = (p[0], p[1], p[2], p[3], p[4], p[5], p[6]);
    let e_rel = match shape.kind {
        GemmKind::Fp8BlockScaled => 2f64.powi(-8) + (c.k / 128 + 4) as f64 * 2f64.powi(-24),
        GemmKind::Bf16 => (c.k / 16 + 4) as f64 * 2f64.powi(-23),
    };
    let (mut worst, mut worst_differ) = (0f64, 0f64);
    let path = if own { "own FP8 GEMM" } else { "GEMM" };
    for &t in ts {
        let x = activations(rng, t, width);
        let xabs: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        d.put(px, &x);
        d.put(pxabs, &xabs);
        let op = |y| DenseOp {
            x: px,
            ldx: width,
            t,
            w,
            groups: c.groups,
            mode: c.mode,
            round: c.round,
            y,
            ldy,
            fused_act_max_t: 0,
            warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
        };
        d.poison(py);
        d.poison(py2);
        let o = own.then_some(&d.k.fp8);
        for y in [py, py2] {
            let ran =
                fast_dense_gemm::run_gemm(&d.k.dense, &gemm, o, d.ctx(), &op(y), &gws, &dws, d.s())
                    .unwrap();
            assert!(ran, "{}: T={t}: the GEMM path declined", c.name);
        }
        reference(d, c, &w, px, t, pxq, pr, c.round);
        reference(d, c, &wabs, pxabs, t, pxq, pabs, false);
        let got: Vec<f32> = d.get(py, t * ldy);
        let again: Vec<f32> = d.get(py2, t * ldy);
        common::assert_bits(&format!("{}: T={t}: rerun", c.name), &again, &got);
        let want: Vec<f32> = d.get(pr, t * outs);
        let abs: Vec<f32> = d.get(pabs, t * outs);
        let label = format!("{} ({path})", c.name);
        let (differ, w) = compare(c, &label, t, (outs, ldy), &got, &want, &abs, e_rel);
        worst = worst.max(w);
        let frac = differ as f64 / (t * outs) as f64;
        worst_differ = worst_differ.max(if c.round { frac } else { 0.0 });
        println!(
            "{label}: T={t}: {differ} of {} outputs differ from the reference",
            t * outs
        );
    }
    println!(
        "{} ({path}): largest |Δ| / Σ|a·w| (f32 outputs) {worst:.3e}; bound {e_rel:.3e}; BF16 outputs differing at most {:.2}%",
        c.name,
        100.0 * worst_differ
    );
    (worst, worst_differ)
}

#[test]
fn gemm_projections_match_the_reference() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("gemm_projections_match_the_reference");
    let cases = [
        ("wq_a", StorageFormat::Fp8, 1024, 4096, true),
        ("wq_b", StorageFormat::Fp8, 32768, 1024, true),
        ("wkv", StorageFormat::Fp8, 512, 4096, true),
        ("wo_b", StorageFormat::Fp8, 4096, 8192, true),
        ("indexer wq_b", StorageFormat::Fp8, 8192, 1024, true),
        (
            "odd FP8: 272 x 512, f32 out",
            StorageFormat::Fp8,
            272,
            512,
            false,
        ),
        (
            "compressor wkv (f32 out)",
            StorageFormat::Bf16,
            1024,
            4096,
            false,
        ),
        ("weights_proj", StorageFormat::Bf16, 64, 4096, true),
        (
            "a head of 16384 rows (f32 out)",
            StorageFormat::Bf16,
            16384,
            4096,
            false,
        ),
        ("odd BF16: 96 x 384", StorageFormat::Bf16, 96, 384, true),
    ];
    let grouped = [
        ("wo_a: 8 groups of 1024 x 4096", 8, 1024, 4096, true),
        ("grouped 3 x 256 x 640, f32 out", 3, 256, 640, false),
    ];
    let cases = cases
        .into_iter()
        .map(|(name, format, n, k, round)| (name, format, 1, n, k, round))
        .chain(
            grouped
                .into_iter()
                .map(|(name, g, n, k, round)| (name, StorageFormat::Fp8, g, n, k, round)),
        );
    for (name, format, groups, n, k, round) in cases {
        let mode = match (format, groups) {
            (StorageFormat::Fp8, 1) => ActMode::Quant,
            (StorageFormat::Fp8, _) => ActMode::F16,
            _ => ActMode::Bf16,
        };
        let c = Case {
            name,
            format,
            mode,
            n,
            k,
            groups,
            round,
        };
        let ts: &[usize] = if groups * n * k > 8 << 20 {
            &[16, 33, 300]
        } else {
            &[16, 17, 64, 129, 1000]
        };
        // FP8 single-group cases also through our kernel (it declines N % 128 != 0: cuBLASLt).
        let own_too = format == StorageFormat::Fp8 && groups == 1;
        for own in [false, true].into_iter().filter(|&own| !own || own_too) {
            let (_, differ) = check_gemm_case(&d, &mut rng, &c, ts, own);
            assert!(
                differ <= 0.25,
                "{name} (own: {own}): {:.1}% of the BF16 outputs differ from the reference",
                100.0 * differ
            );
        }
    }
}

/// A group of projections of one input through the GEMM path (`run_gemm_group`, as the fast set
/// runs the attention sub-block's projections of u from 32 tokens): every member it runs gives
/// the bits `run_gemm` gives that member alone (one operand per K and mode serves them all), a
/// member below its crossover (small FP8 weights, below 128 tokens) is left to the caller
/// untouched, and reruns are bit-identical.
#[test]
fn gemm_groups_share_operands_and_give_each_members_bits() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("gemm_groups_share_operands_and_give_each_members_bits");
    let k = 4096;
    // (format, rows, BF16 output): wq_a and wkv (FP8 under 8 MiB), a larger FP8 weight, the
    // compressor's wkv (BF16, f32 out), weights_proj (BF16, BF16 out).
    let members = [
        (StorageFormat::Fp8, 1024, true),
        (StorageFormat::Bf16, 1024, false),
        (StorageFormat::Fp8, 512, true),
        (StorageFormat::Fp8, 2048, false),
        (StorageFormat::Bf16, 64, true),
    ];
    let shapes: Vec<GemmShape> = members
        .iter()
        .map(|&(f, n, _)| {
            let mode = if f == StorageFormat::Fp8 {
                ActMode::Quant
            } else {
                ActMode::Bf16
            };
            fast_dense_gemm::gemm_shape(f, [128, 128], n, k, 1, mode).unwrap()
        })
        .collect();
    let tmax = 300;
    let (_ga, gemm, gws) = gemm_for(&d, &shapes, &[], tmax, &[]);
    let dense_shapes: Vec<Shape> = members
        .iter()
        .map(|&(_, n, _)| Shape { n, k, groups: 1 })
        .collect();
    let (_wsa, dws) = workspace(&d, &dense_shapes);
    let weights: Vec<_> = members
        .iter()
        .map(|&(f, n, _)| HostWeight::random(&mut rng, f, n, k).upload(&d))
        .collect();
    let sizes: Vec<usize> = std::iter::once(tmax * k * 4)
        .chain(members.iter().flat_map(|&(_, n, _)| [tmax * n * 4; 3]))
        .collect();
    let (_a, p) = d.alloc(&sizes);
    let x = p[0];
    // With cuBLASLt for every member, then with the FP8 members through our kernel.
    for (t, own) in [64, 129, 300]
        .into_iter()
        .flat_map(|t| [(t, None), (t, Some(&d.k.fp8))])
    {
        d.put(x, &activations(&mut rng, t, k));
        let ops: Vec<DenseOp> = members
            .iter()
            .zip(&weights)
            .enumerate()
            .map(|(i, (&(f, n, round), (_, w)))| DenseOp {
                x,
                ldx: k,
                t,
                w: *w,
                groups: 1,
                mode: if f == StorageFormat::Fp8 {
                    ActMode::Quant
                } else {
                    ActMode::Bf16
                },
                round,
                y: p[1 + 3 * i],
                ldy: n,
                fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
                warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
            })
            .collect();
        let mut runs = Vec::new();
        for rerun in 0..2 {
            let ops: Vec<DenseOp> = ops
                .iter()
                .enumerate()
                .map(|(i, op)| DenseOp {
                    y: p[1 + 3 * i + rerun],
                    ..*op
                })
                .collect();
            for op in &ops {
                d.poison(op.y);
            }
            let ran = fast_dense_gemm::run_gemm_group(
                &d.k.dense,
                &gemm,
                own,
                d.ctx(),
                &ops,
                &gws,
                &dws,
                d.s(),
            )
            .unwrap();
            runs.push(ran);
        }
        assert_eq!(runs[0], runs[1], "T={t}: the same members ran");
        for (i, op) in ops.iter().enumerate() {
            let (f, n, _) = members[i];
            let got: Vec<u32> = d.get(op.y, t * n);
            let again: Vec<u32> = d.get(p[1 + 3 * i + 1], t * n);
            let small_fp8 = f == StorageFormat::Fp8 && n * k < fast_dense_gemm::SMALL_FP8_BYTES;
            let expect_ran = !small_fp8 || t >= fast_dense_gemm::SMALL_FP8_MIN_TOKENS;
            assert_eq!(
                runs[0][i], expect_ran,
                "T={t}: member {i} ({f:?} {n} x {k})"
            );
            if !expect_ran {
                assert!(
                    got.iter().all(|&b| b == u32::MAX),
                    "T={t}: member {i} was left to the caller but its y was written"
                );
                continue;
            }
            assert_eq!(got, again, "T={t}: member {i}: rerun");
            let alone = DenseOp {
                y: p[1 + 3 * i + 2],
                ..*op
            };
            d.poison(alone.y);
            assert!(
                fast_dense_gemm::run_gemm(
                    &d.k.dense,
                    &gemm,
                    own,
                    d.ctx(),
                    &alone,
                    &gws,
                    &dws,
                    d.s()
                )
                .unwrap()
            );
            let want: Vec<u32> = d.get(alone.y, t * n);
            assert!(
                got == want,
                "T={t}: member {i} ({f:?} {n} x {k}): the group's output differs from its own call's"
            );
        }
        println!(
            "T={t} (own FP8 GEMM: {}): members run through the shared operands: {:?}",
            own.is_some(),
            runs[0]
        );
    }
}

/// wo_a then wo_b through `run_gemm_chain` (wo_b's act_quant made by the pass that finishes
/// wo_a, from its unrounded sums) give wo_b the bits `run_gemm` gives it after `run_gemm` of wo_a,
/// with cuBLASLt and with our FP8 GEMM for wo_b; wo_a's output is left unrounded only for the
/// tokens the GEMMs took (its rounding is each value's official one), the tail's rows are the
/// gemv's; reruns are bit-identical; below the grouped crossover the chain declines having
/// written nothing.
#[test]
fn gemm_chain_gives_wo_b_the_bits_of_the_two_calls() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("gemm_chain_gives_wo_b_the_bits_of_the_two_calls");
    // (groups, rows a group, k a group, wo_b's outputs): Flash's wo_a and wo_b, and odd ones.
    // wo_b's K (groups x n) must be a multiple of 512 (the FP8 scale grid's leading dimension).
    for (groups, n, k, outs) in [(8, 1024, 4096, 4096), (4, 256, 640, 384)] {
        let (width, mid) = (groups * k, groups * n);
        let first_shape = fast_dense_gemm::gemm_shape(
            StorageFormat::Fp8,
            [128, 128],
            mid,
            k,
            groups,
            ActMode::F16,
        )
        .expect("a grouped GEMM shape");
        let second_shape = fast_dense_gemm::gemm_shape(
            StorageFormat::Fp8,
            [128, 128],
            outs,
            mid,
            1,
            ActMode::Quant,
        )
        .expect("an FP8 GEMM shape");
        let tmax = 300;
        let (_ga, gemm, gws) = gemm_for(
            &d,
            &[first_shape, second_shape],
            &[(n, k, groups)],
            tmax,
            &[],
        );
        let (_wsa, dws) = workspace(
            &d,
            &[
                Shape { n, k, groups },
                Shape {
                    n: outs,
                    k: mid,
                    groups: 1,
                },
            ],
        );
        let (_w1, wo_a) = HostWeight::random(&mut rng, StorageFormat::Fp8, mid, k).upload(&d);
        let (_w2, wo_b) = HostWeight::random(&mut rng, StorageFormat::Fp8, outs, mid).upload(&d);
        let (_a, p) = d.alloc(&[
            tmax * width * 4,
            tmax * mid * 4,
            tmax * mid * 4,
            tmax * outs * 4,
            tmax * outs * 4,
            tmax * outs * 4,
        ]);
        let (x, z_want, z_got, a_want, a_got, a_again) = (p[0], p[1], p[2], p[3], p[4], p[5]);
        for (t, own) in [64, 128, 131, 300]
            .into_iter()
            .flat_map(|t| [(t, None), (t, Some(&d.k.fp8))])
        {
            d.put(x, &activations(&mut rng, t, width));
            let first = |z| DenseOp {
                x,
                ldx: width,
                t,
                w: wo_a,
                groups,
                mode: ActMode::F16,
                round: true,
                y: z,
                ldy: mid,
                fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
                warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
            };
            let second = |z, a| DenseOp {
                x: z,
                ldx: mid,
                t,
                w: wo_b,
                groups: 1,
                mode: ActMode::Quant,
                round: true,
                y: a,
                ldy: outs,
                fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
                warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
            };
            let run = |op: &DenseOp| {
                fast_dense_gemm::run_gemm(&d.k.dense, &gemm, own, d.ctx(), op, &gws, &dws, d.s())
                    .unwrap()
            };
            let chain = |z, a| {
                fast_dense_gemm::run_gemm_chain(
                    &d.k.dense,
                    &gemm,
                    own,
                    d.ctx(),
                    &first(z),
                    None,
                    &second(z, a),
                    &gws,
                    &dws,
                    d.s(),
                )
                .unwrap()
            };
            for ptr in [z_want, z_got, a_want, a_got, a_again] {
                d.poison(ptr);
            }
            let label = format!(
                "{groups} x {n} x {k} then {outs}: T={t} (own: {})",
                own.is_some()
            );
            if t < fast_dense_gemm::GROUPED_MIN_TOKENS {
                assert!(
                    !chain(z_got, a_got),
                    "{label}: below the crossover, chained"
                );
                let z: Vec<u32> = d.get(z_got, t * mid);
                let a: Vec<u32> = d.get(a_got, t * outs);
                assert!(
                    z.iter().chain(&a).all(|&b| b == u32::MAX),
                    "{label}: the declined chain wrote"
                );
                continue;
            }
            assert!(run(&first(z_want)), "{label}: wo_a's GEMM path declined");
            assert!(
                run(&second(z_want, a_want)),
                "{label}: wo_b's GEMM path declined"
            );
            assert!(chain(z_got, a_got), "{label}: the chain declined");
            assert!(
                chain(z_got, a_again),
                "{label}: the chain declined on a rerun"
            );
            let want: Vec<f32> = d.get(a_want, t * outs);
            let got: Vec<f32> = d.get(a_got, t * outs);
            let again: Vec<f32> = d.get(a_again, t * outs);
            common::assert_bits(&format!("{label}: wo_b chained"), &got, &want);
            common::assert_bits(&format!("{label}: wo_b rerun"), &again, &got);
            // wo_a's output: unrounded for the GEMMs' tokens (each rounds to the two calls'
            // value), the gemv's rounded rows for the rest.
            let m = t / fast_dense_gemm::M_GRANULE * fast_dense_gemm::M_GRANULE;
            let z_w: Vec<f32> = d.get(z_want, t * mid);
            let z_g: Vec<f32> = d.get(z_got, t * mid);
            let rounded: Vec<f32> = z_g[..m * mid]
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            common::assert_bits(&format!("{label}: wo_a rounded"), &rounded, &z_w[..m * mid]);
            common::assert_bits(
                &format!("{label}: wo_a tail"),
                &z_g[m * mid..],
                &z_w[m * mid..],
            );
            println!("{label}: wo_b chained after wo_a: the bits of the two calls");
        }
    }
}

/// wo_a's grouped GEMMs reading a BF16 copy of x (`run_grouped_gemm` with `x_bf16`, as the fast
/// set runs them where the inverse RoPE wrote o's copy) give the bits they give from x (their
/// operand passes make the same BF16 values); where the copy is not 16-byte aligned they run
/// from x. `grouped_reads_bf16` asks for the copy from the grouped crossover on.
#[test]
fn grouped_gemms_from_a_bf16_copy_give_the_same_bits() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("grouped_gemms_from_a_bf16_copy_give_the_same_bits");
    // (groups, rows a group, k, extra columns of x's stride)
    for (groups, n, k, pad) in [(8, 1024, 4096, 0), (3, 256, 640, 64)] {
        let width = groups * k;
        let ldx = width + pad;
        let hw = HostWeight::random(&mut rng, StorageFormat::Fp8, groups * n, k);
        let (_wa, w) = hw.upload(&d);
        let shape = fast_dense_gemm::gemm_shape(
            StorageFormat::Fp8,
            [128, 128],
            groups * n,
            k,
            groups,
            ActMode::F16,
        )
        .unwrap();
        let tmax = 300;
        let (_ga, gemm, gws) = gemm_for(&d, &[shape], &[(n, k, groups)], tmax, &[]);
        let (_wsa, dws) = workspace(&d, &[Shape { n, k, groups }]);
        let (_a, p) = d.alloc(&[
            tmax * ldx * 4,
            tmax * ldx * 2 + 16,
            tmax * groups * n * 4,
            tmax * groups * n * 4,
        ]);
        for t in [64, 129, 300] {
            let x = strided_vals(&activations(&mut rng, t, width), t, width, ldx);
            let xb: Vec<u16> = x
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_bits())
                .collect();
            d.put(p[0], &x);
            let op = |y| DenseOp {
                x: p[0],
                ldx,
                t,
                w,
                groups,
                mode: ActMode::F16,
                round: true,
                y,
                ldy: groups * n,
                fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
                warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
            };
            let reads = fast_dense_gemm::grouped_reads_bf16(&gemm, &gws, &op(p[2]));
            assert_eq!(reads, t >= fast_dense_gemm::GROUPED_MIN_TOKENS, "T={t}");
            if !reads {
                continue;
            }
            d.poison(p[2]);
            assert!(
                fast_dense_gemm::run_gemm(
                    &d.k.dense,
                    &gemm,
                    None,
                    d.ctx(),
                    &op(p[2]),
                    &gws,
                    &dws,
                    d.s()
                )
                .unwrap()
            );
            let want: Vec<u32> = d.get(p[2], t * groups * n);
            // The copy at its own address, then 2 bytes off (not 16-byte aligned: from x).
            for off in [0, 2] {
                d.put(p[1].slice(off, xb.len() * 2).unwrap(), &xb);
                d.poison(p[3]);
                let copy = p[1].slice(off, xb.len() * 2).unwrap();
                assert!(
                    fast_dense_gemm::run_grouped_gemm(
                        &d.k.dense,
                        &gemm,
                        d.ctx(),
                        &op(p[3]),
                        Some(copy),
                        &gws,
                        &dws,
                        d.s()
                    )
                    .unwrap()
                );
                let got: Vec<u32> = d.get(p[3], t * groups * n);
                assert!(
                    got == want,
                    "{groups} x {n} x {k}, ldx {ldx}, T={t}, copy offset {off}: the outputs differ from the operand passes'"
                );
            }
        }
    }
}

/// `rows` rows of `width` values at stride `ld` (zeros between).
fn strided_vals(vals: &[f32], rows: usize, width: usize, ld: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * ld];
    for r in 0..rows {
        out[r * ld..r * ld + width].copy_from_slice(&vals[r * width..(r + 1) * width]);
    }
    out
}

#[test]
fn the_gemm_path_declines_what_it_does_not_cover() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("the_gemm_path_declines_what_it_does_not_cover");
    // (Which shapes the GEMM path takes: fast_dense_gemm's unit tests.)
    // A K whose scale grid is not a multiple of 4 is declined.
    assert!(
        fast_dense_gemm::gemm_shape(StorageFormat::Fp8, [128, 128], 256, 384, 1, ActMode::Quant)
            .is_none()
    );
    // A planned shape beyond the planned tokens is declined, and writes nothing.
    let (n, k) = (256, 512);
    let shape =
        fast_dense_gemm::gemm_shape(StorageFormat::Fp8, [128, 128], n, k, 1, ActMode::Quant)
            .unwrap();
    let (_ga, gemm, gws) = gemm_for(&d, &[shape], &[], 64, &[]);
    assert!(gemm.covers(&shape, 64) && !gemm.covers(&shape, 65));
    // Which m the planned algorithms accept (why cuBLASLt gets multiples of M_GRANULE only).
    let fitting: Vec<usize> = (16..=64)
        .filter(|&m| gemm.fits(&shape, m, n).unwrap())
        .collect();
    println!("m in 16..=64 the planned algorithms accept for {n} x {k}: {fitting:?}");
    for m in (16..=64).step_by(fast_dense_gemm::M_GRANULE) {
        assert!(fitting.contains(&m), "m = {m} is refused");
    }
    let (_wsa, dws) = workspace(&d, &[Shape { n, k, groups: 1 }]);
    let hw = HostWeight::random(&mut rng, StorageFormat::Fp8, n, k);
    let (_wa, w) = hw.upload(&d);
    let t = 100;
    let (_a, p) = d.alloc(&[t * k * 4, t * n * 4]);
    d.put(p[0], &activations(&mut rng, t, k));
    d.poison(p[1]);
    let op = DenseOp {
        x: p[0],
        ldx: k,
        t,
        w,
        groups: 1,
        mode: ActMode::Quant,
        round: true,
        y: p[1],
        ldy: n,
        fused_act_max_t: 0,
        warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
    };
    // Beyond the planned tokens, and fewer than M_GRANULE tokens: declined, nothing written.
    for t in [t, fast_dense_gemm::M_GRANULE - 1] {
        let op = DenseOp { t, ..op };
        assert!(
            !fast_dense_gemm::run_gemm(&d.k.dense, &gemm, None, d.ctx(), &op, &gws, &dws, d.s())
                .unwrap()
        );
        let y: Vec<u32> = d.get(p[1], t * n);
        assert!(y.iter().all(|&b| b == u32::MAX), "a declined call wrote y");
    }
}

// ---- Our FP8 GEMM (kernels/fast_fp8_gemm.cu) against an exact host sum ----
//
// The same bound as cuBLASLt's above: each 128-block summed by four chained wgmma k32 steps
// (2^-10 of the running |sum| a step: 2^-8 · A_block), then added to an f32 accumulator times its
// two power-of-two scales by one FFMA (one f32 rounding a block: K/128 · 2^-24 · A), so
// E = (2^-8 + (K/128 + 4) · 2^-24) · A; bf16-rounded outputs: |Δ| ≤ E + 2^-8 (|got| + |exact|).

use dsv4::cuda::blockscaled_gemm::{GemmCall, GemmOut};

/// The value of an e4m3fn code (NaN codes excluded by the callers).
fn e4m3_value(c: u8) -> f64 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((c >> 3) & 0xf) as i32, (c & 7) as f64);
    sign * if e == 0 {
        m * 2f64.powi(-9)
    } else {
        (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

/// `n` random e4m3fn codes, NaN excluded.
fn e4m3_codes(rng: &mut Rng, n: usize) -> Vec<u8> {
    (0..n)
        .map(|_| {
            loop {
                let c = (rng.u64() & 0xff) as u8;
                if c & 0x7f != 0x7f {
                    break c;
                }
            }
        })
        .collect()
}

/// The FP8 block-scaled call of `m` tokens (`n` outputs of `k`) over `p` = [activation codes,
/// weight codes, activation scales, weight scales], into `y` with row stride `ldy`.
fn fp8_call(
    p: &[DevicePtr],
    (m, n, k): (usize, usize, usize),
    y: DevicePtr,
    ldy: usize,
) -> GemmCall {
    GemmCall {
        shape: GemmShape {
            kind: GemmKind::Fp8BlockScaled,
            n,
            k,
            out: GemmOut::F32,
        },
        m,
        w: p[1],
        wscale: Some(p[3]),
        a: p[0],
        lda: k,
        ascale: Some(p[2]),
        y,
        ldy,
    }
}

/// The kernel alone on operands made here (codes and power-of-two scales over a wide range, in
/// cuBLASLt's layouts: `[m, k]` codes with `[k / 128, m]` scales, `[n, k]` codes with
/// `[n / 128, k / 128]` block scales) against the exact sum in f64, with every tile shape that
/// takes the case: partial token tiles, one tile, a long K, and more tiles than SMs (the
/// persistent blocks loop over tiles and the ring wraps across them); outputs past n (a strided
/// y) and rows past m keep their poison, a rerun gives the same bits, and the rounded f32 and
/// the BF16 outputs are half's roundings of the unrounded sums, bit for bit.
#[test]
fn own_fp8_gemm_matches_a_host_sum() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("own_fp8_gemm_matches_a_host_sum");
    let sms = d.ctx().info().multiprocessors as usize;
    for (m, n, k, round) in [
        (4usize, 128usize, 128usize, false),
        (260, 384, 1024, true),
        (132, 256, 4096, false),
        (1040, 3840, 256, true),
        (1000, 512, 1024, false),
    ] {
        let (kb, ldy) = (k / 128, n + 8);
        let a = e4m3_codes(&mut rng, m * k);
        let w = e4m3_codes(&mut rng, n * k);
        let sa: Vec<f32> = (0..kb * m)
            .map(|_| 2f32.powi(-(rng.below(12) as i32)))
            .collect();
        let sw: Vec<f32> = (0..n / 128 * kb)
            .map(|_| 2f32.powi(-(4 + rng.below(9) as i32)))
            .collect();
        // The exact outputs and Σ|a·w| of each, in f64 (every product and partial sum exact).
        let av: Vec<f64> = a.iter().map(|&c| e4m3_value(c)).collect();
        let wv: Vec<f64> = w.iter().map(|&c| e4m3_value(c)).collect();
        let (mut exact, mut abs) = (vec![0f64; m * n], vec![0f64; m * n]);
        for t in 0..m {
            for j in 0..n {
                for b in 0..kb {
                    let (mut s, mut sabs) = (0f64, 0f64);
                    for c in b * 128..(b + 1) * 128 {
                        let prod = av[t * k + c] * wv[j * k + c];
                        s += prod;
                        sabs += prod.abs();
                    }
                    let scale = sa[b * m + t] as f64 * sw[(j / 128) * kb + b] as f64;
                    exact[t * n + j] += s * scale;
                    abs[t * n + j] += sabs * scale;
                }
            }
        }
        let (_arena, p) = d.alloc(&[
            a.len(),
            w.len(),
            sa.len() * 4,
            sw.len() * 4,
            (m + 4) * ldy * 4,
            (m + 4) * ldy * 4,
        ]);
        d.put(p[0], &a);
        d.put(p[1], &w);
        d.put(p[2], &sa);
        d.put(p[3], &sw);
        let call = |y: DevicePtr| fp8_call(&p, (m, n, k), y, ldy);
        let e_rel = 2f64.powi(-8) + (kb + 4) as f64 * 2f64.powi(-24);
        for tile in TileShape::ALL {
            let label = format!("{m} x {n} x {k} ({tile:?})");
            if !n.is_multiple_of(tile.outputs()) {
                assert!(!FastFp8Gemm::takes(&call(p[4]), tile), "{label}: taken");
                continue;
            }
            assert!(FastFp8Gemm::takes(&call(p[4]), tile), "{label}: declined");
            for y in [p[4], p[5]] {
                d.poison(y);
                d.k.fp8.run(d.ctx(), &call(y), tile, round, d.s()).unwrap();
            }
            let got: Vec<f32> = d.get(p[4], (m + 4) * ldy);
            let again: Vec<f32> = d.get(p[5], (m + 4) * ldy);
            common::assert_bits(&format!("{label}: rerun"), &again, &got);
            if round {
                // The epilogue's rounding is round_bf16 (half's from_f32) of the sums it would
                // have stored unrounded, bit for bit.
                d.k.fp8
                    .run(d.ctx(), &call(p[5]), tile, false, d.s())
                    .unwrap();
                let raw: Vec<f32> = d.get(p[5], (m + 4) * ldy);
                let rounded: Vec<f32> = raw
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_f32())
                    .collect();
                let outputs = |v: &[f32]| -> Vec<f32> {
                    (0..m)
                        .flat_map(|t| v[t * ldy..t * ldy + n].to_vec())
                        .collect()
                };
                common::assert_bits(
                    &format!("{label}: rounded in the epilogue"),
                    &outputs(&got),
                    &outputs(&rounded),
                );
                // A BF16 output holds the same roundings' bits, ldy elements a row.
                let bf16_call = GemmCall {
                    shape: GemmShape {
                        out: GemmOut::Bf16,
                        ..call(p[5]).shape
                    },
                    ..call(p[5])
                };
                d.poison(p[5]);
                d.k.fp8
                    .run(d.ctx(), &bf16_call, tile, false, d.s())
                    .unwrap();
                let bf16: Vec<u16> = d.get(p[5], (m + 4) * ldy);
                for t in 0..m + 4 {
                    for j in 0..ldy {
                        let (b, at) = (bf16[t * ldy + j], format!("{label}: BF16 y[{t}, {j}]"));
                        if t >= m || j >= n {
                            assert_eq!(b, u16::MAX, "{at} outside the outputs was written");
                        } else {
                            assert_eq!(b, half::bf16::from_f32(raw[t * ldy + j]).to_bits(), "{at}");
                        }
                    }
                }
            }
            let mut worst = 0f64;
            for t in 0..m + 4 {
                for j in 0..ldy {
                    let g = got[t * ldy + j];
                    if t >= m || j >= n {
                        assert_eq!(
                            g.to_bits(),
                            u32::MAX,
                            "{label}: y[{t}, {j}] outside the outputs was written"
                        );
                        continue;
                    }
                    let (x, sum_abs) = (exact[t * n + j], abs[t * n + j]);
                    let e = e_rel * sum_abs;
                    let allowed = if round {
                        assert_eq!(
                            g.to_bits() & 0xffff,
                            0,
                            "{label}: y[{t}, {j}] = {g} is not a bf16 value"
                        );
                        e + 2f64.powi(-8) * ((g as f64).abs() + x.abs())
                    } else {
                        e
                    };
                    let diff = (g as f64 - x).abs();
                    assert!(
                        diff <= allowed,
                        "{label}: y[{t}, {j}] = {g}, exact {x}, bound {allowed:e} (Σ|a·w| = {sum_abs:e})"
                    );
                    if sum_abs > 0.0 && !round {
                        worst = worst.max(diff / sum_abs);
                    }
                }
            }
            let tiles = m.div_ceil(tile.tokens()) * (n / tile.outputs());
            println!(
                "own FP8 GEMM {label} (round {round}): {tiles} tiles on {sms} SMs, largest |Δ| / Σ|a·w| {worst:.3e}, bound {e_rel:.3e}"
            );
        }
    }
}

/// What the kernel does not take ([`FastFp8Gemm::takes`]) it refuses before launching, naming
/// itself, and writes nothing; the GEMM path then runs cuBLASLt.
#[test]
fn own_fp8_gemm_declines_what_it_does_not_take() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let (m, n, k) = (8, 256, 256);
    let (_arena, p) = d.alloc(&[
        m * k,
        n * k,
        k / 128 * m * 4,
        n / 128 * k / 128 * 4,
        m * n * 4 + 8,
    ]);
    let call = fp8_call(&p, (m, n, k), p[4], n);
    assert!(
        FastFp8Gemm::takes(&call, TileShape::M128N128)
            && FastFp8Gemm::takes(&call, TileShape::M128N256)
    );
    let shape = call.shape;
    for (what, bad) in [
        (
            "N not a multiple of 128",
            GemmCall {
                shape: GemmShape { n: 192, ..shape },
                ..call
            },
        ),
        (
            "K not a multiple of 128",
            GemmCall {
                shape: GemmShape { k: 192, ..shape },
                ..call
            },
        ),
        ("m not a multiple of 4", GemmCall { m: 6, ..call }),
        ("no tokens", GemmCall { m: 0, ..call }),
        ("odd ldy", GemmCall { ldy: n + 1, ..call }),
        (
            "y not 8-byte aligned",
            GemmCall {
                y: p[4].slice(4, m * n * 4).unwrap(),
                ..call
            },
        ),
        (
            "BF16 operands",
            GemmCall {
                shape: GemmShape {
                    kind: GemmKind::Bf16,
                    ..shape
                },
                ..call
            },
        ),
        (
            "no weight scales",
            GemmCall {
                wscale: None,
                ..call
            },
        ),
        (
            "strided activation rows",
            GemmCall {
                lda: k + 16,
                ..call
            },
        ),
    ] {
        assert!(FastFp8Gemm::tile_for(&bad).is_none(), "{what}: taken");
        d.poison(p[4]);
        let err =
            d.k.fp8
                .run(d.ctx(), &bad, TileShape::M128N128, true, d.s())
                .unwrap_err();
        assert!(
            err.message.contains("ffg_gemm_kernel"),
            "{what}: {}",
            err.message
        );
        let y: Vec<u32> = d.get(p[4], m * n);
        assert!(y.iter().all(|&b| b == u32::MAX), "{what}: y was written");
    }
    // 384 outputs: the 128-output tile only.
    let n384 = GemmCall {
        shape: GemmShape { n: 384, ..shape },
        ldy: 384,
        ..call
    };
    assert!(
        FastFp8Gemm::takes(&n384, TileShape::M128N128)
            && !FastFp8Gemm::takes(&n384, TileShape::M128N256)
    );
    assert_eq!(FastFp8Gemm::tile_for(&n384), Some(TileShape::M128N128));
    // A y too small for m rows: refused by the extent checks.
    let short = GemmCall {
        y: p[4].slice(0, (m - 1) * n * 4).unwrap(),
        ..call
    };
    let err =
        d.k.fp8
            .run(d.ctx(), &short, TileShape::M128N128, false, d.s())
            .unwrap_err();
    assert!(err.message.contains("`y`"), "{}", err.message);
}

// ---- A norm that makes its output's GEMM operands (fd_norm_operands_kernel) ----

/// A prefill's norm input: `t` rows of `dim` BF16 values at magnitudes that move from block to
/// block, row 1 all zeros (its rms is 0: every output 0) and row 2 all NaN (NaN outputs: NaN
/// codes, the 1e-4 floor's scale).
fn norm_input(rng: &mut Rng, t: usize, dim: usize) -> Vec<f32> {
    let mut x = activations(rng, t, dim);
    x[dim..2 * dim].fill(0.0);
    x[2 * dim..3 * dim].fill(f32::NAN);
    x
}

/// A norm weight of `dim` values: normal ones, a 128-block of zeros (a block of zero outputs:
/// amax 0) and a block of tiny ones (codes of small scales, near e4m3's subnormals).
fn norm_weight(rng: &mut Rng, dim: usize) -> Vec<f32> {
    let mut w: Vec<f32> = (0..dim).map(|_| 1.0 + 0.25 * rng.normal()).collect();
    w[..128].fill(0.0);
    for v in &mut w[128..256.min(dim)] {
        *v *= 1e-30;
    }
    w
}

/// `fd_norm_operands_kernel` writes the normed rows `NormRope::rmsnorm` writes (on its block: the
/// rows kernel's from 256 rows, rmsnorm_kernel's below; the same bits) and, for the first m rows,
/// the FP8 codes, the scales and the BF16 values `fd_lt_operand_kernel` makes of those rows, byte
/// for byte; the rows past m keep the operand buffers' poison; at Flash's u and q_lora widths and
/// an odd one (384: a 128-block without its pair of the same j), with and without the weight and
/// the BF16 rounding.
#[test]
fn norm_operands_give_the_norms_and_the_operand_passes_bits() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("norm_operands_give_the_norms_and_the_operand_passes_bits");
    let rows = norm_rope::RMSNORM_ROWS_MIN + 44;
    let cover = fast_dense::norm_operands_cover;
    assert!(cover(rows, 4096) && cover(100, 4096), "both blocks");
    assert!(
        !cover(rows, 4224) && !cover(100, 4224),
        "a row not held in registers"
    );
    assert!(!cover(rows, 4096 + 64), "not whole 128-blocks");
    let eps = 1e-6;
    // (width, rows, m, weight, rounding): the rows kernel's block, then rmsnorm_kernel's (fewer rows).
    for (dim, rows, m, weighted, round_out) in [
        (4096, rows, rows, true, true),
        (4096, rows, rows - 4, true, false),
        (1024, rows, rows - 4, true, true),
        (384, rows, rows, false, true),
        (4096, 100, 96, true, true),
        (1024, 37, 36, true, true),
    ] {
        let x0 = norm_input(&mut rng, rows, dim);
        let w = norm_weight(&mut rng, dim);
        // x twice (fused, reference), the weight, the fused kernel's operands, the passes'.
        let (_a, p) = d.alloc(&[
            rows * dim * 4,
            rows * dim * 4,
            dim * 4,
            rows * dim,
            rows * dim / 128 * 4,
            rows * dim * 2,
            rows * dim,
            rows * dim / 128 * 4,
            rows * dim * 2,
        ]);
        d.put(p[0], &x0);
        d.put(p[1], &x0);
        d.put(p[2], &w);
        for &q in &p[3..] {
            d.poison(q);
        }
        let weight = weighted.then_some(p[2]);
        let op = fast_dense::NormOperands {
            norm: RmsNorm {
                x: p[0],
                rows,
                dim,
                ld: dim,
                weight,
                eps,
                round_out,
            },
            m,
            fp8: Some((p[3], p[4])),
            bf16: Some(p[5]),
            gemv: None,
        };
        d.k.dense.norm_operands(d.ctx(), &op, d.s()).unwrap();
        d.k.nr
            .rmsnorm(d.ctx(), p[1], rows, dim, dim, weight, eps, round_out, d.s())
            .unwrap();
        for (mode, codes, scale) in [(ActMode::Quant, p[6], p[7]), (ActMode::Bf16, p[8], p[7])] {
            let lt = fast_dense::LtOperand {
                x: p[1],
                ldx: dim,
                t: m,
                k: dim,
                mode,
                round_in: false,
                codes,
                scale,
            };
            d.k.dense.lt_operand(d.ctx(), &lt, d.s()).unwrap();
        }
        let case = format!("dim {dim}, m {m}, weight {weighted}, round {round_out}");
        let (fused, want): (Vec<u32>, Vec<u32>) =
            (d.get(p[0], rows * dim), d.get(p[1], rows * dim));
        assert!(
            fused == want,
            "{case}: the normed rows differ from rmsnorm's"
        );
        assert!(
            fused[2 * dim..3 * dim]
                .iter()
                .all(|&b| f32::from_bits(b).is_nan()),
            "{case}: the NaN row"
        );
        let codes: Vec<u8> = d.get(p[3], rows * dim);
        let want_codes: Vec<u8> = d.get(p[6], m * dim);
        assert!(
            codes[..m * dim] == want_codes[..],
            "{case}: the e4m3 codes differ"
        );
        assert!(
            codes[m * dim..].iter().all(|&c| c == 0xff),
            "{case}: codes past row m were written"
        );
        let scales: Vec<u32> = d.get(p[4], rows * dim / 128);
        let want_scales: Vec<u32> = d.get(p[7], m * dim / 128);
        assert!(
            scales[..m * dim / 128] == want_scales[..],
            "{case}: the scales differ"
        );
        let bf16: Vec<u16> = d.get(p[5], rows * dim);
        let want_bf16: Vec<u16> = d.get(p[8], m * dim);
        assert!(
            bf16[..m * dim] == want_bf16[..],
            "{case}: the BF16 values differ"
        );
        assert!(
            bf16[m * dim..].iter().all(|&c| c == 0xffff),
            "{case}: BF16 values past row m were written"
        );
        // The cases the operands must cover: zero blocks, NaN codes, small scales.
        let zero_block =
            (0..m).any(|r| codes[r * dim..r * dim + 128].iter().all(|&c| c & 0x7f == 0));
        assert!(zero_block || !weighted, "{case}: no zero block");
        assert!(codes.contains(&0x7f), "{case}: no NaN code");
        println!("{case}: rows, codes, scales and BF16 values as the two passes make them");
    }
}

/// A norm and the group of its output, as the fast set runs them from `fd_norm_operands_kernel`
/// (`norm_group_operands`, `run_gemm_group_from`), give the bits of the norm, then
/// `run_gemm_group`: u's group at Flash's width (FP8 members under and over the small-weight
/// crossover, BF16 members with f32 and BF16 outputs: one FP8 and one BF16 operand side by side in
/// the workspace) and q_lora's (FP8 only), at a token count cuBLASLt takes whole and one that
/// leaves a tail to the gemv; the members left to the caller are the same; the workspace sized by
/// `gemm_workspace_sizes` holds both operands; reruns are bit-identical.
#[test]
fn norm_groups_give_the_bits_of_the_norm_then_the_group() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("norm_groups_give_the_bits_of_the_norm_then_the_group");
    let mode_of = |f| {
        if f == StorageFormat::Fp8 {
            ActMode::Quant
        } else {
            ActMode::Bf16
        }
    };
    // (k, members as (format, rows, BF16 output)).
    type Members = &'static [(StorageFormat, usize, bool)];
    let groups: [(usize, Members); 2] = [
        (
            4096,
            &[
                (StorageFormat::Fp8, 1024, true),
                (StorageFormat::Fp8, 512, true),
                (StorageFormat::Bf16, 256, false),
                (StorageFormat::Bf16, 64, true),
                (StorageFormat::Fp8, 2048, false),
            ],
        ),
        (
            1024,
            &[
                (StorageFormat::Fp8, 4096, false),
                (StorageFormat::Fp8, 2048, false),
            ],
        ),
    ];
    let tmax = norm_rope::RMSNORM_ROWS_MIN + 44;
    for (k, members) in groups {
        let shapes: Vec<GemmShape> = members
            .iter()
            .map(|&(f, n, _)| {
                fast_dense_gemm::gemm_shape(f, [128, 128], n, k, 1, mode_of(f)).unwrap()
            })
            .collect();
        let (_ga, gemm, gws) = gemm_for(&d, &shapes, &[], tmax, &[k]);
        let dense_shapes: Vec<Shape> = members
            .iter()
            .map(|&(_, n, _)| Shape { n, k, groups: 1 })
            .collect();
        let (_wsa, dws) = workspace(&d, &dense_shapes);
        let weights: Vec<_> = members
            .iter()
            .map(|&(f, n, _)| HostWeight::random(&mut rng, f, n, k).upload(&d))
            .collect();
        // x for the fused path and for the two calls, the norm weight, each member's y x 3.
        let sizes: Vec<usize> = [tmax * k * 4, tmax * k * 4, k * 4]
            .into_iter()
            .chain(members.iter().flat_map(|&(_, n, _)| [tmax * n * 4; 3]))
            .collect();
        let (_a, p) = d.alloc(&sizes);
        d.put(p[2], &norm_weight(&mut rng, k));
        // The rows kernel's block (all tokens to cuBLASLt, then a tail of 2 to the gemv), and
        // rmsnorm_kernel's (129: one token to the gemv).
        for t in [tmax, tmax - 2, 129] {
            let x0 = norm_input(&mut rng, t, k);
            let ops_of = |x: DevicePtr, out: usize| -> Vec<DenseOp> {
                members
                    .iter()
                    .zip(&weights)
                    .enumerate()
                    .map(|(i, (&(f, n, round), (_, w)))| DenseOp {
                        x,
                        ldx: k,
                        t,
                        w: *w,
                        groups: 1,
                        mode: mode_of(f),
                        round,
                        y: p[3 + 3 * i + out],
                        ldy: n,
                        fused_act_max_t: fast_dense::FUSED_ACT_MAX_T,
                        warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
                    })
                    .collect()
            };
            // The norm, then the group making its operands (p[1], outputs 2).
            d.put(p[1], &x0);
            let plain = ops_of(p[1], 2);
            for op in &plain {
                d.poison(op.y);
            }
            d.k.nr
                .rmsnorm(d.ctx(), p[1], t, k, k, Some(p[2]), 1e-6, true, d.s())
                .unwrap();
            let want_ran = fast_dense_gemm::run_gemm_group(
                &d.k.dense,
                &gemm,
                None,
                d.ctx(),
                &plain,
                &gws,
                &dws,
                d.s(),
            )
            .unwrap();
            // The norm making them (p[0], outputs 0 then 1).
            let mut runs = Vec::new();
            for rerun in 0..2 {
                d.put(p[0], &x0);
                let fused = ops_of(p[0], rerun);
                for op in &fused {
                    d.poison(op.y);
                }
                let made = fast_dense_gemm::norm_group_operands(&gemm, &gws, &fused, p[0], k, k)
                    .unwrap_or_else(|| panic!("k {k}, T={t}: the norm's operands are not planned"));
                assert_eq!(made.m, t / 4 * 4, "k {k}, T={t}: cuBLASLt's tokens");
                assert!(made.fp8.is_some(), "k {k}: an FP8 operand");
                assert_eq!(made.bf16.is_some(), k == 4096, "k {k}: a BF16 operand");
                d.k.dense
                    .norm_operands(
                        d.ctx(),
                        &fast_dense::NormOperands {
                            norm: RmsNorm {
                                x: p[0],
                                rows: t,
                                dim: k,
                                ld: k,
                                weight: Some(p[2]),
                                eps: 1e-6,
                                round_out: true,
                            },
                            m: made.m,
                            fp8: made.fp8,
                            bf16: made.bf16,
                            gemv: None,
                        },
                        d.s(),
                    )
                    .unwrap();
                runs.push(
                    fast_dense_gemm::run_gemm_group_from(
                        &d.k.dense,
                        &gemm,
                        None,
                        d.ctx(),
                        &fused,
                        &made,
                        &gws,
                        &dws,
                        d.s(),
                    )
                    .unwrap(),
                );
            }
            let case = format!("k {k}, T={t}");
            assert_eq!(
                runs[0], want_ran,
                "{case}: the same members take the GEMM path"
            );
            assert_eq!(runs[0], runs[1], "{case}: rerun");
            let (xf, xp): (Vec<u32>, Vec<u32>) = (d.get(p[0], t * k), d.get(p[1], t * k));
            assert!(xf == xp, "{case}: the normed x");
            for (i, &(f, n, _)) in members.iter().enumerate() {
                let ys: Vec<Vec<u32>> = (0..3).map(|o| d.get(p[3 + 3 * i + o], t * n)).collect();
                assert!(
                    ys[0] == ys[2],
                    "{case}: member {i} ({f:?} {n} x {k}) differs from the group's"
                );
                assert!(ys[0] == ys[1], "{case}: member {i}: rerun");
                if !runs[0][i] {
                    assert!(
                        ys[0].iter().all(|&b| b == u32::MAX),
                        "{case}: member {i} was written"
                    );
                }
            }
            println!(
                "{case}: the members through the norm's operands: {:?}",
                runs[0]
            );
        }
    }
}

/// At a decode step's few rows (`rmsnorm_kernel`'s block), `fd_norm_operands_row_kernel` writes the
/// normed rows `NormRope::rmsnorm` writes and the gemv operand `fd_act_kernel` makes of them (the
/// f16 of each act_quant code and the scales, byte for byte); a gemv from it (`run_from_act`: no
/// operand launch, none made in the blocks) gives the bits of the gemv that makes its own, with K
/// split across blocks and inside them; at q_lora's width (1024, a 256-thread block), Flash's
/// hidden size (4096, 1024 threads) and an odd one (384), with zero and NaN rows.
#[test]
fn norm_operands_give_the_gemvs_operands_at_few_rows() {
    let Some(d) = dev() else { return };
    let _s = serial();
    let mut rng = Rng::from_env("norm_operands_give_the_gemvs_operands_at_few_rows");
    let eps = 1e-6;
    // (width, rows, weight rows): the weight's rows choose the gemv's K split (wq_b-like tiles
    // for 1024, the indexer wq_b's in-block split at 4 tokens or fewer).
    for (dim, rows, n) in [
        (1024, 1, 8192),
        (1024, 4, 8192),
        (1024, 8, 32768),
        (4096, 3, 1024),
        (4096, 64, 512),
        (384, 5, 256),
    ] {
        assert!(fast_dense::norm_operands_cover(rows, dim), "{dim} x {rows}");
        let x0 = if rows >= 3 {
            norm_input(&mut rng, rows, dim)
        } else {
            activations(&mut rng, rows, dim)
        };
        let w = norm_weight(&mut rng, dim);
        let hw = HostWeight::random(&mut rng, StorageFormat::Fp8, n, dim);
        let (_wa, wd) = hw.upload(&d);
        let shape = [Shape {
            n,
            k: dim,
            groups: 1,
        }];
        let (_wsa, ws_a) = workspace(&d, &shape);
        let (_wsb, ws_b) = workspace(&d, &shape);
        // x twice (the norm then the gemv making its operands; the norm making them), the norm's
        // weight, y twice.
        let (_a, p) = d.alloc(&[
            rows * dim * 4,
            rows * dim * 4,
            dim * 4,
            rows * n * 4,
            rows * n * 4,
        ]);
        d.put(p[0], &x0);
        d.put(p[1], &x0);
        d.put(p[2], &w);
        d.poison(p[3]);
        d.poison(p[4]);
        let op = |x, y, fused_act_max_t| DenseOp {
            x,
            ldx: dim,
            t: rows,
            w: wd,
            groups: 1,
            mode: ActMode::Quant,
            round: false,
            y,
            ldy: n,
            fused_act_max_t,
            warp_split_max_t: fast_dense::WARP_SPLIT_MAX_T,
        };
        d.k.nr
            .rmsnorm(d.ctx(), p[0], rows, dim, dim, Some(p[2]), eps, true, d.s())
            .unwrap();
        // fd_act_kernel makes the operands (0 tokens made in the blocks) and leaves them in ws_a.
        d.k.dense
            .run(d.ctx(), &op(p[0], p[3], 0), &ws_a, d.s())
            .unwrap();
        let made = fast_dense::NormOperands {
            norm: RmsNorm {
                x: p[1],
                rows,
                dim,
                ld: dim,
                weight: Some(p[2]),
                eps,
                round_out: true,
            },
            m: rows,
            fp8: None,
            bf16: None,
            gemv: Some((ws_b.act, ws_b.scale)),
        };
        d.k.dense.norm_operands(d.ctx(), &made, d.s()).unwrap();
        let act_b: Vec<u16> = d.get(ws_b.act, rows * dim);
        d.k.dense
            .run_from_act(
                d.ctx(),
                &op(p[1], p[4], fast_dense::FUSED_ACT_MAX_T),
                &ws_b,
                d.s(),
            )
            .unwrap();
        let case = format!("{dim} x {rows} rows, {n} weight rows");
        let (xa, xb): (Vec<u32>, Vec<u32>) = (d.get(p[0], rows * dim), d.get(p[1], rows * dim));
        assert!(xa == xb, "{case}: the normed rows differ from rmsnorm's");
        let act_a: Vec<u16> = d.get(ws_a.act, rows * dim);
        assert!(
            act_a == act_b,
            "{case}: the f16 operands differ from fd_act_kernel's"
        );
        let (sa, sb): (Vec<u32>, Vec<u32>) = (
            d.get(ws_a.scale, rows * dim / 128),
            d.get(ws_b.scale, rows * dim / 128),
        );
        assert!(sa == sb, "{case}: the scales differ from fd_act_kernel's");
        let (ya, yb): (Vec<u32>, Vec<u32>) = (d.get(p[3], rows * n), d.get(p[4], rows * n));
        assert!(ya == yb, "{case}: the gemv from the made operands differs");
        assert!(
            ya.iter().any(|&b| b != u32::MAX),
            "{case}: y was not written"
        );
        println!("{case}: rows, operands and the gemv's outputs as the unfused calls make them");
    }
}
