//! Deterministic dummy weights (`dsv4_load` with format DUMMY): small values chosen so that a
//! forward pass is finite and non-trivial, for tests, benchmarks and demos without a checkpoint.
//!
//! Each weight draws from its own PRNG stream seeded by (seed, canonical name), so a value
//! depends only on the seed and the weight, not on table order or on other weights. Values
//! are rounded to BF16 so a BF16 device copy holds exactly what the f32 CPU reference uses.

use std::ops::Range;

use crate::config::ModelConfig;
use crate::weights::qmatrix::QFormat;
use crate::weights::rows::{Geometry, encode_rows};
use crate::weights::spec::TensorSpec;
use crate::weights::store::WeightStore;
use crate::weights::table::{StorageKind, WeightTable};
use crate::weights::values::{Progress, WeightValues, write_to_store};

/// splitmix64: tiny, fast, and good enough to decorrelate per-weight streams. It is
/// counter-based (output k mixes `state + k * GAMMA`), so any chunk of a weight can be
/// produced on its own ([`SplitMix::at`]): the CUDA load generates row chunks in parallel.
#[derive(Clone, Copy)]
struct SplitMix(u64);

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        mix(self.0)
    }

    /// The `k`-th output from now (k >= 1; `at(1)` is what `next_u64` returns next), without
    /// advancing.
    fn at(&self, k: u64) -> u64 {
        mix(self.0.wrapping_add(k.wrapping_mul(GAMMA)))
    }

    /// [`SplitMix::uniform`] of the `k`-th output from now.
    fn uniform_at(&self, k: u64, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * unit_of(self.at(k))
    }

    /// Uniform integer in [0, n) (n > 0; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Uniform in [0, 1) from the top 24 bits of a random word (exact in f32).
fn unit_of(word: u64) -> f32 {
    (word >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
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

/// Fills every weight of a host store with deterministic small values (see [`DummyValues`]).
pub fn fill_dummy(store: &mut WeightStore, cfg: &ModelConfig, seed: u64) {
    let values = DummyValues::new(store.table(), cfg, seed);
    let progress = Progress::new("dsv4_load", store.table(), &values.targets());
    write_to_store(store, &values, &progress);
}

/// Deterministic dummy values of every weight of a table: floats uniform in a range by role
/// and rounded to BF16; quantized storage filled directly with random codes and power-of-two
/// scales sized for the weight's range (quantizing random floats would be far slower at real
/// sizes); hash-routing tables get rows of distinct valid expert ids.
pub struct DummyValues {
    seed: u64,
    n_experts: usize,
    count: usize,
}

impl DummyValues {
    pub fn new(table: &WeightTable, cfg: &ModelConfig, seed: u64) -> DummyValues {
        DummyValues {
            seed,
            n_experts: cfg.n_routed_experts.max(1),
            count: table.len(),
        }
    }
}

impl WeightValues for DummyValues {
    fn targets(&self) -> Vec<usize> {
        (0..self.count).collect()
    }

    fn fill(
        &self,
        table: &WeightTable,
        dst: usize,
        rows: Range<usize>,
        data: &mut [u8],
        scales: &mut [f32],
    ) {
        let spec = &table.entry(dst).spec;
        let g = Geometry::of(table.entry(dst));
        let rng = stream(self.seed, &spec.name);
        let (lo, hi) = range_of(spec);
        match g.kind {
            StorageKind::Quant(q) => {
                let (qmax, fp8) = match q {
                    QFormat::Fp8 { .. } => (448.0, 1u8),
                    QFormat::Fp4 => (6.0, 0u8),
                };
                // 0x7f / 0xff are the e4m3fn NaNs: map them to the largest finite codes.
                let nan_free = |b: u8| b - (fp8 & u8::from(b & 0x7f == 0x7f));
                // Code byte i is byte i % 8 (little-endian) of output i / 8 + 1 of the weight's
                // stream: one output per 8 codes, written a word at a time after the first
                // ragged bytes of the chunk.
                let first = g.data_range(&rows).start;
                let head = ((8 - first % 8) % 8).min(data.len());
                let (ragged, words) = data.split_at_mut(head);
                for (k, c) in ragged.iter_mut().enumerate() {
                    let i = first + k;
                    *c = nan_free(rng.at(i as u64 / 8 + 1).to_le_bytes()[i % 8]);
                }
                let word0 = ((first + head) / 8 + 1) as u64;
                for (w, chunk) in words.chunks_mut(8).enumerate() {
                    let b = rng.at(word0 + w as u64).to_le_bytes();
                    chunk.iter_mut().zip(b).for_each(|(c, x)| *c = nan_free(x));
                }
                let scale = 2f32.powi((hi / qmax).log2().ceil() as i32);
                scales.iter_mut().for_each(|s| *s = scale);
            }
            StorageKind::F32 | StorageKind::Bf16 => {
                // Element i is output i + 1 of the weight's stream.
                let first = rows.start * g.cols;
                let values: Vec<f32> = (0..rows.len() * g.cols)
                    .map(|k| {
                        let v = rng.uniform_at((first + k) as u64 + 1, lo, hi);
                        half::bf16::from_f32(v).to_f32()
                    })
                    .collect();
                encode_rows(g.kind, &values, g.cols, data, scales);
            }
            StorageKind::I32 => {
                // The table's rows share one evolving permutation, so the whole (small) table
                // is generated for any chunk of it.
                let all = hash_table(spec, self.n_experts, rng);
                let ints = &all[rows.start * g.cols..rows.end * g.cols];
                data.chunks_exact_mut(4)
                    .zip(ints)
                    .for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes()));
            }
        }
    }
}

/// tid2eid [vocab, k]: each row a random k-subset of the experts (partial Fisher-Yates), in
/// random order.
fn hash_table(spec: &TensorSpec, n_experts: usize, mut rng: SplitMix) -> Vec<i32> {
    let k = spec.shape.last().copied().unwrap_or(1).max(1);
    let mut v = vec![0i32; spec.numel()];
    let mut perm: Vec<i32> = (0..n_experts as i32).collect();
    for row in v.chunks_mut(k) {
        for j in 0..row.len().min(n_experts) {
            let r = j + rng.below(n_experts - j);
            perm.swap(j, r);
            row[j] = perm[j];
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::weights::store::TensorData;

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
                TensorData::Bf16(v) => v.iter().map(|&x| x as u32).collect(),
                TensorData::I32(v) => v.iter().map(|&x| x as u32).collect(),
                _ => panic!("the test config stores every weight as f32/bf16/i32"),
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
            // BF16 matrices (head, compressors) are checked as the f32 values they hold.
            let widened: Vec<f32>;
            let floats: Option<&[f32]> = match &t.data {
                TensorData::F32(v) => Some(v),
                TensorData::Bf16(v) => {
                    widened = v
                        .iter()
                        .map(|&b| half::bf16::from_bits(b).to_f32())
                        .collect();
                    Some(&widened)
                }
                _ => None,
            };
            if let Some(v) = floats {
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
            match &t.data {
                TensorData::F32(_) | TensorData::Bf16(_) => {}
                TensorData::Quant(_) => {
                    panic!("the test config stores every weight as f32/bf16/i32")
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

    /// A weight produced in small row chunks (as the CUDA load does) has the bytes of the
    /// weight produced whole, in every storage kind.
    #[test]
    fn chunks_equal_the_whole_weight() {
        use crate::weights::rows::Geometry;
        use crate::weights::table::WeightTable;
        let cfg = ModelConfig::tiny_default();
        for format in [
            crate::weights::WeightFormat::Quantize,
            crate::weights::WeightFormat::Bf16,
            crate::weights::WeightFormat::AsStored,
        ] {
            let table = WeightTable::new(&cfg, format).unwrap();
            let values = DummyValues::new(&table, &cfg, 11);
            for i in values.targets() {
                let g = Geometry::of(table.entry(i));
                let all = 0..g.rows;
                let whole = |rows: &std::ops::Range<usize>| {
                    let mut d = vec![0u8; g.data_range(rows).len()];
                    let mut s = vec![0f32; g.scale_range(rows).len()];
                    values.fill(&table, i, rows.clone(), &mut d, &mut s);
                    (d, s)
                };
                let (want_d, want_s) = whole(&all);
                let (mut got_d, mut got_s) = (Vec::new(), Vec::new());
                for c in g.chunks(g.min_chunk_bytes() + 1) {
                    let (d, s) = whole(&c);
                    got_d.extend(d);
                    got_s.extend(s);
                }
                assert_eq!(got_d, want_d, "{} ({format:?})", table.name(i));
                assert_eq!(got_s, want_s, "{} ({format:?})", table.name(i));
            }
        }
    }
}
