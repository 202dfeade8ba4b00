//! Row chunks of a weight in its storage layout: which value bytes and which scales rows
//! `[r0, r1)` occupy, how a weight splits into chunks that a staging buffer holds, and the
//! quantizer that writes a chunk (the official rules of MODEL.md §8).
//!
//! Every writer of weights goes through this: the CPU store writes a weight as one chunk in
//! place, the CUDA upload writes chunks into pinned staging buffers and copies each to its
//! place in the arena (src/cuda/upload.rs). Both produce the same bytes.

use std::ops::Range;

use crate::weights::qmatrix::{FP4_BLOCK, QFormat};
use crate::weights::quant::{E2M1_MAX, E4M3_MAX, e2m1_encode, e4m3_encode, ue8m0_scale};
use crate::weights::table::{StorageKind, TableEntry};

/// The storage geometry of one weight's matrix view `[rows, cols]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub kind: StorageKind,
    pub rows: usize,
    pub cols: usize,
}

impl Geometry {
    pub fn of(e: &TableEntry) -> Geometry {
        Geometry {
            kind: e.layout.kind,
            rows: e.rows(),
            cols: e.cols(),
        }
    }

    /// Bytes of one row's values (codes for quantized storage).
    pub fn row_bytes(&self) -> usize {
        match self.kind {
            StorageKind::F32 | StorageKind::I32 => self.cols * 4,
            StorageKind::Bf16 => self.cols * 2,
            StorageKind::Quant(QFormat::Fp8 { .. }) => self.cols,
            StorageKind::Quant(QFormat::Fp4) => self.cols.div_ceil(2),
        }
    }

    /// A chunk starts at a multiple of this many rows: FP8 scales cover blocks of rows, and a
    /// chunk is quantized on its own.
    pub fn row_align(&self) -> usize {
        match self.kind {
            StorageKind::Quant(QFormat::Fp8 { block }) => block[0].max(1),
            _ => 1,
        }
    }

    /// Value bytes of rows `rows`.
    pub fn data_range(&self, rows: &Range<usize>) -> Range<usize> {
        rows.start * self.row_bytes()..rows.end * self.row_bytes()
    }

    /// Indices of the f32 scales that cover rows `rows` (a chunk: start aligned, see
    /// [`Geometry::row_align`]); empty for unquantized storage.
    pub fn scale_range(&self, rows: &Range<usize>) -> Range<usize> {
        match self.kind {
            StorageKind::Quant(QFormat::Fp8 { block }) => {
                let per_row = self.cols.div_ceil(block[1].max(1));
                let bo = block[0].max(1);
                (rows.start / bo) * per_row..rows.end.div_ceil(bo) * per_row
            }
            StorageKind::Quant(QFormat::Fp4) => {
                let per_row = self.cols.div_ceil(FP4_BLOCK);
                rows.start * per_row..rows.end * per_row
            }
            _ => 0..0,
        }
    }

    /// Bytes a chunk of rows `rows` takes in a staging buffer: values, then f32 scales.
    pub fn chunk_bytes(&self, rows: &Range<usize>) -> usize {
        self.data_range(rows).len() + 4 * self.scale_range(rows).len()
    }

    /// Rows `[0, rows)` split into chunks of at most `max_bytes` each (values and scales),
    /// starting at multiples of [`Geometry::row_align`]. A weight whose smallest chunk (one
    /// aligned group of rows) exceeds `max_bytes` still gets that chunk: the caller checks
    /// [`Geometry::min_chunk_bytes`] against its buffers first.
    pub fn chunks(&self, max_bytes: usize) -> Vec<Range<usize>> {
        let align = self.row_align();
        let group = self.chunk_bytes(&(0..align.min(self.rows))).max(1);
        let step = ((max_bytes / group).max(1) * align).max(1);
        (0..self.rows.div_ceil(step))
            .map(|k| k * step..((k + 1) * step).min(self.rows))
            .collect()
    }

    /// Bytes of the smallest chunk (one aligned group of rows).
    pub fn min_chunk_bytes(&self) -> usize {
        self.chunk_bytes(&(0..self.row_align().min(self.rows)))
    }
}

/// Quantizes `src` (whole rows of `cols` values, starting at a block-row boundary for FP8)
/// into `codes` and `scales` (the chunk's own, [`Geometry::data_range`] /
/// [`Geometry::scale_range`]): UE8M0 power-of-two scales from each block's amax,
/// round-to-nearest-even codes, saturating. Values must be finite (callers check first).
pub fn quantize_rows(
    format: QFormat,
    src: &[f32],
    cols: usize,
    codes: &mut [u8],
    scales: &mut [f32],
) {
    let rows = src.len().checked_div(cols).unwrap_or(0);
    match format {
        QFormat::Fp8 { block } => {
            let scols = cols.div_ceil(block[1]);
            for br in 0..rows.div_ceil(block[0]) {
                let r1 = ((br + 1) * block[0]).min(rows);
                for bc in 0..scols {
                    let c1 = ((bc + 1) * block[1]).min(cols);
                    let mut amax = 0.0f32;
                    for r in br * block[0]..r1 {
                        src[r * cols + bc * block[1]..r * cols + c1]
                            .iter()
                            .for_each(|v| amax = amax.max(v.abs()));
                    }
                    let (_, s) = ue8m0_scale(amax.max(1e-4), E4M3_MAX);
                    scales[br * scols + bc] = s;
                    for r in br * block[0]..r1 {
                        for j in bc * block[1]..c1 {
                            codes[r * cols + j] =
                                e4m3_encode((src[r * cols + j] / s).clamp(-E4M3_MAX, E4M3_MAX));
                        }
                    }
                }
            }
        }
        QFormat::Fp4 => {
            let scols = cols.div_ceil(FP4_BLOCK);
            let half = cols.div_ceil(2);
            for r in 0..rows {
                for bc in 0..scols {
                    let (c0, c1) = (bc * FP4_BLOCK, ((bc + 1) * FP4_BLOCK).min(cols));
                    let vals = &src[r * cols + c0..r * cols + c1];
                    let amax = vals
                        .iter()
                        .fold(0.0f32, |m, v| m.max(v.abs()))
                        .max(E2M1_MAX * f32::MIN_POSITIVE);
                    let (_, s) = ue8m0_scale(amax, E2M1_MAX);
                    scales[r * scols + bc] = s;
                    for j in c0..c1 {
                        let nib = e2m1_encode((src[r * cols + j] / s).clamp(-E2M1_MAX, E2M1_MAX));
                        let b = &mut codes[r * half + j / 2];
                        *b = if j % 2 == 0 {
                            (*b & 0xf0) | nib
                        } else {
                            (*b & 0x0f) | (nib << 4)
                        };
                    }
                }
            }
        }
    }
}

/// Writes `values` (whole rows) into a chunk of unquantized or quantized storage: f32 as is,
/// BF16 rounded to nearest even, quantized per [`quantize_rows`].
pub fn encode_rows(
    kind: StorageKind,
    values: &[f32],
    cols: usize,
    data: &mut [u8],
    scales: &mut [f32],
) {
    match kind {
        StorageKind::F32 => data
            .chunks_exact_mut(4)
            .zip(values)
            .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        StorageKind::Bf16 => data.chunks_exact_mut(2).zip(values).for_each(|(o, v)| {
            o.copy_from_slice(&half::bf16::from_f32(*v).to_bits().to_le_bytes())
        }),
        StorageKind::Quant(q) => quantize_rows(q, values, cols, data, scales),
        // Index tables never hold floats (the plan pairs encodings with kinds).
        StorageKind::I32 => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom(kind: StorageKind, rows: usize, cols: usize) -> Geometry {
        Geometry { kind, rows, cols }
    }

    #[test]
    fn chunks_cover_every_row_once_and_align_fp8_blocks() {
        let fp8 = geom(
            StorageKind::Quant(QFormat::Fp8 { block: [128, 128] }),
            1000,
            300,
        );
        // One 128-row group: 128 * 300 code bytes + 1 * 3 scales.
        assert_eq!(fp8.min_chunk_bytes(), 128 * 300 + 12);
        let ch = fp8.chunks(3 * fp8.min_chunk_bytes() + 5);
        assert_eq!(ch.first(), Some(&(0..384)));
        assert_eq!(ch.last(), Some(&(768..1000)));
        let mut next = 0;
        for c in &ch {
            assert_eq!(c.start, next);
            assert_eq!(c.start % 128, 0);
            assert!(fp8.chunk_bytes(c) <= 3 * fp8.min_chunk_bytes() + 5);
            next = c.end;
        }
        assert_eq!(next, 1000);
        // Scale ranges of consecutive chunks tile the grid [8, 3].
        assert_eq!(fp8.scale_range(&(0..384)), 0..9);
        assert_eq!(fp8.scale_range(&(768..1000)), 18..24);
        let fp4 = geom(StorageKind::Quant(QFormat::Fp4), 10, 70);
        assert_eq!(fp4.row_bytes(), 35);
        assert_eq!(fp4.scale_range(&(2..5)), 6..15);
        // A budget below one row still makes progress, one row at a time.
        assert_eq!(geom(StorageKind::F32, 3, 8).chunks(1).len(), 3);
    }

    #[test]
    fn chunked_quantization_equals_whole_matrix_quantization() {
        let (rows, cols) = (300, 200);
        let src: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * if i % 11 == 0 { 3.0 } else { 0.01 })
            .collect();
        for q in [QFormat::Fp8 { block: [128, 128] }, QFormat::Fp4] {
            let g = geom(StorageKind::Quant(q), rows, cols);
            let mut m = crate::weights::qmatrix::QMatrix::zeros(q, rows, cols);
            m.quantize_from(&src);
            let (mut codes, mut scales) = (vec![0u8; m.codes.len()], vec![0f32; m.scales.len()]);
            for c in g.chunks(g.min_chunk_bytes() * 2) {
                let (d, s) = (g.data_range(&c), g.scale_range(&c));
                quantize_rows(
                    q,
                    &src[c.start * cols..c.end * cols],
                    cols,
                    &mut codes[d],
                    &mut scales[s],
                );
            }
            assert_eq!(codes, m.codes, "{q:?}");
            assert_eq!(scales, m.scales, "{q:?}");
        }
    }
}
