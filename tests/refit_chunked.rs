//! Chunked refit through the C ABI (dsv4_refit_begin / dsv4_refit / dsv4_refit_end): the RL
//! "init dummy, then sync the real weights in pieces" flow on the CPU backend. Forward and
//! finalize are STATE errors while a refit is open; a bad chunk changes nothing; after
//! refit_end the engine equals a normal load of the same checkpoint bit for bit, and no
//! weight address moved.

mod common;

use std::ffi::{CStr, CString};

use common::{Oracle, fixture_dir};
use dsv4::ffi::*;
use safetensors::SafeTensors;

fn last_error() -> String {
    unsafe { CStr::from_ptr(dsv4_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(s: dsv4_status) {
    assert_eq!(s, DSV4_STATUS_OK, "{}", last_error());
}

fn engine(load: Option<&str>) -> *mut dsv4_engine {
    let dir = CString::new(fixture_dir("tiny").to_str().unwrap()).unwrap();
    let mut p = dsv4_create_params_default();
    p.config_path = dir.as_ptr();
    p.numerics = DSV4_NUMERICS_EXACT;
    p.max_num_seqs = 2;
    p.max_num_tokens = 64;
    p.max_seq_len = 64;
    let mut e = std::ptr::null_mut();
    unsafe {
        ok(dsv4_create(&p, &mut e));
        match load {
            Some(_) => ok(dsv4_load(e, dir.as_ptr(), DSV4_LOAD_AUTO)),
            None => ok(dsv4_load(e, std::ptr::null(), DSV4_LOAD_DUMMY)),
        }
        ok(dsv4_finalize(e, std::ptr::null_mut()));
    }
    e
}

fn forward(e: *mut dsv4_engine, toks: &[i32]) -> (dsv4_status, Vec<f32>) {
    let pos: Vec<i32> = (0..toks.len() as i32).collect();
    let (slots, qs) = ([0i32], [0, toks.len() as i32]);
    let mut out = vec![f32::NAN; toks.len() * 256];
    let mut b = dsv4_batch_default();
    b.num_tokens = toks.len() as i32;
    b.num_seqs = 1;
    b.token_ids = toks.as_ptr();
    b.positions = pos.as_ptr();
    b.seq_slots = slots.as_ptr();
    b.query_start = qs.as_ptr();
    b.num_logits = toks.len() as i32;
    b.logits = out.as_mut_ptr().cast();
    b.logits_dtype = DSV4_LOGITS_F32;
    let s = unsafe { dsv4_forward(e, &b, std::ptr::null_mut()) };
    (s, out)
}

/// The checkpoint's tensors as refit entries (names as stored, BF16/I64 data).
struct Entries {
    names: Vec<CString>,
    data: Vec<Vec<u8>>,
    meta: Vec<(i32, Vec<i64>)>,
}

fn checkpoint_entries() -> Entries {
    let bytes = std::fs::read(fixture_dir("tiny").join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut e = Entries {
        names: vec![],
        data: vec![],
        meta: vec![],
    };
    for (name, t) in st.tensors() {
        let dtype = match t.dtype() {
            safetensors::Dtype::BF16 => DSV4_DTYPE_BF16,
            safetensors::Dtype::I64 => DSV4_DTYPE_I64,
            safetensors::Dtype::F32 => DSV4_DTYPE_F32,
            d => panic!("unexpected dtype {d:?} in the fixture"),
        };
        e.names.push(CString::new(name).unwrap());
        e.data.push(t.data().to_vec());
        e.meta
            .push((dtype, t.shape().iter().map(|&x| x as i64).collect()));
    }
    e
}

fn tensors(e: &Entries, range: std::ops::Range<usize>) -> Vec<dsv4_tensor> {
    range
        .map(|i| {
            let mut t = dsv4_tensor_default();
            t.name = e.names[i].as_ptr();
            t.dtype = e.meta[i].0;
            t.ndim = e.meta[i].1.len() as i32;
            for (d, &x) in t.shape.iter_mut().zip(&e.meta[i].1) {
                *d = x;
            }
            t.data = e.data[i].as_ptr().cast();
            t.memory = DSV4_MEMORY_HOST;
            t
        })
        .collect()
}

fn weight_addresses(e: *mut dsv4_engine) -> Vec<usize> {
    let mut n = 0usize;
    unsafe { ok(dsv4_weight_count(e, &mut n)) };
    (0..n)
        .map(|i| {
            let mut w: dsv4_weight_desc = unsafe { std::mem::zeroed() };
            w.struct_size = std::mem::size_of::<dsv4_weight_desc>();
            unsafe { ok(dsv4_weight_info(e, i, &mut w)) };
            w.data as usize
        })
        .collect()
}

#[test]
fn dummy_then_chunked_sync_equals_a_normal_load() {
    let o = Oracle::load("tiny");
    let toks = &o.prompts[0][..30];
    let reference = engine(Some("tiny"));
    let (s, want) = forward(reference, toks);
    ok(s);

    let e = engine(None);
    let addrs = weight_addresses(e);
    let (s, dummy) = forward(e, toks);
    ok(s);
    assert!(dummy.iter().all(|v| v.is_finite()));

    let entries = checkpoint_entries();
    let n = entries.names.len();
    unsafe {
        // Ends without a begin, or a second begin, are STATE errors.
        assert_eq!(dsv4_refit_end(e, std::ptr::null_mut()), DSV4_STATUS_STATE);
        assert!(last_error().contains("refit_begin"), "{}", last_error());
        ok(dsv4_refit_begin(e));
        assert_eq!(dsv4_refit_begin(e), DSV4_STATUS_STATE);
        let mut info: dsv4_info = std::mem::zeroed();
        info.struct_size = std::mem::size_of::<dsv4_info>();
        ok(dsv4_get_info(e, &mut info));
        assert_eq!(info.phase, DSV4_PHASE_REFITTING);

        // First half of the weights.
        let first = tensors(&entries, 0..n / 2);
        ok(dsv4_refit(
            e,
            first.as_ptr(),
            first.len(),
            std::ptr::null_mut(),
        ));
        // Forward and finalize are refused while the refit is open.
        let (s, _) = forward(e, toks);
        assert_eq!(s, DSV4_STATUS_STATE);
        assert!(last_error().contains("refit"), "{}", last_error());
        assert_eq!(dsv4_finalize(e, std::ptr::null_mut()), DSV4_STATUS_STATE);

        // A chunk with one bad entry (wrong shape) writes nothing: prove it by refitting the
        // good entries of that chunk afterwards and comparing with the reference at the end.
        let mut second = tensors(&entries, n / 2..n);
        let shape0 = second[0].shape[0];
        second[0].shape[0] = shape0 + 1;
        assert_eq!(
            dsv4_refit(e, second.as_ptr(), second.len(), std::ptr::null_mut()),
            DSV4_STATUS_TENSOR
        );
        second[0].shape[0] = shape0;
        ok(dsv4_refit(
            e,
            second.as_ptr(),
            second.len(),
            std::ptr::null_mut(),
        ));
        ok(dsv4_refit_end(e, std::ptr::null_mut()));
        ok(dsv4_get_info(e, &mut info));
        assert_eq!(info.phase, DSV4_PHASE_READY);
    }
    let (s, got) = forward(e, toks);
    ok(s);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
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
