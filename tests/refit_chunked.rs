//! Chunked refit through the C ABI (dsv4_refit_begin / dsv4_refit / dsv4_refit_end): the RL
//! "init dummy, then sync the real weights in pieces" flow on the CPU backend. Forward and
//! finalize are STATE errors while a refit is open; a bad chunk changes nothing; after
//! refit_end the engine equals a normal load of the same checkpoint bit for bit, and no
//! weight address moved.
//!
//! Stored-format pairs (`tiny_fp8`: FP8 matrices and FP4 experts with E8M0 scales): inside a
//! chunked refit a weight's codes and its block scale may come in different chunks, in either
//! order; the half that comes first is held until its partner arrives. refit_end names every
//! half still waiting and leaves the refit open; a plain dsv4_refit still needs both halves in
//! one call. Every comparison is bit for bit (weight bytes, scales, NaN-poisoned logits),
//! starting from a dummy load whose values differ from the checkpoint's.

mod common;

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use common::abi::{Entry, fails, last_error, ok, shard_entries, shard_files, tensors};
use common::{Oracle, TempDir, bits, fixture_dir};
use dsv4::ffi::*;
use safetensors::SafeTensors;

#[derive(Clone, PartialEq)]
enum Load {
    /// The model's own checkpoint.
    Checkpoint,
    Dummy,
    /// Another checkpoint of the same model.
    From(PathBuf),
}

/// create -> load -> finalize, on the CPU, with the config of fixture `model`.
fn engine(model: &str, load: Load) -> *mut dsv4_engine {
    let dir = CString::new(fixture_dir(model).to_str().unwrap()).unwrap();
    let mut p = dsv4_create_params_default();
    p.config_path = dir.as_ptr();
    // tiny: exact numerics (the oracle's); tiny_fp8: the official FP8/FP4 simulations, the
    // mode its stored format is for.
    p.numerics = if model == "tiny" {
        DSV4_NUMERICS_EXACT
    } else {
        DSV4_NUMERICS_OFFICIAL
    };
    p.max_num_seqs = 2;
    p.max_num_tokens = 64;
    p.max_seq_len = 64;
    let mut e = std::ptr::null_mut();
    unsafe {
        ok(dsv4_create(&p, &mut e));
        match load {
            Load::Checkpoint => ok(dsv4_load(e, dir.as_ptr(), DSV4_LOAD_AUTO)),
            Load::Dummy => ok(dsv4_load(e, std::ptr::null(), DSV4_LOAD_DUMMY)),
            Load::From(path) => {
                let path = CString::new(path.to_str().unwrap()).unwrap();
                ok(dsv4_load(e, path.as_ptr(), DSV4_LOAD_AUTO))
            }
        }
        ok(dsv4_finalize(e, std::ptr::null_mut()));
    }
    e
}

/// One forward of `toks` as one sequence in slot 0, every row's logits; the output buffer is
/// NaN-poisoned first.
fn forward(e: *mut dsv4_engine, toks: &[i32]) -> (dsv4_status, Vec<f32>) {
    common::abi::forward_one_sequence(e, toks, 256)
}

/// Forward from a fresh slot (the previous sequence in slot 0 is released first).
fn logits(e: *mut dsv4_engine, toks: &[i32]) -> Vec<f32> {
    unsafe { ok(dsv4_release_slot(e, 0)) };
    let (s, out) = forward(e, toks);
    ok(s);
    assert!(out.iter().all(|v| v.is_finite()), "non-finite logits");
    out
}

fn prompt(model: &str) -> Vec<i32> {
    Oracle::load(model).prompts[0][..30].to_vec()
}

fn phase(e: *mut dsv4_engine) -> i32 {
    let mut info: dsv4_info = unsafe { std::mem::zeroed() };
    info.struct_size = std::mem::size_of::<dsv4_info>();
    unsafe { ok(dsv4_get_info(e, &mut info)) };
    info.phase
}

// ------------------------------------------------------------------------ checkpoint entries

/// The tensors of one safetensors file, sorted by name.
fn read_shard(path: &Path) -> Vec<Entry> {
    let mut out = shard_entries(path);
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// `tiny_fp8`'s checkpoint entries, the reference engine's view of it, and a fresh engine
/// with dummy weights (to be destroyed by the test).
fn fp8_dummy() -> (Vec<Entry>, Reference, *mut dsv4_engine) {
    let ck = checkpoint("tiny_fp8");
    let reference = Reference::of("tiny_fp8");
    (ck, reference, engine("tiny_fp8", Load::Dummy))
}

/// Every tensor of a fixture checkpoint (all shards), sorted by name.
fn checkpoint(model: &str) -> Vec<Entry> {
    let mut all = common::abi::checkpoint_file_order(model);
    all.sort_by(|a, b| a.name.cmp(&b.name));
    all
}

fn find(entries: &[Entry], name: &str) -> Entry {
    common::abi::find(entries, name).clone()
}

/// `entries` without the named ones (each must be there).
fn without(entries: &[Entry], names: &[String]) -> Vec<Entry> {
    for n in names {
        find(entries, n);
    }
    entries
        .iter()
        .filter(|e| !names.iter().any(|n| n == e.name()))
        .cloned()
        .collect()
}

/// One dsv4_refit call with `entries` from host memory.
fn refit(e: *mut dsv4_engine, entries: &[Entry]) -> dsv4_status {
    let ts = tensors(entries);
    unsafe { dsv4_refit(e, ts.as_ptr(), ts.len(), std::ptr::null_mut()) }
}

/// `<module>.weight` / `<module>.scale`: upstream names of a module's codes and scale.
fn weight_of(m: &str) -> String {
    format!("{m}.weight")
}

fn scale_of(m: &str) -> String {
    format!("{m}.scale")
}

// ------------------------------------------------------------------------ engine contents

fn weight_desc(e: *mut dsv4_engine, i: usize) -> dsv4_weight_desc {
    let mut w: dsv4_weight_desc = unsafe { std::mem::zeroed() };
    w.struct_size = std::mem::size_of::<dsv4_weight_desc>();
    unsafe { ok(dsv4_weight_info(e, i, &mut w)) };
    w
}

fn weight_addresses(e: *mut dsv4_engine) -> Vec<usize> {
    let mut n = 0usize;
    unsafe { ok(dsv4_weight_count(e, &mut n)) };
    (0..n).map(|i| weight_desc(e, i).data as usize).collect()
}

/// Every source weight's storage as bytes: (name, codes / values, f32 block scales). CPU
/// backend: the addresses are host memory.
fn weight_bytes(e: *mut dsv4_engine) -> Vec<(String, Vec<u8>, Vec<u8>)> {
    let mut n = 0usize;
    unsafe { ok(dsv4_weight_count(e, &mut n)) };
    (0..n)
        .map(|i| weight_desc(e, i))
        .filter(|w| w.derived == 0)
        .map(|w| {
            let read = |p: *const std::ffi::c_void, nbytes: u64| {
                if p.is_null() {
                    return Vec::new();
                }
                // SAFETY: the engine's host storage, `nbytes` long, alive until destroy.
                unsafe { std::slice::from_raw_parts(p as *const u8, nbytes as usize) }.to_vec()
            };
            let name = unsafe { CStr::from_ptr(w.name) }
                .to_string_lossy()
                .into_owned();
            (name, read(w.data, w.nbytes), read(w.scale, w.scale_nbytes))
        })
        .collect()
}

/// The stored bytes (codes, scales) of weight `name`.
fn stored(e: *mut dsv4_engine, name: &str) -> (Vec<u8>, Vec<u8>) {
    let (_, d, s) = weight_bytes(e)
        .into_iter()
        .find(|(n, _, _)| n == name)
        .unwrap_or_else(|| panic!("no weight `{name}`"));
    (d, s)
}

/// A normal load of `model`, for comparisons.
struct Reference {
    weights: Vec<(String, Vec<u8>, Vec<u8>)>,
    logits: Vec<f32>,
}

impl Reference {
    fn of(model: &str) -> Reference {
        let e = engine(model, Load::Checkpoint);
        let r = Reference {
            weights: weight_bytes(e),
            logits: logits(e, &prompt(model)),
        };
        unsafe { dsv4_destroy(e) };
        r
    }

    fn stored(&self, name: &str) -> (Vec<u8>, Vec<u8>) {
        let (_, d, s) = self.weights.iter().find(|(n, _, _)| n == name).unwrap();
        (d.clone(), s.clone())
    }

    /// `e` (READY) holds exactly the weights of the normal load and computes the same
    /// logits, bit for bit.
    fn assert_equal(&self, e: *mut dsv4_engine, model: &str, what: &str) {
        assert_eq!(phase(e), DSV4_PHASE_READY, "{what}");
        let got = weight_bytes(e);
        assert_eq!(got.len(), self.weights.len());
        for ((n, d, s), (rn, rd, rs)) in got.iter().zip(&self.weights) {
            assert_eq!(n, rn);
            assert!(
                d == rd && s == rs,
                "{what}: weight `{n}` differs from a normal load"
            );
        }
        assert_eq!(
            bits(&logits(e, &prompt(model))),
            bits(&self.logits),
            "{what}: logits differ from a normal load"
        );
    }
}

/// Asserts a dummy-loaded engine's values of the named weights differ from the checkpoint's,
/// so that a half dropped on the way (never written) would show.
fn assert_fresh(dummy: *mut dsv4_engine, reference: &Reference, weights: &[String]) {
    for w in weights {
        assert_ne!(
            stored(dummy, w),
            reference.stored(w),
            "dummy `{w}` equals the checkpoint: the test would not see a missed write"
        );
    }
}

// ------------------------------------------------------------------------ tests

#[test]
fn dummy_then_chunked_sync_equals_a_normal_load() {
    let toks = &prompt("tiny");
    let reference = engine("tiny", Load::Checkpoint);
    let (s, want) = forward(reference, toks);
    ok(s);

    let e = engine("tiny", Load::Dummy);
    let addrs = weight_addresses(e);
    let (s, dummy) = forward(e, toks);
    ok(s);
    assert!(dummy.iter().all(|v| v.is_finite()));

    let entries = checkpoint("tiny");
    let n = entries.len();
    unsafe {
        // Ends without a begin, or a second begin, are STATE errors.
        assert_eq!(dsv4_refit_end(e, std::ptr::null_mut()), DSV4_STATUS_STATE);
        assert!(last_error().contains("refit_begin"), "{}", last_error());
        ok(dsv4_refit_begin(e));
        assert_eq!(dsv4_refit_begin(e), DSV4_STATUS_STATE);
        assert_eq!(phase(e), DSV4_PHASE_REFITTING);

        // First half of the weights.
        ok(refit(e, &entries[..n / 2]));
        // Forward and finalize are refused while the refit is open.
        let (s, _) = forward(e, toks);
        assert_eq!(s, DSV4_STATUS_STATE);
        assert!(last_error().contains("refit"), "{}", last_error());
        assert_eq!(dsv4_finalize(e, std::ptr::null_mut()), DSV4_STATUS_STATE);

        // A chunk with one bad entry (wrong shape) writes nothing: prove it by refitting the
        // good entries of that chunk afterwards and comparing with the reference at the end.
        let mut second = entries[n / 2..].to_vec();
        second[0].shape[0] += 1;
        assert_eq!(refit(e, &second), DSV4_STATUS_TENSOR);
        second[0].shape[0] -= 1;
        ok(refit(e, &second));
        ok(dsv4_refit_end(e, std::ptr::null_mut()));
        assert_eq!(phase(e), DSV4_PHASE_READY);
    }
    let (s, got) = forward(e, toks);
    ok(s);
    assert_eq!(
        bits(&got),
        bits(&want),
        "chunked sync differs from a normal load"
    );
    assert_ne!(bits(&got), bits(&dummy));
    assert_eq!(
        weight_addresses(e),
        addrs,
        "a weight moved during the refit"
    );
    unsafe {
        dsv4_destroy(e);
        dsv4_destroy(reference);
    }
}

/// FP8 matrices (128x128-block scales) of tiny_fp8 and FP4 experts (1x32 scales).
const FP8: [&str; 2] = ["layers.0.attn.wq_a", "layers.0.attn.wo_a"];
const FP4: [&str; 2] = ["layers.0.ffn.experts.0.w1", "layers.0.ffn.experts.1.w2"];

#[test]
fn stored_format_pairs_split_across_chunks_in_either_order() {
    let ck = checkpoint("tiny_fp8");
    for m in FP8 {
        assert_eq!(find(&ck, &weight_of(m)).dtype, DSV4_DTYPE_F8_E4M3, "{m}");
    }
    for m in FP4 {
        assert_eq!(find(&ck, &weight_of(m)).dtype, DSV4_DTYPE_FP4_E2M1, "{m}");
    }
    let reference = Reference::of("tiny_fp8");
    let e = engine("tiny_fp8", Load::Dummy);
    let split: Vec<String> = FP8.iter().chain(&FP4).map(|m| weight_of(m)).collect();
    assert_fresh(e, &reference, &split);
    let dummy_logits = logits(e, &prompt("tiny_fp8"));

    // Weight first: wq_a (FP8), experts.0.w1 (FP4). Scale first: wo_a (FP8), experts.1.w2
    // (FP4). Some halves come under another naming scheme than their partner: pairs are
    // matched by the weight they belong to.
    let (wq_a, wo_a, w1, w2) = (FP8[0], FP8[1], FP4[0], FP4[1]);
    let first = vec![
        find(&ck, &weight_of(wq_a)),
        find(&ck, &weight_of(w1)),
        find(&ck, &scale_of(wo_a)).renamed("model.layers.0.attn.wo_a.weight_scale_inv"),
        find(&ck, &scale_of(w2)),
    ];
    let last = vec![
        find(&ck, &scale_of(wq_a)),
        find(&ck, &scale_of(w1)).renamed("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"),
        find(&ck, &weight_of(wo_a)).renamed("model.layers.0.self_attn.o_a_proj.weight"),
        find(&ck, &weight_of(w2)),
    ];
    let split_names: Vec<String> = FP8
        .iter()
        .chain(&FP4)
        .flat_map(|m| [weight_of(m), scale_of(m)])
        .collect();
    let rest = without(&ck, &split_names);
    let addrs = weight_addresses(e);
    unsafe { ok(dsv4_refit_begin(e)) };
    // The first halves wait across an unrelated chunk (the rest of the checkpoint).
    ok(refit(e, &first));
    ok(refit(e, &rest));
    ok(refit(e, &last));
    unsafe { ok(dsv4_refit_end(e, std::ptr::null_mut())) };
    reference.assert_equal(e, "tiny_fp8", "pairs split across chunks");
    assert_ne!(bits(&logits(e, &prompt("tiny_fp8"))), bits(&dummy_logits));
    assert_eq!(weight_addresses(e), addrs, "a weight moved");
    unsafe { dsv4_destroy(e) };
}

/// Pairs (scale entry, weight entry) whose halves lie in different shards.
fn split_pairs(shards: &[Vec<Entry>]) -> Vec<(String, String)> {
    let shard_of = |name: &str| {
        shards
            .iter()
            .position(|s| s.iter().any(|e| e.name() == name))
    };
    let mut out = vec![];
    for (i, shard) in shards.iter().enumerate() {
        for s in shard {
            let Some(m) = s.name().strip_suffix(".scale") else {
                continue;
            };
            let w = weight_of(m);
            let j = shard_of(&w).unwrap_or_else(|| panic!("`{}` has no weight", s.name()));
            if j != i {
                out.push((s.name().to_owned(), w));
            }
        }
    }
    out
}

/// Writes the tensors of tiny_fp8 again as three shards of a checkpoint (sorted names, with
/// an index), cut inside pairs, as a sharded checkpoint may be: between a weight's `.scale`
/// and its `.weight` (sorted, the scale comes first). The first cut splits an FP8 pair, the
/// second an FP4 pair. `dir` gets config.json too.
fn recut_tiny_fp8(dir: &Path) {
    let src = fixture_dir("tiny_fp8");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let files: Vec<Vec<u8>> = shard_files(&src)
        .iter()
        .map(|f| std::fs::read(f).unwrap())
        .collect();
    let sts: Vec<SafeTensors> = files
        .iter()
        .map(|b| SafeTensors::deserialize(b).unwrap())
        .collect();
    let mut all: Vec<(String, safetensors::tensor::TensorView)> =
        sts.iter().flat_map(|st| st.tensors()).collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    let n = all.len();
    // Cut after index i where all[i] is `X.scale` and all[i + 1] is `X.weight` of `dtype`.
    let cut_in_pair = |from: usize, dtype: safetensors::Dtype| {
        (from..n - 1)
            .find(|&i| {
                all[i].0.strip_suffix(".scale").map(weight_of).as_deref()
                    == Some(all[i + 1].0.as_str())
                    && all[i + 1].1.dtype() == dtype
            })
            .expect("a pair to cut")
    };
    let c1 = cut_in_pair(n / 3, safetensors::Dtype::F8_E4M3);
    let c2 = cut_in_pair((2 * n / 3).max(c1 + 1), safetensors::Dtype::I8);
    let runs = [0..c1 + 1, c1 + 1..c2 + 1, c2 + 1..n];
    let mut weight_map = serde_json::Map::new();
    let mut total = 0usize;
    for (k, run) in runs.into_iter().enumerate() {
        let file = format!("model-{:05}-of-00003.safetensors", k + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = all[run].to_vec();
        for (name, v) in &views {
            weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
            total += v.data().len();
        }
        let bytes = safetensors::serialize(views, None).unwrap();
        std::fs::write(dir.join(&file), bytes).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// Reads a checkpoint one shard per chunk, in `order`, into a dummy-loaded engine.
fn refit_by_shard(shards: &[Vec<Entry>], order: &[usize]) -> *mut dsv4_engine {
    let e = engine("tiny_fp8", Load::Dummy);
    unsafe { ok(dsv4_refit_begin(e)) };
    for &k in order {
        ok(refit(e, &shards[k]));
    }
    unsafe { ok(dsv4_refit_end(e, std::ptr::null_mut())) };
    e
}

#[test]
fn one_shard_per_chunk_equals_a_normal_load() {
    let reference = Reference::of("tiny_fp8");

    // The committed fixture's two shards. Its generator cuts between pairs (see
    // tests/fixtures/README.md), so this split keeps every pair in one chunk.
    let committed: Vec<Vec<Entry>> = shard_files(&fixture_dir("tiny_fp8"))
        .iter()
        .map(|f| read_shard(f))
        .collect();
    assert_eq!(committed.len(), 2);
    for order in [[0, 1], [1, 0]] {
        let e = refit_by_shard(&committed, &order);
        reference.assert_equal(e, "tiny_fp8", &format!("committed shards {order:?}"));
        unsafe { dsv4_destroy(e) };
    }

    // The same tensors in three shards that split pairs.
    let dir = TempDir::new("recut");
    recut_tiny_fp8(&dir.0);
    let shards: Vec<Vec<Entry>> = shard_files(&dir.0).iter().map(|f| read_shard(f)).collect();
    assert_eq!(shards.len(), 3);
    let split = split_pairs(&shards);
    assert!(!split.is_empty(), "the re-cut shards split no pair");
    let dtype_of = |w: &str| {
        shards
            .iter()
            .flatten()
            .find(|e| e.name() == w)
            .unwrap()
            .dtype
    };
    let dtypes: Vec<i32> = split.iter().map(|(_, w)| dtype_of(w)).collect();
    assert!(
        dtypes.contains(&DSV4_DTYPE_F8_E4M3) && dtypes.contains(&DSV4_DTYPE_FP4_E2M1),
        "want an FP8 and an FP4 pair split: {split:?}"
    );
    let fresh: Vec<String> = split.iter().map(|(_, w)| w.clone()).collect();
    let dummy = engine("tiny_fp8", Load::Dummy);
    assert_fresh(dummy, &reference, &fresh);
    unsafe { dsv4_destroy(dummy) };

    // A normal load of the re-cut checkpoint is the same model.
    let e = engine("tiny_fp8", Load::From(dir.0.clone()));
    reference.assert_equal(e, "tiny_fp8", "load of the re-cut shards");
    unsafe { dsv4_destroy(e) };

    // In file order each split pair's scale comes first; in reverse order its weight does.
    for order in [[0, 1, 2], [2, 1, 0]] {
        let e = refit_by_shard(&shards, &order);
        reference.assert_equal(
            e,
            "tiny_fp8",
            &format!("re-cut shards {order:?}, split pairs {split:?}"),
        );
        unsafe { dsv4_destroy(e) };
    }
}

#[test]
fn unpaired_halves_at_refit_end_are_named_and_the_refit_stays_open() {
    let (ck, reference, e) = fp8_dummy();
    let (wq_a, wo_a, w1) = (FP8[0], FP8[1], FP4[0]);
    // Held: wq_a's codes (no scale yet), experts.0.w1's scale and wo_a's scale (no weight yet).
    let missing = [scale_of(wq_a), weight_of(w1), weight_of(wo_a)];
    let held = [weight_of(wq_a), scale_of(w1), scale_of(wo_a)];
    assert_fresh(
        e,
        &reference,
        &[weight_of(wq_a), weight_of(w1), weight_of(wo_a)],
    );
    unsafe {
        ok(dsv4_refit_begin(e));
        ok(refit(e, &without(&ck, &missing)));

        let all: Vec<&str> = held.iter().map(String::as_str).collect();
        for _ in 0..2 {
            // Every waiting half is named, every time; the refit stays open.
            fails(
                dsv4_refit_end(e, std::ptr::null_mut()),
                DSV4_STATUS_TENSOR,
                &all,
            );
            assert!(last_error().contains("stays open"), "{}", last_error());
            assert_eq!(phase(e), DSV4_PHASE_REFITTING);
            let (s, _) = forward(e, &prompt("tiny_fp8"));
            assert_eq!(s, DSV4_STATUS_STATE);
        }

        // One partner: that pair is written, the others still wait.
        ok(refit(e, &[find(&ck, &missing[0])]));
        fails(
            dsv4_refit_end(e, std::ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &[&held[1], &held[2]],
        );
        assert!(!last_error().contains(&held[0]), "{}", last_error());
        assert_eq!(phase(e), DSV4_PHASE_REFITTING);

        // The rest: the refit closes and equals a normal load.
        ok(refit(e, &[find(&ck, &missing[1]), find(&ck, &missing[2])]));
        ok(dsv4_refit_end(e, std::ptr::null_mut()));
    }
    reference.assert_equal(e, "tiny_fp8", "after sending the missing halves");
    unsafe { dsv4_destroy(e) };
}

#[test]
fn plain_refit_still_needs_both_halves_in_one_call() {
    let (ck, reference, e) = fp8_dummy();
    let toks = prompt("tiny_fp8");
    let before = logits(e, &toks);
    for m in [FP8[0], FP4[0]] {
        let (w, s) = (weight_of(m), scale_of(m));
        assert_fresh(e, &reference, std::slice::from_ref(&w));
        let dummy = stored(e, &w);
        // The scale alone, then the weight alone: each refused (the scale was not held).
        fails(
            refit(e, &[find(&ck, &s)]),
            DSV4_STATUS_TENSOR,
            &[&s, "together"],
        );
        fails(
            refit(e, &[find(&ck, &w)]),
            DSV4_STATUS_TENSOR,
            &[&w, "scale"],
        );
        assert_eq!(phase(e), DSV4_PHASE_READY);
        assert_eq!(stored(e, &w), dummy, "`{w}` changed");
        assert_eq!(bits(&logits(e, &toks)), bits(&before));
    }
    // Together they are written.
    for m in [FP8[0], FP4[0]] {
        ok(refit(
            e,
            &[find(&ck, &scale_of(m)), find(&ck, &weight_of(m))],
        ));
        assert_eq!(stored(e, &weight_of(m)), reference.stored(&weight_of(m)));
    }
    unsafe { dsv4_destroy(e) };
}

#[test]
fn a_bad_chunk_holds_nothing_and_held_halves_are_checked() {
    let (ck, reference, e) = fp8_dummy();
    let (wq_a, wo_a, w1) = (FP8[0], FP8[1], FP4[0]);
    assert_fresh(e, &reference, &[weight_of(wq_a), weight_of(w1)]);
    let dummy_wq_a = stored(e, &weight_of(wq_a));
    let mut bad = find(&ck, "layers.0.attn_norm.weight");
    bad.shape[0] += 1;
    bad.data.extend([0, 0]);

    unsafe {
        // A weight that would be held, with a bad entry: nothing is held (refit_end closes)
        // and nothing is written.
        ok(dsv4_refit_begin(e));
        fails(
            refit(e, &[find(&ck, &weight_of(wq_a)), bad.clone()]),
            DSV4_STATUS_TENSOR,
            &["attn_norm"],
        );
        ok(dsv4_refit_end(e, std::ptr::null_mut()));
        assert_eq!(stored(e, &weight_of(wq_a)), dummy_wq_a);

        // A scale that would be held, with a bad entry: the same.
        ok(dsv4_refit_begin(e));
        fails(
            refit(e, &[bad.clone(), find(&ck, &scale_of(w1))]),
            DSV4_STATUS_TENSOR,
            &["attn_norm"],
        );
        ok(dsv4_refit_end(e, std::ptr::null_mut()));

        // A chunk that would complete a held half, with a bad entry: the half stays held.
        ok(dsv4_refit_begin(e));
        ok(refit(e, &[find(&ck, &scale_of(w1))]));
        fails(
            refit(e, &[find(&ck, &weight_of(w1)), bad.clone()]),
            DSV4_STATUS_TENSOR,
            &["attn_norm"],
        );
        fails(
            dsv4_refit_end(e, std::ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &[&scale_of(w1)],
        );
        // A float value for a weight whose scale is held cannot take that scale.
        let mut as_f32 = find(&ck, &weight_of(w1));
        as_f32.dtype = DSV4_DTYPE_F32;
        as_f32.data = vec![0u8; as_f32.shape.iter().product::<i64>() as usize * 4];
        fails(
            refit(e, &[as_f32]),
            DSV4_STATUS_TENSOR,
            &[&weight_of(w1), &scale_of(w1)],
        );

        // Two scales of one weight, one held and one sent (another naming scheme).
        let alias = find(&ck, &scale_of(w1)).renamed("layers.0.ffn.experts.0.w1.weight_scale_inv");
        fails(
            refit(e, &[alias]),
            DSV4_STATUS_INVALID_ARGUMENT,
            &[&scale_of(w1), "weight_scale_inv", "both the scale"],
        );
        // Two codes of one weight, both waiting for the scale.
        ok(refit(e, &[find(&ck, &weight_of(wq_a))]));
        let alias = find(&ck, &weight_of(wq_a)).renamed("model.layers.0.self_attn.q_a_proj.weight");
        fails(
            refit(e, &[alias]),
            DSV4_STATUS_INVALID_ARGUMENT,
            &[&weight_of(wq_a), "q_a_proj", "both write"],
        );

        // A half that waits is checked alone first: unknown weight, scale grid, codes shape,
        // a scale for a weight that is never quantised.
        let mut grid = find(&ck, &scale_of(wo_a));
        grid.shape = vec![3, 2];
        grid.data = vec![127; 6];
        fails(refit(e, &[grid]), DSV4_STATUS_TENSOR, &["wo_a", "[3, 2]"]);
        let mut codes = find(&ck, &weight_of(wo_a));
        codes.shape = vec![codes.shape[0] / 2, codes.shape[1]];
        codes.data.truncate(codes.data.len() / 2);
        fails(refit(e, &[codes]), DSV4_STATUS_TENSOR, &["wo_a"]);
        let ghost = find(&ck, &scale_of(wq_a)).renamed("layers.9.attn.wq_a.scale");
        fails(refit(e, &[ghost]), DSV4_STATUS_TENSOR, &["layers.9"]);
        let norm_scale = find(&ck, &scale_of(wq_a)).renamed("layers.0.attn_norm.scale");
        fails(refit(e, &[norm_scale]), DSV4_STATUS_TENSOR, &["attn_norm"]);

        // None of it left a trace: exactly wq_a's codes and w1's scale wait.
        fails(
            dsv4_refit_end(e, std::ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &[&weight_of(wq_a), &scale_of(w1), "2 refit entries"],
        );
        let waiting = [weight_of(wq_a), scale_of(w1)];
        ok(refit(e, &without(&ck, &waiting)));
        ok(dsv4_refit_end(e, std::ptr::null_mut()));
    }
    reference.assert_equal(e, "tiny_fp8", "after the refused chunks");
    unsafe { dsv4_destroy(e) };
}

/// dsv4_refit_abort (ABI 1.3): without a refit open it is a STATE error; inside one it keeps
/// every chunk already written, drops the halves held for a partner (never written), and
/// leaves a ready engine whose forward runs; a later complete refit then equals a normal load.
#[test]
fn refit_abort_keeps_written_chunks_drops_held_halves_and_readies_the_engine() {
    let (ck, reference, e) = fp8_dummy();
    let (wq_a, wo_a, w1, w2) = (FP8[0], FP8[1], FP4[0], FP4[1]);
    let missing = [scale_of(wq_a), weight_of(w1), weight_of(wo_a)];
    let held = [weight_of(wq_a), scale_of(w1), scale_of(wo_a)];
    let dummy = engine("tiny_fp8", Load::Dummy);
    unsafe {
        fails(
            dsv4_refit_abort(e, std::ptr::null_mut()),
            DSV4_STATUS_STATE,
            &["dsv4_refit_abort", "ready"],
        );
        fails(
            dsv4_refit_abort(std::ptr::null_mut(), std::ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["engine"],
        );

        ok(dsv4_refit_begin(e));
        ok(refit(e, &without(&ck, &missing)));
        ok(dsv4_refit_abort(e, std::ptr::null_mut()));
        assert_eq!(phase(e), DSV4_PHASE_READY);
        assert_eq!(last_error(), "");
    }
    // Written: a pair that came whole (experts.1.w2) is the checkpoint's.
    let w2w = weight_of(w2);
    assert_eq!(
        stored(e, &w2w),
        reference.stored(&w2w),
        "{w2}: a written chunk was lost"
    );
    // Held, then dropped: wq_a's codes, w1's and wo_a's scales are still the dummy's.
    for (m, what) in [(wq_a, &held[0]), (w1, &held[1]), (wo_a, &held[2])] {
        let w = weight_of(m);
        assert_eq!(
            stored(e, &w),
            stored(dummy, &w),
            "{what}: a held half was written"
        );
    }
    let l = logits(e, &prompt("tiny_fp8"));
    assert!(l.iter().all(|v| v.is_finite()), "forward after abort");
    unsafe {
        // Nothing is held any more: the three pairs must come whole, and then the engine
        // equals a normal load.
        let pairs: Vec<Entry> = [wq_a, w1, wo_a]
            .iter()
            .flat_map(|m| [find(&ck, &weight_of(m)), find(&ck, &scale_of(m))])
            .collect();
        ok(dsv4_refit_begin(e));
        ok(refit(e, &pairs));
        ok(dsv4_refit_end(e, std::ptr::null_mut()));
        dsv4_destroy(dummy);
    }
    reference.assert_equal(e, "tiny_fp8", "after abort and a complete refit");
    unsafe { dsv4_destroy(e) };
}
