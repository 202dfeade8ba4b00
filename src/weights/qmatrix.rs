//! A weight matrix held in a quantized stored format: FP8 e4m3 codes with block scales, or
//! packed FP4 e2m1 codes with 1x32 scales (MODEL.md §8). Scales are kept as f32 values
//! (UE8M0 checkpoints give powers of two; F32-scaled checkpoints keep theirs exactly).
//! Rows are dequantized on demand; writes quantize with the official rounding rules.

use super::dtype::{E4M3_LUT, FP4_LUT};

/// Scale block of FP4 experts along the input dimension.
pub const FP4_BLOCK: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QFormat {
    /// FP8 e4m3fn, one scale per `[rows, cols]` block.
    Fp8 { block: [usize; 2] },
    /// FP4 e2m1, two codes per byte (low nibble = even column), one scale per 1x32.
    Fp4,
}

/// A `[rows, cols]` matrix (possibly a stack `[.., rows, cols]` flattened to rows) in a
/// quantized format. Allocated once; written in place.
pub struct QMatrix {
    pub format: QFormat,
    pub rows: usize,
    pub cols: usize,
    pub codes: Vec<u8>,
    pub scales: Vec<f32>,
}

impl QMatrix {
    /// Zero matrix of the given format (all allocation happens here).
    pub fn zeros(format: QFormat, rows: usize, cols: usize) -> Self {
        let (ncodes, nscales) = match format {
            QFormat::Fp8 { block } => (
                rows * cols,
                rows.div_ceil(block[0]) * cols.div_ceil(block[1]),
            ),
            QFormat::Fp4 => (rows * cols.div_ceil(2), rows * cols.div_ceil(FP4_BLOCK)),
        };
        QMatrix {
            format,
            rows,
            cols,
            codes: vec![0; ncodes],
            scales: vec![1.0; nscales],
        }
    }

    /// Scale-grid columns per scale row.
    fn scale_cols(&self) -> usize {
        match self.format {
            QFormat::Fp8 { block } => self.cols.div_ceil(block[1]),
            QFormat::Fp4 => self.cols.div_ceil(FP4_BLOCK),
        }
    }

    /// Dequantizes row `r` into `out` (`cols` values).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        match self.format {
            QFormat::Fp8 { block } => {
                let srow = &self.scales[(r / block[0]) * self.scale_cols()..][..self.scale_cols()];
                let codes = &self.codes[r * c..(r + 1) * c];
                for (j, (o, &q)) in out.iter_mut().zip(codes).enumerate() {
                    *o = E4M3_LUT[q as usize] * srow[j / block[1]];
                }
            }
            QFormat::Fp4 => {
                let srow = &self.scales[r * self.scale_cols()..(r + 1) * self.scale_cols()];
                let bytes = &self.codes[r * c.div_ceil(2)..(r + 1) * c.div_ceil(2)];
                for j in 0..c {
                    let nib = if j % 2 == 0 {
                        bytes[j / 2] & 0xf
                    } else {
                        bytes[j / 2] >> 4
                    };
                    out[j] = FP4_LUT[nib as usize] * srow[j / FP4_BLOCK];
                }
            }
        }
    }

    /// Quantizes all `rows x cols` values of `src` into this matrix (official rules: UE8M0
    /// power-of-two scales from the block amax, round-to-nearest-even codes). Values must be
    /// finite (callers check first).
    pub fn quantize_from(&mut self, src: &[f32]) {
        debug_assert_eq!(src.len(), self.rows * self.cols);
        crate::weights::rows::quantize_rows(
            self.format,
            src,
            self.cols,
            &mut self.codes,
            &mut self.scales,
        );
    }

    /// Bytes of codes + scales (f32), for introspection.
    pub fn nbytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0)
                    * if i % 7 == 0 { 30.0 } else { 1.0 }
            })
            .collect()
    }

    #[test]
    fn fp8_quantize_dequantize_ragged_blocks() {
        // 130 x 200 with 128x128 blocks: ragged edge blocks in both dimensions.
        let (r, c) = (130, 200);
        let src = sample(r * c);
        let mut m = QMatrix::zeros(QFormat::Fp8 { block: [128, 128] }, r, c);
        m.quantize_from(&src);
        assert_eq!(m.scales.len(), 2 * 2);
        let mut row = vec![0.0; c];
        for i in [0, 127, 128, 129] {
            m.row(i, &mut row);
            for j in 0..c {
                let s = m.scales[(i / 128) * 2 + j / 128];
                assert!(s.log2().fract() == 0.0, "scale is a power of two");
                // e4m3 keeps 3 mantissa bits: relative error <= 2^-4 unless subnormal.
                assert!(
                    (row[j] - src[i * c + j]).abs()
                        <= src[i * c + j].abs() / 16.0 + s * 2f32.powi(-9),
                    "{i},{j}"
                );
            }
        }
        // Re-quantizing the dequantized values reproduces them exactly.
        let deq: Vec<f32> = (0..r)
            .flat_map(|i| {
                let mut v = vec![0.0; c];
                m.row(i, &mut v);
                v
            })
            .collect();
        let mut m2 = QMatrix::zeros(QFormat::Fp8 { block: [128, 128] }, r, c);
        m2.quantize_from(&deq);
        let deq2: Vec<f32> = (0..r)
            .flat_map(|i| {
                let mut v = vec![0.0; c];
                m2.row(i, &mut v);
                v
            })
            .collect();
        assert_eq!(deq, deq2);
    }

    #[test]
    fn fp4_nibble_order_and_scales() {
        let (r, c) = (2, 64);
        let mut src = vec![0.0f32; r * c];
        src[0] = 6.0; // even column -> low nibble of byte 0
        src[1] = -1.0; // odd column -> high nibble of byte 0
        src[c + 33] = 3.0; // second scale block of row 1
        let mut m = QMatrix::zeros(QFormat::Fp4, r, c);
        m.quantize_from(&src);
        assert_eq!(
            m.codes[0],
            0x7 | (0xa << 4),
            "6.0 = code 7 low, -1.0 = code 0xa high"
        );
        assert_eq!(m.scales[0], 1.0);
        let mut row = vec![0.0; c];
        m.row(1, &mut row);
        assert_eq!(row[33], 3.0);
        assert!(row.iter().enumerate().all(|(j, v)| j == 33 || *v == 0.0));
    }
}
