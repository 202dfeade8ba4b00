//! Shared helpers of the integration tests: fixture paths and the HF oracle file.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use safetensors::SafeTensors;

/// `tests/fixtures/<name>` of the checkout the test binary was built in, or of the current
/// directory when the binary runs elsewhere (the GPU machine runs prebuilt binaries from a
/// copy of the tree).
pub fn fixture_dir(name: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let root = if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures")
    };
    root.join(name)
}

/// The oracle of one fixture model: prompts and fp32 logits recorded with transformers.
pub struct Oracle {
    pub prompts: Vec<Vec<i32>>,
    /// One-shot logits per sequence, [len, vocab] row-major.
    pub logits: Vec<Vec<f32>>,
    /// HF prefill + token-by-token decode logits per sequence.
    pub logits_decode: Vec<Vec<f32>>,
    pub meta: HashMap<String, String>,
    /// Fixture directory name.
    pub model: String,
}

impl Oracle {
    pub fn load(name: &str) -> Oracle {
        let bytes = std::fs::read(fixture_dir(name).join("oracle.safetensors"))
            .expect("oracle.safetensors");
        let (_, meta) = SafeTensors::read_metadata(&bytes).expect("oracle header");
        let st = SafeTensors::deserialize(&bytes).expect("oracle");
        let ints = |n: &str| -> Vec<i32> {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let floats = |n: &str| -> Vec<f32> {
            st.tensor(n)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let mut o = Oracle {
            prompts: vec![],
            logits: vec![],
            logits_decode: vec![],
            meta: meta.metadata().clone().unwrap_or_default(),
            model: name.to_string(),
        };
        let mut s = 0;
        while st.tensor(&format!("prompt.{s}")).is_ok() {
            o.prompts.push(ints(&format!("prompt.{s}")));
            o.logits.push(floats(&format!("logits.{s}")));
            o.logits_decode.push(floats(&format!("logits_decode.{s}")));
            s += 1;
        }
        o
    }
}

impl Oracle {
    fn raw(name: &str) -> Vec<u8> {
        std::fs::read(fixture_dir(name).join("oracle.safetensors")).expect("oracle.safetensors")
    }
}

/// Extra per-sequence arrays of an oracle (e.g. `logits_official.{s}`), loaded on demand.
pub trait OracleExtra {
    fn extra(&self, prefix: &str) -> Vec<Vec<f32>>;
    fn has(&self, name: &str) -> bool;
}

impl OracleExtra for Oracle {
    fn extra(&self, prefix: &str) -> Vec<Vec<f32>> {
        let bytes = Oracle::raw(&self.model);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        (0..self.prompts.len())
            .map(|s| {
                let t = st
                    .tensor(&format!("{prefix}.{s}"))
                    .unwrap_or_else(|_| panic!("oracle lacks {prefix}.{s}"));
                t.data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect()
            })
            .collect()
    }

    fn has(&self, name: &str) -> bool {
        let bytes = Oracle::raw(&self.model);
        SafeTensors::deserialize(&bytes)
            .unwrap()
            .tensor(name)
            .is_ok()
    }
}

/// max |a - b| over two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
