//! Token-streaming KV compressor (MODEL.md §6.3, Appendix A): softmax-gated pooling of
//! `ratio` tokens per channel, with overlapping windows (previous window's A halves +
//! current window's B halves) when the compressor has overlap (CSA, ratio 4).

use super::ops::exp;
use crate::state::CompressorState;

/// Pushes the token at absolute position `pos` (`a` and raw gate logits `z`, each
/// `state.width()` wide; `ape` is [ratio, width]). When the token completes a window,
/// writes the pooled (not yet normalised) entry into `entry` (`[d_c]`) and returns true.
#[allow(clippy::needless_range_loop)] // j indexes entry and the pooled slot columns together
pub fn push(
    st: &mut CompressorState,
    ape: &[f32],
    pos: usize,
    a: &[f32],
    z: &[f32],
    entry: &mut [f32],
) -> bool {
    let (r, dc, w) = (st.ratio, st.dc, st.width());
    let i = pos % r;
    st.pending_a[i * w..(i + 1) * w].copy_from_slice(a);
    let zrow = &mut st.pending_z[i * w..(i + 1) * w];
    zrow.iter_mut()
        .zip(z.iter().zip(&ape[i * w..(i + 1) * w]))
        .for_each(|(o, (z, p))| *o = z + p);
    if i != r - 1 {
        return false;
    }
    if st.overlap {
        // Slots 0..r: previous window, A halves; slots r..2r: this window, B halves.
        for j in 0..dc {
            let prev = (0..r)
                .filter(|_| st.has_prev)
                .map(|s| (st.prev_z[s * dc + j], st.prev_a[s * dc + j]));
            let cur = (0..r).map(|s| (st.pending_z[s * w + dc + j], st.pending_a[s * w + dc + j]));
            entry[j] = pool(prev.chain(cur));
        }
        for s in 0..r {
            st.prev_a[s * dc..(s + 1) * dc].copy_from_slice(&st.pending_a[s * w..s * w + dc]);
            st.prev_z[s * dc..(s + 1) * dc].copy_from_slice(&st.pending_z[s * w..s * w + dc]);
        }
        st.has_prev = true;
    } else {
        for j in 0..dc {
            entry[j] = pool((0..r).map(|s| (st.pending_z[s * w + j], st.pending_a[s * w + j])));
        }
    }
    true
}

/// sum_s softmax_s(z) * a over (z, a) pairs of one channel: p_s = e_s / sum(e) in f32,
/// both sums accumulated in f64 and rounded once.
fn pool(slots: impl Iterator<Item = (f32, f32)> + Clone) -> f32 {
    let m = slots
        .clone()
        .map(|(z, _)| z)
        .fold(f32::NEG_INFINITY, f32::max);
    let den = slots.clone().map(|(z, _)| exp(z - m) as f64).sum::<f64>() as f32;
    slots
        .map(|(z, a)| (exp(z - m) / den) as f64 * a as f64)
        .sum::<f64>() as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::state::SlotState;

    #[test]
    fn overlap_mixes_previous_a_and_current_b_halves() {
        let cfg = ModelConfig::tiny_default();
        let mut slot = SlotState::new(&cfg, 64).unwrap();
        let st = slot.layers[1].compressor.as_mut().unwrap();
        let (r, dc) = (st.ratio, st.dc);
        let w = 2 * dc;
        let ape = vec![0.0; r * w];
        let mut entry = vec![0.0; dc];
        // Window 0: a = 1 on A halves, 2 on B halves; z = 0 everywhere.
        let (mut a, z) = (vec![1.0; w], vec![0.0; w]);
        a[dc..].iter_mut().for_each(|v| *v = 2.0);
        for p in 0..r {
            assert_eq!(push(st, &ape, p, &a, &z, &mut entry), p == r - 1);
        }
        assert!(
            entry.iter().all(|v| (v - 2.0).abs() < 1e-6),
            "window 0 sees only its B halves"
        );
        // Window 1: B halves = 4; equal gates -> mean of 4 A-slots (1) and 4 B-slots (4).
        a[dc..].iter_mut().for_each(|v| *v = 4.0);
        for p in r..2 * r {
            push(st, &ape, p, &a, &z, &mut entry);
        }
        assert!(entry.iter().all(|v| (v - 2.5).abs() < 1e-6), "{}", entry[0]);
    }
}
