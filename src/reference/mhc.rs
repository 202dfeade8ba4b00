//! Manifold-constrained hyper-connections (MODEL.md §5): hc_pre (flat RMS scale, mixing
//! projection, sigmoid gates, Sinkhorn, collapse), hc_post and hc_head.

use super::ops::{Threads, exp, matmul, rsqrt, sigmoid, sum};

/// Parameters of one mHC site, borrowed from the weight store.
pub struct HcParams<'a> {
    /// [(2+N)*N, N*D] for a layer site, [N, N*D] for the head.
    pub proj: &'a [f32],
    pub base: &'a [f32],
    pub scale: &'a [f32],
    /// Layer 0's attention site only: [`fold_projection`] of `proj`, used instead of it
    /// (every stream holds the same embedding there).
    pub fold: Option<&'a [f64]>,
}

pub use crate::model::hc_fold::fold_projection;

/// [`mix_logits`] of tokens whose N streams are equal, from stream 0 and the fold.
fn mix_logits_folded(x: &[f32], nd: usize, d: usize, fold: &[f64], eps: f32) -> Vec<f32> {
    let t = x.len() / nd;
    let m_dim = fold.len() / d;
    let mut m = vec![0.0; t * m_dim];
    for (ti, row) in m.chunks_exact_mut(m_dim).enumerate() {
        let xr = &x[ti * nd..ti * nd + d];
        for (j, o) in row.iter_mut().enumerate() {
            let w = &fold[j * d..(j + 1) * d];
            *o = xr.iter().zip(w).map(|(&a, &b)| a as f64 * b).sum::<f64>() as f32;
        }
        let ms = (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64) as f32;
        let rho = rsqrt(ms + eps);
        row.iter_mut().for_each(|v| *v *= rho);
    }
    m
}

/// Per-token RMS scale rho = rsqrt(mean(x^2) + eps) over the flattened N*D streams,
/// and the scaled mixing logits m = rho * (Phi x) for every token.
fn mix_logits(th: Threads, x: &[f32], nd: usize, proj: &[f32], eps: f32) -> Vec<f32> {
    let t = x.len() / nd;
    let m_dim = proj.len() / nd;
    let mut m = vec![0.0; t * m_dim];
    matmul(th, x, nd, proj, &mut m);
    for (ti, row) in m.chunks_exact_mut(m_dim).enumerate() {
        let xr = &x[ti * nd..(ti + 1) * nd];
        let ms = (xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / nd as f64) as f32;
        let rho = rsqrt(ms + eps);
        row.iter_mut().for_each(|v| *v *= rho);
    }
    m
}

/// The exact Sinkhorn iteration of the official kernel on an N x N logit matrix (in place):
/// row softmax + eps, column normalise, then (iters - 1) x (row, column) normalisation.
pub fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    // Sums in f64 rounded once (order-independent); eps added in f32 afterwards.
    for row in c.chunks_exact_mut(n) {
        let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        row.iter_mut().for_each(|v| *v = exp(*v - mx));
        let s = sum(row.iter().copied());
        row.iter_mut().for_each(|v| *v = *v / s + eps);
    }
    let col_norm = |c: &mut [f32]| {
        for k in 0..n {
            let s = sum((0..n).map(|j| c[j * n + k])) + eps;
            (0..n).for_each(|j| c[j * n + k] /= s);
        }
    };
    col_norm(c);
    for _ in 1..iters {
        for row in c.chunks_exact_mut(n) {
            let s = sum(row.iter().copied()) + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
        col_norm(c);
    }
}

/// Output of hc_pre for T tokens.
pub struct HcPre {
    /// Collapsed block input u: [T, D].
    pub u: Vec<f32>,
    /// post gates: [T, N].
    pub post: Vec<f32>,
    /// Sinkhorn-normalised mixing matrices C[j, k]: [T, N, N].
    pub comb: Vec<f32>,
}

/// hc_pre over streams x: [T, N, D].
#[allow(clippy::too_many_arguments)]
pub fn hc_pre(
    th: Threads,
    x: &[f32],
    n: usize,
    d: usize,
    p: &HcParams,
    iters: usize,
    hc_eps: f32,
    rms_eps: f32,
) -> HcPre {
    let nd = n * d;
    let t = x.len() / nd;
    let m = match p.fold {
        Some(f) => mix_logits_folded(x, nd, d, f, rms_eps),
        None => mix_logits(th, x, nd, p.proj, rms_eps),
    };
    let mix = (2 + n) * n;
    let (a0, a1, a2) = (p.scale[0], p.scale[1], p.scale[2]);
    let mut u = vec![0.0; t * d];
    let mut post = vec![0.0; t * n];
    let mut comb = vec![0.0; t * n * n];
    for ti in 0..t {
        let mr = &m[ti * mix..(ti + 1) * mix];
        let pre: Vec<f32> = (0..n)
            .map(|i| sigmoid(a0 * mr[i] + p.base[i]) + hc_eps)
            .collect();
        for i in 0..n {
            post[ti * n + i] = 2.0 * sigmoid(a1 * mr[n + i] + p.base[n + i]);
        }
        let c = &mut comb[ti * n * n..(ti + 1) * n * n];
        for i in 0..n * n {
            c[i] = a2 * mr[2 * n + i] + p.base[2 * n + i];
        }
        sinkhorn(c, n, iters, hc_eps);
        let ur = &mut u[ti * d..(ti + 1) * d];
        for (i, o) in ur.iter_mut().enumerate() {
            *o = sum((0..n).map(|s| pre[s] * x[ti * nd + s * d + i]));
        }
    }
    HcPre { u, post, comb }
}

/// hc_post in place: `X'[k] = post_k * a + sum_j C[j, k] * X[j]`.
pub fn hc_post(x: &mut [f32], a: &[f32], pre: &HcPre, n: usize, d: usize) {
    let nd = n * d;
    let mut out = vec![0.0; nd];
    for (ti, xt) in x.chunks_exact_mut(nd).enumerate() {
        let at = &a[ti * d..(ti + 1) * d];
        let c = &pre.comb[ti * n * n..(ti + 1) * n * n];
        for k in 0..n {
            let pk = pre.post[ti * n + k];
            for i in 0..d {
                // sum_j C[j,k] X[j] in f64 (rounded once), then post_k * a + mix in f32.
                let mix = (0..n)
                    .map(|j| c[j * n + k] as f64 * xt[j * d + i] as f64)
                    .sum::<f64>() as f32;
                out[k * d + i] = pk * at[i] + mix;
            }
        }
        xt.copy_from_slice(&out);
    }
}

/// hc_head: `y = sum_n (sigmoid(alpha * m_n + beta_n) + eps) X[n]`, no Sinkhorn. Returns [T, D].
pub fn hc_head(
    th: Threads,
    x: &[f32],
    n: usize,
    d: usize,
    p: &HcParams,
    hc_eps: f32,
    rms_eps: f32,
) -> Vec<f32> {
    let nd = n * d;
    let t = x.len() / nd;
    let m = mix_logits(th, x, nd, p.proj, rms_eps);
    let mut y = vec![0.0; t * d];
    for ti in 0..t {
        let w: Vec<f32> = (0..n)
            .map(|s| sigmoid(m[ti * n + s] * p.scale[0] + p.base[s]) + hc_eps)
            .collect();
        for (i, o) in y[ti * d..(ti + 1) * d].iter_mut().enumerate() {
            *o = sum((0..n).map(|s| w[s] * x[ti * nd + s * d + i]));
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_columns_sum_to_one() {
        let mut c: Vec<f32> = (0..16).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.8).collect();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for k in 0..4 {
            let s: f32 = (0..4).map(|j| c[j * 4 + k]).sum();
            assert!((s - 1.0).abs() < 1e-5, "column {k} sums to {s}");
        }
        assert!(c.iter().all(|v| *v > 0.0));
    }

    #[test]
    fn sinkhorn_one_iteration_is_softmax_then_column_norm() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let mut c = logits.to_vec();
        sinkhorn(&mut c, 2, 1, 0.0);
        let e = |v: f32| v.exp();
        let r0 = [e(0.0) / (e(0.0) + e(1.0)), e(1.0) / (e(0.0) + e(1.0))];
        let r1 = [e(2.0) / (e(2.0) + e(3.0)), e(3.0) / (e(2.0) + e(3.0))];
        let want = [
            r0[0] / (r0[0] + r1[0]),
            r0[1] / (r0[1] + r1[1]),
            r1[0] / (r0[0] + r1[0]),
            r1[1] / (r0[1] + r1[1]),
        ];
        for (a, b) in c.iter().zip(want) {
            assert!((a - b).abs() < 1e-6);
        }
    }

    #[test]
    fn hc_post_contracts_over_first_index() {
        // N = 2, D = 1: X' [k] = post_k a + sum_j C[j,k] X[j].
        let pre = HcPre {
            u: vec![],
            post: vec![0.5, 2.0],
            comb: vec![0.1, 0.2, 0.3, 0.4],
        };
        let mut x = vec![10.0, 100.0];
        hc_post(&mut x, &[1.0], &pre, 2, 1);
        assert!((x[0] - (0.5 + 0.1 * 10.0 + 0.3 * 100.0)).abs() < 1e-5);
        assert!((x[1] - (2.0 + 0.2 * 10.0 + 0.4 * 100.0)).abs() < 1e-5);
    }
}
