//! Encoders and fake-quant ("sim") functions of the official numerics (MODEL.md §3.4):
//! FP8 e4m3fn and FP4 e2m1 round-to-nearest-even with saturation, UE8M0 power-of-two
//! scales, and block fake-quantisation. Decoders live in `dtype.rs`.

use super::dtype::{E4M3_LUT, FP4_LUT};

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest e2m1 value.
pub const E2M1_MAX: f32 = 6.0;

/// floor(log2(v)) for a positive finite normal or subnormal f32.
fn floor_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    let e = ((bits >> 23) & 0xff) as i32;
    if e == 0 {
        // Subnormal: position of the highest set mantissa bit.
        -149 + (31 - (bits & 0x7f_ffff).leading_zeros() as i32)
    } else {
        e - 127
    }
}

/// Rounds |v| to a float grid with `mant_bits` explicit mantissa bits, exponents >= `min_exp`
/// (subnormals below), saturating at `max`; ties to even. Sign preserved; NaN stays NaN.
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
    let q = (2.0f32).powi(e - mant_bits);
    let r = ((a / q).round_ties_even() * q).min(max);
    r.copysign(x)
}

/// Nearest e4m3fn value (ties to even, saturating at ±448).
pub fn e4m3_round(x: f32) -> f32 {
    round_to_grid(x, 3, -6, E4M3_MAX)
}

/// Nearest e2m1 value (ties to even, saturating at ±6).
pub fn e2m1_round(x: f32) -> f32 {
    round_to_grid(x, 1, 0, E2M1_MAX)
}

/// e4m3fn code of `x` after rounding (NaN -> 0x7f).
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let v = e4m3_round(x);
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    // The rounded magnitude is exactly representable: find its code among the 127
    // non-negative finite codes (the table is increasing).
    let mag = v.abs();
    let code = (0u8..0x7f)
        .find(|&c| E4M3_LUT[c as usize] == mag)
        .expect("rounded value is an e4m3 code");
    sign | code
}

/// e2m1 nibble of `x` after rounding (bit 3 = sign).
pub fn e2m1_encode(x: f32) -> u8 {
    let v = e2m1_round(x);
    let mag = v.abs();
    let code = (0u8..8)
        .find(|&c| FP4_LUT[c as usize] == mag)
        .expect("rounded value is an e2m1 code");
    if v.is_sign_negative() { code | 8 } else { code }
}

/// UE8M0 scale for a block with max magnitude `amax` and format maximum `qmax`:
/// the power of two `2^ceil(log2(amax / qmax))`, as (biased exponent byte, value).
pub fn ue8m0_scale(amax: f32, qmax: f32) -> (u8, f32) {
    let y = amax / qmax;
    let bits = y.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    if bits & 0x7f_ffff != 0 {
        e += 1;
    }
    let e = e.clamp(-127, 127);
    ((e + 127) as u8, (2.0f32).powi(e))
}

/// Official `FP8sim(x, block)` in place: per block, scale = UE8M0(max(amax, 1e-4) / 448),
/// x = e4m3(x / scale) * scale.
pub fn fp8_sim(x: &mut [f32], block: usize) {
    for b in x.chunks_mut(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-4);
        let (_, s) = ue8m0_scale(amax, E4M3_MAX);
        b.iter_mut()
            .for_each(|v| *v = e4m3_round((*v / s).clamp(-E4M3_MAX, E4M3_MAX)) * s);
    }
}

/// Official `FP4sim(x, block)` in place: per block, scale = UE8M0(max(amax, 6*2^-126) / 6),
/// x = e2m1(x / scale) * scale.
pub fn fp4_sim(x: &mut [f32], block: usize) {
    let floor = E2M1_MAX * f32::MIN_POSITIVE;
    for b in x.chunks_mut(block) {
        let amax = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(floor);
        let (_, s) = ue8m0_scale(amax, E2M1_MAX);
        b.iter_mut()
            .for_each(|v| *v = e2m1_round((*v / s).clamp(-E2M1_MAX, E2M1_MAX)) * s);
    }
}

/// Rounds every value to the nearest bfloat16 (ties to even), in place.
pub fn round_bf16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounding_matches_the_documented_ties() {
        let cases = [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (7.0, 6.0),
            (-0.3, -0.5),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_round(x), want, "{x}");
        }
    }

    #[test]
    fn e4m3_encode_roundtrips_every_code() {
        for c in 0u16..256 {
            let c = c as u8;
            let v = E4M3_LUT[c as usize];
            if v.is_nan() {
                continue;
            }
            let back = e4m3_encode(v);
            // -0 and +0 both decode to zero; compare values.
            assert_eq!(E4M3_LUT[back as usize], v, "code {c:#x}");
            assert_eq!(e4m3_round(v), v);
        }
        assert_eq!(e4m3_round(1000.0), 448.0);
        assert_eq!(e4m3_round(-1000.0), -448.0);
        // Halfway between 1.0 and 1.125 rounds to even (1.0); between 1.125 and 1.25 to 1.25.
        assert_eq!(e4m3_round(1.0625), 1.0);
        assert_eq!(e4m3_round(1.1875), 1.25);
        // Smallest subnormal 2^-9; half of it ties to 0.
        assert_eq!(e4m3_round(2f32.powi(-10)), 0.0);
        assert_eq!(e4m3_round(3.0 * 2f32.powi(-10)), 2f32.powi(-8));
    }

    #[test]
    fn e2m1_encode_roundtrips_every_code() {
        for c in 0u8..16 {
            let v = FP4_LUT[c as usize];
            assert_eq!(FP4_LUT[e2m1_encode(v) as usize], v, "nibble {c}");
        }
    }

    #[test]
    fn ue8m0_is_power_of_two_ceiling() {
        assert_eq!(ue8m0_scale(448.0, 448.0), (127, 1.0));
        assert_eq!(ue8m0_scale(449.0, 448.0), (128, 2.0));
        assert_eq!(ue8m0_scale(224.0, 448.0), (126, 0.5));
        assert_eq!(ue8m0_scale(1e-4, 448.0).1, 2f32.powi(-22));
    }

    #[test]
    fn fp8_sim_is_idempotent_and_bounded() {
        let mut x: Vec<f32> = (0..200)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 13.0)
            .collect();
        let orig = x.clone();
        fp8_sim(&mut x, 64);
        let once = x.clone();
        fp8_sim(&mut x, 64);
        assert_eq!(x, once);
        for (a, b) in once.iter().zip(&orig) {
            assert!((a - b).abs() <= b.abs() * 0.0625 + 1e-3, "{a} vs {b}");
        }
    }
}
