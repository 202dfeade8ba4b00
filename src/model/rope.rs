//! RoPE inverse frequencies (MODEL.md §3.2): plain for sliding layers, `compress_rope_theta`
//! with YaRN for compressed layers. Computed from the config in f64 and rounded once to
//! f32 (never from a BF16 table: MODEL.md pitfall 15).

use crate::config::{AttnKind, ModelConfig, Yarn};

/// Inverse frequencies `f_k`, k = 0 .. rope_dim/2, for one layer kind.
pub fn inv_freq(cfg: &ModelConfig, kind: AttnKind) -> Vec<f32> {
    match kind {
        AttnKind::Sliding => plain(cfg.rope_theta, cfg.rope_dim),
        AttnKind::Csa | AttnKind::Hca => match cfg.yarn {
            Some(y) => yarn(cfg.compress_rope_theta, cfg.rope_dim, y),
            None => plain(cfg.compress_rope_theta, cfg.rope_dim),
        },
    }
}

fn base_freq(theta: f64, dim: usize, k: usize) -> f64 {
    1.0 / theta.powf((2 * k) as f64 / dim as f64)
}

fn plain(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|k| base_freq(theta, dim, k) as f32)
        .collect()
}

/// The YaRN correction range `[lo, hi]` of pair indices (15, 25 for the released config).
pub fn yarn_range(theta: f64, dim: usize, y: Yarn) -> (f64, f64) {
    let corr = |n: f64| {
        dim as f64 * (y.original_max_position / (n * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let lo = corr(y.beta_fast).floor().max(0.0);
    let hi = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
    (lo, hi)
}

fn yarn(theta: f64, dim: usize, y: Yarn) -> Vec<f32> {
    let (lo, mut hi) = yarn_range(theta, dim, y);
    if lo == hi {
        hi += 0.001;
    }
    (0..dim / 2)
        .map(|k| {
            let f0 = base_freq(theta, dim, k);
            let ramp = ((k as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            (f0 * (1.0 - ramp) + f0 / y.factor * ramp) as f32
        })
        .collect()
}

/// Rotates the trailing `2 * freqs.len()` channels of `x` in interleaved pairs by
/// `pos * f_k` (`sign = -1.0` rotates back).
pub fn apply(x: &mut [f32], freqs: &[f32], pos: usize, sign: f32) {
    let start = x.len() - 2 * freqs.len();
    let tail = &mut x[start..];
    for (k, &f) in freqs.iter().enumerate() {
        let theta = pos as f32 * f;
        let (s, c) = (theta as f64).sin_cos();
        let (s, c) = (sign * s as f32, c as f32);
        let (a, b) = (tail[2 * k], tail[2 * k + 1]);
        tail[2 * k] = a * c - b * s;
        tail[2 * k + 1] = a * s + b * c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_yarn_range_is_15_25() {
        let y = Yarn {
            factor: 16.0,
            original_max_position: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        assert_eq!(yarn_range(160000.0, 64, y), (15.0, 25.0));
        let f = yarn(160000.0, 64, y);
        // Pairs k <= 15 keep their frequency, k >= 25 are divided by the factor.
        assert!((f[10] as f64 - base_freq(160000.0, 64, 10)).abs() < 1e-9);
        assert!((f[30] as f64 * 16.0 / base_freq(160000.0, 64, 30) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_and_inverts() {
        let freqs = plain(10000.0, 4);
        let mut x = vec![9.0, 1.0, 2.0, 3.0, 4.0];
        apply(&mut x, &freqs, 7, 1.0);
        assert_eq!(x[0], 9.0, "nope channel untouched");
        let t = 7.0f64;
        assert!((x[1] as f64 - (1.0 * t.cos() - 2.0 * t.sin())).abs() < 1e-5);
        assert!((x[2] as f64 - (1.0 * t.sin() + 2.0 * t.cos())).abs() < 1e-5);
        apply(&mut x, &freqs, 7, -1.0);
        for (a, b) in x.iter().zip([9.0, 1.0, 2.0, 3.0, 4.0]) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
