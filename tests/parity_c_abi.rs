//! CPU reference vs the transformers fp32 oracle (tests/fixtures), through the exported C
//! functions only (`dsv4::ffi::dsv4_*`): `dsv4_create` with `config_path` and
//! `DSV4_NUMERICS_EXACT`, `dsv4_load` (AUTO), `dsv4_finalize`, `dsv4_forward`.
//!
//! For `tiny` and `tiny_native`: one-shot (all 3 sequences in one batch, every row, and
//! again with a permuted `logits_rows`), chunked prefill with odd chunk sizes and the
//! sequences interleaved at different offsets in shared batches, and prefill + batched
//! single-token decode. Tolerance (DESIGN.md §4): max |dlogit| <= 1e-3; the measured
//! maximum is printed.

mod common;

use std::ffi::{CStr, CString};
use std::ptr;

use common::{Oracle, fixture_dir, max_abs_diff};
use dsv4::ffi::*;

const TOL: f32 = 1e-3;

fn last_error() -> String {
    // SAFETY: dsv4_last_error never returns NULL and the text is NUL-terminated.
    unsafe { CStr::from_ptr(dsv4_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn ok(s: dsv4_status, what: &str) {
    // SAFETY: static NUL-terminated string.
    let name = unsafe { CStr::from_ptr(dsv4_status_name(s)) }.to_string_lossy();
    assert_eq!(s, DSV4_STATUS_OK, "{what}: {name}: {}", last_error());
    assert_eq!(
        last_error(),
        "",
        "{what}: success leaves the last error empty"
    );
}

/// An engine destroyed on drop.
struct Eng {
    ptr: *mut dsv4_engine,
    vocab: usize,
}

impl Drop for Eng {
    fn drop(&mut self) {
        // SAFETY: created by dsv4_create, destroyed once.
        unsafe { dsv4_destroy(self.ptr) };
    }
}

/// create (config_path, exact numerics) -> load (AUTO) -> finalize, all through the C ABI.
fn engine(name: &str) -> Eng {
    let dir = CString::new(fixture_dir(name).to_str().unwrap()).unwrap();
    let mut p = dsv4_create_params_default();
    p.config_path = dir.as_ptr();
    p.max_num_seqs = 4;
    p.max_num_tokens = 160;
    p.max_seq_len = 64;
    p.num_threads = 2;
    p.numerics = DSV4_NUMERICS_EXACT;
    let mut e = ptr::null_mut();
    // SAFETY: valid params and out pointer; the strings outlive the calls.
    unsafe {
        ok(dsv4_create(&p, &mut e), "dsv4_create");
        let mut eng = Eng { ptr: e, vocab: 0 };
        ok(dsv4_load(e, dir.as_ptr(), DSV4_LOAD_AUTO), "dsv4_load");
        ok(dsv4_finalize(e, ptr::null_mut()), "dsv4_finalize");
        let mut i: dsv4_info = std::mem::zeroed();
        i.struct_size = size_of::<dsv4_info>();
        ok(dsv4_get_info(e, &mut i), "dsv4_get_info");
        assert_eq!(i.numerics, DSV4_NUMERICS_EXACT);
        assert_eq!(i.phase, DSV4_PHASE_READY);
        assert_eq!(i.device, DSV4_DEVICE_CPU);
        eng.vocab = i.vocab_size as usize;
        eng
    }
}

/// One piece of work in a step: tokens [start, start + len) of sequence `seq` in `slot`.
#[derive(Clone, Copy)]
struct Piece {
    seq: usize,
    slot: i32,
    start: usize,
    len: usize,
}

/// Runs one batch made of `pieces` through `dsv4_forward` and scatters its logits into
/// `got[seq]`. With `permute_rows`, every row is requested through `logits_rows` in a
/// scrambled order (and put back in place here).
fn step(e: &Eng, o: &Oracle, pieces: &[Piece], got: &mut [Vec<f32>], permute_rows: bool) {
    let vocab = e.vocab;
    let (mut toks, mut pos, mut slots, mut qs) = (vec![], vec![], vec![], vec![0i32]);
    for p in pieces {
        toks.extend_from_slice(&o.prompts[p.seq][p.start..p.start + p.len]);
        pos.extend((p.start..p.start + p.len).map(|x| x as i32));
        slots.push(p.slot);
        qs.push(toks.len() as i32);
    }
    let n = toks.len();
    // Row k of the output holds token row rows[k].
    // Permuted: odd rows descending, then even rows ascending.
    let rows: Vec<i32> = if permute_rows {
        let n = n as i32;
        (0..n)
            .rev()
            .filter(|r| r % 2 == 1)
            .chain((0..n).filter(|r| r % 2 == 0))
            .collect()
    } else {
        (0..n as i32).collect()
    };
    let mut out = vec![f32::NAN; n * vocab];
    let mut b = dsv4_batch_default();
    b.num_tokens = n as i32;
    b.num_seqs = pieces.len() as i32;
    b.token_ids = toks.as_ptr();
    b.positions = pos.as_ptr();
    b.seq_slots = slots.as_ptr();
    b.query_start = qs.as_ptr();
    b.logits_rows = if permute_rows {
        rows.as_ptr()
    } else {
        ptr::null()
    };
    b.num_logits = n as i32;
    b.logits = out.as_mut_ptr().cast();
    // SAFETY: valid engine; the batch points into live host arrays of the stated sizes.
    ok(
        unsafe { dsv4_forward(e.ptr, &b, ptr::null_mut()) },
        "dsv4_forward",
    );
    // Token row -> (sequence, position).
    let mut owner = Vec::with_capacity(n);
    for p in pieces {
        owner.extend((p.start..p.start + p.len).map(|t| (p.seq, t)));
    }
    for (k, &r) in rows.iter().enumerate() {
        let (seq, t) = owner[r as usize];
        got[seq][t * vocab..(t + 1) * vocab].copy_from_slice(&out[k * vocab..(k + 1) * vocab]);
    }
}

fn empty_like(o: &Oracle) -> Vec<Vec<f32>> {
    o.logits.iter().map(|l| vec![f32::NAN; l.len()]).collect()
}

/// Checks every row against both oracles and prints the measured maximum.
fn report(name: &str, case: &str, o: &Oracle, got: &[Vec<f32>]) {
    for (s, g) in got.iter().enumerate() {
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{name} {case}: sequence {s} has unset or non-finite logits"
        );
    }
    let worst = (0..o.prompts.len())
        .map(|s| max_abs_diff(&got[s], &o.logits[s]))
        .fold(0.0, f32::max);
    let worst_dec = (0..o.prompts.len())
        .map(|s| max_abs_diff(&got[s], &o.logits_decode[s]))
        .fold(0.0, f32::max);
    println!(
        "{name} {case} (C ABI): max |dlogit| vs HF one-shot = {worst:.3e}, vs HF decode = {worst_dec:.3e}"
    );
    assert!(
        worst <= TOL,
        "{name} {case}: max |dlogit| = {worst} > {TOL}"
    );
    assert!(
        worst_dec <= TOL,
        "{name} {case}: vs decode oracle {worst_dec} > {TOL}"
    );
}

fn one_shot(name: &str) {
    let o = Oracle::load(name);
    assert_eq!(o.prompts.len(), 3);
    let e = engine(name);
    let pieces: Vec<Piece> = o
        .prompts
        .iter()
        .enumerate()
        .map(|(s, p)| Piece {
            seq: s,
            slot: [2, 0, 3][s % 3],
            start: 0,
            len: p.len(),
        })
        .collect();
    let mut got = empty_like(&o);
    step(&e, &o, &pieces, &mut got, false);
    report(name, "one-shot, all 3 sequences in one batch", &o, &got);
    // Same batch again (position 0 restarts every slot), rows requested in a permuted order.
    let mut got = empty_like(&o);
    step(&e, &o, &pieces, &mut got, true);
    report(name, "one-shot, permuted logits_rows", &o, &got);
}

fn chunked(name: &str) {
    let o = Oracle::load(name);
    let e = engine(name);
    let mut got = empty_like(&o);
    // Odd chunk sizes, each sequence on its own schedule, so the sequences sit at different
    // offsets in every batch; sequence 1 sits out every third round and the order of the
    // sequences in the batch alternates.
    let sizes = [
        [7usize, 3, 5, 1, 11, 3, 13],
        [1, 5, 3, 9, 1, 3, 7],
        [3, 1, 1, 5, 3, 7, 1],
    ];
    let mut next = vec![0usize; o.prompts.len()];
    let (mut round, mut batches, mut shared) = (0, 0, 0);
    while next.iter().zip(&o.prompts).any(|(n, p)| *n < p.len()) {
        let mut pieces = vec![];
        for s in 0..o.prompts.len() {
            let left = o.prompts[s].len() - next[s];
            if left == 0 || (s == 1 && round % 3 == 2) {
                continue;
            }
            let len = sizes[s % 3][round % 7].min(left);
            pieces.push(Piece {
                seq: s,
                slot: 3 - s as i32,
                start: next[s],
                len,
            });
            next[s] += len;
        }
        if round % 2 == 0 {
            pieces.reverse();
        }
        if !pieces.is_empty() {
            if pieces.len() > 1 && pieces.iter().any(|p| p.start != pieces[0].start) {
                shared += 1;
            }
            step(&e, &o, &pieces, &mut got, false);
            batches += 1;
        }
        round += 1;
    }
    assert!(
        shared >= 3,
        "the schedule must mix offsets in shared batches"
    );
    report(
        name,
        &format!("chunked, odd chunks interleaved ({batches} batches, {shared} mixing offsets)"),
        &o,
        &got,
    );
}

fn prefill_then_decode(name: &str) {
    let o = Oracle::load(name);
    let e = engine(name);
    let mut got = empty_like(&o);
    // The oracle's decode run prefills 13, 9, 5 tokens (metadata `decode_prefill`).
    let prefill = [13usize, 9, 5];
    let pieces: Vec<Piece> = (0..o.prompts.len())
        .map(|s| Piece {
            seq: s,
            slot: s as i32 + 1,
            start: 0,
            len: prefill[s % 3].min(o.prompts[s].len()),
        })
        .collect();
    step(&e, &o, &pieces, &mut got, false);
    let mut next: Vec<usize> = pieces.iter().map(|p| p.len).collect();
    let mut steps = 0;
    loop {
        let pieces: Vec<Piece> = (0..o.prompts.len())
            .filter(|&s| next[s] < o.prompts[s].len())
            .map(|s| Piece {
                seq: s,
                slot: s as i32 + 1,
                start: next[s],
                len: 1,
            })
            .collect();
        if pieces.is_empty() {
            break;
        }
        step(&e, &o, &pieces, &mut got, false);
        pieces.iter().for_each(|p| next[p.seq] += 1);
        steps += 1;
    }
    report(
        name,
        &format!("prefill + batched single-token decode ({steps} decode steps)"),
        &o,
        &got,
    );
}

#[test]
fn tiny_one_shot() {
    one_shot("tiny");
}

#[test]
fn tiny_chunked_interleaved() {
    chunked("tiny");
}

#[test]
fn tiny_prefill_decode() {
    prefill_then_decode("tiny");
}

#[test]
fn native_one_shot() {
    one_shot("tiny_native");
}

#[test]
fn native_chunked_interleaved() {
    chunked("tiny_native");
}

#[test]
fn native_prefill_decode() {
    prefill_then_decode("tiny_native");
}
