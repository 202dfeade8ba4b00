//! GPU op tests of the `norm_rope` kernel family (kernels/norm_rope.cu): every kernel on fresh
//! random inputs, compared BIT FOR BIT with the CPU reference (ops::rms_norm, rope::apply with
//! plain and YaRN inverse frequencies, Prec::kv_nope_sim / index_sim, quant::round_bf16,
//! half's bf16 conversion, plain copies) in both numerics modes. Out-of-place outputs are
//! poisoned with NaN first; in-place kernels must leave bytes outside their rows untouched.
//!
//! Without a CUDA device every device test prints `skipped: no CUDA device` and returns. The
//! NVRTC compile check runs wherever NVRTC is installed (no GPU needed).

mod common;

use common::gpu::{assert_families_compile, family_gpu};
use common::rng::Rng;
use common::{assert_bits, assert_u16};
use dsv4::ModelConfig;
use dsv4::config::AttnKind;
use dsv4::cuda::kernels::norm_rope::{self, NormRope};
use dsv4::model::rope;
use dsv4::reference::ops::{inv_sqrt, rms_norm};
use dsv4::reference::precision::Prec;
use dsv4::weights::quant::{fp8_sim, round_bf16};

// ------------------------------------------------------------------------------ harness

type Dev = common::gpu::Dev<NormRope>;

/// One test's device state on the shared device with this family loaded (the family's
/// kernels, its own stream and buffers), or None after printing the skip line.
fn dev() -> Option<Dev> {
    let g = family_gpu(&norm_rope::FAMILIES)?;
    Some(Dev::new(g, NormRope::new(&g.reg).unwrap()))
}

/// The tiny config's YaRN inverse frequencies (a CSA layer's) on the host, the rope half
/// width, and the table uploaded (its arena, whose first pointer the kernels read).
fn yarn_table(
    d: &Dev,
) -> (
    Vec<f32>,
    usize,
    dsv4::cuda::Arena,
    Vec<dsv4::cuda::DevicePtr>,
) {
    let cfg = ModelConfig::tiny_default();
    let freqs = rope::inv_freq(&cfg, AttnKind::Csa);
    let (arena, fp) = d.alloc(&[freqs.len() * 4]);
    d.put(fp[0], &freqs);
    (freqs, cfg.rope_dim / 2, arena, fp)
}

fn bf16_all(mut v: Vec<f32>) -> Vec<f32> {
    round_bf16(&mut v);
    v
}

/// Rows of random values with a different magnitude per row (2^-12 .. 2^12), bf16-rounded
/// when `official` (the model feeds these kernels BF16 values in that mode).
fn rows_of(rng: &mut Rng, rows: usize, width: usize, official: bool) -> Vec<f32> {
    let mut v = Vec::with_capacity(rows * width);
    for _ in 0..rows {
        let scale = 2f32.powi(rng.below(25) as i32 - 12);
        v.extend(rng.normals(width, scale));
    }
    if official { bf16_all(v) } else { v }
}

/// Sentinel written into padding columns of strided rows: must survive every kernel.
const PAD: f32 = -12345.678;

/// `rows` rows of `width` values at stride `ld`, padding set to PAD.
fn strided(vals: &[f32], rows: usize, width: usize, ld: usize) -> Vec<f32> {
    let mut out = vec![PAD; rows * ld];
    for r in 0..rows {
        out[r * ld..r * ld + width].copy_from_slice(&vals[r * width..(r + 1) * width]);
    }
    out
}

// ------------------------------------------------------------------- NVRTC compile check

#[test]
fn norm_rope_family_compiles_for_sm_90a() {
    assert_families_compile(&norm_rope::FAMILIES);
}

/// The device computes f32(dim^-1/2) as f32(1 / sqrt(dim)) in f64; the reference uses
/// powf(-0.5). They must agree for every power of two (index_sim) — no GPU needed.
#[test]
fn index_sim_scale_formula_matches_inv_sqrt() {
    for k in 0..=20 {
        let n = 1usize << k;
        let dev = (1.0 / (n as f64).sqrt()) as f32;
        assert_eq!(dev.to_bits(), inv_sqrt(n).to_bits(), "n = {n}");
    }
}

// --------------------------------------------------------------------------------- RMSNorm

#[test]
fn rmsnorm_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(1);
    // (rows, dim, ld, with weight): hidden sizes, per-head q norm (no weight), q_lora with a
    // padded stride, the released hidden size (past the registers path: the strided loop), a row
    // whose last threads hold fewer values; then rows enough for rmsnorm_rows_kernel
    // (norm_rope::RMSNORM_ROWS_MIN): Flash's hidden size and q_lora (padded stride), a row
    // that leaves the last values part-filled, and a row too wide for it (rmsnorm_kernel).
    let many = norm_rope::RMSNORM_ROWS_MIN;
    let cases = [
        (37, 256, 256, true),
        (5, 4096, 4096, true),
        (2, 4000, 4000, false),
        (300, 128, 128, false),
        (9, 1536, 1600, true),
        (3, 7168, 7168, true),
        (1, 64, 64, true),
        (many + 7, 4096, 4096, true),
        (many, 1024, 1056, false),
        (many + 1, 4000, 4000, true),
        (many, 7168, 7168, true),
    ];
    for official in [false, true] {
        for &(rows, dim, ld, with_w) in &cases {
            let x = rows_of(&mut rng, rows, dim, official);
            let w: Vec<f32> = (0..dim).map(|_| 1.0 + 0.2 * rng.normal()).collect();
            let eps = 1e-6f32;
            let mut want = x.clone();
            rms_norm(&mut want, dim, with_w.then_some(&w[..]), eps);
            Prec { official }.bf16(&mut want);

            let xs = strided(&x, rows, dim, ld);
            let (_a, p) = d.alloc(&[xs.len() * 4, dim * 4]);
            d.put(p[0], &xs);
            d.put(p[1], &w);
            d.k.rmsnorm(
                d.ctx(),
                p[0],
                rows,
                dim,
                ld,
                with_w.then_some(p[1]),
                eps,
                official,
                d.s(),
            )
            .unwrap();
            let got: Vec<f32> = d.get(p[0], xs.len());
            let want_s = strided(&want, rows, dim, ld);
            assert_bits(
                &format!(
                    "rmsnorm rows {rows} dim {dim} ld {ld} weight {with_w} official {official}"
                ),
                &got,
                &want_s,
            );
        }
    }
}

// ------------------------------------------------------------------------------------ RoPE

#[test]
fn rope_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(2);
    let cfg = ModelConfig::tiny_default();
    assert!(cfg.yarn.is_some(), "the tiny config has YaRN");
    let freq_sets = [
        ("plain", rope::inv_freq(&cfg, AttnKind::Sliding)),
        ("yarn", rope::inv_freq(&cfg, AttnKind::Csa)),
    ];
    // (rows, heads, head_dim, ld): q heads, one kv / entry row per token, a padded stride,
    // the released head size (512 with 64 rope channels), a head that is all rope; then rows
    // enough for rope_rows_kernel (norm_rope::ROPE_ROWS_MIN): the released heads (16-byte
    // rounding), an odd stride (one value at a time).
    let half = cfg.rope_dim / 2;
    let many = norm_rope::ROPE_ROWS_MIN;
    let cases = [
        (13, 4, 128, 512),
        (29, 1, 128, 128),
        (7, 3, 128, 3 * 128 + 17),
        (5, 8, 512, 8 * 512),
        (11, 2, 2 * half, 4 * half),
        (many + 44, 16, 512, 16 * 512),
        (many + 3, 3, 128, 3 * 128 + 17),
    ];
    for (fname, freqs) in &freq_sets {
        let (_f, fp) = d.alloc(&[freqs.len() * 4]);
        d.put(fp[0], freqs);
        // round_in (official, as the engine uses it): inputs that are not bf16, and the result
        // of rounding them first.
        for (official, round_in) in [(false, false), (true, false), (true, true)] {
            for sign in [1.0f32, -1.0] {
                for &(rows, heads, hd, ld) in &cases {
                    let width = heads * hd;
                    let x = rows_of(&mut rng, rows, width, official && !round_in);
                    // Positions: the first few, random up to 2^17, and a few large ones.
                    let pos: Vec<i32> = (0..rows)
                        .map(|r| match r {
                            0..=2 => r as i32,
                            3 => 1_000_000,
                            4 => 65_535,
                            _ => rng.below(1 << 17) as i32,
                        })
                        .collect();
                    let mut want = x.clone();
                    if round_in {
                        round_bf16(&mut want);
                        assert_ne!(want, x, "the round_in case needs inputs that are not bf16");
                    }
                    for (r, row) in want.chunks_exact_mut(width).enumerate() {
                        for head in row.chunks_exact_mut(hd) {
                            rope::apply(head, freqs, pos[r] as usize, sign);
                            Prec { official }.bf16(head);
                        }
                    }
                    let xs = strided(&x, rows, width, ld);
                    let (_a, p) = d.alloc(&[xs.len() * 4, rows * 4]);
                    d.put(p[0], &xs);
                    d.put(p[1], &pos);
                    d.k.rope(
                        d.ctx(),
                        p[0],
                        rows,
                        ld,
                        heads,
                        hd,
                        p[1],
                        fp[0],
                        half,
                        sign,
                        official,
                        round_in,
                        d.s(),
                    )
                    .unwrap();
                    let got: Vec<f32> = d.get(p[0], xs.len());
                    assert_bits(
                        &format!(
                            "rope {fname} rows {rows} heads {heads} head_dim {hd} ld {ld} sign {sign} official {official} round_in {round_in}"
                        ),
                        &got,
                        &strided(&want, rows, width, ld),
                    );
                }
            }
        }
    }
}

/// `rope_with_bf16_copy` (official RoPE, the inverse one as the attention output's): x gets the
/// bits `rope` gives it, and the copy every value's bf16 bits at the same columns of its own
/// stride, its padding untouched: through rope_kernel and rope_rows_kernel, with 8-byte copy
/// stores (copy stride a multiple of 4) and without.
#[test]
fn rope_bf16_copy_is_the_rounded_values() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(12);
    let (_, half, _f, fp) = yarn_table(&d);
    let many = norm_rope::ROPE_ROWS_MIN;
    // (rows, heads, head_dim, ld, copy stride - width)
    let cases = [
        (13, 4, 128, 512, 8),
        (7, 3, 128, 3 * 128 + 17, 2),
        (many + 44, 16, 512, 16 * 512, 8),
        (many + 3, 3, 128, 3 * 128 + 17, 2),
        (many + 1, 4, 2 * half, 4 * 2 * half, 4),
    ];
    for &(rows, heads, hd, ld, extra) in &cases {
        let width = heads * hd;
        let ld_out = width + extra;
        let x = strided(&rows_of(&mut rng, rows, width, true), rows, width, ld);
        let pos: Vec<i32> = (0..rows).map(|_| rng.below(1 << 17) as i32).collect();
        let (_a, p) = d.alloc(&[x.len() * 4, x.len() * 4, rows * 4, rows * ld_out * 2]);
        d.put(p[0], &x);
        d.put(p[1], &x);
        d.put(p[2], &pos);
        d.put(p[3], &vec![0xA5A5u16; rows * ld_out]);
        let what = format!("rows {rows} heads {heads} head_dim {hd} ld {ld} ld_out {ld_out}");
        d.k.rope(
            d.ctx(),
            p[0],
            rows,
            ld,
            heads,
            hd,
            p[2],
            fp[0],
            half,
            -1.0,
            true,
            false,
            d.s(),
        )
        .unwrap();
        d.k.rope_with_bf16_copy(
            d.ctx(),
            p[1],
            rows,
            ld,
            heads,
            hd,
            p[2],
            fp[0],
            half,
            -1.0,
            (p[3], ld_out),
            d.s(),
        )
        .unwrap();
        let want: Vec<f32> = d.get(p[0], x.len());
        let got: Vec<f32> = d.get(p[1], x.len());
        assert_bits(&format!("{what}: x"), &got, &want);
        let mut want_copy = vec![0xA5A5u16; rows * ld_out];
        for r in 0..rows {
            for c in 0..width {
                want_copy[r * ld_out + c] = (want[r * ld + c].to_bits() >> 16) as u16;
                assert_eq!(
                    want[r * ld + c].to_bits() & 0xffff,
                    0,
                    "{what}: official RoPE values are bf16"
                );
            }
        }
        let copy: Vec<u16> = d.get(p[3], rows * ld_out);
        assert_u16(&format!("{what}: the BF16 copy"), &copy, &want_copy);
    }
    // A copy stride narrower than the heads is refused.
    let (_a, p) = d.alloc(&[8 * 512 * 4, 8 * 4, 8 * 512 * 2]);
    let err =
        d.k.rope_with_bf16_copy(
            d.ctx(),
            p[0],
            8,
            512,
            4,
            128,
            p[1],
            fp[0],
            half,
            -1.0,
            (p[2], 511),
            d.s(),
        )
        .unwrap_err();
    assert!(err.message.contains("ld_out"), "{}", err.message);
}

// ----------------------------------------------------------------- head_prep (fused)

/// head_prep_kernel against the CPU reference's three steps (ops::rms_norm, rope::apply,
/// fp8_sim of the nope channels, each followed by the official bf16 rounding): bit for bit, as
/// the three separate kernels are.
#[test]
fn head_prep_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(7);
    let (freqs, half, _f, fp) = yarn_table(&d);
    // (rows, heads, head_dim, weight, sim): Flash's queries (64 heads of 512, unit norm) and
    // window KV (one head with kv_norm, nope FP8-simulated), the tiny model's, a head whose
    // pairs leave the last warp part-filled (200 = 100 pairs) with a short last KV
    // block, a head that is all rope, the largest head covered.
    let cases = [
        (3, 64, 512, false, false),
        (5, 1, 512, true, true),
        (9, 4, 128, false, false),
        (9, 1, 128, true, true),
        (6, 2, 200, true, true),
        (4, 3, 2 * half, false, false),
        (2, 1, 2 * norm_rope::HEAD_PREP_MAX_PAIRS, true, true),
        // head_prep_rows_kernel (a prefill's queries: ROPE_ROWS_MIN rows, 8 heads or more): the
        // released heads, and a part-filled warp with the KV sim and a weight.
        (norm_rope::ROPE_ROWS_MIN + 5, 16, 512, false, false),
        (norm_rope::ROPE_ROWS_MIN + 1, 8, 200, true, true),
    ];
    // round_in (official only, as the engine uses it): x holds f32 values that are not bf16,
    // and the kernel must give what it gives on x rounded to bf16 first.
    for (official, round_in) in [(false, false), (true, false), (true, true)] {
        for &(rows, heads, hd, with_w, sim) in &cases {
            assert!(NormRope::head_prep_covers(hd, half), "head_dim {hd}");
            let width = heads * hd;
            let nope = hd - 2 * half;
            let sim_nope = if sim && official { nope } else { 0 };
            let x = rows_of(&mut rng, rows, width, official && !round_in);
            if round_in {
                let mut rounded = x.clone();
                round_bf16(&mut rounded);
                assert_ne!(
                    rounded, x,
                    "the round_in case needs inputs that are not bf16"
                );
            }
            let w: Vec<f32> = (0..hd).map(|_| 1.0 + 0.2 * rng.normal()).collect();
            let pos: Vec<i32> = (0..rows)
                .map(|r| if r == 0 { 0 } else { rng.below(1 << 17) as i32 })
                .collect();
            let mut want = x.clone();
            if round_in {
                Prec { official: true }.bf16(&mut want);
            }
            for (r, row) in want.chunks_exact_mut(width).enumerate() {
                rms_norm(row, hd, with_w.then_some(&w[..]), 1e-6);
                Prec { official }.bf16(row);
                for head in row.chunks_exact_mut(hd) {
                    rope::apply(head, &freqs, pos[r] as usize, 1.0);
                    Prec { official }.bf16(head);
                    if sim_nope > 0 {
                        fp8_sim(&mut head[..sim_nope], 64);
                    }
                }
            }
            let (_a, p) = d.alloc(&[x.len() * 4, rows * 4, hd * 4, x.len() * 2]);
            d.put(p[0], &x);
            d.put(p[1], &pos);
            d.put(p[2], &w);
            let launch = |out_bf16| {
                d.k.head_prep(
                    d.ctx(),
                    p[0],
                    rows,
                    width,
                    heads,
                    hd,
                    with_w.then_some(p[2]),
                    1e-6,
                    p[1],
                    fp[0],
                    half,
                    sim_nope,
                    official,
                    round_in,
                    out_bf16,
                    d.s(),
                )
                .unwrap()
            };
            launch(None);
            let got: Vec<f32> = d.get(p[0], x.len());
            let tag = format!(
                "head_prep rows {rows} heads {heads} head_dim {hd} weight {with_w} sim_nope {sim_nope} official {official} round_in {round_in}"
            );
            assert_bits(&tag, &got, &want);
            // Official (bf16 results): the same values as BF16 into out_bf16 (poisoned first),
            // x left as it was.
            if official {
                d.put(p[0], &x);
                d.put(p[3], &vec![0xffffu16; x.len()]);
                launch(Some(p[3]));
                let got16: Vec<u16> = d.get(p[3], x.len());
                let want16: Vec<u16> = want
                    .iter()
                    .map(|&v| half::bf16::from_f32(v).to_bits())
                    .collect();
                assert!(
                    want.iter()
                        .all(|&v| half::bf16::from_f32(v).to_f32().to_bits() == v.to_bits()),
                    "{tag}: the official results are bf16 values"
                );
                assert_eq!(got16, want16, "{tag}: out_bf16");
                let after: Vec<f32> = d.get(p[0], x.len());
                assert_bits(&format!("{tag}: x with out_bf16"), &after, &x);
            }
        }
    }
    // What it does not cover is refused before launching.
    assert!(!NormRope::head_prep_covers(63, 8));
    assert!(!NormRope::head_prep_covers(
        2 * norm_rope::HEAD_PREP_MAX_PAIRS + 2,
        8
    ));
    assert!(!NormRope::head_prep_covers(64, 33));
}

// ------------------------------------------------------------------------------ KV FP8 sim

#[test]
fn kv_sim_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(3);
    // (rows, dim, nope, ld): released (512, 448), tiny (128, 64), a partial last block, a
    // padded stride.
    let cases = [
        (50, 512, 448, 512),
        (40, 128, 64, 128),
        (20, 200, 100, 200),
        (9, 128, 64, 160),
    ];
    for &(rows, dim, nope, ld) in &cases {
        let mut x = rows_of(&mut rng, rows, dim, true);
        // Tiny rows (amax below the 1e-4 floor), an all-zero block, a huge block.
        x[..dim].iter_mut().for_each(|v| *v *= 1e-6);
        if rows > 2 {
            x[dim..dim + 64.min(nope)].iter_mut().for_each(|v| *v = 0.0);
            x[2 * dim..3 * dim].iter_mut().for_each(|v| *v *= 3e4);
        }
        let mut want = x.clone();
        if ld == dim {
            Prec { official: true }.kv_nope_sim(&mut want, dim, nope);
        } else {
            want.chunks_exact_mut(dim)
                .for_each(|r| fp8_sim(&mut r[..nope], 64));
        }
        let xs = strided(&x, rows, dim, ld);
        let got = d.in_place(&xs, |p| d.k.kv_sim(d.ctx(), p, rows, ld, nope, d.s()));
        assert_bits(
            &format!("kv_sim rows {rows} dim {dim} nope {nope} ld {ld}"),
            &got,
            &strided(&want, rows, dim, ld),
        );
    }
}

// ------------------------------------------------------------------- indexer Hadamard sim

#[test]
fn index_sim_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(4);
    for &(rows, dim) in &[
        (33, 128),
        (17, 64),
        (5, 1024),
        (9, 512),
        (12, 32),
        (6, 16),
        (3, 1),
    ] {
        let mut x = rows_of(&mut rng, rows, dim, true);
        x[..dim].iter_mut().for_each(|v| *v *= 1e-30); // the FP4 amax floor
        let mut want = x.clone();
        Prec { official: true }.index_sim(&mut want, dim);
        let got = d.in_place(&x, |p| d.k.index_sim(d.ctx(), p, rows, dim, d.s()));
        assert_bits(&format!("index_sim rows {rows} dim {dim}"), &got, &want);
    }
}

// ----------------------------------------------------------------------------- elementwise

/// Values that exercise rounding: every class of f32, ties, random bit patterns.
fn probe_values(rng: &mut Rng) -> Vec<f32> {
    let mut v: Vec<f32> = [
        0.0f32,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001), // signalling NaN
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-45,
        f32::from_bits(0x3f80_8000), // exact bf16 tie, even below
        f32::from_bits(0x3f81_8000), // exact bf16 tie, odd below
        f32::from_bits(0x7f7f_ffff),
    ]
    .to_vec();
    for _ in 0..200_000 {
        let r = rng.u64();
        v.push(f32::from_bits(r as u32));
        v.push(rng.normal() * 2f32.powi((r >> 40) as i32 % 60 - 30));
    }
    v
}

#[test]
fn elementwise_kernels_match_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(5);
    let x = probe_values(&mut rng);
    let n = x.len();
    let (_a, p) = d.alloc(&[n * 4, n * 2]);

    // round_bf16
    d.put(p[0], &x);
    d.k.round_bf16(d.ctx(), p[0], n, d.s()).unwrap();
    let got: Vec<f32> = d.get(p[0], n);
    assert_bits("round_bf16", &got, &bf16_all(x.clone()));

    // to_bf16 (output poisoned first)
    d.put(p[0], &x);
    d.poison(p[1]);
    d.k.to_bf16(d.ctx(), p[0], p[1], n, d.s()).unwrap();
    let got: Vec<u16> = d.get(p[1], n);
    let want: Vec<u16> = x
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    assert_u16("to_bf16", &got, &want);

    // scale2 with the indexer-weight constants, then with arbitrary ones
    for (s1, s2) in [
        (inv_sqrt(128), inv_sqrt(64)),
        (inv_sqrt(7), 3.3f32),
        (1e-20, 1e25),
    ] {
        d.put(p[0], &x);
        d.k.scale2(d.ctx(), p[0], n, s1, s2, d.s()).unwrap();
        let got: Vec<f32> = d.get(p[0], n);
        let want: Vec<f32> = x.iter().map(|&v| v * s1 * s2).collect();
        // NaN inputs: both sides NaN, payload bits are the hardware's; compare the rest.
        let keep: Vec<usize> = (0..n).filter(|&i| !want[i].is_nan()).collect();
        assert!(
            (0..n).all(|i| want[i].is_nan() == got[i].is_nan()),
            "scale2: NaN positions differ"
        );
        assert_bits(
            &format!("scale2 {s1:e} {s2:e} (non-NaN)"),
            &keep.iter().map(|&i| got[i]).collect::<Vec<_>>(),
            &keep.iter().map(|&i| want[i]).collect::<Vec<_>>(),
        );
    }
}

// ----------------------------------------------------------------------------------- copies

#[test]
fn embed_and_gather_copy_rows_exactly() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(6);
    let (vocab, dd, nstreams, t) = (1000usize, 256usize, 4usize, 37usize);
    let table = bf16_all(rng.normals(vocab * dd, 0.05));
    let tokens: Vec<i32> = (0..t).map(|_| rng.below(vocab) as i32).collect();
    // The same table as f32 and as BF16 bits (the engine stores the embedding BF16).
    let bits: Vec<u16> = table
        .iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect();
    let (_a, p) = d.alloc(&[
        table.len() * 4,
        t * 4,
        t * nstreams * dd * 4,
        bits.len() * 2,
    ]);
    d.put(p[0], &table);
    d.put(p[1], &tokens);
    d.put(p[3], &bits);
    let mut want = vec![0.0f32; t * nstreams * dd];
    for (ti, &tok) in tokens.iter().enumerate() {
        let row = &table[tok as usize * dd..(tok as usize + 1) * dd];
        for s in 0..nstreams {
            want[(ti * nstreams + s) * dd..(ti * nstreams + s + 1) * dd].copy_from_slice(row);
        }
    }
    for (what, tab, bf16) in [("embed f32", p[0], false), ("embed bf16", p[3], true)] {
        d.poison(p[2]);
        d.k.embed(d.ctx(), p[1], t, tab, bf16, dd, nstreams, p[2], d.s())
            .unwrap();
        let got: Vec<f32> = d.get(p[2], t * nstreams * dd);
        assert_bits(what, &got, &want);
    }

    // gather_rows: explicit row list (with repeats), then the identity.
    let (src_rows, row_len) = (50usize, 300usize);
    let src = rng.normals(src_rows * row_len, 1.0);
    let rows: Vec<i32> = (0..20).map(|_| rng.below(src_rows) as i32).collect();
    let (_b, q) = d.alloc(&[src.len() * 4, rows.len() * 4, src.len() * 4]);
    d.put(q[0], &src);
    d.put(q[1], &rows);
    d.poison(q[2]);
    d.k.gather_rows(d.ctx(), q[0], row_len, Some(q[1]), rows.len(), q[2], d.s())
        .unwrap();
    let got: Vec<f32> = d.get(q[2], rows.len() * row_len);
    let want: Vec<f32> = rows
        .iter()
        .flat_map(|&r| src[r as usize * row_len..(r as usize + 1) * row_len].to_vec())
        .collect();
    assert_bits("gather_rows (list)", &got, &want);
    d.poison(q[2]);
    d.k.gather_rows(d.ctx(), q[0], row_len, None, src_rows, q[2], d.s())
        .unwrap();
    let got: Vec<f32> = d.get(q[2], src.len());
    assert_bits("gather_rows (identity)", &got, &src);
}

#[test]
fn wrappers_reject_undersized_buffers() {
    let Some(d) = dev() else { return };
    let (_a, p) = d.alloc(&[1024]);
    let small = p[0];
    // 256 floats fit; 257 do not.
    assert!(
        d.k.rmsnorm(d.ctx(), small, 2, 129, 129, None, 1e-6, false, d.s())
            .is_err()
    );
    assert!(d.k.round_bf16(d.ctx(), small, 257, d.s()).is_err());
    assert!(
        d.k.index_sim(d.ctx(), small, 1, 96, d.s()).is_err(),
        "not a power of two"
    );
    assert!(
        d.k.kv_sim(d.ctx(), small, 2, 128, 200, d.s()).is_err(),
        "nope > ld"
    );
    assert!(
        d.k.round_bf16(d.ctx(), small, 0, d.s()).is_ok(),
        "empty is a no-op"
    );
}
