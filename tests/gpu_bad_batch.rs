//! Bad batches and padding through the C ABI (part of the GPU suite; its CPU half runs
//! everywhere): DESIGN.md §3's promise that no batch value can crash the host or touch a
//! sequence's state, and that DSV4_PAD_SLOT sequences are harmless padding.
//!
//! Every batch field is poisoned with every class of bad value (negative, >= capacity,
//! INT32_MIN/MAX, query_start not increasing or past num_tokens, positions not consecutive,
//! continuing an empty slot, duplicate slots, logits_rows out of range). On the CPU reference
//! dsv4_forward returns the fault; on CUDA it runs eagerly AND as the replay of a graph
//! captured with good values whose buffers were then overwritten, and afterwards:
//! - a driver operation on the host's context succeeds (the context is healthy);
//! - the batch's logits are all NaN;
//! - dsv4_device_error returns the fault, with the field, index and the very message the
//!   host-side rules (`model::batch::plan`, what the CPU backend returns) give for it;
//! - the next good forward of every slot equals a twin engine that never saw the bad batch,
//!   bit for bit.
//!
//! Padding: a batch padded with DSV4_PAD_SLOT sequences (first, between, last; positions
//! anything) gives the real sequences' logits bit for bit as the unpadded batch on the twin,
//! zeros in the padding rows, and leaves every slot's state as the twin's.

mod common;

use common::abi::{last_error, ok};
use common::bits;
use common::fixture_dir;
use common::gpu::devices;
use common::rig::{Rig, RigOptions, Step};
use common::rng::tokens;
use dsv4::cuda::DevicePtr;
use dsv4::cuda::arena::copy_to_host_sync;
use dsv4::cuda::graph::Graph;
use dsv4::engine::EngineOptions;
use dsv4::ffi::*;
use dsv4::model::batch::plan;

/// Slots 0..4 hold sequences; the rest leave room for padding sequences (they count
/// against max_num_seqs like any other).
const SEQS: usize = 8;
const TOKENS: usize = 64;
const SEQ_LEN: usize = 256;

/// The `tiny` model through the C ABI on `dev`, official numerics, with room for padding
/// sequences. Logits are poisoned with a pattern that is neither NaN nor zero (0x01 bytes),
/// so both the NaN and the zero rows are seen written. CUDA engines have a device error
/// record, the CPU none.
fn rig(dev: i32) -> Rig {
    let mut o = RigOptions::new("tiny", dev);
    o.max_num_seqs = SEQS as i32;
    o.max_num_tokens = TOKENS as i32;
    o.max_seq_len = SEQ_LEN as i32;
    o.poison = 0x01;
    let r = Rig::build(&o, &[]);
    let i = r.info();
    if dev >= 0 {
        assert!(!i.device_error.is_null(), "CUDA: no device error record");
    } else {
        assert!(i.device_error.is_null());
    }
    r
}

/// Stages `s` (same counts as the captured batch) into buffer set 0 and replays `g`.
fn replay(r: &Rig, g: &Graph, s: &Step) -> Vec<f32> {
    r.stage(s, 0);
    r.replay(g, &[(0, s.num_logits())]).remove(0)
}

/// An engine and its twin that never sees a bad batch, with the slot lengths both hold.
struct Pair {
    a: Rig,
    twin: Rig,
    lens: [i32; 4],
    round: u64,
}

impl Pair {
    fn new(dev: i32) -> Pair {
        let mut p = Pair {
            a: rig(dev),
            twin: rig(dev),
            lens: [0; 4],
            round: 0,
        };
        // Slots 0 and 1 hold a prompt; 2 and 3 are empty.
        let s = Step::of(&[(0, 0, tokens(1, 13)), (1, 0, tokens(2, 9))]);
        p.both(&s);
        p.lens[0] = 13;
        p.lens[1] = 9;
        p
    }

    /// Runs a good step on both engines; their logits must agree bit for bit.
    fn both(&mut self, s: &Step) -> Vec<f32> {
        let x = self.a.forward(s);
        let y = self.twin.forward(s);
        assert_eq!(bits(&x), bits(&y), "device {}: engine != twin", self.a.dev);
        assert!(x.iter().all(|v| v.is_finite()));
        x
    }

    /// The base batch the bad cases mutate: slot 0 continues with 2 tokens, slot 1 with 1,
    /// slot 2 starts fresh with 3; logits of rows 1, 2 and 5.
    fn base(&self) -> Step {
        let mut s = Step::of(&[
            (0, self.lens[0], tokens(10 + self.round, 2)),
            (1, self.lens[1], tokens(20 + self.round, 1)),
            (2, 0, tokens(30 + self.round, 3)),
        ]);
        s.rows = Some(vec![1, 2, 5]);
        s
    }

    /// After a bad batch: every slot continues (slot 2 and 3 restart) on both engines, and
    /// the engine equals the twin bit for bit.
    fn probe(&mut self) {
        self.round += 1;
        let s = Step::of(&[
            (0, self.lens[0], tokens(40 + self.round, 1)),
            (1, self.lens[1], tokens(50 + self.round, 2)),
            (2, 0, tokens(60 + self.round, 2)),
            (3, 0, tokens(70 + self.round, 1)),
        ]);
        self.both(&s);
        self.lens[0] += 1;
        self.lens[1] += 2;
        self.lens[2] = 2;
        self.lens[3] = 1;
    }

    /// What the host-side rules say of `s` (the CPU backend's error), from the lengths held.
    fn expected_fault(&self, s: &Step) -> dsv4::Error {
        let cfg = dsv4::ModelConfig::from_path(&fixture_dir("tiny")).unwrap();
        let opts = EngineOptions {
            max_num_seqs: SEQS,
            max_num_tokens: TOKENS,
            max_seq_len: SEQ_LEN,
            ..Default::default()
        };
        let lens: Vec<usize> = self.lens.iter().map(|&l| l as usize).collect();
        let mut out = vec![0.0f32; s.num_logits() * cfg.vocab_size];
        plan(&cfg, &opts, &lens, &s.batch(&mut out)).expect_err("a bad case the rules accept")
    }
}

/// One bad value: `value` written at `index` of `field`.
struct Case {
    name: String,
    field: i32,
    index: usize,
    value: i32,
}

/// Every class of bad value for every field of the base batch (T = 6, S = 3, R = 3).
fn cases(p: &Pair) -> Vec<(Case, Step)> {
    let base = p.base();
    let (t, s) = (base.toks.len() as i32, base.slots.len() as i32);
    let v = p.a.vocab as i32;
    let l0 = p.lens[0];
    // (field, how a value is written into the batch, the (index, value, name) of each case).
    type Write = fn(&mut Step, usize, i32);
    type Values<'a> = &'a [(usize, i32, &'a str)];
    let groups: [(i32, Write, Values); 7] = [
        (
            DSV4_FIELD_TOKEN_IDS,
            |s, i, val| s.toks[i] = val,
            &[
                (0, -5, "token negative"),
                (3, v, "token = vocab"),
                (4, v + 1000, "token > vocab"),
                (5, i32::MIN, "token INT32_MIN"),
                (1, i32::MAX, "token INT32_MAX"),
            ],
        ),
        (
            DSV4_FIELD_SEQ_SLOTS,
            |s, i, val| s.slots[i] = val,
            &[
                (0, -2, "slot -2"),
                (1, SEQS as i32, "slot = max_num_seqs"),
                (2, SEQS as i32 + 3, "slot > max_num_seqs"),
                (1, i32::MIN, "slot INT32_MIN"),
                (0, i32::MAX, "slot INT32_MAX"),
                (2, 0, "slot duplicate"),
            ],
        ),
        (
            DSV4_FIELD_QUERY_START,
            |s, i, val| s.qs[i] = val,
            &[
                (0, 1, "query_start[0] != 0"),
                (s as usize, t - 1, "query_start[S] != T"),
                (2, 1, "query_start decreasing"),
                (2, 2, "query_start repeated"),
                (1, 100, "query_start past num_tokens"),
                (2, i32::MIN, "query_start INT32_MIN"),
                (1, i32::MAX, "query_start INT32_MAX"),
                (2, -3, "query_start negative"),
            ],
        ),
        (
            DSV4_FIELD_POSITIONS,
            |s, i, val| s.pos[i] = val,
            &[
                (0, SEQ_LEN as i32 + 50, "position > max_seq_len"),
                (4, 1 << 30, "position 2^30"),
                (3, -1, "position negative"),
                (2, i32::MIN, "position INT32_MIN"),
                (5, i32::MAX, "position INT32_MAX"),
                (1, 40, "positions not consecutive"),
            ],
        ),
        // Slot 2 is empty: continuing it at 5 (positions consecutive from 5).
        (
            DSV4_FIELD_POSITIONS,
            |s, i, val| s.pos[i..i + 3].copy_from_slice(&[val, val + 1, val + 2]),
            &[(3, 5, "continuing an empty slot")],
        ),
        // Slot 0 continued one position early.
        (
            DSV4_FIELD_POSITIONS,
            |s, i, val| s.pos[i..i + 2].copy_from_slice(&[val, val + 1]),
            &[(0, l0 - 1, "continuing at the wrong position")],
        ),
        (
            DSV4_FIELD_LOGITS_ROWS,
            |s, i, val| s.rows.as_mut().unwrap()[i] = val,
            &[
                (0, -1, "logits row negative"),
                (1, t, "logits row = num_tokens"),
                (2, i32::MIN, "logits row INT32_MIN"),
                (0, i32::MAX, "logits row INT32_MAX"),
            ],
        ),
    ];
    let mut out = vec![];
    for (field, write, values) in groups {
        for &(index, value, name) in values {
            let mut step = base.clone();
            write(&mut step, index, value);
            let case = Case {
                name: name.into(),
                field,
                index,
                value,
            };
            out.push((case, step));
        }
    }
    out
}

/// The fault the rules report names the field and index the case poisoned.
fn names_case(msg: &str, c: &Case) -> bool {
    let field = match c.field {
        DSV4_FIELD_TOKEN_IDS => "token_ids",
        DSV4_FIELD_POSITIONS => "positions",
        DSV4_FIELD_SEQ_SLOTS => "seq_slots",
        DSV4_FIELD_QUERY_START => "query_start",
        _ => "logits_rows",
    };
    msg.contains(&format!("batch.{field}["))
}

#[test]
fn every_bad_value_is_caught_and_changes_nothing() {
    let _turn = common::gpu::turn();
    for dev in devices() {
        let mut p = Pair::new(dev);
        // The graph is captured once with the good base batch; each case overwrites its
        // buffers (same counts) before a replay.
        let graph = (dev >= 0).then(|| p.a.capture(&[(&p.base(), 0)]));
        let n = cases(&p).len();
        assert!(n >= 30);
        let modes: &[&str] = if dev >= 0 {
            &["eager", "graph"]
        } else {
            &["eager"]
        };
        for k in 0..n {
            for &mode in modes {
                // Rebuilt from the current slot lengths (every probe moves them).
                let (c, bad) = cases(&p).swap_remove(k);
                let want = p.expected_fault(&bad);
                assert!(
                    names_case(&want.message, &c),
                    "case `{}`: the rules report `{}`",
                    c.name,
                    want.message
                );
                let ctx = format!("device {dev}, case `{}` ({mode})", c.name);
                if dev < 0 {
                    let (st, _) = p.a.try_forward(&bad);
                    assert_eq!(st, want.status as i32, "{ctx}: status");
                    assert_eq!(
                        last_error(),
                        format!("dsv4_forward: {}", want.message),
                        "{ctx}: message"
                    );
                    let (st, rec, _) = p.a.device_error();
                    assert_eq!(st, DSV4_STATUS_OK, "{ctx}: CPU has no device record");
                    assert_eq!(rec, dsv4_batch_fault::default());
                } else {
                    let logits = match mode {
                        "eager" => {
                            let (st, l) = p.a.try_forward(&bad);
                            assert_eq!(st, DSV4_STATUS_OK, "{ctx}: {}", last_error());
                            l
                        }
                        _ => replay(&p.a, graph.as_ref().unwrap(), &bad),
                    };
                    p.a.host.as_ref().unwrap().context_is_healthy();
                    assert!(
                        logits.iter().all(|v| v.is_nan()),
                        "{ctx}: a bad batch's logits must be NaN"
                    );
                    let (st, rec, msg) = p.a.device_error();
                    assert_eq!(st, want.status as i32, "{ctx}: status ({msg})");
                    assert_eq!(
                        msg,
                        format!("dsv4_device_error: {}", want.message),
                        "{ctx}: message"
                    );
                    assert_eq!(rec.status, want.status as i32, "{ctx}");
                    assert_eq!(rec.field, c.field, "{ctx}: field");
                    assert_eq!(
                        (rec.index as usize, rec.value),
                        (c.index, c.value),
                        "{ctx}: the record names the poisoned value"
                    );
                    // The record is cleared by reading it.
                    let (st, rec, _) = p.a.device_error();
                    assert_eq!(st, DSV4_STATUS_OK, "{ctx}: the record was not cleared");
                    assert_eq!(rec, dsv4_batch_fault::default());
                }
                // The fault the rules report is the value the case poisoned.
                assert!(
                    want.message
                        .contains(&format!("[{}] = {}", c.index, c.value)),
                    "{ctx}: {}",
                    want.message
                );
                p.probe();
            }
        }
        drop(graph);
    }
}

#[test]
fn the_first_fault_is_sticky_until_read() {
    let _turn = common::gpu::turn();
    for dev in devices() {
        if dev < 0 {
            continue; // the CPU backend reports faults from dsv4_forward
        }
        let mut p = Pair::new(dev);
        let mut first = p.base();
        first.toks[2] = -1;
        let mut second = p.base();
        second.slots[1] = 99;
        let want = p.expected_fault(&first);
        ok(p.a.try_forward(&first).0);
        ok(p.a.try_forward(&second).0);
        let (st, rec, msg) = p.a.device_error();
        assert_eq!(st, DSV4_STATUS_INVALID_ARGUMENT);
        assert_eq!(
            msg,
            format!("dsv4_device_error: {}", want.message),
            "the first bad batch's fault is kept"
        );
        assert_eq!(
            (rec.field, rec.index, rec.value, rec.rule),
            (DSV4_FIELD_TOKEN_IDS, 2, -1, DSV4_RULE_RANGE)
        );
        // A good forward leaves the (cleared) record empty.
        p.probe();
        assert_eq!(p.a.device_error().0, DSV4_STATUS_OK);
        let mut second = p.base();
        second.slots[1] = 99;
        // The record is readable at its device address too (a host may copy it in a graph).
        ok(p.a.try_forward(&second).0);
        let mut i: dsv4_info = unsafe { std::mem::zeroed() };
        i.struct_size = std::mem::size_of::<dsv4_info>();
        unsafe { ok(dsv4_get_info(p.a.e, &mut i)) };
        let h = p.a.host.as_ref().unwrap();
        let _g = h.ctx.enter().unwrap();
        let mut raw = [0i32; 8];
        let src = unsafe { DevicePtr::from_raw(i.device_error as u64, 32) };
        copy_to_host_sync(&mut raw, src, h.stream.borrow()).unwrap();
        assert_eq!(
            raw[..5],
            [
                DSV4_STATUS_INVALID_ARGUMENT,
                DSV4_FIELD_SEQ_SLOTS,
                1,
                99,
                DSV4_RULE_RANGE
            ]
        );
        assert_eq!(raw[5], SEQS as i32, "expected = max_num_seqs");
        assert_eq!(p.a.device_error().0, DSV4_STATUS_INVALID_ARGUMENT);
        p.probe();
    }
}

/// `real` with padding sequences (slot DSV4_PAD_SLOT, junk positions) inserted before,
/// between and after its sequences.
fn padded(real: &[(i32, i32, Vec<i32>)], round: u64) -> Vec<(i32, i32, Vec<i32>)> {
    let pad = |k: u64, n: usize, p0: i32| (DSV4_PAD_SLOT, p0, tokens(900 + 7 * round + k, n));
    let mut out = vec![pad(1, 2, 1 << 30)];
    for (k, r) in real.iter().enumerate() {
        out.push(r.clone());
        if k == 0 {
            out.push(pad(2, 3, -77));
        }
    }
    out.push(pad(3, 1, i32::MAX));
    out
}

#[test]
fn padding_gives_the_unpadded_logits_and_touches_no_state() {
    let _turn = common::gpu::turn();
    for dev in devices() {
        let mut p = Pair::new(dev);
        let modes: &[&str] = if dev >= 0 {
            &["eager", "graph"]
        } else {
            &["eager"]
        };
        for &mode in modes {
            for round in 0..3u64 {
                let real = vec![
                    (0, p.lens[0], tokens(100 + round, 2)),
                    (2, 0, tokens(110 + round, 3)),
                    (1, p.lens[1], tokens(120 + round, 1)),
                ];
                let mut unpadded = Step::of(&real);
                let mut pad = Step::of(&padded(&real, round));
                // Every row, and (round 1) a rows subset that also asks for padding rows.
                if round == 1 {
                    pad.rows = Some(vec![0, 2, 3, 5, 7, 9, pad.toks.len() as i32 - 1]);
                }
                let ctx = format!("device {dev}, {mode}, round {round}");
                let got = match mode {
                    "eager" => p.a.forward(&pad),
                    _ => {
                        // Captured with the padded shape, then restaged with this round's values.
                        let g = p.a.capture(&[(&pad, 0)]);
                        replay(&p.a, &g, &pad)
                    }
                };
                unpadded.rows = None;
                let want = p.twin.forward(&unpadded);
                // Map each logits row of the padded batch to its real row, if any.
                let v = p.a.vocab;
                let real_row = |i: usize| -> Option<usize> {
                    let q = pad.qs.iter().rposition(|&a| a as usize <= i).unwrap();
                    if pad.slots[q] == DSV4_PAD_SLOT {
                        return None;
                    }
                    let k = pad.slots[..q]
                        .iter()
                        .zip(pad.qs.windows(2))
                        .filter(|(s, _)| **s != DSV4_PAD_SLOT)
                        .map(|(_, w)| (w[1] - w[0]) as usize)
                        .sum::<usize>();
                    Some(k + i - pad.qs[q] as usize)
                };
                let mut zero_rows = 0;
                for (k, i) in pad.logits_token_rows().into_iter().enumerate() {
                    let row = &got[k * v..(k + 1) * v];
                    match real_row(i) {
                        Some(j) => assert_eq!(
                            bits(row),
                            bits(&want[j * v..(j + 1) * v]),
                            "{ctx}: row {k} (token {i}) differs from the unpadded batch"
                        ),
                        None => {
                            zero_rows += 1;
                            assert!(
                                row.iter().all(|&x| x.to_bits() == 0),
                                "{ctx}: padding row {k} must be zeros"
                            );
                        }
                    }
                }
                assert!(zero_rows > 0, "{ctx}: the batch asked for no padding row");
                // The engine saw padding + the real sequences, the twin only the real ones.
                p.lens[0] += 2;
                p.lens[1] += 1;
                p.lens[2] = 3;
                if dev >= 0 {
                    assert_eq!(
                        p.a.device_error().0,
                        DSV4_STATUS_OK,
                        "{ctx}: padding is no fault"
                    );
                }
                p.probe();
            }
        }
        // A batch of padding only: zeros, no state touched.
        let only = Step::of(&[
            (DSV4_PAD_SLOT, 5, tokens(7, 3)),
            (DSV4_PAD_SLOT, -9, tokens(8, 2)),
        ]);
        let got = p.a.forward(&only);
        assert!(got.iter().all(|&x| x.to_bits() == 0), "device {dev}");
        p.probe();
    }
}

#[test]
fn a_released_slot_cannot_be_continued() {
    let _turn = common::gpu::turn();
    for dev in devices() {
        let mut p = Pair::new(dev);
        unsafe { ok(dsv4_release_slot(p.a.e, 0)) };
        let cont = Step::of(&[(0, p.lens[0], tokens(5, 1))]);
        // The rules with slot 0 holding nothing.
        let mut released = Pair {
            a: rig(-1),
            twin: rig(-1),
            lens: p.lens,
            round: 0,
        };
        released.lens[0] = 0;
        let want_released = released.expected_fault(&cont);
        drop(released);
        assert!(want_released.message.contains("slot 0 holds 0 tokens"));
        let (st, logits) = p.a.try_forward(&cont);
        if dev < 0 {
            assert_eq!(st, want_released.status as i32);
            assert!(last_error().ends_with(&want_released.message));
        } else {
            ok(st);
            assert!(logits.iter().all(|v| v.is_nan()), "device {dev}");
            let (st, _, msg) = p.a.device_error();
            assert_eq!(st, want_released.status as i32);
            assert!(msg.ends_with(&want_released.message), "device {dev}: {msg}");
        }
        // Restarting the released slot works; the twin restarts it too.
        let restart = Step::of(&[(0, 0, tokens(6, 4))]);
        p.both(&restart);
        p.lens[0] = 4;
        p.probe();
    }
}
