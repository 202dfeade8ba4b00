//! What a host's log callback receives from dsv4_load / dsv4_load_tensor / dsv4_finalize
//! (the wording documented in `src/load_report.rs`), through the C ABI on the CPU backend:
//! one summary line each at Info, per-tensor lines only at Debug, nothing at Warn.
//!
//! The log sink is process-global, so the whole sequence is ONE test function (and the sink
//! is restored when it ends, even on a failed assertion).

mod common;

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_void};
use std::ptr;
use std::sync::Mutex;

use common::abi::{checkpoint_file_order, find, ok, tensors};
use common::fixture_dir;
use dsv4::ffi::*;

static LINES: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());
const USER: usize = 0x10C5;

unsafe extern "C" fn record(level: i32, msg: *const c_char, user: *mut c_void) {
    assert_eq!(user as usize, USER);
    // SAFETY: dsv4 passes a NUL-terminated message valid during the call.
    let m = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    LINES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((level, m));
}

fn take_lines() -> Vec<(i32, String)> {
    std::mem::take(&mut *LINES.lock().unwrap_or_else(|p| p.into_inner()))
}

fn set_level(level: i32) {
    // SAFETY: `record` follows the callback contract.
    ok(unsafe { dsv4_set_log_callback(Some(record), USER as *mut c_void, level) });
}

/// Puts the default sink back when the test ends, however it ends.
struct RestoreSink;
impl Drop for RestoreSink {
    fn drop(&mut self) {
        // SAFETY: NULL callback restores the default sink.
        unsafe { dsv4_set_log_callback(None, ptr::null_mut(), DSV4_LOG_WARN) };
    }
}

struct Eng(*mut dsv4_engine);
impl Drop for Eng {
    fn drop(&mut self) {
        // SAFETY: from dsv4_create, destroyed once.
        unsafe { dsv4_destroy(self.0) };
    }
}

/// An engine on the tiny fixture (config from its directory), CPU backend.
fn create() -> Eng {
    let mut p = dsv4_create_params_default();
    p.numerics = DSV4_NUMERICS_EXACT;
    create_with(p)
}

/// As [`create`] with `p`'s device, numerics and cache directory.
fn create_with(mut p: dsv4_create_params) -> Eng {
    let dir = CString::new(fixture_dir("tiny").to_str().unwrap()).unwrap();
    p.config_path = dir.as_ptr();
    p.max_num_seqs = 2;
    p.max_num_tokens = 16;
    p.max_seq_len = 32;
    p.num_threads = 2;
    let mut e = ptr::null_mut();
    // SAFETY: valid params and out pointer.
    ok(unsafe { dsv4_create(&p, &mut e) });
    Eng(e)
}

fn load(e: &Eng) {
    let dir = CString::new(fixture_dir("tiny").to_str().unwrap()).unwrap();
    // SAFETY: live engine, NUL-terminated path.
    ok(unsafe { dsv4_load(e.0, dir.as_ptr(), DSV4_LOAD_AUTO) });
}

fn finalize(e: &Eng) {
    // SAFETY: live engine; the CPU backend ignores the stream.
    ok(unsafe { dsv4_finalize(e.0, ptr::null_mut()) });
}

/// Source (non-derived) weights of `e`, counted through dsv4_weight_count / dsv4_weight_info.
fn source_weights(e: &Eng) -> usize {
    let mut n = 0usize;
    // SAFETY: live engine, valid out pointer.
    ok(unsafe { dsv4_weight_count(e.0, &mut n) });
    (0..n)
        .filter(|&i| {
            // SAFETY: zeroed desc is valid; struct_size set as the contract asks.
            let mut w: dsv4_weight_desc = unsafe { std::mem::zeroed() };
            w.struct_size = size_of::<dsv4_weight_desc>();
            // SAFETY: live engine, index in range, valid out pointer.
            ok(unsafe { dsv4_weight_info(e.0, i, &mut w) });
            w.derived == 0
        })
        .count()
}

/// `key=value` fields after `<call>: `; quoted values (`"..."`) may hold spaces.
fn fields(line: &str) -> HashMap<String, String> {
    let body = line.split_once(": ").map_or(line, |(_, b)| b);
    let mut out = HashMap::new();
    let mut rest = body.trim();
    while !rest.is_empty() {
        let (key, after) = rest
            .split_once('=')
            .unwrap_or_else(|| panic!("no `=` in {rest:?}"));
        let (value, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"').expect("closing quote");
            (q[..end].to_string(), &q[end + 1..])
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        out.insert(key.to_string(), value);
        rest = next.trim_start();
    }
    out
}

/// The single line at `level` starting with `prefix`, parsed.
#[track_caller]
fn one(lines: &[(i32, String)], level: i32, prefix: &str) -> HashMap<String, String> {
    let hits: Vec<&String> = lines
        .iter()
        .filter(|(l, m)| *l == level && m.starts_with(prefix))
        .map(|(_, m)| m)
        .collect();
    assert_eq!(
        hits.len(),
        1,
        "want one `{prefix}` line at level {level}: {lines:#?}"
    );
    println!("{}", hits[0]);
    fields(hits[0])
}

fn num<T: std::str::FromStr>(f: &HashMap<String, String>, key: &str) -> T
where
    T::Err: std::fmt::Debug,
{
    let v = f
        .get(key)
        .unwrap_or_else(|| panic!("no field `{key}` in {f:?}"));
    v.parse()
        .unwrap_or_else(|e| panic!("field {key}={v}: {e:?}"))
}

#[test]
fn load_and_finalize_lines_by_level() {
    let _restore = RestoreSink;
    let entries = checkpoint_file_order("tiny");
    take_lines();

    // --- Info: one summary line per call, no per-tensor detail.
    set_level(DSV4_LOG_INFO);
    let e = create();
    load(&e);
    finalize(&e);
    let lines = take_lines();
    let n_src = source_weights(&e);

    let l = one(&lines, DSV4_LOG_INFO, "dsv4_load: ");
    assert_eq!(l["source"], "checkpoint");
    assert!(l["path"].ends_with("tiny"), "{l:?}");
    assert_eq!(num::<usize>(&l, "tensors"), n_src);
    assert_eq!(num::<usize>(&l, "src_tensors"), entries.len());
    assert_eq!(num::<usize>(&l, "skipped"), 0);
    assert_eq!(num::<usize>(&l, "files"), 1);
    let want_bytes: u64 = entries.iter().map(|e| e.data.len() as u64).sum();
    assert_eq!(num::<u64>(&l, "bytes"), want_bytes);
    assert!(want_bytes > 0);
    assert!(num::<f64>(&l, "secs") >= 0.0);
    assert!(num::<f64>(&l, "gbps") >= 0.0);
    assert_eq!(l["naming"], "save_pretrained");
    assert!(l["src_dtypes"].contains("BF16:"), "{l:?}");
    assert_eq!(l["weight_format"], "as_stored");
    assert!(num::<u64>(&l, "held_bytes") > 0);
    assert_eq!(l["numerics"], "exact");

    let f = one(&lines, DSV4_LOG_INFO, "dsv4_finalize: ");
    assert_eq!(f["backend"], "cpu");
    assert_eq!(f["device"], "-");
    assert_eq!(f["kernel_set"], "-");
    assert_eq!(f["numerics"], "exact");
    assert_eq!(f["families"], "-");
    assert_eq!(f["compiled"], "-");
    assert!(num::<u64>(&f, "weights_bytes") > 0);
    assert_eq!(
        num::<u64>(&f, "weights_bytes"),
        num::<u64>(&l, "held_bytes")
    );
    assert!(num::<u64>(&f, "derived_bytes") > 0);
    // The same figures dsv4_get_info (and dsv4_plan_memory) report.
    let mut info: dsv4_info = unsafe { std::mem::zeroed() };
    info.struct_size = std::mem::size_of::<dsv4_info>();
    ok(unsafe { dsv4_get_info(e.0, &mut info) });
    for (k, v) in [
        ("weights_bytes", info.weights_nbytes),
        ("derived_bytes", info.derived_nbytes),
        ("state_bytes", info.state_nbytes),
        ("workspace_bytes", info.workspace_nbytes),
    ] {
        assert_eq!(num::<u64>(&f, k), v, "{k}");
    }
    assert!(num::<u64>(&f, "state_bytes") > 0);
    assert!(num::<f64>(&f, "secs") >= 0.0);
    assert!(
        lines.iter().all(|(lvl, _)| *lvl <= DSV4_LOG_INFO),
        "nothing above the max level: {lines:#?}"
    );
    assert!(
        !lines
            .iter()
            .any(|(_, m)| m.starts_with("dsv4_load tensor:")),
        "no per-tensor lines at Info"
    );
    drop(e);

    // --- Debug: per-tensor lines during load, and dsv4_load_tensor's own line.
    set_level(DSV4_LOG_DEBUG);
    let e = create();
    load(&e);
    let lines = take_lines();
    one(&lines, DSV4_LOG_INFO, "dsv4_load: ");
    let per: Vec<&String> = lines
        .iter()
        .filter(|(l, m)| *l == DSV4_LOG_DEBUG && m.starts_with("dsv4_load tensor: "))
        .map(|(_, m)| m)
        .collect();
    assert_eq!(per.len(), entries.len(), "one line per checkpoint tensor");
    let name = "model.layers.0.attn.wq_a.weight";
    let t = one(
        &lines,
        DSV4_LOG_DEBUG,
        &format!("dsv4_load tensor: name={name} "),
    );
    let want = find(&entries, name);
    assert_eq!(t["dtype"], "BF16");
    let shape: Vec<String> = want.shape.iter().map(|d| d.to_string()).collect();
    assert_eq!(t["shape"], format!("[{}]", shape.join(",")));
    assert_eq!(num::<usize>(&t, "bytes"), want.data.len());
    assert_eq!(t["file"], "model.safetensors");
    assert_eq!(t["role"], "weight:layers.0.attn.wq_a.weight");

    // dsv4_load_tensor (allowed before finalize) logs its tensor.
    let one_entry = [want.clone()];
    let ts = tensors(&one_entry);
    // SAFETY: live engine, entry points into `one_entry`.
    ok(unsafe { dsv4_load_tensor(e.0, &ts[0]) });
    let lines = take_lines();
    let lt = one(&lines, DSV4_LOG_DEBUG, "dsv4_load_tensor: ");
    assert_eq!(lt["name"], name);
    assert_eq!(lt["dtype"], "BF16");
    assert_eq!(num::<usize>(&lt, "bytes"), want.data.len());
    assert_eq!(lt["weights"], "1");
    assert_eq!(lt["loaded"], format!("{n_src}/{n_src}"));
    finalize(&e);
    one(&take_lines(), DSV4_LOG_INFO, "dsv4_finalize: ");
    drop(e);

    // --- Warn: none of it.
    set_level(DSV4_LOG_WARN);
    let e = create();
    load(&e);
    // SAFETY: as above.
    ok(unsafe { dsv4_load_tensor(e.0, &ts[0]) });
    finalize(&e);
    let lines = take_lines();
    assert!(
        !lines
            .iter()
            .any(|(_, m)| m.starts_with("dsv4_load") || m.starts_with("dsv4_finalize")),
        "nothing at Warn: {lines:#?}"
    );
    drop(e);

    cuda_finalize_lines();
}

/// CUDA device 0 (when present): the finalize line names the device and kernel set, and
/// counts the kernel families compiled (fresh cache directory) then read from the cache.
fn cuda_finalize_lines() {
    if !common::gpu::has_cuda() {
        return;
    }
    let cache = common::TempDir::new("logging-kcache");
    let cache_c = CString::new(cache.0.to_str().unwrap()).unwrap();
    set_level(DSV4_LOG_INFO);
    for round in 0..2 {
        let mut p = dsv4_create_params_default();
        p.device = 0;
        p.numerics = DSV4_NUMERICS_OFFICIAL;
        p.cache_dir = cache_c.as_ptr();
        let e = create_with(p);
        load(&e);
        finalize(&e);
        let lines = take_lines();
        let f = one(&lines, DSV4_LOG_INFO, "dsv4_finalize: ");
        assert_eq!(f["backend"], "cuda:0");
        assert!(f["device"] != "-" && !f["device"].is_empty(), "{f:?}");
        assert!(f["arch"].starts_with("sm_"), "{f:?}");
        assert_eq!(f["kernel_set"], "fast");
        assert_eq!(f["numerics"], "official");
        let fams: usize = num(&f, "families");
        let (compiled, cached, rejected): (usize, usize, usize) =
            (num(&f, "compiled"), num(&f, "cached"), num(&f, "rejected"));
        assert!(fams > 0);
        assert_eq!(compiled + cached + rejected, fams);
        if round == 0 {
            assert_eq!(compiled, fams, "fresh cache: every family compiled");
        } else {
            assert_eq!(cached, fams, "second engine: every family from the cache");
        }
        assert!(num::<f64>(&f, "compile_secs") >= 0.0);
        for k in [
            "weights_bytes",
            "derived_bytes",
            "state_bytes",
            "workspace_bytes",
        ] {
            assert!(num::<u64>(&f, k) > 0, "{k}: {f:?}");
        }
    }
    drop(cache);
}
