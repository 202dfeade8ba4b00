//! Shared helpers of the integration tests, written once: fixture paths and the HF oracle
//! file, comparisons, scratch directories (here); random numbers ([`rng`]); the C ABI's
//! status helpers and fixture checkpoints as refit entries ([`abi`]); CUDA skip helpers and
//! the per-family kernel-test device ([`gpu`]); an engine driven through the C ABI on either
//! backend, with host slices staged into fixed device buffers on CUDA ([`rig`]); the HF-oracle
//! parity scenarios, backend-neutral ([`parity`]); the attention tests' block tables and batch
//! layouts ([`kv`]).
//!
//! Each test binary compiles all of it and uses a part, hence `dead_code` is allowed.
#![allow(dead_code)]

pub mod abi;
pub mod gpu;
pub mod kv;
pub mod names;
pub mod native;
pub mod parity;
pub mod rig;
pub mod rng;
pub mod sets;

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

/// An engine on fixture `model` with `opts`: created from the fixture's config, its
/// checkpoint loaded (AUTO) and finalized; panics on any failure.
pub fn fixture_engine(model: &str, opts: dsv4::EngineOptions) -> dsv4::Engine {
    let dir = fixture_dir(model);
    let mut e = dsv4::Engine::create(dsv4::ConfigSource::Path(dir.clone()), opts).expect("create");
    e.load(Some(&dir), dsv4::LoadFormat::Auto).expect("load");
    e.finalize().expect("finalize");
    e
}

/// One forward of the given host arrays on `e`, every row's logits: f32 [toks.len(), vocab],
/// NaN where the engine wrote nothing; panics if the forward fails.
pub fn forward_all_rows(
    e: &mut dsv4::Engine,
    toks: &[i32],
    pos: &[i32],
    slots: &[i32],
    qs: &[i32],
) -> Vec<f32> {
    let mut out = vec![f32::NAN; toks.len() * e.config().vocab_size];
    e.forward(&mut dsv4::Batch {
        token_ids: toks,
        positions: pos,
        seq_slots: slots,
        query_start: qs,
        logits_rows: None,
        logits: dsv4::LogitsOut::F32(&mut out),
    })
    .expect("forward");
    out
}

/// Logits of every oracle prompt ([len, vocab] per sequence), all NaN until written.
pub fn nan_logits(o: &Oracle, vocab: usize) -> Vec<Vec<f32>> {
    o.prompts
        .iter()
        .map(|p| vec![f32::NAN; p.len() * vocab])
        .collect()
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

/// Tensor `name` of `st` as 4-byte little-endian words, each decoded by `from`.
fn words<T>(st: &SafeTensors, name: &str, from: fn([u8; 4]) -> T) -> Vec<T> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|b| from(b.try_into().unwrap()))
        .collect()
}

impl Oracle {
    pub fn load(name: &str) -> Oracle {
        let bytes = std::fs::read(fixture_dir(name).join("oracle.safetensors"))
            .expect("oracle.safetensors");
        let (_, meta) = SafeTensors::read_metadata(&bytes).expect("oracle header");
        let st = SafeTensors::deserialize(&bytes).expect("oracle");
        let ints = |n: &str| words(&st, n, i32::from_le_bytes);
        let floats = |n: &str| words(&st, n, f32::from_le_bytes);
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

/// The bit patterns of `v` (compare with `assert_eq!` for bit-for-bit equality).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Bit-exact comparison; on failure names the first mismatch (index and both values).
#[track_caller]
pub fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut bad = 0usize;
    let mut first = None;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            bad += 1;
            first.get_or_insert(i);
        }
    }
    if let Some(i) = first {
        panic!(
            "{what}: {bad} of {} values differ; first at index {i}: device {:e} ({:#010x}), reference {:e} ({:#010x})",
            got.len(),
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// Exact comparison of 16-bit codes; on failure names the first mismatch.
#[track_caller]
pub fn assert_u16(what: &str, got: &[u16], want: &[u16]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let bad = (0..got.len()).filter(|&i| got[i] != want[i]).count();
        panic!(
            "{what}: {bad} of {} values differ; first at index {i}: device {:#06x}, reference {:#06x}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// A fresh directory under the system temp dir (`dsv4-<tag>-<pid>-<n>-<nanos>`), removed on
/// drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let d = std::env::temp_dir().join(format!(
            "dsv4-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
