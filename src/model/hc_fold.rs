//! The derived "layer-0 mHC broadcast weight" (docs/numerics.md), shared by both backends.

/// dsv4_weight_info name of the derived layer-0 folded mHC projection (both backends).
pub const HC0_FOLD_NAME: &str = "derived:layers.0.hc_attn_fn.stream_fold";

/// At layer 0 every stream holds the embedding, so Φ·[e, e, .., e] = (Σ_n Φ_n)·e and mean(x²)
/// over N*D equals mean(e²) over D. The fold [(2+N)*N, D] is kept in f64: a sum of N f32
/// values is exact there (for the usual exponent spread), and so are its products with f32
/// activations, so the folded logits equal the unfolded ones except where an f64 rounding
/// error (~1e-16) straddles an f32 rounding boundary. The kernel reads D instead of N*D
/// columns. Rebuilt whenever `proj` changes.
pub fn fold_projection(proj: &[f32], n: usize, d: usize, out: &mut [f64]) {
    let mix = proj.len() / (n * d);
    debug_assert_eq!(out.len(), mix * d);
    for j in 0..mix {
        for i in 0..d {
            // In stream order from +0.0: mhc.cu hc0_fold_kernel sums the same way.
            let mut acc = 0.0f64;
            for s in 0..n {
                acc += proj[j * n * d + s * d + i] as f64;
            }
            out[j * d + i] = acc;
        }
    }
}
