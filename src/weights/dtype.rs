//! Element decoding: every on-disk / host element type the loader accepts, turned into the
//! engine's f32 (weights) or i32 (index tables).
//!
//! Float formats: F32, BF16, F16, FP8 e4m3fn, UE8M0 scale bytes (F8_E8M0) and packed FP4
//! e2m1 (two per byte). Integer formats: I8/U8/I16/I32/I64 -> i32 with a range check.
//! All decoders take little-endian byte slices with no alignment requirement, because a
//! memory-mapped safetensors header may leave tensor data at any byte offset.

use safetensors::Dtype;

/// bfloat16 bit pattern -> f32 (exact: bf16 is the top half of an f32).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// IEEE binary16 bit pattern -> f32 (exact).
#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

/// FP8 e4m3fn (OCP "fn": no infinities; S.1111.111 is NaN) -> f32, exact.
///
/// Bias 7; exponent field 0 is subnormal (m/8 · 2^-6); max finite 448.
pub const fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let e = ((b >> 3) & 0x0F) as i32;
    let m = (b & 0x07) as i32;
    if e == 15 && m == 7 {
        return f32::NAN;
    }
    // value = (e == 0 ? m/8 · 2^-6 : (1 + m/8) · 2^(e-7)); build it as an integer times a power
    // of two so the const evaluation is exact.
    let (mant, exp) = if e == 0 { (m, -9) } else { (8 + m, e - 10) };
    sign * (mant as f32) * pow2(exp)
}

/// 2^k for |k| small enough to stay in f32's normal or subnormal range (const-evaluable).
const fn pow2(k: i32) -> f32 {
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        // Subnormal: 2^k = 2^-149 · 2^(k+149).
        f32::from_bits(1u32 << (k + 149))
    }
}

/// Every e4m3 code decoded once at compile time.
pub static E4M3_LUT: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    t
};

/// UE8M0 scale byte e -> 2^(e - 127); 255 is NaN (OCP MX spec). e = 0 gives the f32
/// subnormal 2^-127, still exact.
#[inline]
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((e as u32) << 23),
    }
}

/// FP4 e2m1 nibble -> value; bit 3 is the sign (so code 8 is -0.0).
pub const FP4_LUT: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Storage class of a float source: what the bytes mean before any block scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FloatDtype {
    F32,
    Bf16,
    F16,
}

impl FloatDtype {
    /// Plain (unscaled) float dtypes a weight may be stored in.
    pub fn from_dtype(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F32 => Some(FloatDtype::F32),
            Dtype::BF16 => Some(FloatDtype::Bf16),
            Dtype::F16 => Some(FloatDtype::F16),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            FloatDtype::F32 => 4,
            FloatDtype::Bf16 | FloatDtype::F16 => 2,
        }
    }
}

/// Decodes `out.len()` plain floats from `bytes` (which must hold exactly that many).
pub fn decode_float(dtype: FloatDtype, bytes: &[u8], out: &mut [f32]) {
    debug_assert_eq!(bytes.len(), out.len() * dtype.size());
    match dtype {
        FloatDtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        FloatDtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        FloatDtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
    }
}

/// Integer dtypes an index table (tid2eid) may be stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IntDtype {
    I8,
    U8,
    I16,
    I32,
    I64,
}

impl IntDtype {
    pub fn from_dtype(d: Dtype) -> Option<Self> {
        match d {
            Dtype::I8 => Some(IntDtype::I8),
            Dtype::U8 => Some(IntDtype::U8),
            Dtype::I16 => Some(IntDtype::I16),
            Dtype::I32 => Some(IntDtype::I32),
            Dtype::I64 => Some(IntDtype::I64),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            IntDtype::I8 | IntDtype::U8 => 1,
            IntDtype::I16 => 2,
            IntDtype::I32 => 4,
            IntDtype::I64 => 8,
        }
    }

    /// Element `i` of `bytes` widened to i64 (no range check).
    #[inline]
    pub fn get(self, bytes: &[u8], i: usize) -> i64 {
        let s = self.size();
        let c = &bytes[i * s..(i + 1) * s];
        match self {
            IntDtype::I8 => c[0] as i8 as i64,
            IntDtype::U8 => c[0] as i64,
            IntDtype::I16 => i16::from_le_bytes([c[0], c[1]]) as i64,
            IntDtype::I32 => i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64,
            IntDtype::I64 => i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]),
        }
    }
}

/// First element of `bytes` outside `[lo, hi)`, as (element index, value). Used to validate
/// an index table before anything is written.
pub fn find_out_of_range(dtype: IntDtype, bytes: &[u8], lo: i64, hi: i64) -> Option<(usize, i64)> {
    let n = bytes.len() / dtype.size();
    (0..n)
        .map(|i| (i, dtype.get(bytes, i)))
        .find(|&(_, v)| v < lo || v >= hi)
}

/// Decodes integers to i32. The caller validated the range (see [`find_out_of_range`]);
/// a value that still does not fit i32 saturates rather than wrapping.
pub fn decode_int(dtype: IntDtype, bytes: &[u8], out: &mut [i32]) {
    debug_assert_eq!(bytes.len(), out.len() * dtype.size());
    for (i, o) in out.iter_mut().enumerate() {
        *o = dtype.get(bytes, i).clamp(i32::MIN as i64, i32::MAX as i64) as i32;
    }
}

/// Dtype of a block-scale tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleDtype {
    /// UE8M0 power-of-two bytes (DeepSeek-V4 `.scale`).
    E8M0,
    /// Plain f32 multipliers (DeepSeek-V3 style `weight_scale_inv`).
    F32,
}

impl ScaleDtype {
    pub fn from_dtype(d: Dtype) -> Option<Self> {
        match d {
            Dtype::F8_E8M0 => Some(ScaleDtype::E8M0),
            Dtype::F32 => Some(ScaleDtype::F32),
            _ => None,
        }
    }

    pub fn size(self) -> usize {
        match self {
            ScaleDtype::E8M0 => 1,
            ScaleDtype::F32 => 4,
        }
    }

    /// Scale element `i` of `bytes`.
    #[inline]
    pub fn get(self, bytes: &[u8], i: usize) -> f32 {
        match self {
            ScaleDtype::E8M0 => e8m0_to_f32(bytes[i]),
            ScaleDtype::F32 => {
                let c = &bytes[4 * i..4 * i + 4];
                f32::from_le_bytes([c[0], c[1], c[2], c[3]])
            }
        }
    }
}

/// Dequantises rows of an FP8 e4m3 matrix with block scales.
///
/// `q` holds `out.len() / cols` consecutive rows of `cols` codes each, the first being row
/// `row0` of a `rows x cols` matrix; `scale` holds that matrix's `ceil(rows/bo) x
/// ceil(cols/bi)` scales. Blocks at the right/bottom edge may be partial ("ragged").
pub fn dequant_fp8_rows(
    q: &[u8],
    scale: &[u8],
    sdt: ScaleDtype,
    row0: usize,
    cols: usize,
    block: [usize; 2],
    out: &mut [f32],
) {
    let [bo, bi] = block;
    let scols = cols.div_ceil(bi);
    for (k, (orow, qrow)) in out
        .chunks_exact_mut(cols)
        .zip(q.chunks_exact(cols))
        .enumerate()
    {
        let srow = (row0 + k) / bo;
        for (cb, (oblk, qblk)) in orow.chunks_mut(bi).zip(qrow.chunks(bi)).enumerate() {
            let s = sdt.get(scale, srow * scols + cb);
            for (o, &b) in oblk.iter_mut().zip(qblk) {
                *o = E4M3_LUT[b as usize] * s;
            }
        }
    }
}

/// Dequantises rows of a packed FP4 e2m1 matrix with 1x32 scales.
///
/// Byte `c` of a row holds column `2c` in its low nibble and `2c + 1` in its high nibble;
/// `scale` holds `ceil(cols/32)` scales per row for exactly the rows in `q`.
pub fn dequant_fp4_rows(q: &[u8], scale: &[u8], sdt: ScaleDtype, cols: usize, out: &mut [f32]) {
    debug_assert_eq!(cols % 2, 0);
    let scols = cols.div_ceil(32);
    for (r, (orow, qrow)) in out
        .chunks_exact_mut(cols)
        .zip(q.chunks_exact(cols / 2))
        .enumerate()
    {
        for (cb, (oblk, qblk)) in orow.chunks_mut(32).zip(qrow.chunks(16)).enumerate() {
            let s = sdt.get(scale, r * scols + cb);
            for (o2, &b) in oblk.chunks_exact_mut(2).zip(qblk) {
                o2[0] = FP4_LUT[(b & 0x0F) as usize] * s;
                o2[1] = FP4_LUT[(b >> 4) as usize] * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Closed form of e4m3fn, written independently of the decoder (float arithmetic).
    fn e4m3_ref(b: u8) -> f64 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = ((b >> 3) & 15) as i32;
        let m = (b & 7) as f64;
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        if e == 0 {
            s * (m / 8.0) * 2f64.powi(-6)
        } else {
            s * (1.0 + m / 8.0) * 2f64.powi(e - 7)
        }
    }

    #[test]
    fn e4m3_all_codes() {
        for b in 0..=255u8 {
            let got = e4m3_to_f32(b);
            let want = e4m3_ref(b);
            if want.is_nan() {
                assert!(
                    got.is_nan() && E4M3_LUT[b as usize].is_nan(),
                    "code {b:#04x}"
                );
                assert!(b == 0x7F || b == 0xFF);
            } else {
                assert_eq!(got as f64, want, "code {b:#04x}");
                assert_eq!(
                    E4M3_LUT[b as usize].to_bits(),
                    got.to_bits(),
                    "LUT code {b:#04x}"
                );
                assert_eq!(
                    got.is_sign_negative(),
                    b & 0x80 != 0,
                    "sign of code {b:#04x}"
                );
            }
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0xFE), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert!(E4M3_LUT.iter().all(|v| !v.is_infinite()));
        // Agrees with the `half`-free closed form for the NaN count: exactly two NaN codes.
        assert_eq!(E4M3_LUT.iter().filter(|v| v.is_nan()).count(), 2);
    }

    #[test]
    fn e8m0_all_codes() {
        for e in 0..=255u8 {
            let got = e8m0_to_f32(e);
            if e == 255 {
                assert!(got.is_nan());
            } else {
                assert_eq!(got as f64, 2f64.powi(e as i32 - 127), "code {e}");
            }
        }
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
    }

    #[test]
    fn fp4_lut_closed_form() {
        // e2m1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal.
        for n in 0..16u8 {
            let s = if n & 8 != 0 { -1.0 } else { 1.0 };
            let e = ((n >> 1) & 3) as i32;
            let m = (n & 1) as f64;
            let v = if e == 0 {
                s * m * 0.5
            } else {
                s * (1.0 + m / 2.0) * 2f64.powi(e - 1)
            };
            assert_eq!(FP4_LUT[n as usize] as f64, v, "nibble {n}");
            assert_eq!(
                FP4_LUT[n as usize].is_sign_negative(),
                n & 8 != 0,
                "sign of nibble {n}"
            );
        }
    }

    #[test]
    fn bf16_f16_all_codes() {
        for bits in 0..=u16::MAX {
            let b = bf16_to_f32(bits);
            let want = half::bf16::from_bits(bits).to_f32();
            assert!(
                b.to_bits() == want.to_bits() || (b.is_nan() && want.is_nan()),
                "bf16 {bits:#06x}"
            );
            // f16 closed form: sign, 5-bit exponent (bias 15), 10-bit mantissa.
            let s = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
            let e = ((bits >> 10) & 31) as i32;
            let m = (bits & 0x3FF) as f64;
            let want = match e {
                0 => s * m * 2f64.powi(-24),
                31 if m == 0.0 => s * f64::INFINITY,
                31 => f64::NAN,
                _ => s * (1.0 + m / 1024.0) * 2f64.powi(e - 15),
            };
            let got = f16_to_f32(bits) as f64;
            assert!(
                got == want || (got.is_nan() && want.is_nan()),
                "f16 {bits:#06x}: {got} vs {want}"
            );
        }
        let mut out = [0.0f32; 2];
        decode_float(FloatDtype::Bf16, &[0x80, 0x3F, 0x00, 0xC0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
        decode_float(FloatDtype::F16, &[0x00, 0x3C, 0x00, 0xC0], &mut out);
        assert_eq!(out, [1.0, -2.0]);
        decode_float(
            FloatDtype::F32,
            &[0, 0, 0x80, 0x3F, 0, 0, 0, 0xC0],
            &mut out,
        );
        assert_eq!(out, [1.0, -2.0]);
    }

    #[test]
    fn integers_and_range() {
        let v: Vec<u8> = [3i64, -1, 7, i64::MAX]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(find_out_of_range(IntDtype::I64, &v, 0, 8), Some((1, -1)));
        assert_eq!(find_out_of_range(IntDtype::I64, &v[..8], 0, 8), None);
        assert_eq!(
            find_out_of_range(IntDtype::I64, &v[16..], 0, 8),
            Some((1, i64::MAX))
        );
        let mut out = [0i32; 4];
        decode_int(IntDtype::I64, &v, &mut out);
        assert_eq!(out, [3, -1, 7, i32::MAX]);
        let mut o1 = [0i32; 2];
        decode_int(IntDtype::I8, &[0xFF, 5], &mut o1);
        assert_eq!(o1, [-1, 5]);
        decode_int(IntDtype::U8, &[0xFF, 5], &mut o1);
        assert_eq!(o1, [255, 5]);
        decode_int(IntDtype::I16, &[0xFE, 0xFF, 5, 0], &mut o1);
        assert_eq!(o1, [-2, 5]);
        decode_int(IntDtype::I32, &[1, 0, 0, 0, 0, 0, 0, 0x80], &mut o1);
        assert_eq!(o1, [1, i32::MIN]);
    }

    #[test]
    fn fp8_block_ragged() {
        // 3x5 matrix, 2x2 blocks -> 2x3 scales, last block row/column partial.
        let q: Vec<u8> = (0..15u8).map(|i| 0x30 + i).collect();
        let scale: Vec<u8> = (0..6u8).map(|i| 120 + i).collect();
        let mut out = vec![0.0f32; 15];
        dequant_fp8_rows(&q, &scale, ScaleDtype::E8M0, 0, 5, [2, 2], &mut out);
        for r in 0..3 {
            for c in 0..5 {
                let s = e8m0_to_f32(scale[(r / 2) * 3 + c / 2]);
                assert_eq!(out[r * 5 + c], e4m3_to_f32(q[r * 5 + c]) * s, "({r},{c})");
            }
        }
        // Decoding only row 2 (row0 = 2) uses the second block row of scales.
        let mut last = vec![0.0f32; 5];
        dequant_fp8_rows(&q[10..], &scale, ScaleDtype::E8M0, 2, 5, [2, 2], &mut last);
        assert_eq!(last, out[10..]);
        // F32 scales.
        let fs: Vec<u8> = [0.5f32, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        let mut o = vec![0.0f32; 3];
        dequant_fp8_rows(
            &[0x38, 0x38, 0x38],
            &fs,
            ScaleDtype::F32,
            0,
            3,
            [1, 2],
            &mut o,
        );
        assert_eq!(o, [0.5, 0.5, 2.0]);
    }

    #[test]
    fn fp4_nibble_order_and_scales() {
        // One row of 66 columns: 33 bytes, scales for 3 blocks (last ragged: 2 columns).
        let q: Vec<u8> = (0..33u8).map(|i| i.wrapping_mul(37)).collect();
        let scale = [127u8, 128, 126];
        let mut out = vec![0.0f32; 66];
        dequant_fp4_rows(&q, &scale, ScaleDtype::E8M0, 66, &mut out);
        for c in 0..66 {
            let b = q[c / 2];
            let nib = if c % 2 == 0 { b & 15 } else { b >> 4 };
            let want = FP4_LUT[nib as usize] * e8m0_to_f32(scale[c / 32]);
            assert_eq!(out[c].to_bits(), want.to_bits(), "column {c}");
        }
        assert_eq!(out[0], 0.0); // byte 0x00: both nibbles 0
        // byte 1 = 37 = 0x25: low nibble 5 -> 3.0 (col 2), high nibble 2 -> 1.0 (col 3)
        assert_eq!((out[2], out[3]), (3.0, 1.0));
    }
}
