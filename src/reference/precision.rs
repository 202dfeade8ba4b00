//! The numerics policy of one forward (docs/numerics.md): `exact` leaves every value f32;
//! `official` rounds to BF16 at the official boundaries, quantizes GEMM activations to FP8
//! when the weight is quantized, and applies the KV / indexer fake-quantisation.

use super::ops::{Threads, matmul_mat};
use crate::weights::quant::{fp4_sim, fp8_sim, round_bf16};
use crate::weights::store::WeightStore;

/// Block of the per-token activation quantisation before FP8/FP4 GEMMs.
const ACT_BLOCK: usize = 128;
/// Block of the FP8 simulation of KV nope channels.
pub const KV_BLOCK: usize = 64;
/// Block of the FP4 simulation of indexer queries and keys.
pub const INDEX_BLOCK: usize = 32;

#[derive(Clone, Copy, Debug)]
pub struct Prec {
    pub official: bool,
}

impl Prec {
    /// `-> bf16` of the table: rounds in official mode, no-op in exact mode.
    pub fn bf16(self, x: &mut [f32]) {
        if self.official {
            round_bf16(x);
        }
    }

    /// Nope channels `[0, nope)` of every `dim`-row: FP8 simulation in blocks of 64.
    pub fn kv_nope_sim(self, x: &mut [f32], dim: usize, nope: usize) {
        if self.official {
            x.chunks_exact_mut(dim)
                .for_each(|r| fp8_sim(&mut r[..nope], KV_BLOCK));
        }
    }

    /// Indexer query/key quantisation of every `dim`-row: Hadamard then FP4 simulation.
    pub fn index_sim(self, x: &mut [f32], dim: usize) {
        if self.official {
            for r in x.chunks_exact_mut(dim) {
                hadamard(r);
                fp4_sim(r, INDEX_BLOCK);
                round_bf16(r);
            }
        }
    }

    /// A linear layer on rows `x` ([T, k]) with weight `idx`: `qlinear` (FP8 activation
    /// quantisation, BF16 output) for quantized weights and `blinear` (BF16 output) for
    /// others in official mode; plain f32 in exact mode.
    pub fn linear(self, th: Threads, w: &WeightStore, idx: usize, x: &[f32], k: usize) -> Vec<f32> {
        let n = w.tensor(idx).spec.shape[0];
        self.linear_rows(th, w, idx, 0, n, x, k)
    }

    /// [`Prec::linear`] against rows `[row0, row0 + n)` of weight `idx` (a group of wo_a).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_rows(
        self,
        th: Threads,
        w: &WeightStore,
        idx: usize,
        row0: usize,
        n: usize,
        x: &[f32],
        k: usize,
    ) -> Vec<f32> {
        let mut y = vec![0.0; x.len() / k * n];
        if self.official && w.is_quantized(idx) {
            let mut xq = x.to_vec();
            xq.chunks_exact_mut(k).for_each(|r| fp8_sim(r, ACT_BLOCK));
            matmul_mat(th, &xq, k, w.matrix(idx), row0, n, &mut y);
        } else {
            matmul_mat(th, x, k, w.matrix(idx), row0, n, &mut y);
        }
        self.bf16(&mut y);
        y
    }

    /// `blinear`: a BF16-output linear that never quantizes activations (wo_a, whose FP8
    /// weight the official code dequantizes to BF16; weights_proj).
    #[allow(clippy::too_many_arguments)]
    pub fn linear_bf16(
        self,
        th: Threads,
        w: &WeightStore,
        idx: usize,
        row0: usize,
        n: usize,
        x: &[f32],
        k: usize,
    ) -> Vec<f32> {
        let mut y = vec![0.0; x.len() / k * n];
        matmul_mat(th, x, k, w.matrix(idx), row0, n, &mut y);
        self.bf16(&mut y);
        y
    }
}

/// Normalised Walsh–Hadamard transform (Sylvester order) in place; len must be a power of
/// two. The butterflies run in f64 (exact for these sizes) and each output is rounded once
/// to f32 before the f32 scale `len^-1/2`, like the oracle's `f32(H x) * f32(n^-1/2)`.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut y: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (y[j], y[j + h]);
                y[j] = a + b;
                y[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = super::ops::inv_sqrt(n);
    x.iter_mut().zip(&y).for_each(|(o, &v)| *o = v as f32 * s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hadamard_matches_sylvester_matrix_and_is_orthogonal() {
        // H_4 (Sylvester) rows: ++++, +-+-, ++--, +--+.
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        hadamard(&mut x);
        let want = [10.0, -2.0, -4.0, 0.0].map(|v: f32| v / 2.0);
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6);
        }
        hadamard(&mut x);
        for (a, b) in x.iter().zip([1.0, 2.0, 3.0, 4.0]) {
            assert!((a - b).abs() < 1e-5, "H is its own inverse");
        }
    }
}
