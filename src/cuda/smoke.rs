//! The `smoke` kernel family (kernels/smoke.cu): tiny kernels that exercise the runtime
//! (NVRTC, cache, module loading, parameter passing, launches on a borrowed stream) and the
//! helpers of kernels/common.cuh. Tests only: no model code may use it.
//!
//! This file is also the template of a family wrapper: the family's declaration (the
//! `SOURCE` the registry compiles and one typed `Args` per entry point), and launch functions
//! that check buffer sizes before launching.

use super::stream::BorrowedStream;
use super::{Context, DevicePtr};
use crate::error::{Error, Result, Status};

crate::kernel_family! {
    pub const SOURCE = "smoke", include_str!("../../kernels/smoke.cu");

    fn smoke_fill(out_u32: *mut u32, out_f32: *mut f32, n: u64, seed: i32, scale: f32);
    fn smoke_roundtrip(xf: *const f32, xu: *const u32, out: *mut u32, n: i32);
    fn smoke_reduce(
        x: *const f32, sums: *mut f32, maxs: *mut f32, warp_sums: *mut f32, agree: *mut u32,
    );
    fn smoke_silu_exhaustive(first: u64, step: u64, n: u64, counts: *mut u64);
}

/// Columns written per element by `smoke_roundtrip` (u32 bit patterns), in order.
pub const ROUNDTRIP_COLS: usize = 19;

/// What each column of `smoke_roundtrip` holds, as the CPU reference computes it
/// (inputs: `x` a float, `u` a u32 whose low bits supply codes).
pub const ROUNDTRIP_COLUMNS: [&str; ROUNDTRIP_COLS] = [
    "bf16_to_f32(u & 0xffff)",
    "f32_to_bf16(x)",
    "round_bf16(x)",
    "e4m3_to_f32(u & 0xff)",
    "e4m3_round(x)",
    "e4m3_encode(x)",
    "e2m1_to_f32(u & 0xf)",
    "e2m1_round(x)",
    "e2m1_encode(x) (NaN x: 0xffffffff)",
    "ue8m0_code(|x|, 448)",
    "ue8m0_scale(|x|, 448)",
    "ue8m0_code(|x|, 6)",
    "ue8m0_scale(|x|, 6)",
    "e8m0_to_f32(u & 0xff)",
    "ue8m0_exponent(x, 1)",
    "round_bf16_nonnan(x) (NaN x: any NaN)",
    "e4m3x2_code_hw(x, -x)",
    "pack_bf16x2(x, -x) (NaN x: any NaNs)",
    "canary 0x5a5a5a5a",
];

/// The value `smoke_fill` writes to `out_u32[i]`.
pub fn fill_u32_ref(i: u64, seed: i32) -> u32 {
    let mut x = (i as u32).wrapping_mul(2_654_435_761) ^ seed as u32;
    x ^= x >> 15;
    x = x.wrapping_mul(0x2c1b_3c6d);
    x ^= x >> 12;
    x
}

crate::launchers! {
    /// The smoke family's entry points, resolved from a loaded registry.
    pub struct Smoke {
        fill: smoke_fill,
        roundtrip: smoke_roundtrip,
        reduce: smoke_reduce,
        silu_exhaustive: smoke_silu_exhaustive,
    }
}

fn need(what: &str, p: DevicePtr, bytes: usize) -> Result<()> {
    if p.bytes() < bytes {
        return Err(Error::new(
            Status::Internal,
            format!("smoke: `{what}` holds {} bytes, needs {bytes}", p.bytes()),
        ));
    }
    Ok(())
}

impl Smoke {
    /// `out_u32[i] = fill_u32_ref(i, seed)`, `out_f32[i] = i as f32 * scale` for `i < n`.
    #[allow(clippy::too_many_arguments)]
    pub fn fill(
        &self,
        ctx: &Context,
        out_u32: DevicePtr,
        out_f32: DevicePtr,
        n: u64,
        seed: i32,
        scale: f32,
        stream: BorrowedStream,
    ) -> Result<()> {
        need("out_u32", out_u32, n as usize * 4)?;
        need("out_f32", out_f32, n as usize * 4)?;
        let _g = ctx.enter()?;
        let args = smoke_fill::Args {
            out_u32,
            out_f32,
            n,
            seed,
            scale,
        };
        let blocks = n.div_ceil(256).clamp(1, 4096) as u32;
        self.fill.launch(blocks, 256, 0, stream, args)
    }

    /// Applies every common.cuh helper to `n` elements: `xf` f32, `xu` u32, `out`
    /// `n * ROUNDTRIP_COLS` u32.
    pub fn roundtrip(
        &self,
        ctx: &Context,
        xf: DevicePtr,
        xu: DevicePtr,
        out: DevicePtr,
        n: usize,
        stream: BorrowedStream,
    ) -> Result<()> {
        need("xf", xf, n * 4)?;
        need("xu", xu, n * 4)?;
        need("out", out, n * ROUNDTRIP_COLS * 4)?;
        let n32 = i32::try_from(n)
            .map_err(|_| Error::new(Status::Internal, "smoke_roundtrip: n above i32"))?;
        let _g = ctx.enter()?;
        let args = smoke_roundtrip::Args {
            xf,
            xu,
            out,
            n: n32,
        };
        self.roundtrip
            .launch((n.div_ceil(256).max(1)) as u32, 256, 0, stream, args)
    }

    /// Block/warp reductions: `rows` rows of `threads` (multiple of 32, <= 1024) f32 in `x`;
    /// `sums`/`maxs`/`agree` hold `rows` entries, `warp_sums` `rows * threads / 32`.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(
        &self,
        ctx: &Context,
        x: DevicePtr,
        sums: DevicePtr,
        maxs: DevicePtr,
        warp_sums: DevicePtr,
        agree: DevicePtr,
        rows: u32,
        threads: u32,
        stream: BorrowedStream,
    ) -> Result<()> {
        if threads == 0 || !threads.is_multiple_of(32) || threads > 1024 {
            return Err(Error::new(
                Status::Internal,
                format!("smoke_reduce: {threads} threads per row"),
            ));
        }
        let (r, t) = (rows as usize, threads as usize);
        need("x", x, r * t * 4)?;
        need("sums", sums, r * 4)?;
        need("maxs", maxs, r * 4)?;
        need("warp_sums", warp_sums, r * t / 32 * 4)?;
        need("agree", agree, r * 4)?;
        let _g = ctx.enter()?;
        let args = smoke_reduce::Args {
            x,
            sums,
            maxs,
            warp_sums,
            agree,
        };
        self.reduce.launch(rows, threads, 0, stream, args)
    }

    /// silu_newton against silu_div_rn (kernels/common.cuh) on the f32 bit patterns
    /// `first + i * step` (mod 2^32), `i < n`. `counts`: 3 u64, set to `[0, 0, u64::MAX]`
    /// before: they come back as [patterns where silu_newton claimed its result, of them those
    /// whose bits differ from silu_div_rn's, the smallest such pattern (or `u64::MAX`)].
    pub fn silu_exhaustive(
        &self,
        ctx: &Context,
        first: u32,
        step: u32,
        n: u64,
        counts: DevicePtr,
        stream: BorrowedStream,
    ) -> Result<()> {
        need("counts", counts, 3 * 8)?;
        let _g = ctx.enter()?;
        let args = smoke_silu_exhaustive::Args {
            first: first as u64,
            step: step as u64,
            n,
            counts,
        };
        // Enough blocks to fill any current GPU; each thread strides over the patterns.
        self.silu_exhaustive.launch(4096, 256, 0, stream, args)
    }
}

/// The CPU reference of one `smoke_roundtrip` row, computed with the engine's own number
/// formats (weights/dtype.rs, weights/quant.rs, `half`): what common.cuh must reproduce.
pub fn roundtrip_ref(x: f32, u: u32) -> [u32; ROUNDTRIP_COLS] {
    use crate::weights::dtype::{FP4_LUT, bf16_to_f32, e4m3_to_f32, e8m0_to_f32};
    use crate::weights::quant::{
        E2M1_MAX, E4M3_MAX, e2m1_encode, e2m1_round, e4m3_encode, e4m3_round, ue8m0_scale,
    };
    let ax = x.abs();
    let (c448, s448) = ue8m0_scale(ax, E4M3_MAX);
    let (c6, s6) = ue8m0_scale(ax, E2M1_MAX);
    [
        bf16_to_f32(u as u16).to_bits(),
        half::bf16::from_f32(x).to_bits() as u32,
        half::bf16::from_f32(x).to_f32().to_bits(),
        e4m3_to_f32(u as u8).to_bits(),
        e4m3_round(x).to_bits(),
        e4m3_encode(x) as u32,
        FP4_LUT[(u & 0xf) as usize].to_bits(),
        e2m1_round(x).to_bits(),
        if x.is_nan() {
            u32::MAX
        } else {
            e2m1_encode(x) as u32
        },
        c448 as u32,
        s448.to_bits(),
        c6 as u32,
        s6.to_bits(),
        e8m0_to_f32(u as u8).to_bits(),
        (ue8m0_scale(x, 1.0).0 as i32 - 127) as u32,
        half::bf16::from_f32(x).to_f32().to_bits(),
        e4m3_encode(x) as u32 | (e4m3_encode(-x) as u32) << 8,
        half::bf16::from_f32(x).to_bits() as u32
            | (half::bf16::from_f32(-x).to_bits() as u32) << 16,
        0x5a5a_5a5a,
    ]
}

/// Does a device result match the reference for column `col`? Bit-exact, except that a NaN
/// produced by a decoder may carry any payload (Rust does not pin NaN bits of arithmetic), and
/// so may `round_bf16_nonnan`'s and each half of `pack_bf16x2`'s (the hardware conversion
/// does not keep it).
pub fn roundtrip_col_matches(col: usize, got: u32, want: u32) -> bool {
    let nan_any = matches!(col, 3 | 13 | 15);
    if col == 17 {
        let bf16_nan = |h: u32| (h & 0x7f80) == 0x7f80 && (h & 0x7f) != 0;
        return [0, 16].iter().all(|&sh| {
            let (g, w) = ((got >> sh) & 0xffff, (want >> sh) & 0xffff);
            g == w || (bf16_nan(g) && bf16_nan(w))
        });
    }
    got == want || (nan_any && f32::from_bits(got).is_nan() && f32::from_bits(want).is_nan())
}

/// The CPU reference of common.cuh's `warp_sum`: the xor butterfly over 32 lanes.
pub fn warp_sum_ref(lanes: &[f32]) -> f32 {
    butterfly(lanes, |a, b| a + b)
}

/// The CPU reference of `warp_max` (fmaxf: NaN-ignoring, like f32::max).
pub fn warp_max_ref(lanes: &[f32]) -> f32 {
    butterfly(lanes, f32::max)
}

fn butterfly(lanes: &[f32], op: impl Fn(f32, f32) -> f32) -> f32 {
    assert_eq!(lanes.len(), 32);
    let mut v = [0.0f32; 32];
    v.copy_from_slice(lanes);
    let mut o = 16;
    while o > 0 {
        let prev = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = op(prev[i], prev[i ^ o]);
        }
        o >>= 1;
    }
    v[0]
}

/// The CPU references of `block_sum` / `block_max` for one block's inputs (length a multiple
/// of 32): per-warp butterflies, then a butterfly over the per-warp results padded with the
/// identity.
pub fn block_sum_ref(vals: &[f32]) -> f32 {
    block_ref(vals, 0.0, warp_sum_ref)
}

pub fn block_max_ref(vals: &[f32]) -> f32 {
    block_ref(vals, f32::NEG_INFINITY, warp_max_ref)
}

fn block_ref(vals: &[f32], identity: f32, warp: fn(&[f32]) -> f32) -> f32 {
    let mut w = [identity; 32];
    for (k, chunk) in vals.chunks_exact(32).enumerate() {
        w[k] = warp(chunk);
    }
    warp(&w)
}

/// Inputs (x, u) for `smoke_roundtrip` that hit every class: all 65536 bf16 patterns (and
/// codes), every e4m3 value with its midpoints and neighbours, e2m1 ties, saturation
/// boundaries, subnormals, and 400k random bit patterns and magnitudes (deterministic).
pub fn probe_inputs() -> Vec<(f32, u32)> {
    let mut v = Vec::new();
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for i in 0..=u16::MAX as u32 {
        v.push((f32::from_bits(i << 16), i));
    }
    for c in 0..=255u32 {
        let a = crate::weights::dtype::E4M3_LUT[c as usize];
        let b = crate::weights::dtype::E4M3_LUT[(c + 1).min(255) as usize];
        for x in [a, (a + b) / 2.0, a * 1.0001, b * 0.9999] {
            v.push((x, c));
        }
    }
    for x in [
        0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.0, 5.999, 448.0, 464.0, 480.0, 1e-45,
        1e-40,
    ] {
        v.push((x, 0));
        v.push((-x, 8));
    }
    // Extremes and NaNs, signalling ones included (helpers must pass NaN bits through).
    for bits in [
        0x7f7f_ffffu32,
        0x0080_0000,
        0x007f_ffff,
        0x7f80_0001,
        0xff80_0001,
        0x7fc0_0000,
    ] {
        v.push((f32::from_bits(bits), bits));
        v.push((-f32::from_bits(bits), !bits));
    }
    for _ in 0..200_000 {
        let r = rnd();
        v.push((f32::from_bits(r as u32), (r >> 32) as u32));
        let m = (r >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        let e = ((r >> 8) % 48) as i32 - 24;
        v.push((
            m * 2f32.powi(e) * if r & 1 == 0 { 1.0 } else { -1.0 },
            r as u32,
        ));
    }
    v
}

#[cfg(test)]
mod tests {
    //! Mirrors of common.cuh's bit tricks, written line by line like the CUDA code, checked
    //! against the CPU reference on the host. The GPU test then checks the device itself.
    use super::*;

    fn pow2(k: i32) -> f32 {
        if k >= -126 {
            f32::from_bits(((k + 127) as u32) << 23)
        } else {
            f32::from_bits(1u32 << (k + 149))
        }
    }

    fn floor_log2(a: f32) -> i32 {
        let bits = a.to_bits();
        let e = ((bits >> 23) & 0xff) as i32;
        if e == 0 {
            -149 + (31 - (bits & 0x7fffff).leading_zeros() as i32)
        } else {
            e - 127
        }
    }

    fn round_to_grid(x: f32, mant_bits: i32, min_exp: i32, max: f32) -> f32 {
        if x.is_nan() {
            return x;
        }
        let a = x.abs();
        if a == 0.0 {
            return x;
        }
        if a >= max {
            return max.copysign(x);
        }
        let e = floor_log2(a).max(min_exp);
        let q = pow2(e - mant_bits);
        (((a / q).round_ties_even() * q).min(max)).copysign(x)
    }

    fn f32_to_bf16(f: f32) -> u16 {
        let x = f.to_bits();
        if x & 0x7fff_ffff > 0x7f80_0000 {
            return ((x >> 16) | 0x40) as u16;
        }
        if x & 0x8000 != 0 && x & (3 * 0x8000 - 1) != 0 {
            ((x >> 16) + 1) as u16
        } else {
            (x >> 16) as u16
        }
    }

    fn e4m3_to_f32(b: u8) -> f32 {
        let (e, m) = (((b >> 3) & 15) as u32, (b & 7) as u32);
        if e == 15 && m == 7 {
            return f32::NAN;
        }
        let v = if e == 0 {
            m as f32 * 0.001953125
        } else {
            f32::from_bits(((e + 120) << 23) | (m << 20))
        };
        if b & 0x80 != 0 { -v } else { v }
    }

    fn e4m3_encode(x: f32) -> u8 {
        if x.is_nan() {
            return 0x7f;
        }
        let v = round_to_grid(x, 3, -6, 448.0);
        let sign = (v.to_bits() >> 24) & 0x80;
        let a = v.abs();
        let code = if a < 0.015625 {
            (a * 512.0) as u32
        } else {
            let bits = a.to_bits();
            ((((bits >> 23) & 0xff) - 120) << 3) | ((bits >> 20) & 7)
        };
        (sign | code) as u8
    }

    fn e2m1_to_f32(n: u32) -> f32 {
        let (e, m) = ((n >> 1) & 3, n & 1);
        let v = if e == 0 {
            m as f32 * 0.5
        } else {
            f32::from_bits(((e + 126) << 23) | (m << 22))
        };
        if n & 8 != 0 { -v } else { v }
    }

    fn e2m1_encode(x: f32) -> u32 {
        let v = round_to_grid(x, 1, 0, 6.0);
        let sign = (v.to_bits() >> 28) & 8;
        let a = v.abs();
        let code = if a < 1.0 {
            (a * 2.0) as u32
        } else {
            let bits = a.to_bits();
            ((((bits >> 23) & 0xff) - 126) << 1) | ((bits >> 22) & 1)
        };
        sign | code
    }

    fn ue8m0_exponent(amax: f32, qmax: f32) -> i32 {
        let bits = (amax / qmax).to_bits();
        let mut e = ((bits >> 23) & 0xff) as i32 - 127;
        if bits & 0x7fffff != 0 {
            e += 1;
        }
        e.clamp(-127, 127)
    }

    fn e8m0_to_f32(e: u8) -> f32 {
        match e {
            255 => f32::NAN,
            0 => f32::from_bits(0x0040_0000),
            _ => f32::from_bits((e as u32) << 23),
        }
    }

    /// The mirror row, in `roundtrip_ref`'s column order.
    fn mirror_row(x: f32, u: u32) -> [u32; ROUNDTRIP_COLS] {
        let ax = x.abs();
        [
            f32::from_bits((u & 0xffff) << 16).to_bits(),
            f32_to_bf16(x) as u32,
            f32::from_bits((f32_to_bf16(x) as u32) << 16).to_bits(),
            e4m3_to_f32(u as u8).to_bits(),
            round_to_grid(x, 3, -6, 448.0).to_bits(),
            e4m3_encode(x) as u32,
            e2m1_to_f32(u & 0xf).to_bits(),
            round_to_grid(x, 1, 0, 6.0).to_bits(),
            if x.is_nan() { u32::MAX } else { e2m1_encode(x) },
            (ue8m0_exponent(ax, 448.0) + 127) as u32,
            pow2(ue8m0_exponent(ax, 448.0)).to_bits(),
            (ue8m0_exponent(ax, 6.0) + 127) as u32,
            pow2(ue8m0_exponent(ax, 6.0)).to_bits(),
            e8m0_to_f32(u as u8).to_bits(),
            ue8m0_exponent(x, 1.0) as u32,
            f32::from_bits((f32_to_bf16(x) as u32) << 16).to_bits(),
            e4m3_encode(x) as u32 | (e4m3_encode(-x) as u32) << 8,
            f32_to_bf16(x) as u32 | (f32_to_bf16(-x) as u32) << 16,
            0x5a5a_5a5a,
        ]
    }

    #[test]
    fn mirrors_of_common_cuh_match_the_cpu_reference() {
        let mut bad = 0;
        for (x, u) in probe_inputs() {
            let (m, r) = (mirror_row(x, u), roundtrip_ref(x, u));
            for c in 0..ROUNDTRIP_COLS {
                if !roundtrip_col_matches(c, m[c], r[c]) {
                    bad += 1;
                    if bad < 20 {
                        eprintln!(
                            "{}: x={x:e} ({:#010x}) u={u:#x}: mirror {:#x} reference {:#x}",
                            ROUNDTRIP_COLUMNS[c],
                            x.to_bits(),
                            m[c],
                            r[c]
                        );
                    }
                }
            }
        }
        assert_eq!(bad, 0);
    }

    #[test]
    fn reduction_references() {
        let v: Vec<f32> = (0..96).map(|i| i as f32 - 40.5).collect();
        let exact_sum: f32 = v.iter().sum();
        assert_eq!(block_sum_ref(&v), exact_sum); // small integers + halves: every order is exact
        assert_eq!(block_max_ref(&v), 54.5);
        assert_eq!(warp_sum_ref(&v[..32]), v[..32].iter().sum::<f32>());
        assert_eq!(warp_max_ref(&v[..32]), -9.5);
    }

    #[test]
    fn fill_reference_is_a_permutation_of_sorts() {
        let a: std::collections::HashSet<u32> =
            (0..10_000u64).map(|i| fill_u32_ref(i, 3)).collect();
        assert!(a.len() > 9_990);
    }
}
