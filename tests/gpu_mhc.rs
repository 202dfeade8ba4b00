//! GPU op tests of the `mhc` kernel family (kernels/mhc.cu): hc_pre (with Sinkhorn), hc_post
//! and hc_head on fresh random inputs, compared BIT FOR BIT with reference::mhc (hc_mult 4,
//! D = 256 and D = 4096, 20 Sinkhorn iterations) in both numerics modes (official: BF16 inputs,
//! outputs rounded to BF16 where the reference forward rounds them). Outputs are poisoned with
//! NaN first.
//!
//! Without a CUDA device every device test prints `skipped: no CUDA device` and returns. The
//! NVRTC compile check runs wherever NVRTC is installed (no GPU needed).

mod common;

use common::assert_bits;
use common::gpu::{assert_families_compile, family_gpu};
use common::rng::Rng;
use dsv4::cuda::Arena;
use dsv4::cuda::kernels::mhc::{self, HcSiteDev, Mhc};
use dsv4::reference::mhc::{HcParams, HcPre, fold_projection, hc_head, hc_post, hc_pre};
use dsv4::reference::ops::Threads;
use dsv4::weights::quant::round_bf16;

// ------------------------------------------------------------------------------ harness

type Dev = common::gpu::Dev<Mhc>;

/// One test's device state on the shared device with this family loaded (the family's
/// kernels, its own stream and buffers), or None after printing the skip line.
fn dev() -> Option<Dev> {
    let g = family_gpu(&[&mhc::SOURCE])?;
    Some(Dev::new(g, Mhc::new(&g.reg).unwrap()))
}

fn bf16_if(official: bool, mut v: Vec<f32>) -> Vec<f32> {
    if official {
        round_bf16(&mut v);
    }
    v
}

const N: usize = 4;
const HC_EPS: f32 = 1e-6;
const RMS_EPS: f32 = 1e-6;
const ITERS: usize = 20;
/// Rows of an mHC site's projection: pre (N), post (N) and comb (N x N) logits.
const MIX: usize = (2 + N) * N;

/// Residual streams [t, N, d]: each token at its own magnitude (bf16 in official mode).
fn streams(rng: &mut Rng, t: usize, d: usize, official: bool) -> Vec<f32> {
    let mut x = Vec::with_capacity(t * N * d);
    for _ in 0..t {
        let s = 2f32.powi((rng.u64() % 13) as i32 - 6);
        x.extend(rng.normals(N * d, s));
    }
    bf16_if(official, x)
}

/// Random mHC site parameters: `rows` projection rows over N*d, logits of order `logit`.
struct Site {
    proj: Vec<f32>,
    base: Vec<f32>,
    scale: Vec<f32>,
}

fn site(rng: &mut Rng, rows: usize, d: usize, nscale: usize, logit: f32) -> Site {
    let nd = N * d;
    Site {
        proj: rng.normals(rows * nd, logit / (nd as f32).sqrt()),
        base: rng.normals(rows, 1.0),
        scale: (0..nscale).map(|_| rng.range(0.5, 2.0)).collect(),
    }
}

impl Site {
    fn params(&self) -> HcParams<'_> {
        HcParams {
            proj: &self.proj,
            base: &self.base,
            scale: &self.scale,
            fold: None,
        }
    }

    /// Uploads proj, base, scale into three fresh regions.
    fn upload(&self, d: &Dev) -> (Arena, HcSiteDev) {
        let (a, p) = d.alloc(&[
            self.proj.len() * 4,
            self.base.len() * 4,
            self.scale.len() * 4,
        ]);
        d.put(p[0], &self.proj);
        d.put(p[1], &self.base);
        d.put(p[2], &self.scale);
        (
            a,
            HcSiteDev {
                proj: p[0],
                base: p[1],
                scale: p[2],
                fold: None,
            },
        )
    }
}

// ------------------------------------------------------------------- NVRTC compile check

#[test]
fn mhc_family_compiles_for_sm_90a() {
    assert_families_compile(&[&mhc::SOURCE]);
}

// --------------------------------------------------------------------------------- hc_pre

/// hc_pre on the device over streams `x` [t, N, dd] (outputs poisoned first): u [t, dd]
/// (bf16 if `round_u`), post [t, N] and comb [t, N, N], and `x` as the device holds it after.
fn device_hc_pre(
    d: &Dev,
    x: &[f32],
    t: usize,
    dd: usize,
    sp: HcSiteDev,
    iters: usize,
    round_u: bool,
) -> (HcPre, Vec<f32>) {
    let (_a, p) = d.alloc(&[
        x.len() * 4,
        t * dd * 4,
        t * N * 4,
        t * N * N * 4,
        mhc::PARTIALS * 8,
    ]);
    d.put(p[0], x);
    for &q in &p[1..] {
        d.poison(q);
    }
    let (u, post, comb) = (p[1], p[2], p[3]);
    d.k.hc_pre(
        d.ctx(),
        p[0],
        t,
        N,
        dd,
        sp,
        iters,
        HC_EPS,
        RMS_EPS,
        round_u,
        u,
        post,
        comb,
        p[4],
        d.s(),
    )
    .unwrap();
    let got = HcPre {
        u: d.get(u, t * dd),
        post: d.get(post, t * N),
        comb: d.get(comb, t * N * N),
    };
    (got, d.get(p[0], x.len()))
}

/// The device's hc_pre outputs equal the reference's bit for bit; comb first: a Sinkhorn
/// difference is the most informative failure.
fn assert_hc_pre(what: &str, got: &HcPre, want: &HcPre) {
    assert_bits(&format!("{what}: comb"), &got.comb, &want.comb);
    assert_bits(&format!("{what}: post"), &got.post, &want.post);
    assert_bits(&format!("{what}: u"), &got.u, &want.u);
}

#[test]
fn hc_pre_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(11);
    // (tokens, D, Sinkhorn iterations, logit magnitude): the tiny and the released hidden size
    // with the model's 20 iterations; one iteration; sharp logits (Sinkhorn exps spanning
    // many orders of magnitude).
    // T <= mhc::SPLIT_MAX_T runs the split kernels, above it one block per token: both here.
    let cases = [
        (9, 256, ITERS, 2.0f32),
        (1, 4096, ITERS, 2.0),
        (70, 256, ITERS, 2.0),
        (4, 4096, ITERS, 2.0),
        (6, 256, 1, 2.0),
        (5, 256, ITERS, 12.0),
        (3, 4096, ITERS, 12.0),
    ];
    for official in [false, true] {
        for &(t, dd, iters, logit) in &cases {
            let what =
                format!("hc_pre T {t} D {dd} iters {iters} logits ~{logit} official {official}");
            let x = streams(&mut rng, t, dd, official);
            let st = site(&mut rng, MIX, dd, 3, logit);
            let mut want = hc_pre(Threads(4), &x, N, dd, &st.params(), iters, HC_EPS, RMS_EPS);
            if official {
                round_bf16(&mut want.u);
            }
            let (_s, sp) = st.upload(&d);
            let (got, x_after) = device_hc_pre(&d, &x, t, dd, sp, iters, official);
            assert_hc_pre(&what, &got, &want);
            assert_bits(&format!("{what}: x unchanged"), &x_after, &x);
        }
    }
}

/// Layer 0's folded projection (the derived "broadcast weight"): with every stream equal, the
/// GPU's folded hc_pre equals the CPU reference's folded hc_pre bit for bit, and both equal
/// the unfolded hc_pre (the fold is exact in f64 for these inputs).
#[test]
fn hc_pre_with_layer0_fold_matches_reference_and_unfolded() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(21);
    for official in [false, true] {
        for &(t, dd) in &[(7usize, 256usize), (3, 4096), (1, 4096), (65, 256)] {
            let what = format!("folded hc_pre T {t} D {dd} official {official}");
            // One embedding row per token, copied into every stream (as layer 0 sees it).
            let e = streams(&mut rng, t, dd, official);
            let mut x = Vec::with_capacity(t * N * dd);
            for ti in 0..t {
                for _ in 0..N {
                    x.extend_from_slice(&e[ti * N * dd..ti * N * dd + dd]);
                }
            }
            let st = site(&mut rng, MIX, dd, 3, 2.0);
            let mut fold = vec![0.0f64; MIX * dd];
            fold_projection(&st.proj, N, dd, &mut fold);
            let folded = HcParams {
                fold: Some(&fold),
                ..st.params()
            };
            let want = hc_pre(Threads(4), &x, N, dd, &folded, ITERS, HC_EPS, RMS_EPS);
            let plain = hc_pre(Threads(4), &x, N, dd, &st.params(), ITERS, HC_EPS, RMS_EPS);
            assert_bits(
                &format!("{what}: CPU folded vs unfolded comb"),
                &want.comb,
                &plain.comb,
            );
            assert_bits(
                &format!("{what}: CPU folded vs unfolded u"),
                &want.u,
                &plain.u,
            );
            let (_s, mut sp) = st.upload(&d);
            let (_f, fp) = d.alloc(&[fold.len() * 8]);
            let fbits: Vec<u64> = fold.iter().map(|v| v.to_bits()).collect();
            d.put(fp[0], &fbits);
            sp.fold = Some(fp[0]);
            let (got, _) = device_hc_pre(&d, &x, t, dd, sp, ITERS, false);
            assert_hc_pre(&what, &got, &want);
        }
    }
}

// -------------------------------------------------------------------------------- hc_post

#[test]
fn hc_post_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(12);
    for official in [false, true] {
        for &(t, dd) in &[(9usize, 256usize), (4, 4096), (1, 256)] {
            let what = format!("hc_post T {t} D {dd} official {official}");
            let x = streams(&mut rng, t, dd, official);
            let st = site(&mut rng, MIX, dd, 3, 3.0);
            // post / comb as hc_pre makes them (the reference's), the block output `a`.
            let pre = hc_pre(Threads(4), &x, N, dd, &st.params(), ITERS, HC_EPS, RMS_EPS);
            let a_raw = rng.normals(t * dd, 0.7);
            let a = bf16_if(official, a_raw.clone());
            let mut want = x.clone();
            let pre_ref = HcPre {
                u: vec![],
                post: pre.post.clone(),
                comb: pre.comb.clone(),
            };
            hc_post(&mut want, &a, &pre_ref, N, dd);
            if official {
                round_bf16(&mut want);
            }
            // Official: also with `a` unrounded and rounded as read (round_in, as the attention's
            // wo_b output comes), against the same reference.
            for round_in in [false, true].into_iter().filter(|&r| !r || official) {
                let (_a, p) = d.alloc(&[x.len() * 4, a.len() * 4, t * N * 4, t * N * N * 4]);
                d.put(p[0], &x);
                d.put(p[1], if round_in { &a_raw } else { &a });
                d.put(p[2], &pre.post);
                d.put(p[3], &pre.comb);
                let rounds = (round_in, official);
                d.k.hc_post(d.ctx(), p[0], p[1], p[2], p[3], t, N, dd, rounds, d.s())
                    .unwrap();
                assert_bits(
                    &format!("{what} round_in {round_in}"),
                    &d.get(p[0], x.len()),
                    &want,
                );
            }
        }
    }
}

// -------------------------------------------------------------------------------- hc_head

#[test]
fn hc_head_matches_reference_bit_for_bit() {
    let Some(d) = dev() else { return };
    let mut rng = Rng::new(13);
    for official in [false, true] {
        for &(r, dd) in &[(5usize, 256usize), (3, 4096), (1, 4096), (66, 256)] {
            let what = format!("hc_head R {r} D {dd} official {official}");
            let x = streams(&mut rng, r, dd, official);
            let st = site(&mut rng, N, dd, 1, 2.0);
            let mut want = hc_head(Threads(4), &x, N, dd, &st.params(), HC_EPS, RMS_EPS);
            if official {
                round_bf16(&mut want);
            }
            let (_s, sp) = st.upload(&d);
            let (_a, p) = d.alloc(&[x.len() * 4, r * dd * 4, mhc::PARTIALS * 8]);
            d.put(p[0], &x);
            d.poison(p[1]);
            d.poison(p[2]);
            d.k.hc_head(
                d.ctx(),
                p[0],
                r,
                N,
                dd,
                sp,
                HC_EPS,
                RMS_EPS,
                official,
                p[1],
                p[2],
                d.s(),
            )
            .unwrap();
            assert_bits(&what, &d.get(p[1], r * dd), &want);
        }
    }
}

#[test]
fn wrappers_reject_bad_shapes() {
    let Some(d) = dev() else { return };
    let (_a, p) = d.alloc(&[4096]);
    let b = p[0];
    let site = HcSiteDev {
        proj: b,
        base: b,
        scale: b,
        fold: None,
    };
    let (k, ctx, s) = (&d.k, d.ctx(), d.s());
    // Nine streams exceed the kernels' limit; proj too small for D = 256.
    let pre = k.hc_pre(
        ctx, b, 1, 9, 4, site, 20, HC_EPS, RMS_EPS, false, b, b, b, b, s,
    );
    assert!(pre.is_err());
    let head = k.hc_head(ctx, b, 1, N, 256, site, HC_EPS, RMS_EPS, false, b, b, s);
    assert!(head.is_err());
    let post = k.hc_post(ctx, b, b, b, b, 0, N, 16, (false, false), s);
    assert!(post.is_ok(), "no tokens is a no-op");
}
