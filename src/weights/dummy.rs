//! Deterministic dummy weights (`dsv4_load` with format DUMMY): small values chosen so that a
//! forward pass is finite and non-trivial, for tests, benchmarks and demos without a checkpoint.
//!
//! Each weight draws from its own PRNG stream seeded by (seed, canonical name), so a value
//! depends only on the seed and the weight, not on table order or on other weights. Values
//! are rounded to BF16 so a BF16 device copy holds exactly what the f32 CPU reference uses.

use crate::config::ModelConfig;
use crate::weights::qmatrix::{QFormat, QMatrix};
use crate::weights::spec::TensorSpec;
use crate::weights::store::{TensorData, WeightStore};

/// splitmix64: tiny, fast, and good enough to decorrelate per-weight streams.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 24 random bits (exact in f32).
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [lo, hi).
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in [0, n) (n > 0; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// FNV-1a of the name mixed with the seed: the per-weight stream.
fn stream(seed: u64, name: &str) -> SplitMix {
    let mut h = 0xCBF2_9CE4_8422_2325u64;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01B3);
    }
    let mut s = SplitMix(seed ^ h);
    s.next_u64();
    s
}

/// Value range of a float weight, by role.
fn range_of(spec: &TensorSpec) -> (f32, f32) {
    let n = spec.name.as_str();
    let leaf = n.rsplit('.').next().unwrap_or(n);
    if leaf.ends_with("_fn") {
        // mHC projections: small, so the Sinkhorn inputs stay near the base.
        (-0.05, 0.05)
    } else if leaf.ends_with("_base") {
        (-0.5, 0.5)
    } else if leaf.ends_with("_scale") {
        (0.5, 1.5)
    } else if leaf == "attn_sink" {
        (-0.5, 0.5)
    } else if leaf == "ape" || n.ends_with("gate.bias") {
        (-0.1, 0.1)
    } else if n.ends_with("norm.weight") {
        (0.9, 1.1)
    } else if n == "embed.weight" {
        (-1.0, 1.0)
    } else {
        // Linear [out, in]: uniform in ±1/sqrt(fan_in) keeps activations O(1).
        let fan_in = spec.shape.last().copied().unwrap_or(1).max(1) as f32;
        let b = 1.0 / fan_in.sqrt();
        (-b, b)
    }
}

/// Fills every weight with deterministic small values; hash-routing tables get rows of
/// distinct valid expert ids.
pub fn fill_dummy(store: &mut WeightStore, cfg: &ModelConfig, seed: u64) {
    // Weights are independent streams: fill them on all cores (real-size dummy models hold
    // tens of GB).
    let tensors = store.tensors_mut();
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(tensors.len().max(1));
    let next = std::sync::Mutex::new(tensors.iter_mut());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let t = next.lock().unwrap_or_else(|e| e.into_inner()).next();
                    let Some(t) = t else { break };
                    fill_one(t, cfg, seed);
                }
            });
        }
    });
}

/// Quantized storage is filled directly with random codes and power-of-two scales sized
/// for the weight's range (quantizing random floats would be far slower at real sizes).
fn fill_quantized(q: &mut QMatrix, hi: f32, rng: &mut SplitMix) {
    let (qmax, nan_free): (f32, fn(u8) -> u8) = match q.format {
        // 0x7f / 0xff are the e4m3fn NaNs: map them to the largest finite codes.
        QFormat::Fp8 { .. } => (448.0, |b| if b & 0x7f == 0x7f { b - 1 } else { b }),
        QFormat::Fp4 => (6.0, |b| b),
    };
    let scale = 2f32.powi((hi / qmax).log2().ceil() as i32);
    let mut word = 0u64;
    for (i, c) in q.codes.iter_mut().enumerate() {
        if i % 8 == 0 {
            word = rng.next_u64();
        }
        *c = nan_free((word >> (8 * (i % 8))) as u8);
    }
    q.scales.iter_mut().for_each(|s| *s = scale);
}

fn fill_one(t: &mut crate::weights::store::Tensor, cfg: &ModelConfig, seed: u64) {
    let n_experts = cfg.n_routed_experts.max(1);
    {
        let mut rng = stream(seed, &t.spec.name);
        match &mut t.data {
            TensorData::Quant(q) => {
                let (_, hi) = range_of(&t.spec);
                fill_quantized(q, hi, &mut rng);
            }
            TensorData::F32(_) | TensorData::Bf16(_) => {
                let (lo, hi) = range_of(&t.spec);
                let values: Vec<f32> = (0..t.spec.numel())
                    .map(|_| half::bf16::from_f32(rng.uniform(lo, hi)).to_f32())
                    .collect();
                t.data.set_from_f32(&values);
            }
            TensorData::I32(v) => {
                // tid2eid [vocab, k]: each row a random k-subset of the experts (partial
                // Fisher-Yates), in random order.
                let k = t.spec.shape.last().copied().unwrap_or(1).max(1);
                let mut perm: Vec<i32> = (0..n_experts as i32).collect();
                for row in v.chunks_mut(k) {
                    for j in 0..row.len().min(n_experts) {
                        let r = j + rng.below(n_experts - j);
                        perm.swap(j, r);
                        row[j] = perm[j];
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filled(seed: u64) -> (ModelConfig, WeightStore) {
        let cfg = ModelConfig::tiny_default();
        let mut s = WeightStore::allocate(&cfg).unwrap();
        fill_dummy(&mut s, &cfg, seed);
        (cfg, s)
    }

    fn bits(s: &WeightStore) -> Vec<Vec<u32>> {
        s.tensors()
            .iter()
            .map(|t| match &t.data {
                TensorData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
                TensorData::I32(v) => v.iter().map(|&x| x as u32).collect(),
                _ => panic!("the test config stores every weight as f32/i32"),
            })
            .collect()
    }

    #[test]
    fn deterministic_and_seed_dependent() {
        let (_, a) = filled(7);
        let (_, b) = filled(7);
        let (_, c) = filled(8);
        assert_eq!(bits(&a), bits(&b));
        let (ba, bc) = (bits(&a), bits(&c));
        // Every weight changes with the seed (the mHC scale [1] included, with overwhelming odds).
        for (i, t) in a.tensors().iter().enumerate() {
            assert_ne!(ba[i], bc[i], "{}", t.spec.name);
        }
    }

    #[test]
    fn values_are_valid() {
        let (cfg, s) = filled(0x5EED);
        for t in s.tensors() {
            let name = &t.spec.name;
            match &t.data {
                TensorData::F32(v) => {
                    let (lo, hi) = range_of(&t.spec);
                    assert!(
                        v.iter()
                            .all(|x| x.is_finite() && *x >= lo - 1e-2 && *x <= hi + 1e-2),
                        "{name}"
                    );
                    // Non-trivial: not constant.
                    if v.len() > 1 {
                        assert!(v.iter().any(|&x| x != v[0]), "{name} is constant");
                    }
                    assert!(
                        v.iter().all(|x| half::bf16::from_f32(*x).to_f32() == *x),
                        "{name} not bf16-exact"
                    );
                }
                TensorData::Bf16(_) | TensorData::Quant(_) => {
                    panic!("the test config stores every weight as f32/i32")
                }
                TensorData::I32(v) => {
                    let k = t.spec.shape[1];
                    assert_eq!(k, cfg.experts_per_tok);
                    for row in v.chunks(k) {
                        assert!(
                            row.iter()
                                .all(|&e| e >= 0 && (e as usize) < cfg.n_routed_experts),
                            "{name}"
                        );
                        let mut r = row.to_vec();
                        r.sort_unstable();
                        r.dedup();
                        assert_eq!(r.len(), k, "{name}: duplicate expert ids in {row:?}");
                    }
                    // Rows differ: tokens do not all hash to the same experts.
                    assert!(v.chunks(k).any(|r| r != &v[..k]), "{name}");
                }
            }
        }
        let get = |n: &str| s.f32(s.index_of(n).unwrap()).to_vec();
        assert!(
            get("layers.0.attn_norm.weight")
                .iter()
                .all(|x| (0.89..=1.11).contains(x))
        );
        assert!(
            get("layers.0.hc_attn_scale")
                .iter()
                .all(|x| (0.5..=1.5).contains(x))
        );
        let b = 1.0 / (cfg.hidden_size as f32).sqrt();
        assert!(
            get("layers.0.attn.wq_a.weight")
                .iter()
                .all(|x| x.abs() <= b * 1.01)
        );
    }
}
