//! The C ABI's bad-input matrix, called through the exported functions themselves
//! (`dsv4::ffi::dsv4_*` are the `extern "C"` symbols of the cdylib).
//!
//! Every failing call is checked for its status AND for a `dsv4_last_error()` text naming
//! the culprit; after every failure the same engine must still accept a valid call. Bad
//! checkpoints (built in a temp dir from tests/fixtures/tiny) go through `dsv4_load`, and
//! the same engine must then load the good fixture and match the transformers oracle.

mod common;

use std::ffi::{CStr, CString, c_char, c_void};
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::Mutex;

use common::abi::{check, last_error, status_name as name};
use common::rig::Step;
use common::{Oracle, fixture_dir, max_abs_diff};
use dsv4::ffi::*;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

// ----------------------------------------------------------------------------------------
// helpers

#[track_caller]
fn ok(got: dsv4_status) {
    check(got, DSV4_STATUS_OK, &[]);
}

/// An engine destroyed on drop.
struct Eng(*mut dsv4_engine);

impl Drop for Eng {
    fn drop(&mut self) {
        // SAFETY: created by dsv4_create, destroyed once.
        unsafe { dsv4_destroy(self.0) };
    }
}

/// A mutation of create params, for tables of bad inputs.
type SetParam = fn(&mut dsv4_create_params);

const SEQS: i32 = 4;
const TOKENS: i32 = 32;
const SEQ_LEN: i32 = 64;

fn tiny_params() -> dsv4_create_params {
    let mut p = dsv4_create_params_default();
    p.use_tiny_default = 1;
    p.max_num_seqs = SEQS;
    p.max_num_tokens = TOKENS;
    p.max_seq_len = SEQ_LEN;
    p.num_threads = 2;
    p.numerics = DSV4_NUMERICS_EXACT;
    p
}

fn create(p: &dsv4_create_params) -> (dsv4_status, Option<Eng>) {
    let mut e = ptr::null_mut();
    // SAFETY: valid params and out pointer.
    let s = unsafe { dsv4_create(p, &mut e) };
    if s != DSV4_STATUS_OK {
        assert!(e.is_null(), "a failed dsv4_create leaves *out NULL");
        return (s, None);
    }
    assert!(!e.is_null());
    (s, Some(Eng(e)))
}

fn created() -> Eng {
    let (s, e) = create(&tiny_params());
    ok(s);
    e.unwrap()
}

fn ready() -> Eng {
    let e = created();
    // SAFETY: valid engine.
    unsafe {
        ok(dsv4_load(e.0, ptr::null(), DSV4_LOAD_DUMMY));
        ok(dsv4_finalize(e.0, ptr::null_mut()));
    }
    e
}

fn info(e: &Eng) -> dsv4_info {
    // SAFETY: dsv4_info is plain data; zeroed is a valid value.
    let mut i: dsv4_info = unsafe { std::mem::zeroed() };
    i.struct_size = size_of::<dsv4_info>();
    // SAFETY: valid engine and out.
    ok(unsafe { dsv4_get_info(e.0, &mut i) });
    i
}

fn weight_count(e: &Eng) -> usize {
    let mut n = 0usize;
    // SAFETY: valid engine and out.
    ok(unsafe { dsv4_weight_count(e.0, &mut n) });
    n
}

fn weight(e: &Eng, i: usize) -> dsv4_weight_desc {
    // SAFETY: plain data.
    let mut w: dsv4_weight_desc = unsafe { std::mem::zeroed() };
    w.struct_size = size_of::<dsv4_weight_desc>();
    // SAFETY: valid engine and out.
    ok(unsafe { dsv4_weight_info(e.0, i, &mut w) });
    w
}

fn weight_name(w: &dsv4_weight_desc) -> String {
    // SAFETY: engine-owned NUL-terminated name.
    unsafe { CStr::from_ptr(w.name) }
        .to_string_lossy()
        .into_owned()
}

/// Index of the weight called `name`.
fn find_weight(e: &Eng, name: &str) -> (usize, dsv4_weight_desc) {
    (0..weight_count(e))
        .map(|i| (i, weight(e, i)))
        .find(|(_, w)| weight_name(w) == name)
        .unwrap_or_else(|| panic!("no weight `{name}`"))
}

fn weight_bytes(w: &dsv4_weight_desc) -> Vec<u8> {
    // SAFETY: the engine's storage of nbytes bytes, alive while the engine is.
    unsafe { std::slice::from_raw_parts(w.data as *const u8, w.nbytes as usize) }.to_vec()
}

/// Host arrays of one batch; `raw()` points a dsv4_batch into them.
struct HostBatch {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    slots: Vec<i32>,
    query_start: Vec<i32>,
    rows: Option<Vec<i32>>,
    logits: Vec<f32>,
}

impl HostBatch {
    /// One sequence in `slot` continuing at `start` with `n` tokens.
    fn single(slot: i32, start: i32, n: i32) -> Self {
        Self::seqs(&[(slot, start, n)])
    }

    /// Sequences `(slot, start, n)` batched together; token ids are a function of slot and
    /// position below the 1024-token vocab.
    fn seqs(seqs: &[(i32, i32, i32)]) -> Self {
        let seqs: Vec<(i32, i32, Vec<i32>)> = seqs
            .iter()
            .map(|&(slot, start, n)| {
                let toks = (start..start + n).map(|p| (7 * p + 3 * slot + 1).rem_euclid(1024));
                (slot, start, toks.collect())
            })
            .collect();
        let s = Step::of(&seqs);
        let logits = vec![f32::NAN; s.toks.len() * 1024];
        HostBatch {
            tokens: s.toks,
            positions: s.pos,
            slots: s.slots,
            query_start: s.qs,
            rows: None,
            logits,
        }
    }

    fn last_rows(mut self) -> Self {
        let rows: Vec<i32> = self.query_start[1..].iter().map(|&q| q - 1).collect();
        self.logits = vec![f32::NAN; rows.len() * 1024];
        self.rows = Some(rows);
        self
    }

    fn raw(&mut self) -> dsv4_batch {
        let mut b = dsv4_batch_default();
        b.num_tokens = self.tokens.len() as i32;
        b.num_seqs = self.slots.len() as i32;
        b.token_ids = self.tokens.as_ptr();
        b.positions = self.positions.as_ptr();
        b.seq_slots = self.slots.as_ptr();
        b.query_start = self.query_start.as_ptr();
        b.logits_rows = self.rows.as_ref().map_or(ptr::null(), |r| r.as_ptr());
        b.num_logits = self.rows.as_ref().map_or(self.tokens.len(), |r| r.len()) as i32;
        b.logits = self.logits.as_mut_ptr().cast();
        b
    }
}

fn forward_raw(e: &Eng, b: &dsv4_batch) -> dsv4_status {
    // SAFETY: valid engine; the batch points into live host arrays (or is deliberately bad
    // in ways the library must detect before reading).
    unsafe { dsv4_forward(e.0, b, ptr::null_mut()) }
}

/// Runs a valid forward of `hb` and asserts it succeeds with finite logits.
#[track_caller]
fn forward_ok(e: &Eng, hb: &mut HostBatch) {
    let b = hb.raw();
    ok(forward_raw(e, &b));
    assert!(hb.logits.iter().all(|v| v.is_finite()), "non-finite logits");
}

/// The engine still works: a fresh sequence in the last slot runs (READY engines), or
/// get_info succeeds (other phases).
#[track_caller]
fn still_works(e: &Eng) {
    if info(e).phase == DSV4_PHASE_READY {
        forward_ok(e, &mut HostBatch::single(SEQS - 1, 0, 2));
    }
}

fn cstr(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn f32_tensor(name: &CString, shape: &[i64], data: &[f32]) -> dsv4_tensor {
    let mut t = dsv4_tensor_default();
    t.name = name.as_ptr();
    t.dtype = DSV4_DTYPE_F32;
    t.ndim = shape.len() as i32;
    t.shape[..shape.len()].copy_from_slice(shape);
    t.data = data.as_ptr().cast();
    t
}

// ----------------------------------------------------------------------------------------
// versions and names

#[test]
fn versions_and_status_names() {
    assert_eq!(
        dsv4_abi_version(),
        (DSV4_ABI_VERSION_MAJOR << 16) | DSV4_ABI_VERSION_MINOR
    );
    // SAFETY: static string.
    let v = unsafe { CStr::from_ptr(dsv4_version_string()) }
        .to_str()
        .unwrap();
    assert!(
        v.starts_with("dsv4 ") && v.contains(env!("CARGO_PKG_VERSION")),
        "{v}"
    );
    let expected = [
        (DSV4_STATUS_OK, "OK"),
        (DSV4_STATUS_INVALID_ARGUMENT, "INVALID_ARGUMENT"),
        (DSV4_STATUS_NULL_POINTER, "NULL_POINTER"),
        (DSV4_STATUS_STATE, "STATE"),
        (DSV4_STATUS_CONFIG, "CONFIG"),
        (DSV4_STATUS_IO, "IO"),
        (DSV4_STATUS_FORMAT, "FORMAT"),
        (DSV4_STATUS_TENSOR, "TENSOR"),
        (DSV4_STATUS_CAPACITY, "CAPACITY"),
        (DSV4_STATUS_NO_DEVICE, "NO_DEVICE"),
        (DSV4_STATUS_CUDA, "CUDA"),
        (DSV4_STATUS_UNSUPPORTED, "UNSUPPORTED"),
        (DSV4_STATUS_INTERNAL, "INTERNAL"),
        (DSV4_STATUS_OUT_OF_MEMORY, "OUT_OF_MEMORY"),
    ];
    for (s, n) in expected {
        assert_eq!(name(s), n);
        assert_eq!(
            dsv4::Status::InvalidArgument as i32,
            DSV4_STATUS_INVALID_ARGUMENT
        );
    }
    assert_eq!(name(-1), "UNKNOWN");
    assert_eq!(name(14), "UNKNOWN");
}

#[test]
fn defaults_are_documented_values() {
    let p = dsv4_create_params_default();
    assert_eq!(p.struct_size, size_of::<dsv4_create_params>());
    assert!(p.config_path.is_null() && p.config_json.is_null() && p.cache_dir.is_null());
    assert_eq!(p.use_tiny_default, 0);
    assert_eq!(p.device, DSV4_DEVICE_CPU);
    assert_eq!(
        (
            p.max_num_seqs,
            p.max_num_tokens,
            p.max_seq_len,
            p.num_threads
        ),
        (8, 512, 4096, 0)
    );
    assert_eq!(p.numerics, DSV4_NUMERICS_OFFICIAL);
    assert_eq!(p.weight_format, DSV4_WEIGHT_FORMAT_AS_STORED);
    let t = dsv4_tensor_default();
    assert_eq!(t.struct_size, size_of::<dsv4_tensor>());
    assert_eq!(t.memory, DSV4_MEMORY_HOST);
    let b = dsv4_batch_default();
    assert_eq!(b.struct_size, size_of::<dsv4_batch>());
    assert_eq!(b.logits_dtype, DSV4_LOGITS_F32);
}

// ----------------------------------------------------------------------------------------
// NULL arguments, every export

#[test]
fn null_arguments_every_export() {
    let e = ready();
    let p = tiny_params();
    let mut out: *mut dsv4_engine = ptr::dangling_mut();
    // SAFETY: each call passes NULL where the library must detect it.
    unsafe {
        check(
            dsv4_create(ptr::null(), &mut out),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_create", "`params`"],
        );
        assert!(out.is_null(), "*out is reset to NULL on failure");
        check(
            dsv4_create(&p, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`out`"],
        );
        dsv4_destroy(ptr::null_mut());

        check(
            dsv4_load(ptr::null_mut(), ptr::null(), DSV4_LOAD_DUMMY),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_load", "`engine`"],
        );
        let c = created();
        check(
            dsv4_load(c.0, ptr::null(), DSV4_LOAD_AUTO),
            DSV4_STATUS_NULL_POINTER,
            &["`source`"],
        );
        check(
            dsv4_load(c.0, ptr::null(), DSV4_LOAD_SAFETENSORS),
            DSV4_STATUS_NULL_POINTER,
            &["`source`"],
        );

        let t = dsv4_tensor_default();
        check(
            dsv4_load_tensor(ptr::null_mut(), &t),
            DSV4_STATUS_NULL_POINTER,
            &["`engine`"],
        );
        check(
            dsv4_load_tensor(c.0, ptr::null()),
            DSV4_STATUS_NULL_POINTER,
            &["`tensor`"],
        );
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_NULL_POINTER,
            &["`tensor->name`"],
        );
        let n = cstr("norm.weight");
        let mut t2 = f32_tensor(&n, &[256], &[]);
        t2.data = ptr::null();
        check(
            dsv4_load_tensor(c.0, &t2),
            DSV4_STATUS_NULL_POINTER,
            &["`tensor->data`", "norm.weight"],
        );

        check(
            dsv4_finalize(ptr::null_mut(), ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_finalize", "`engine`"],
        );

        let mut hb = HostBatch::single(0, 0, 3);
        let b = hb.raw();
        check(
            dsv4_forward(ptr::null_mut(), &b, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_forward", "`engine`"],
        );
        check(
            dsv4_forward(e.0, ptr::null(), ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`batch`"],
        );
        for field in [
            "token_ids",
            "positions",
            "seq_slots",
            "query_start",
            "logits",
        ] {
            let mut b = hb.raw();
            match field {
                "token_ids" => b.token_ids = ptr::null(),
                "positions" => b.positions = ptr::null(),
                "seq_slots" => b.seq_slots = ptr::null(),
                "query_start" => b.query_start = ptr::null(),
                _ => b.logits = ptr::null_mut(),
            }
            check(
                forward_raw(&e, &b),
                DSV4_STATUS_NULL_POINTER,
                &[&format!("`batch->{field}`")],
            );
            still_works(&e);
        }

        check(
            dsv4_refit(ptr::null_mut(), ptr::null(), 0, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_refit", "`engine`"],
        );
        check(
            dsv4_refit(e.0, ptr::null(), 2, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`tensors`", "n = 2"],
        );
        let t3 = dsv4_tensor_default();
        check(
            dsv4_refit(e.0, &t3, 1, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`tensors[0].name`"],
        );

        check(
            dsv4_release_slot(ptr::null_mut(), 0),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_release_slot", "`engine`"],
        );

        let mut i: dsv4_info = std::mem::zeroed();
        i.struct_size = size_of::<dsv4_info>();
        check(
            dsv4_get_info(ptr::null(), &mut i),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_get_info", "`engine`"],
        );
        check(
            dsv4_get_info(e.0, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`out`"],
        );
        let mut n = 0usize;
        check(
            dsv4_weight_count(ptr::null(), &mut n),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_weight_count", "`engine`"],
        );
        check(
            dsv4_weight_count(e.0, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`out`"],
        );
        let mut w: dsv4_weight_desc = std::mem::zeroed();
        w.struct_size = size_of::<dsv4_weight_desc>();
        check(
            dsv4_weight_info(ptr::null(), 0, &mut w),
            DSV4_STATUS_NULL_POINTER,
            &["dsv4_weight_info", "`engine`"],
        );
        check(
            dsv4_weight_info(e.0, 0, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`out`"],
        );
    }
    still_works(&e);
}

// ----------------------------------------------------------------------------------------
// lifecycle order

#[test]
fn wrong_lifecycle_order_is_state_error() {
    let e = created();
    assert_eq!(info(&e).phase, DSV4_PHASE_CREATED);
    let mut hb = HostBatch::single(0, 0, 2);
    let b = hb.raw();
    let n = cstr("norm.weight");
    let vals = vec![1.0f32; 256];
    let t = f32_tensor(&n, &[256], &vals);
    // SAFETY: valid engine and arguments throughout.
    unsafe {
        check(
            forward_raw(&e, &b),
            DSV4_STATUS_STATE,
            &["dsv4_forward", "created"],
        );
        check(
            dsv4_refit(e.0, &t, 1, ptr::null_mut()),
            DSV4_STATUS_STATE,
            &["dsv4_refit"],
        );
        check(
            dsv4_finalize(e.0, ptr::null_mut()),
            DSV4_STATUS_STATE,
            &["dsv4_finalize", "dsv4_load"],
        );
        assert_eq!(info(&e).phase, DSV4_PHASE_CREATED);

        ok(dsv4_load(e.0, ptr::null(), DSV4_LOAD_DUMMY));
        assert_eq!(info(&e).phase, DSV4_PHASE_LOADED);
        check(
            forward_raw(&e, &b),
            DSV4_STATUS_STATE,
            &["dsv4_forward", "dsv4_finalize"],
        );
        check(
            dsv4_refit(e.0, &t, 1, ptr::null_mut()),
            DSV4_STATUS_STATE,
            &["dsv4_refit"],
        );
        // A second load before finalize is allowed (overwrites).
        ok(dsv4_load(e.0, ptr::null(), DSV4_LOAD_DUMMY));

        ok(dsv4_finalize(e.0, ptr::null_mut()));
        ok(dsv4_finalize(e.0, ptr::null_mut())); // idempotent
        assert_eq!(info(&e).phase, DSV4_PHASE_READY);

        check(
            dsv4_load(e.0, ptr::null(), DSV4_LOAD_DUMMY),
            DSV4_STATUS_STATE,
            &["dsv4_load", "finalized"],
        );
        check(
            dsv4_load_tensor(e.0, &t),
            DSV4_STATUS_STATE,
            &["dsv4_load_tensor", "dsv4_refit"],
        );
        assert_eq!(info(&e).phase, DSV4_PHASE_READY);
    }
    still_works(&e);
}

#[test]
fn release_slot_any_phase_and_range() {
    let e = created();
    // SAFETY: valid engine.
    unsafe {
        ok(dsv4_release_slot(e.0, 0));
        check(
            dsv4_release_slot(e.0, -1),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`slot` = -1", "max_num_seqs"],
        );
        check(
            dsv4_release_slot(e.0, SEQS),
            DSV4_STATUS_INVALID_ARGUMENT,
            &[&format!("`slot` = {SEQS}")],
        );
    }
    let e = ready();
    forward_ok(&e, &mut HostBatch::single(1, 0, 4));
    // SAFETY: valid engine.
    unsafe { ok(dsv4_release_slot(e.0, 1)) };
    // After release the slot holds nothing: continuing at 4 is rejected, restarting works.
    check(
        forward_raw(&e, &HostBatch::single(1, 4, 1).raw()),
        DSV4_STATUS_INVALID_ARGUMENT,
        &["slot 1"],
    );
    forward_ok(&e, &mut HostBatch::single(1, 0, 1));
}

// ----------------------------------------------------------------------------------------
// bad enums and struct sizes

#[test]
fn bad_enums_are_rejected_and_named() {
    let cases: [(&str, SetParam); 2] = [
        ("params->numerics", |p| p.numerics = 7),
        ("params->weight_format", |p| p.weight_format = -3),
    ];
    for (field, set) in cases {
        let mut p = tiny_params();
        set(&mut p);
        let (s, _) = create(&p);
        check(s, DSV4_STATUS_INVALID_ARGUMENT, &[field]);
    }
    let e = ready();
    let c = created();
    // SAFETY: valid engines and arguments.
    unsafe {
        check(
            dsv4_load(c.0, ptr::null(), 5),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`format` = 5", "DSV4_LOAD_DUMMY"],
        );
        check(
            dsv4_load(c.0, ptr::null(), -1),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`format` = -1"],
        );
        let n = cstr("norm.weight");
        let vals = vec![0.5f32; 256];
        let mut t = f32_tensor(&n, &[256], &vals);
        t.dtype = 9;
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->dtype` = 9", "norm.weight"],
        );
        let mut t = f32_tensor(&n, &[256], &vals);
        t.memory = 5;
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->memory` = 5"],
        );
        t.memory = DSV4_MEMORY_DEVICE;
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_UNSUPPORTED,
            &["`tensor->memory`", "DSV4_MEMORY_DEVICE"],
        );
        let mut t = f32_tensor(&n, &[256], &vals);
        t.ndim = 9;
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->ndim` = 9"],
        );
        t.ndim = -1;
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->ndim` = -1"],
        );
        let mut t = f32_tensor(&n, &[-256], &vals);
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->shape[0]` = -256"],
        );
        t.shape[0] = 256;
        t.name = c"norm\xffweight".as_ptr();
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->name`", "UTF-8"],
        );

        let mut hb = HostBatch::single(0, 0, 2);
        let mut b = hb.raw();
        b.logits_dtype = 3;
        check(
            forward_raw(&e, &b),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->logits_dtype` = 3"],
        );
        check(
            dsv4_set_log_callback(None, ptr::null_mut(), 9),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`max_level` = 9"],
        );
    }
    still_works(&e);
}

#[test]
fn struct_size_too_small_is_rejected_larger_is_accepted() {
    let mut p = tiny_params();
    p.struct_size = 8;
    let (s, _) = create(&p);
    check(
        s,
        DSV4_STATUS_INVALID_ARGUMENT,
        &["`params->struct_size` = 8", "dsv4_create_params_default"],
    );

    // A newer host's larger struct (extra trailing fields) is accepted.
    #[repr(C)]
    struct Newer {
        p: dsv4_create_params,
        extra: [u64; 4],
    }
    let mut big = Newer {
        p: tiny_params(),
        extra: [0xdead; 4],
    };
    big.p.struct_size = size_of::<Newer>();
    let (s, _) = create(&big.p);
    ok(s);

    let e = ready();
    let mut hb = HostBatch::single(0, 0, 2);
    let mut b = hb.raw();
    b.struct_size = size_of::<dsv4_batch>() - 8;
    check(
        forward_raw(&e, &b),
        DSV4_STATUS_INVALID_ARGUMENT,
        &["`batch->struct_size`", "dsv4_batch_default"],
    );

    let n = cstr("norm.weight");
    let vals = vec![0.5f32; 256];
    let mut t = f32_tensor(&n, &[256], &vals);
    t.struct_size = 0;
    // SAFETY: valid engine and arguments.
    unsafe {
        check(
            dsv4_refit(e.0, &t, 1, ptr::null_mut()),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensors[0].struct_size` = 0"],
        );
        let c = created();
        check(
            dsv4_load_tensor(c.0, &t),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`tensor->struct_size` = 0"],
        );

        let mut i: dsv4_info = std::mem::zeroed();
        i.struct_size = 4;
        check(
            dsv4_get_info(e.0, &mut i),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`out->struct_size` = 4", "sizeof(dsv4_info)"],
        );
        assert_eq!(i.vocab_size, 0, "untouched on failure");
        let mut w: dsv4_weight_desc = std::mem::zeroed();
        w.struct_size = 16;
        check(
            dsv4_weight_info(e.0, 0, &mut w),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`out->struct_size` = 16"],
        );

        // A larger output struct: v1 fields filled, struct_size and the tail left alone.
        #[repr(C)]
        struct NewerInfo {
            i: dsv4_info,
            tail: [u64; 2],
        }
        let mut ni = NewerInfo {
            i: std::mem::zeroed(),
            tail: [7, 7],
        };
        ni.i.struct_size = size_of::<NewerInfo>();
        ok(dsv4_get_info(e.0, &mut ni.i));
        assert_eq!(ni.i.struct_size, size_of::<NewerInfo>());
        assert_eq!(ni.i.vocab_size, 1024);
        assert_eq!(ni.tail, [7, 7]);
    }
    still_works(&e);
}

// ----------------------------------------------------------------------------------------
// create: config sources and options

fn tiny_json() -> serde_json::Value {
    serde_json::from_str(dsv4::config::TINY_DEFAULT_JSON).unwrap()
}

fn create_json(v: &serde_json::Value) -> (dsv4_status, Option<Eng>) {
    let text = cstr(&v.to_string());
    let mut p = tiny_params();
    p.use_tiny_default = 0;
    p.config_json = text.as_ptr();
    create(&p)
}

#[test]
fn config_errors_name_the_field() {
    let text = cstr("{\"vocab_size\": 12,");
    let mut p = tiny_params();
    p.use_tiny_default = 0;
    p.config_json = text.as_ptr();
    let (s, _) = create(&p);
    check(s, DSV4_STATUS_CONFIG, &["dsv4_create", "JSON"]);

    let text = cstr("[1, 2]");
    p.config_json = text.as_ptr();
    check(create(&p).0, DSV4_STATUS_CONFIG, &["JSON object"]);

    let bad: &[(&str, serde_json::Value)] = &[
        ("o_groups", 3.into()),
        ("num_experts_per_tok", 99.into()),
        ("qk_rope_head_dim", 7.into()),
        ("hidden_size", 0.into()),
        ("vocab_size", "big".into()),
        ("scoring_func", "relu".into()),
        ("num_key_value_heads", 4.into()),
        ("index_head_dim", 96.into()),
        ("n_shared_experts", 2.into()),
        ("swiglu_limit", (-1.0).into()),
    ];
    for (field, val) in bad {
        let mut v = tiny_json();
        v[*field] = val.clone();
        check(
            create_json(&v).0,
            DSV4_STATUS_CONFIG,
            &[&format!("`{field}`")],
        );
    }
    let mut v = tiny_json();
    v.as_object_mut().unwrap().remove("q_lora_rank");
    check(
        create_json(&v).0,
        DSV4_STATUS_CONFIG,
        &["`q_lora_rank`", "missing"],
    );

    // The unmodified JSON works.
    ok(create_json(&tiny_json()).0);

    // config_path: a missing file is IO and names the path; a directory with config.json works.
    let missing = cstr("/nonexistent/dsv4-model");
    let mut p = tiny_params();
    p.use_tiny_default = 0;
    p.config_path = missing.as_ptr();
    check(create(&p).0, DSV4_STATUS_IO, &["/nonexistent/dsv4-model"]);
    let dir = std::env::temp_dir().join(format!("dsv4-ffi-abi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut v = tiny_json();
    v["hidden_size"] = 0.into();
    std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
    let d = cstr(dir.to_str().unwrap());
    p.config_path = d.as_ptr();
    check(
        create(&p).0,
        DSV4_STATUS_CONFIG,
        &["config.json", "`hidden_size`"],
    );
    std::fs::write(dir.join("config.json"), tiny_json().to_string()).unwrap();
    ok(create(&p).0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_source_must_be_exactly_one() {
    let mut p = tiny_params();
    p.use_tiny_default = 0;
    check(
        create(&p).0,
        DSV4_STATUS_INVALID_ARGUMENT,
        &["config_path", "config_json", "use_tiny_default"],
    );
    let text = cstr(dsv4::config::TINY_DEFAULT_JSON);
    let mut p = tiny_params();
    p.config_json = text.as_ptr();
    check(create(&p).0, DSV4_STATUS_INVALID_ARGUMENT, &["exactly one"]);
    let mut p = tiny_params();
    let empty = cstr("");
    p.use_tiny_default = 0;
    p.config_path = empty.as_ptr();
    check(
        create(&p).0,
        DSV4_STATUS_INVALID_ARGUMENT,
        &["`params->config_path`", "empty"],
    );
    let mut p = tiny_params();
    p.config_json = c"{\"a\": \"\xff\"}".as_ptr();
    p.use_tiny_default = 0;
    check(
        create(&p).0,
        DSV4_STATUS_INVALID_ARGUMENT,
        &["`params->config_json`", "UTF-8"],
    );
}

#[test]
fn create_options_out_of_range_are_named() {
    let cases: &[(&str, SetParam)] = &[
        ("params->max_num_seqs", |p| p.max_num_seqs = 0),
        ("params->max_num_seqs", |p| p.max_num_seqs = -2),
        ("params->max_num_tokens", |p| p.max_num_tokens = 0),
        ("params->max_seq_len", |p| p.max_seq_len = -1),
        ("params->num_threads", |p| p.num_threads = -1),
        ("params->device", |p| p.device = -2),
        ("params->cache_dir", |p| p.cache_dir = c"".as_ptr()),
    ];
    for (field, set) in cases {
        let mut p = tiny_params();
        set(&mut p);
        check(create(&p).0, DSV4_STATUS_INVALID_ARGUMENT, &[field]);
    }
    // Engine-level capacity rules (max_seq_len beyond max_position_embeddings).
    let mut v = tiny_json();
    v["max_position_embeddings"] = 32.into();
    check(
        create_json(&v).0,
        DSV4_STATUS_INVALID_ARGUMENT,
        &["max_seq_len", "max_position_embeddings"],
    );
    // A CUDA device on this build/machine: a specific, non-OK status naming the device.
    let mut p = tiny_params();
    p.device = 0;
    let (s, _) = create(&p);
    assert!(
        [
            DSV4_STATUS_NO_DEVICE,
            DSV4_STATUS_UNSUPPORTED,
            DSV4_STATUS_CUDA,
            DSV4_STATUS_OK
        ]
        .contains(&s),
        "device 0: {} {}",
        name(s),
        last_error()
    );
    if s != DSV4_STATUS_OK {
        let m = last_error();
        assert!(m.contains("CUDA") || m.contains("device"), "{m}");
    }
}

// ----------------------------------------------------------------------------------------
// forward: batch validation and capacities

#[test]
fn batch_validation_and_capacity() {
    let e = ready();
    // Slot 0 holds 3 tokens; every rejected batch below must leave it so.
    forward_ok(&e, &mut HostBatch::single(0, 0, 3));

    let mut hb = HostBatch::single(0, 3, 1);
    let base = hb.raw();
    // (how the valid batch is broken, the status, what the message names).
    type Break = fn(&mut dsv4_batch);
    let cases: [(Break, dsv4_status, &[&str]); 8] = [
        (
            |b| b.num_tokens = -1,
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->num_tokens` = -1"],
        ),
        (
            |b| b.num_tokens = 0,
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->num_tokens` = 0"],
        ),
        (
            |b| (b.num_tokens, b.num_logits) = (TOKENS + 1, TOKENS + 1),
            DSV4_STATUS_CAPACITY,
            &["`batch->num_tokens`", "max_num_tokens"],
        ),
        (
            |b| b.num_seqs = 0,
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->num_seqs` = 0"],
        ),
        (
            |b| b.num_seqs = SEQS + 1,
            DSV4_STATUS_CAPACITY,
            &["`batch->num_seqs`", "max_num_seqs"],
        ),
        (
            |b| b.num_logits = 2,
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->num_logits` = 2", "logits_rows is NULL"],
        ),
        (
            |b| b.num_logits = -1,
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->num_logits` = -1"],
        ),
        (
            // SAFETY: one byte into the token array: a misaligned pointer the library must
            // reject before reading.
            |b| b.token_ids = unsafe { b.token_ids.cast::<u8>().add(1).cast() },
            DSV4_STATUS_INVALID_ARGUMENT,
            &["`batch->token_ids`", "aligned"],
        ),
    ];
    for (edit, want, needles) in cases {
        let mut b = base;
        edit(&mut b);
        check(forward_raw(&e, &b), want, needles);
        still_works(&e);
    }

    // Content errors, detected by the engine before anything runs.
    let content: Vec<(HostBatch, dsv4_status, Vec<&str>)> = vec![
        (
            {
                let mut h = HostBatch::single(0, 3, 1);
                h.tokens[0] = 1024;
                h
            },
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["token_ids[0]", "vocab_size"],
        ),
        (
            {
                let mut h = HostBatch::single(0, 3, 1);
                h.tokens[0] = -5;
                h
            },
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["token_ids[0]"],
        ),
        (
            HostBatch::single(SEQS, 0, 1),
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["seq_slots[0]", "max_num_seqs"],
        ),
        (
            HostBatch::single(-2, 0, 1),
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["seq_slots[0]"],
        ),
        (
            HostBatch::single(2, SEQ_LEN, 1),
            DSV4_STATUS_CAPACITY,
            vec!["positions[0]", "max_seq_len"],
        ),
        (
            HostBatch::single(2, SEQ_LEN - 2, 4),
            DSV4_STATUS_CAPACITY,
            vec!["positions[2]", "max_seq_len"],
        ),
        (
            HostBatch::single(0, 5, 1),
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["slot 0 holds 3 tokens"],
        ),
        (
            {
                let mut h = HostBatch::single(0, 3, 2);
                h.positions[1] = 9;
                h
            },
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["positions[1]", "consecutive"],
        ),
        (
            {
                let mut h = HostBatch::single(0, 3, 2);
                h.query_start[1] = 1;
                h
            },
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["query_start"],
        ),
        (
            HostBatch::seqs(&[(1, 0, 1), (1, 0, 1)]),
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["seq_slots[1]", "twice"],
        ),
        (
            {
                let mut h = HostBatch::single(0, 3, 2).last_rows();
                h.rows = Some(vec![2]);
                h
            },
            DSV4_STATUS_INVALID_ARGUMENT,
            vec!["logits_rows[0]"],
        ),
    ];
    for (mut hb, want, needles) in content {
        let b = hb.raw();
        check(forward_raw(&e, &b), want, &needles);
        still_works(&e);
    }
    // Slot 0 was not advanced by any rejected batch: it continues at position 3.
    forward_ok(&e, &mut HostBatch::single(0, 3, 1));
}

#[test]
fn forward_shapes_rows_and_bf16() {
    let e = ready();
    let mut all = HostBatch::seqs(&[(0, 0, 3), (1, 0, 2)]);
    forward_ok(&e, &mut all);
    // Same prompts again (restart at 0) with only each sequence's last row.
    let mut last = HostBatch::seqs(&[(0, 0, 3), (1, 0, 2)]).last_rows();
    forward_ok(&e, &mut last);
    assert_eq!(last.logits.len(), 2 * 1024);
    for (r, &row) in last.rows.as_ref().unwrap().iter().enumerate() {
        let a = &all.logits[row as usize * 1024..(row as usize + 1) * 1024];
        let b = &last.logits[r * 1024..(r + 1) * 1024];
        let d = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        assert!(d <= 1e-4, "row {row}: logits_rows changes values by {d}");
    }
    // bf16 output of the same batch.
    let mut hb = HostBatch::seqs(&[(0, 0, 3), (1, 0, 2)]);
    let mut out = vec![0u16; 5 * 1024];
    let mut b = hb.raw();
    b.logits = out.as_mut_ptr().cast();
    b.logits_dtype = DSV4_LOGITS_BF16;
    ok(forward_raw(&e, &b));
    for (x, &y) in all.logits.iter().zip(&out) {
        let y = f32::from_bits((y as u32) << 16);
        assert!(
            (x - y).abs() <= 0.01 * x.abs().max(1.0),
            "bf16 {y} vs f32 {x}"
        );
    }
    // num_logits = 0 with an empty rows array: nothing written, still OK.
    let mut hb = HostBatch::single(2, 0, 2);
    hb.rows = Some(vec![]);
    hb.logits = vec![];
    let mut b = hb.raw();
    b.logits_rows = [0i32; 1].as_ptr();
    b.num_logits = 0;
    b.logits = ptr::null_mut();
    ok(forward_raw(&e, &b));
}

// ----------------------------------------------------------------------------------------
// weights: introspection, load_tensor, refit

#[test]
fn weight_info_is_complete_and_stable() {
    let e = created();
    let n = weight_count(&e);
    assert!(n > 10);
    assert_eq!(info(&e).num_weights, n);
    let before: Vec<dsv4_weight_desc> = (0..n).map(|i| weight(&e, i)).collect();
    let mut names = std::collections::HashSet::new();
    for w in &before {
        let name = weight_name(w);
        assert!(names.insert(name.clone()), "duplicate weight `{name}`");
        assert!(w.ndim >= 1 && w.ndim as usize <= DSV4_MAX_DIMS);
        let numel: i64 = w.shape[..w.ndim as usize].iter().product();
        let esize = match w.dtype {
            DSV4_DTYPE_F32 | DSV4_DTYPE_I32 => 4,
            DSV4_DTYPE_BF16 | DSV4_DTYPE_F16 => 2,
            DSV4_DTYPE_I64 | DSV4_DTYPE_F64 => 8,
            d => panic!("weight `{name}` has dtype {d}"),
        };
        // Derived tensors are listed after every source weight.
        assert_eq!(w.derived != 0, name.starts_with("derived:"), "{name}");
        assert_eq!(w.nbytes, numel as u64 * esize, "{name}");
        assert!(!w.data.is_null(), "{name}");
        assert_eq!(w.device, DSV4_DEVICE_CPU);
        assert!(w.shape[w.ndim as usize..].iter().all(|&d| d == 0));
    }
    assert!(names.contains("embed.weight") && names.contains("head.weight"));
    let mut w: dsv4_weight_desc = unsafe { std::mem::zeroed() };
    w.struct_size = size_of::<dsv4_weight_desc>();
    // SAFETY: valid engine and out.
    check(
        unsafe { dsv4_weight_info(e.0, n, &mut w) },
        DSV4_STATUS_INVALID_ARGUMENT,
        &[&format!("`index` = {n}")],
    );

    // Pointers never move: through load, finalize, forward.
    // SAFETY: valid engine.
    unsafe {
        ok(dsv4_load(e.0, ptr::null(), DSV4_LOAD_DUMMY));
        ok(dsv4_finalize(e.0, ptr::null_mut()));
    }
    forward_ok(&e, &mut HostBatch::single(0, 0, 4));
    for (i, b) in before.iter().enumerate() {
        let a = weight(&e, i);
        assert_eq!(a.data, b.data, "weight {i} moved");
        assert_eq!(a.name, b.name, "weight {i} name moved");
    }
}

#[test]
fn info_reports_config_and_capacities() {
    let e = created();
    let i = info(&e);
    assert_eq!(
        (
            i.vocab_size,
            i.hidden_size,
            i.num_layers,
            i.num_heads,
            i.head_dim,
            i.hc_mult
        ),
        (1024, 256, 4, 4, 128, 4)
    );
    assert_eq!((i.n_routed_experts, i.experts_per_tok), (8, 2));
    assert_eq!(
        (i.max_num_seqs, i.max_num_tokens, i.max_seq_len),
        (SEQS, TOKENS, SEQ_LEN)
    );
    assert_eq!(i.device, DSV4_DEVICE_CPU);
    assert_eq!(i.numerics, DSV4_NUMERICS_EXACT);
    assert_eq!(i.weight_format, DSV4_WEIGHT_FORMAT_AS_STORED);
    assert_eq!(i.phase, DSV4_PHASE_CREATED);
}

#[test]
fn load_tensor_validates_and_streams() {
    let e = created();
    let (_, w) = find_weight(&e, "norm.weight");
    let before = weight_bytes(&w);
    let n = cstr("norm.weight");
    let vals: Vec<f32> = (0..256).map(|k| 1.0 + k as f32 / 256.0).collect();
    let unchanged = |what: &str| {
        assert_eq!(
            weight_bytes(&w),
            before,
            "{what}: a rejected load_tensor wrote data"
        );
    };
    // SAFETY: valid engine and tensors (some deliberately wrong).
    unsafe {
        let unknown = cstr("layers.99.attn.nope");
        let t = f32_tensor(&unknown, &[256], &vals);
        check(
            dsv4_load_tensor(e.0, &t),
            DSV4_STATUS_TENSOR,
            &["layers.99.attn.nope"],
        );
        unchanged("unknown name");
        let t = f32_tensor(&n, &[128], &vals[..128]);
        check(
            dsv4_load_tensor(e.0, &t),
            DSV4_STATUS_TENSOR,
            &["norm.weight", "shape"],
        );
        unchanged("wrong shape");
        // A float weight given as I64 is a dtype error naming the weight.
        let ints: Vec<i64> = (0..256).collect();
        let mut t = f32_tensor(&n, &[256], &[]);
        t.dtype = DSV4_DTYPE_I64;
        t.data = ints.as_ptr().cast();
        check(
            dsv4_load_tensor(e.0, &t),
            DSV4_STATUS_TENSOR,
            &["norm.weight", "I64"],
        );
        unchanged("I64 for a float weight");
        // The hash-routing table given as F32, and with an expert id out of range.
        let tid = cstr("layers.0.ffn.gate.tid2eid");
        let fl = vec![0.0f32; 1024 * 2];
        let t = f32_tensor(&tid, &[1024, 2], &fl);
        check(
            dsv4_load_tensor(e.0, &t),
            DSV4_STATUS_TENSOR,
            &["layers.0.ffn.gate.tid2eid", "F32"],
        );
        let mut ids: Vec<i32> = (0..2048).map(|k| k % 8).collect();
        ids[7] = 8;
        let mut t = f32_tensor(&tid, &[1024, 2], &[]);
        t.dtype = DSV4_DTYPE_I32;
        t.data = ids.as_ptr().cast();
        check(
            dsv4_load_tensor(e.0, &t),
            DSV4_STATUS_TENSOR,
            &["layers.0.ffn.gate.tid2eid", "value 8"],
        );

        let t = f32_tensor(&n, &[256], &vals);
        ok(dsv4_load_tensor(e.0, &t));
        let got: Vec<f32> = weight_bytes(&w)
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vals);
        assert_eq!(
            info(&e).phase,
            DSV4_PHASE_CREATED,
            "one tensor does not complete the load"
        );
        check(
            dsv4_finalize(e.0, ptr::null_mut()),
            DSV4_STATUS_STATE,
            &["weights have no value"],
        );
    }
}

/// Streams every tensor of the tiny fixture through `dsv4_load_tensor` (BF16 weights, I64
/// routing table, checkpoint names): the last one completes the load, and the forward
/// matches the transformers oracle.
#[test]
fn load_tensor_streams_the_fixture_to_oracle_parity() {
    let e = fixture_engine("tiny");
    let ts = fixture_tensors("tiny");
    let names: Vec<CString> = ts.iter().map(|t| cstr(&t.name)).collect();
    for (k, (t, name)) in ts.iter().zip(&names).enumerate() {
        assert_eq!(
            info(&e).phase,
            DSV4_PHASE_CREATED,
            "complete before tensor {k}"
        );
        let mut d = dsv4_tensor_default();
        d.name = name.as_ptr();
        d.dtype = match t.dtype {
            Dtype::BF16 => DSV4_DTYPE_BF16,
            Dtype::F32 => DSV4_DTYPE_F32,
            Dtype::I64 => DSV4_DTYPE_I64,
            other => panic!("fixture tensor `{}` has dtype {other}", t.name),
        };
        d.ndim = t.shape.len() as i32;
        for (s, &x) in d.shape.iter_mut().zip(&t.shape) {
            *s = x as i64;
        }
        // The bytes are little-endian; copy into aligned storage of the element type.
        let store = aligned(&t.data);
        d.data = store.as_ptr().cast();
        // SAFETY: valid engine; `store` holds the tensor's bytes.
        ok(unsafe { dsv4_load_tensor(e.0, &d) });
    }
    assert_eq!(info(&e).phase, DSV4_PHASE_LOADED);
    // SAFETY: valid engine.
    ok(unsafe { dsv4_finalize(e.0, ptr::null_mut()) });
    let d = oracle_diff(&e, "tiny");
    println!("load_tensor streaming, tiny: max |dlogit| vs oracle = {d:.3e}");
}

/// Logits of a fixed probe batch: a fresh 3-token sequence in slot 2 (position 0 restarts
/// the slot, so every call computes the same thing).
fn probe(e: &Eng) -> Vec<u32> {
    let mut hb = HostBatch::single(2, 0, 3);
    forward_ok(e, &mut hb);
    hb.logits.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn refit_is_all_or_nothing() {
    let e = ready();
    forward_ok(&e, &mut HostBatch::single(0, 0, 2));
    let logits0 = probe(&e);
    let (_, norm) = find_weight(&e, "norm.weight");
    let (_, attn) = find_weight(&e, "layers.0.attn_norm.weight");
    let (norm0, attn0) = (weight_bytes(&norm), weight_bytes(&attn));
    let (n1, n2) = (cstr("norm.weight"), cstr("layers.0.attn_norm.weight"));
    let good1: Vec<f32> = (0..256).map(|k| 0.5 + k as f32 * 1e-3).collect();
    let good2: Vec<f32> = (0..256).map(|k| 2.0 - k as f32 * 1e-3).collect();
    let unchanged = |what: &str| {
        assert_eq!(weight_bytes(&norm), norm0, "{what}: norm.weight changed");
        assert_eq!(
            weight_bytes(&attn),
            attn0,
            "{what}: layers.0.attn_norm.weight changed"
        );
        // The engine is unchanged as a whole: the probe forward is bit-identical.
        assert!(
            probe(&e) == logits0,
            "{what}: logits changed after a failed refit"
        );
        still_works(&e);
    };
    // SAFETY: valid engine; arrays of valid tensors (some deliberately wrong).
    unsafe {
        // A bad enum in the middle entry, caught at the boundary.
        let mut bad = f32_tensor(&n2, &[256], &good2);
        bad.dtype = 42;
        let ts = [
            f32_tensor(&n1, &[256], &good1),
            bad,
            f32_tensor(&n2, &[256], &good2),
        ];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 3, ptr::null_mut()),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["tensors[1].dtype"],
        );
        unchanged("bad dtype");
        // A NULL data pointer in the last entry.
        let mut bad = f32_tensor(&n2, &[256], &good2);
        bad.data = ptr::null();
        let ts = [f32_tensor(&n1, &[256], &good1), bad];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["tensors[1].data"],
        );
        unchanged("NULL data");
        // Mixed struct sizes.
        let mut ts = [
            f32_tensor(&n1, &[256], &good1),
            f32_tensor(&n2, &[256], &good2),
        ];
        ts[1].struct_size += 8;
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["tensors[1].struct_size"],
        );
        unchanged("mixed struct_size");
        // Device memory on CPU.
        let mut ts = [
            f32_tensor(&n1, &[256], &good1),
            f32_tensor(&n2, &[256], &good2),
        ];
        ts[1].memory = DSV4_MEMORY_DEVICE;
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_UNSUPPORTED,
            &["tensors[1].memory"],
        );
        unchanged("device memory");

        // Errors only the weight table can detect (engine side).
        let unknown = cstr("layers.0.attn.does_not_exist");
        let ts = [
            f32_tensor(&n1, &[256], &good1),
            f32_tensor(&unknown, &[256], &good2),
        ];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &["refit entry 1", "layers.0.attn.does_not_exist"],
        );
        unchanged("unknown name");
        let ts = [
            f32_tensor(&n1, &[256], &good1),
            f32_tensor(&n2, &[16, 16], &good2),
        ];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &["refit entry 1", "layers.0.attn_norm.weight"],
        );
        unchanged("wrong shape");
        let ints: Vec<i64> = (0..256).collect();
        let mut t = f32_tensor(&n2, &[256], &[]);
        t.dtype = DSV4_DTYPE_I64;
        t.data = ints.as_ptr().cast();
        let ts = [f32_tensor(&n1, &[256], &good1), t];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &["refit entry 1", "layers.0.attn_norm.weight", "I64"],
        );
        unchanged("I64 for a float weight");
        // An out-of-range expert id in the hash-routing table, after a valid entry.
        let tid = cstr("layers.0.ffn.gate.tid2eid");
        let mut ids: Vec<i32> = (0..2048).map(|k| k % 8).collect();
        ids[11] = 8;
        let mut t = f32_tensor(&tid, &[1024, 2], &[]);
        t.dtype = DSV4_DTYPE_I32;
        t.data = ids.as_ptr().cast();
        let ts = [f32_tensor(&n1, &[256], &good1), t];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &["refit entry 1", "layers.0.ffn.gate.tid2eid", "value 8"],
        );
        unchanged("expert id out of range");
        let ts = [
            f32_tensor(&n1, &[256], &good1),
            f32_tensor(&n1, &[256], &good2),
        ];
        check(
            dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_INVALID_ARGUMENT,
            &["norm.weight", "both"],
        );
        unchanged("duplicate");

        // The good refit: both written, pointers unchanged, logits change.
        let ts = [
            f32_tensor(&n1, &[256], &good1),
            f32_tensor(&n2, &[256], &good2),
        ];
        ok(dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()));
        let as_f32 = |b: Vec<u8>| -> Vec<f32> {
            b.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        assert_eq!(as_f32(weight_bytes(&norm)), good1);
        assert_eq!(as_f32(weight_bytes(&attn)), good2);
        assert_eq!(find_weight(&e, "norm.weight").1.data, norm.data);
        assert!(probe(&e) != logits0, "a real refit must change the logits");
        // BF16 input is accepted too.
        let bf: Vec<u16> = good2.iter().map(|&v| (v.to_bits() >> 16) as u16).collect();
        let mut t = f32_tensor(&n1, &[256], &[]);
        t.dtype = DSV4_DTYPE_BF16;
        t.data = bf.as_ptr().cast();
        ok(dsv4_refit(e.0, &t, 1, ptr::null_mut()));
        let got = as_f32(weight_bytes(&norm));
        for (g, b) in got.iter().zip(&bf) {
            assert_eq!(*g, f32::from_bits((*b as u32) << 16));
        }
        ok(dsv4_refit(e.0, ptr::null(), 0, ptr::null_mut()));

        // Refitting the original values restores the original logits bit for bit.
        let (v1, v2) = (as_f32(norm0.clone()), as_f32(attn0.clone()));
        let ts = [f32_tensor(&n1, &[256], &v1), f32_tensor(&n2, &[256], &v2)];
        ok(dsv4_refit(e.0, ts.as_ptr(), 2, ptr::null_mut()));
        assert!(probe(&e) == logits0, "refit back to the original weights");
    }
    still_works(&e);
}

/// `bytes` in 8-byte aligned storage (any element type up to 8 bytes can point into it).
fn aligned(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks(8)
        .map(|c| {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect()
}

/// Refit of weights that the forward reaches through routing, mixing and the fused MoE
/// path (all routed experts' w1 of a top-k layer, mHC mixing weights, the hash-routing
/// table), several entries per call: a change shows in the logits, restoring the old
/// values restores them bit for bit, and a failed refit touching them changes nothing.
/// (Backends that keep derived copies of these weights must rebuild them to pass.)
#[test]
fn refit_reaches_the_forward_and_restores_bitwise() {
    let e = ready();
    let logits0 = probe(&e);
    let derived: Vec<String> = (0..weight_count(&e))
        .map(|i| weight(&e, i))
        .filter(|w| w.derived != 0)
        .map(|w| weight_name(&w))
        .collect();
    println!("derived tensors on this backend: {derived:?}");
    let groups: Vec<Vec<String>> = vec![
        (0..8)
            .map(|x| format!("layers.2.ffn.experts.{x}.w1.weight"))
            .collect(),
        vec!["layers.0.hc_attn_fn".into(), "layers.3.hc_ffn_fn".into()],
        vec!["layers.0.ffn.gate.tid2eid".into()],
    ];
    for group in &groups {
        let ws: Vec<dsv4_weight_desc> = group.iter().map(|n| find_weight(&e, n).1).collect();
        let olds: Vec<Vec<u8>> = ws.iter().map(weight_bytes).collect();
        // A visible change: float values negated (sign bit), routing ids rotated.
        let news: Vec<Vec<u8>> = ws
            .iter()
            .zip(&olds)
            .map(|(w, old)| match w.dtype {
                DSV4_DTYPE_F32 => old
                    .chunks(4)
                    .flat_map(|c| {
                        (u32::from_le_bytes(c.try_into().unwrap()) ^ (1 << 31)).to_le_bytes()
                    })
                    .collect(),
                DSV4_DTYPE_BF16 => old
                    .chunks(2)
                    .flat_map(|c| {
                        (u16::from_le_bytes(c.try_into().unwrap()) ^ (1 << 15)).to_le_bytes()
                    })
                    .collect(),
                DSV4_DTYPE_I32 => old
                    .chunks(4)
                    .flat_map(|c| {
                        ((i32::from_le_bytes(c.try_into().unwrap()) + 3) % 8).to_le_bytes()
                    })
                    .collect(),
                d => panic!("`{}` has storage dtype {d}", weight_name(w)),
            })
            .collect();
        let cnames: Vec<CString> = group.iter().map(|n| cstr(n)).collect();
        let bad = cstr("layers.2.ffn.experts.99.w1.weight");
        let refit = |values: &[Vec<u8>], with_bad: bool| -> dsv4_status {
            let store: Vec<Vec<u64>> = values.iter().map(|v| aligned(v)).collect();
            let mut ts: Vec<dsv4_tensor> = ws
                .iter()
                .zip(&cnames)
                .zip(&store)
                .map(|((w, n), d)| {
                    let mut t = dsv4_tensor_default();
                    t.name = n.as_ptr();
                    t.dtype = w.dtype;
                    t.ndim = w.ndim;
                    t.shape = w.shape;
                    t.data = d.as_ptr().cast();
                    t
                })
                .collect();
            if with_bad {
                let mut t = ts[0];
                t.name = bad.as_ptr();
                ts.push(t);
            }
            // SAFETY: valid engine; every entry points into live storage.
            unsafe { dsv4_refit(e.0, ts.as_ptr(), ts.len(), ptr::null_mut()) }
        };
        let what = &group[0];
        for w in &ws {
            assert_eq!(w.derived, 0, "`{}` is a source weight", weight_name(w));
        }
        // Rejected (last entry unknown): nothing changes, derived tensors included.
        check(
            refit(&news, true),
            DSV4_STATUS_TENSOR,
            &["layers.2.ffn.experts.99.w1.weight"],
        );
        for (w, old) in ws.iter().zip(&olds) {
            assert_eq!(&weight_bytes(w), old, "{what}: written by a failed refit");
        }
        assert!(probe(&e) == logits0, "{what}: failed refit changed logits");

        ok(refit(&news, false));
        for (w, new) in ws.iter().zip(&news) {
            assert_eq!(&weight_bytes(w), new, "{what}");
        }
        assert!(
            probe(&e) != logits0,
            "{what}: refit does not reach the forward"
        );
        ok(refit(&olds, false));
        assert!(
            probe(&e) == logits0,
            "{what}: restoring the weights does not restore the logits"
        );
    }
}

// ----------------------------------------------------------------------------------------
// checkpoints: bad files through dsv4_load, then the good fixture on the same engine

/// One tensor of a safetensors file, owned.
#[derive(Clone)]
struct StTensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Every tensor of `tests/fixtures/<name>/model.safetensors`, sorted by name.
fn fixture_tensors(name: &str) -> Vec<StTensor> {
    let bytes = std::fs::read(fixture_dir(name).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<StTensor> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| StTensor {
            name,
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            data: v.data().to_vec(),
        })
        .collect();
    ts.sort_by(|a, b| a.name.cmp(&b.name));
    ts
}

/// Writes `ts` as one safetensors file with the `safetensors` crate.
fn write_st(path: &Path, ts: &[StTensor]) {
    let views: Vec<(String, TensorView)> = ts
        .iter()
        .map(|t| {
            let v = TensorView::new(t.dtype, t.shape.clone(), &t.data)
                .unwrap_or_else(|e| panic!("tensor `{}`: {e}", t.name));
            (t.name.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A fresh, empty scratch directory holding a copy of the fixture's config.json.
fn scratch_dir(tag: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("ffi_abi_ckpt")
        .join(tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture_dir("tiny").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    dir
}

/// A CPU engine (exact numerics) with the config of `tests/fixtures/<name>`.
fn fixture_engine(name: &str) -> Eng {
    let dir = cstr(fixture_dir(name).to_str().unwrap());
    let mut p = dsv4_create_params_default();
    p.config_path = dir.as_ptr();
    p.max_num_seqs = 2;
    p.max_num_tokens = 64;
    p.max_seq_len = 64;
    p.num_threads = 2;
    p.numerics = DSV4_NUMERICS_EXACT;
    let (s, e) = create(&p);
    ok(s);
    e.unwrap()
}

/// Runs the oracle's prompt 0 (every row, slot 0 from position 0) on a READY engine and
/// returns max |logit - oracle| after asserting it is within 1e-3.
#[track_caller]
fn oracle_diff(e: &Eng, name: &str) -> f32 {
    let o = Oracle::load(name);
    let vocab = info(e).vocab_size as usize;
    let (s, out) = common::abi::forward_one_sequence(e.0, &o.prompts[0], vocab);
    ok(s);
    let d = max_abs_diff(&out, &o.logits[0]);
    assert!(d <= 1e-3, "{name}: max |dlogit| vs oracle = {d} > 1e-3");
    d
}

/// Loads `source` (AUTO) and returns the status.
fn load_path(e: &Eng, source: &Path) -> dsv4_status {
    let s = cstr(source.to_str().unwrap());
    // SAFETY: valid engine and NUL-terminated path.
    unsafe { dsv4_load(e.0, s.as_ptr(), DSV4_LOAD_AUTO) }
}

/// A bad checkpoint and what `dsv4_load` must say about it.
struct BadCase {
    tag: &'static str,
    source: PathBuf,
    status: dsv4_status,
    /// The message names every one of these.
    needles: Vec<String>,
    /// If non-empty, the message names at least one of these.
    any_of: Vec<String>,
}

/// The safetensors header of `bytes`: (header length, header JSON).
fn st_header(bytes: &[u8]) -> (usize, serde_json::Map<String, serde_json::Value>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let v: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (n, v.as_object().unwrap().clone())
}

/// A safetensors file made of `header` (re-serialized, space-padded to 8 bytes) and `data`.
fn st_bytes(header: &serde_json::Map<String, serde_json::Value>, data: &[u8]) -> Vec<u8> {
    let mut h = serde_json::to_vec(header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

fn bad_checkpoints() -> Vec<BadCase> {
    let good = fixture_tensors("tiny");
    let file = std::fs::read(fixture_dir("tiny").join("model.safetensors")).unwrap();
    let (hlen, header) = st_header(&file);
    let data = &file[8 + hlen..];
    let s = |x: &str| x.to_string();
    let path_str = |p: &Path| p.display().to_string();
    let mut cases = Vec::new();

    // Missing directory.
    let dir = scratch_dir("missing");
    let source = dir.join("no-such-checkpoint");
    cases.push(BadCase {
        tag: "missing directory",
        needles: vec![path_str(&source)],
        source,
        status: DSV4_STATUS_IO,
        any_of: vec![],
    });

    // A directory with config.json and no weights.
    let dir = scratch_dir("config_only");
    cases.push(BadCase {
        tag: "config.json only",
        needles: vec![path_str(&dir), s(".safetensors")],
        source: dir,
        status: DSV4_STATUS_IO,
        any_of: vec![],
    });

    // Truncated copies: inside the 8-byte length, inside the JSON header, inside the data.
    let data_start = 8 + hlen;
    let cuts = [
        ("truncated to 0 bytes", 0),
        ("truncated inside the length", 5),
        ("truncated after the length", 8),
        ("truncated inside the header", 8 + hlen / 2),
        ("truncated at the end of the header", data_start),
        ("truncated inside the data", data_start + data.len() / 2),
        ("truncated by one byte", file.len() - 1),
    ];
    for (k, (tag, cut)) in cuts.into_iter().enumerate() {
        let dir = scratch_dir(&format!("truncated_{k}"));
        let f = dir.join("model.safetensors");
        std::fs::write(&f, &file[..cut]).unwrap();
        // Cuts inside the data must name a tensor whose bytes are cut off.
        let any_of = if cut > data_start {
            header
                .iter()
                .filter(|(n, v)| {
                    *n != "__metadata__"
                        && data_start + v["data_offsets"][1].as_u64().unwrap() as usize > cut
                })
                .map(|(n, _)| format!("`{n}`"))
                .collect()
        } else {
            vec![]
        };
        cases.push(BadCase {
            tag,
            needles: vec![path_str(&f)],
            // The single file itself for some, its directory for others.
            source: if k % 2 == 0 { dir } else { f },
            status: DSV4_STATUS_FORMAT,
            any_of,
        });
    }

    // Garbage where the JSON header should be.
    let dir = scratch_dir("garbage_header");
    let f = dir.join("model.safetensors");
    let mut bytes = 64u64.to_le_bytes().to_vec();
    let mut junk = b"{\"model.norm.weight\": {\"dtype\": BF16, !!".to_vec();
    junk.resize(64, b'#');
    bytes.extend_from_slice(&junk);
    bytes.extend_from_slice(&data[..4096]);
    std::fs::write(&f, bytes).unwrap();
    cases.push(BadCase {
        tag: "garbage JSON header",
        needles: vec![path_str(&f)],
        source: dir,
        status: DSV4_STATUS_FORMAT,
        any_of: vec![],
    });

    // A header length pointing past the end of the file, and an absurd one.
    for (k, n) in [(0, file.len() as u64), (1, u64::MAX)] {
        let dir = scratch_dir(&format!("header_length_{k}"));
        let f = dir.join("model.safetensors");
        let mut bytes = file.clone();
        bytes[..8].copy_from_slice(&n.to_le_bytes());
        std::fs::write(&f, bytes).unwrap();
        cases.push(BadCase {
            tag: "header length past the end",
            needles: vec![path_str(&f)],
            source: dir,
            status: DSV4_STATUS_FORMAT,
            any_of: vec![],
        });
    }

    // Data offsets past the end of the file.
    let victim = "model.layers.1.attn.wkv.weight";
    let dir = scratch_dir("offsets_past_end");
    let f = dir.join("model.safetensors");
    let mut h = header.clone();
    h[victim]["data_offsets"][1] = (data.len() as u64 + 1024).into();
    std::fs::write(&f, st_bytes(&h, data)).unwrap();
    cases.push(BadCase {
        tag: "data offsets past the end",
        needles: vec![path_str(&f), format!("`{victim}`")],
        source: dir,
        status: DSV4_STATUS_FORMAT,
        any_of: vec![],
    });

    // Overlapping data offsets (inside the file, but not a valid layout).
    let dir = scratch_dir("offsets_overlap");
    let f = dir.join("model.safetensors");
    let mut h = header.clone();
    let o = &mut h[victim]["data_offsets"];
    let (a, b) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
    *o = serde_json::json!([a + 2, b + 2]);
    std::fs::write(&f, st_bytes(&h, data)).unwrap();
    cases.push(BadCase {
        tag: "overlapping data offsets",
        needles: vec![path_str(&f)],
        source: dir,
        status: DSV4_STATUS_FORMAT,
        any_of: vec![],
    });

    // Rewritten from the fixture's tensors with one change each.
    let mut edited = |tag: &'static str,
                      dirname: &str,
                      edit: &dyn Fn(&mut Vec<StTensor>),
                      status: dsv4_status,
                      needles: Vec<String>| {
        let dir = scratch_dir(dirname);
        let f = dir.join("model.safetensors");
        let mut ts = good.clone();
        edit(&mut ts);
        write_st(&f, &ts);
        // Besides the tensor, the message names the file (or, for a missing tensor, the
        // checkpoint directory).
        let mut needles = needles;
        needles.push(path_str(&dir));
        cases.push(BadCase {
            tag,
            source: dir,
            status,
            needles,
            any_of: vec![],
        });
    };
    fn find<'a>(ts: &'a mut [StTensor], name: &str) -> &'a mut StTensor {
        ts.iter_mut().find(|t| t.name == name).unwrap()
    }
    edited(
        "unknown tensor name",
        "renamed_unknown",
        &|ts| {
            find(ts, "model.layers.0.attn.wq_a.weight").name = s("model.layers.0.attn.wq_zz.weight")
        },
        DSV4_STATUS_TENSOR,
        vec![s("`model.layers.0.attn.wq_zz.weight`"), s("unknown")],
    );
    edited(
        "tensor of a layer the model does not have",
        "renamed_layer",
        &|ts| {
            find(ts, "model.layers.0.attn.wq_a.weight").name = s("model.layers.5.attn.wq_a.weight")
        },
        DSV4_STATUS_TENSOR,
        vec![s("`model.layers.5.attn.wq_a.weight`")],
    );
    edited(
        "tensor removed",
        "removed",
        &|ts| ts.retain(|t| t.name != "model.layers.1.attn.indexer.wq_b.weight"),
        DSV4_STATUS_TENSOR,
        vec![s("layers.1.attn.indexer.wq_b.weight"), s("missing")],
    );
    edited(
        "wrong shape",
        "wrong_shape",
        &|ts| find(ts, "model.layers.0.attn.wq_a.weight").shape = vec![64, 256],
        DSV4_STATUS_TENSOR,
        vec![s("`model.layers.0.attn.wq_a.weight`"), s("shape")],
    );
    edited(
        "tid2eid as F32",
        "tid2eid_f32",
        &|ts| {
            let t = find(ts, "model.layers.0.ffn.gate.tid2eid");
            t.data = t
                .data
                .chunks(8)
                .flat_map(|c| (i64::from_le_bytes(c.try_into().unwrap()) as f32).to_le_bytes())
                .collect();
            t.dtype = Dtype::F32;
        },
        DSV4_STATUS_TENSOR,
        vec![s("`model.layers.0.ffn.gate.tid2eid`"), s("F32")],
    );
    edited(
        "tid2eid with an expert id out of range",
        "tid2eid_range",
        &|ts| {
            let t = find(ts, "model.layers.1.ffn.gate.tid2eid");
            t.data[8 * 77..8 * 78].copy_from_slice(&8i64.to_le_bytes());
        },
        DSV4_STATUS_TENSOR,
        vec![
            s("`model.layers.1.ffn.gate.tid2eid`"),
            s("value 8 at [38, 1]"),
        ],
    );
    edited(
        "float weight as I64",
        "weight_i64",
        &|ts| {
            let t = find(ts, "model.layers.2.attn_norm.weight");
            t.data = t
                .data
                .chunks(2)
                .flat_map(|c| (u16::from_le_bytes(c.try_into().unwrap()) as i64).to_le_bytes())
                .collect();
            t.dtype = Dtype::I64;
        },
        DSV4_STATUS_TENSOR,
        vec![s("`model.layers.2.attn_norm.weight`"), s("I64")],
    );

    // Sharded checkpoints: index + two shards.
    let shard_names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let write_sharded = |dir: &Path, map_override: Option<(&str, &str)>| {
        let (a, b) = good.split_at(good.len() / 2);
        write_st(&dir.join(shard_names[0]), a);
        write_st(&dir.join(shard_names[1]), b);
        let mut wm = serde_json::Map::new();
        for (part, shard) in [(a, shard_names[0]), (b, shard_names[1])] {
            for t in part {
                wm.insert(t.name.clone(), shard.into());
            }
        }
        if let Some((n, shard)) = map_override {
            wm.insert(n.into(), shard.into());
        }
        let index = serde_json::json!({"metadata": {}, "weight_map": wm});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        (a[0].name.clone(), b[0].name.clone())
    };
    let dir = scratch_dir("sharded_missing_shard");
    write_sharded(&dir, None);
    std::fs::remove_file(dir.join(shard_names[1])).unwrap();
    cases.push(BadCase {
        tag: "index names a missing shard",
        needles: vec![s(shard_names[1])],
        source: dir,
        status: DSV4_STATUS_IO,
        any_of: vec![],
    });
    let dir = scratch_dir("sharded_wrong_shard");
    let first_of_a = good[0].name.clone();
    write_sharded(&dir, Some((&first_of_a, shard_names[1])));
    cases.push(BadCase {
        tag: "index maps a tensor to the wrong shard",
        needles: vec![format!("`{first_of_a}`"), s(shard_names[1])],
        source: dir,
        status: DSV4_STATUS_TENSOR,
        any_of: vec![],
    });
    let dir = scratch_dir("sharded_bad_index");
    write_sharded(&dir, None);
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        "{\"weight_map\": {",
    )
    .unwrap();
    cases.push(BadCase {
        tag: "index is not JSON",
        needles: vec![s("model.safetensors.index.json")],
        source: dir,
        status: DSV4_STATUS_FORMAT,
        any_of: vec![],
    });
    let dir = scratch_dir("sharded_escape");
    write_sharded(&dir, Some((&first_of_a, "../../model.safetensors")));
    cases.push(BadCase {
        tag: "index escapes the directory",
        needles: vec![
            s("model.safetensors.index.json"),
            s("../../model.safetensors"),
        ],
        source: dir,
        status: DSV4_STATUS_FORMAT,
        any_of: vec![],
    });
    // Two shards without an index, both holding one tensor.
    let dir = scratch_dir("duplicate");
    let (a, b) = good.split_at(good.len() / 2);
    let mut b = b.to_vec();
    b.push(a[3].clone());
    write_st(&dir.join(shard_names[0]), a);
    write_st(&dir.join(shard_names[1]), &b);
    cases.push(BadCase {
        tag: "tensor in two shards",
        needles: vec![
            format!("`{}`", a[3].name),
            s(shard_names[0]),
            s(shard_names[1]),
        ],
        source: dir,
        status: DSV4_STATUS_TENSOR,
        any_of: vec![],
    });
    cases
}

/// Every bad checkpoint fails with its status and a message naming the culprit, in phase
/// CREATED and again in phase LOADED (after a good load); the phase is kept; then the
/// same engine loads the good fixture, finalizes and matches the oracle.
#[test]
fn bad_checkpoints_are_named_and_leave_the_engine_usable() {
    let good = fixture_dir("tiny");
    for case in bad_checkpoints() {
        let e = fixture_engine("tiny");
        let what = format!("{} ({})", case.tag, case.source.display());
        for phase in [DSV4_PHASE_CREATED, DSV4_PHASE_LOADED] {
            if phase == DSV4_PHASE_LOADED {
                ok(load_path(&e, &good));
            }
            let s = load_path(&e, &case.source);
            let msg = last_error();
            println!("{what}: {} {msg}", name(s));
            check(s, case.status, &[]);
            for n in &case.needles {
                assert!(
                    msg.contains(n.as_str()),
                    "{what}: message does not name `{n}`: {msg}"
                );
            }
            assert!(
                case.any_of.is_empty() || case.any_of.iter().any(|n| msg.contains(n.as_str())),
                "{what}: message names none of {:?}: {msg}",
                case.any_of
            );
            assert_eq!(
                info(&e).phase,
                phase,
                "{what}: a failed load changed the phase"
            );
        }
        // The same engine: load the good fixture (the failed load may have written part of
        // the weights, as documented), finalize, and match the oracle.
        ok(load_path(&e, &good));
        assert_eq!(info(&e).phase, DSV4_PHASE_LOADED);
        // SAFETY: valid engine.
        ok(unsafe { dsv4_finalize(e.0, ptr::null_mut()) });
        let d = oracle_diff(&e, "tiny");
        println!("{what}: then the good fixture: max |dlogit| vs oracle = {d:.3e}");
        let scratch = Path::new(env!("CARGO_TARGET_TMPDIR")).join("ffi_abi_ckpt");
        if let Some(dir) = case
            .source
            .ancestors()
            .find(|a| a.parent() == Some(&scratch))
        {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The writer used above produces checkpoints the loader accepts: the fixture re-written
/// as an index + two shards loads and matches the oracle (so each bad case differs from a
/// good one only by its corruption).
#[test]
fn rewritten_sharded_fixture_matches_the_oracle() {
    let dir = scratch_dir("sharded_good");
    let good = fixture_tensors("tiny");
    let (a, b) = good.split_at(good.len() / 3);
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    write_st(&dir.join(names[0]), a);
    write_st(&dir.join(names[1]), b);
    let wm: serde_json::Map<String, serde_json::Value> = a
        .iter()
        .map(|t| (t.name.clone(), names[0].into()))
        .chain(b.iter().map(|t| (t.name.clone(), names[1].into())))
        .collect();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({ "weight_map": wm }).to_string(),
    )
    .unwrap();
    let e = fixture_engine("tiny");
    ok(load_path(&e, &dir));
    // The index itself is also an accepted source.
    ok(load_path(&e, &dir.join("model.safetensors.index.json")));
    // SAFETY: valid engine.
    ok(unsafe { dsv4_finalize(e.0, ptr::null_mut()) });
    let d = oracle_diff(&e, "tiny");
    println!("sharded rewrite of tiny: max |dlogit| vs oracle = {d:.3e}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ----------------------------------------------------------------------------------------
// threads, last error, logging

#[test]
fn engines_are_independent_across_threads_and_errors_are_thread_local() {
    let handles: Vec<_> = (0..2)
        .map(|k| {
            std::thread::spawn(move || {
                let e = ready();
                if k == 1 {
                    // SAFETY: valid engine.
                    check(
                        unsafe { dsv4_release_slot(e.0, 99) },
                        DSV4_STATUS_INVALID_ARGUMENT,
                        &["`slot` = 99"],
                    );
                }
                let mut hb = HostBatch::seqs(&[(0, 0, 3), (1, 0, 1)]);
                forward_ok(&e, &mut hb);
                hb.logits
            })
        })
        .collect();
    let outs: Vec<Vec<f32>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(outs[0], outs[1], "same model, same batch, same logits");
    // The other threads' errors are not visible here.
    // SAFETY: valid call.
    ok(unsafe { dsv4_release_slot(ready().0, 0) });
}

static LOG_LINES: Mutex<Vec<(i32, String, usize)>> = Mutex::new(Vec::new());

unsafe extern "C" fn record(level: i32, msg: *const c_char, user: *mut c_void) {
    // SAFETY: dsv4 passes a NUL-terminated message.
    let m = unsafe { CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned();
    LOG_LINES.lock().unwrap().push((level, m, user as usize));
}

#[test]
fn log_callback_receives_messages_up_to_max_level() {
    // SAFETY: `record` follows the callback contract.
    unsafe {
        ok(dsv4_set_log_callback(
            Some(record),
            0x1234 as *mut c_void,
            DSV4_LOG_INFO,
        ));
        dsv4::log::info("ffi-abi-test info line");
        dsv4::log::log(dsv4::log::Level::Debug, "ffi-abi-test debug line");
        ok(dsv4_set_log_callback(
            Some(record),
            0x1234 as *mut c_void,
            DSV4_LOG_ERROR,
        ));
        dsv4::log::warn("ffi-abi-test filtered warning");
        ok(dsv4_set_log_callback(None, ptr::null_mut(), DSV4_LOG_WARN));
    }
    let lines = LOG_LINES.lock().unwrap();
    let mine: Vec<_> = lines
        .iter()
        .filter(|(_, m, _)| m.starts_with("ffi-abi-test"))
        .collect();
    assert_eq!(mine.len(), 1, "{mine:?}");
    assert_eq!(
        mine[0],
        &(DSV4_LOG_INFO, "ffi-abi-test info line".to_string(), 0x1234)
    );
}

/// ABI 1.3: memory the engine cannot get at create is DSV4_STATUS_OUT_OF_MEMORY naming the
/// buffer (here a 64 TiB embedding: a config within the sanity limits that no host can hold),
/// not CAPACITY (which means "send a smaller batch"); nothing is created.
#[test]
fn memory_the_engine_cannot_get_is_out_of_memory() {
    let fixture = common::fixture_dir("tiny");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    cfg["vocab_size"] = (1u64 << 24).into();
    cfg["hidden_size"] = (1u64 << 20).into();
    let json = std::ffi::CString::new(cfg.to_string()).unwrap();
    let mut p = dsv4_create_params_default();
    p.config_json = json.as_ptr();
    p.max_num_seqs = 1;
    p.max_num_tokens = 4;
    p.max_seq_len = 8;
    let mut e = std::ptr::null_mut();
    let st = unsafe { dsv4_create(&p, &mut e) };
    assert_eq!(
        st,
        DSV4_STATUS_OUT_OF_MEMORY,
        "{}",
        common::abi::last_error()
    );
    assert!(e.is_null());
    let msg = common::abi::last_error();
    assert!(
        msg.contains("embed.weight") && msg.contains("allocate"),
        "{msg}"
    );
    let name = unsafe { std::ffi::CStr::from_ptr(dsv4_status_name(st)) };
    assert_eq!(name.to_str().unwrap(), "OUT_OF_MEMORY");
}

/// dsv4_load_tensors (ABI 1.4): every entry is validated before any is written, errors name
/// the entry and the weight, and a good call writes every entry's values.
#[test]
fn load_tensors_validates_every_entry_before_writing() {
    let c = created();
    let (n1, n2) = (cstr("norm.weight"), cstr("layers.0.attn_norm.weight"));
    let (v1, v2) = (vec![0.5f32; 256], vec![-2.0f32; 256]);
    let read = |name: &str| -> Vec<f32> {
        let (_, w) = find_weight(&c, name);
        // SAFETY: a CPU engine's weight descriptor points at its f32 host buffer.
        unsafe { std::slice::from_raw_parts(w.data.cast::<f32>(), 256) }.to_vec()
    };
    let before = (read("norm.weight"), read("layers.0.attn_norm.weight"));
    // SAFETY: valid engine; the entries point at live buffers.
    unsafe {
        check(
            dsv4_load_tensors(c.0, ptr::null(), 2, ptr::null_mut()),
            DSV4_STATUS_NULL_POINTER,
            &["`tensors`"],
        );
        ok(dsv4_load_tensors(c.0, ptr::null(), 0, ptr::null_mut()));
        // A good entry, then an unknown name: nothing is written.
        let unknown = cstr("layers.0.attn.does_not_exist");
        let ts = [
            f32_tensor(&n1, &[256], &v1),
            f32_tensor(&unknown, &[256], &v2),
        ];
        check(
            dsv4_load_tensors(c.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &["load entry 1", "layers.0.attn.does_not_exist"],
        );
        // A block scale without its weight.
        let scale = cstr("layers.0.attn.wq_a.scale");
        let e8 = [127u8; 4];
        let mut s = f32_tensor(&scale, &[2, 2], &[]);
        s.dtype = DSV4_DTYPE_E8M0;
        s.data = e8.as_ptr().cast();
        let ts = [f32_tensor(&n1, &[256], &v1), s];
        check(
            dsv4_load_tensors(c.0, ts.as_ptr(), 2, ptr::null_mut()),
            DSV4_STATUS_TENSOR,
            &["load entry 1", "wq_a"],
        );
        assert!(
            (read("norm.weight"), read("layers.0.attn_norm.weight")) == before,
            "a refused call wrote a weight"
        );
        // Both good: both written.
        let ts = [f32_tensor(&n1, &[256], &v1), f32_tensor(&n2, &[256], &v2)];
        ok(dsv4_load_tensors(c.0, ts.as_ptr(), 2, ptr::null_mut()));
    }
    assert_eq!(read("norm.weight"), v1);
    assert_eq!(read("layers.0.attn_norm.weight"), v2);
    let r = ready();
    let ts = [f32_tensor(&n1, &[256], &v1)];
    // SAFETY: valid engine and entry.
    check(
        unsafe { dsv4_load_tensors(r.0, ts.as_ptr(), 1, ptr::null_mut()) },
        DSV4_STATUS_STATE,
        &["dsv4_load_tensors"],
    );
}
