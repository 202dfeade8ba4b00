//! f32 primitives of the CPU reference: matmul against row-major weights, RMSNorm,
//! activations and a deterministic top-k. Plain loops; threads only for matmul.

use crate::weights::store::MatRef;
use crate::weights::store::WeightStore;

/// Worker-thread budget of the CPU backend.
#[derive(Clone, Copy, Debug)]
pub struct Threads(pub usize);

/// Dot product accumulated in f64 and rounded once to f32: the correctly rounded value of
/// the (practically) exact sum, independent of summation order. The reference uses this
/// for every reduction so that its results do not depend on batch shape or threading, and
/// so that it agrees with the Python oracles, which do the same.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            acc[i] += x[i] as f64 * y[i] as f64;
        }
    }
    let mut s = (acc[0] + acc[2]) + (acc[1] + acc[3]);
    for (x, y) in ra.iter().zip(rb) {
        s += *x as f64 * *y as f64;
    }
    s as f32
}

/// Sum accumulated in f64, rounded once to f32 (see [`dot`]).
#[inline]
pub fn sum(values: impl Iterator<Item = f32>) -> f32 {
    values.map(f64::from).sum::<f64>() as f32
}

/// `y[t, n] = x[t, :] . w[n, :]` for x: [T, K], w: [N, K] (a linear layer without bias).
pub fn matmul(th: Threads, x: &[f32], k: usize, w: &[f32], y: &mut [f32]) {
    let t = x.len() / k;
    let n = w.len() / k;
    debug_assert_eq!(y.len(), t * n);
    let work = t * n * k;
    let workers = if work < 1 << 16 { 1 } else { th.0.max(1) };
    if workers == 1 || n < workers {
        matmul_cols(x, k, w, 0, n, y, n);
        return;
    }
    // Split the output columns; each worker writes its own strided column block.
    let per = n.div_ceil(workers);
    let yp = SendPtr(y.as_mut_ptr());
    std::thread::scope(|s| {
        for c0 in (0..n).step_by(per) {
            let c1 = (c0 + per).min(n);
            #[allow(clippy::redundant_locals)] // the closure captures the whole Send wrapper
            let yp = yp;
            s.spawn(move || {
                // SAFETY: workers write disjoint column ranges [c0, c1) of every row.
                let y = unsafe { std::slice::from_raw_parts_mut(yp.get(), t * n) };
                matmul_cols(x, k, w, c0, c1, y, n);
            });
        }
    });
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
unsafe impl Send for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

fn matmul_cols(x: &[f32], k: usize, w: &[f32], c0: usize, c1: usize, y: &mut [f32], ldy: usize) {
    for (ti, xr) in x.chunks_exact(k).enumerate() {
        for c in c0..c1 {
            y[ti * ldy + c] = dot(xr, &w[c * k..(c + 1) * k]);
        }
    }
}

/// `y[t, c] = x[t, :] . W[row0 + c, :]` for `c < n`, W in any stored format (rows are
/// dequantized once per call, one at a time).
pub fn matmul_mat(
    th: Threads,
    x: &[f32],
    k: usize,
    w: MatRef,
    row0: usize,
    n: usize,
    y: &mut [f32],
) {
    if let Some(f) = w.as_f32() {
        return matmul(th, x, k, &f[row0 * k..(row0 + n) * k], y);
    }
    let t = x.len() / k;
    let workers = if t * n * k < 1 << 16 {
        1
    } else {
        th.0.max(1).min(n)
    };
    let per = n.div_ceil(workers);
    let yp = SendPtr(y.as_mut_ptr());
    let run = move |c0: usize, c1: usize| {
        // SAFETY: callers give disjoint column ranges [c0, c1) of every row.
        let y = unsafe { std::slice::from_raw_parts_mut(yp.get(), t * n) };
        let mut row = vec![0.0f32; k];
        for c in c0..c1 {
            w.row_into(row0 + c, k, &mut row);
            for (ti, xr) in x.chunks_exact(k).enumerate() {
                y[ti * n + c] = dot(xr, &row);
            }
        }
    };
    if workers == 1 {
        run(0, n);
        return;
    }
    std::thread::scope(|s| {
        for c0 in (0..n).step_by(per) {
            s.spawn(move || run(c0, (c0 + per).min(n)));
        }
    });
}

/// `x · Wᵀ` for every row of weight `idx` of `w`, in its stored format (plain f32 sums: the
/// f32 GEMMs of the official code, e.g. the compressors' and the head's).
pub fn linear_weight(th: Threads, x: &[f32], k: usize, w: &WeightStore, idx: usize) -> Vec<f32> {
    let n = w.tensor(idx).spec.shape[0];
    let mut y = vec![0.0; x.len() / k * n];
    matmul_mat(th, x, k, w.matrix(idx), 0, n, &mut y);
    y
}

/// Allocating convenience form of [`matmul`].
pub fn linear(th: Threads, x: &[f32], k: usize, w: &[f32]) -> Vec<f32> {
    let mut y = vec![0.0; x.len() / k * (w.len() / k)];
    matmul(th, x, k, w, &mut y);
    y
}

/// In-place RMSNorm of every `dim`-row of `x`, with optional weight.
pub fn rms_norm(x: &mut [f32], dim: usize, weight: Option<&[f32]>, eps: f32) {
    for row in x.chunks_exact_mut(dim) {
        let ms = (row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64) as f32;
        let r = rsqrt(ms + eps);
        match weight {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, g)| *v = *v * r * g),
            None => row.iter_mut().for_each(|v| *v *= r),
        }
    }
}

// Elementwise functions are evaluated in f64 and rounded once to f32 (correctly rounded
// for practical purposes), so the reference does not depend on a libm's last-ulp choices
// and agrees bit for bit with the Python oracles, which follow the same convention.

/// e^x.
pub fn exp(x: f32) -> f32 {
    (x as f64).exp() as f32
}

/// 1 / (1 + e^-x).
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

/// x * sigmoid(x).
pub fn silu(x: f32) -> f32 {
    let x = x as f64;
    (x / (1.0 + (-x).exp())) as f32
}

/// torch's softplus (beta 1, threshold 20: linear above).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (x as f64).exp().ln_1p() as f32
    }
}

/// 1 / sqrt(x).
pub fn rsqrt(x: f32) -> f32 {
    (1.0 / (x as f64).sqrt()) as f32
}

/// n^-1/2 as an f32 constant.
pub fn inv_sqrt(n: usize) -> f32 {
    (n as f64).powf(-0.5) as f32
}

/// Indices of the `k` largest values, ties broken toward the LOWER index (project rule);
/// NaN ranks below everything.
pub fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let key = |i: usize| {
        if values[i].is_nan() {
            f32::NEG_INFINITY
        } else {
            values[i]
        }
    };
    idx.sort_by(|&a, &b| {
        key(b)
            .partial_cmp(&key(a))
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    idx.truncate(k.min(values.len()));
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_naive_threaded() {
        let (t, k, n) = (5, 67, 300);
        let x: Vec<f32> = (0..t * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0)
            .collect();
        let mut y = vec![f32::NAN; t * n];
        matmul(Threads(3), &x, k, &w, &mut y);
        for ti in 0..t {
            for c in 0..n {
                let r: f64 = (0..k)
                    .map(|j| x[ti * k + j] as f64 * w[c * k + j] as f64)
                    .sum();
                assert!((y[ti * n + c] as f64 - r).abs() < 1e-4, "{ti},{c}");
            }
        }
    }

    #[test]
    fn top_k_prefers_lower_index_on_ties() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 2.0, 3.0], 2), vec![1, 2]);
        assert_eq!(top_k(&[f32::NAN, 0.0, 0.0], 3), vec![1, 2, 0]);
        assert_eq!(top_k(&[1.0], 4), vec![0]);
    }

    #[test]
    fn rms_norm_closed_form() {
        let mut x = vec![3.0, 4.0];
        rms_norm(&mut x, 2, Some(&[1.0, 2.0]), 0.0);
        let r = 1.0 / 12.5f32.sqrt();
        assert!((x[0] - 3.0 * r).abs() < 1e-6 && (x[1] - 8.0 * r).abs() < 1e-6);
    }

    #[test]
    fn softplus_matches_torch_threshold() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
    }
}
