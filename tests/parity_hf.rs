//! CPU reference vs the transformers fp32 oracle (tests/fixtures), through the engine:
//! one-shot, chunked prefill with sequences interleaved at different offsets in one
//! batch, prefill + batched decode, logits_rows / BF16 output, slot restart.
//! Tolerance (DESIGN.md §4): max |dlogit| <= 1e-3.

mod common;

use common::{Oracle, fixture_dir, max_abs_diff};
use dsv4::{Batch, ConfigSource, Engine, EngineOptions, LoadFormat, LogitsOut, Numerics};

const TOL: f32 = 1e-3;

fn engine(name: &str) -> Engine {
    let dir = fixture_dir(name);
    let opts = EngineOptions {
        max_num_seqs: 4,
        max_num_tokens: 160,
        max_seq_len: 64,
        numerics: Numerics::Exact,
        num_threads: 2,
        ..Default::default()
    };
    let mut e = Engine::create(ConfigSource::Path(dir.clone()), opts).expect("create");
    e.load(Some(&dir), LoadFormat::Auto).expect("load");
    e.finalize().expect("finalize");
    e
}

/// One piece of work in a step: tokens [start, start + len) of sequence `seq` in `slot`.
#[derive(Clone, Copy)]
struct Piece {
    seq: usize,
    slot: i32,
    start: usize,
    len: usize,
}

/// Runs one batch made of `pieces` and scatters its logits into `got[seq]`.
fn step(e: &mut Engine, o: &Oracle, pieces: &[Piece], got: &mut [Vec<f32>]) {
    let vocab = e.config().vocab_size;
    let (mut toks, mut pos, mut slots, mut qs) = (vec![], vec![], vec![], vec![0i32]);
    for p in pieces {
        toks.extend_from_slice(&o.prompts[p.seq][p.start..p.start + p.len]);
        pos.extend((p.start..p.start + p.len).map(|x| x as i32));
        slots.push(p.slot);
        qs.push(toks.len() as i32);
    }
    let mut out = vec![f32::NAN; toks.len() * vocab];
    let mut b = Batch {
        token_ids: &toks,
        positions: &pos,
        seq_slots: &slots,
        query_start: &qs,
        logits_rows: None,
        logits: LogitsOut::F32(&mut out),
    };
    e.forward(&mut b).expect("forward");
    let mut row = 0;
    for p in pieces {
        let dst = &mut got[p.seq][p.start * vocab..(p.start + p.len) * vocab];
        dst.copy_from_slice(&out[row * vocab..(row + p.len) * vocab]);
        row += p.len;
    }
}

fn empty_like(o: &Oracle) -> Vec<Vec<f32>> {
    o.logits.iter().map(|l| vec![f32::NAN; l.len()]).collect()
}

fn report(name: &str, case: &str, o: &Oracle, got: &[Vec<f32>]) {
    let worst = (0..o.prompts.len())
        .map(|s| max_abs_diff(&got[s], &o.logits[s]))
        .fold(0.0, f32::max);
    let worst_dec = (0..o.prompts.len())
        .map(|s| max_abs_diff(&got[s], &o.logits_decode[s]))
        .fold(0.0, f32::max);
    println!(
        "{name} {case}: max |dlogit| vs HF one-shot = {worst:.3e}, vs HF decode = {worst_dec:.3e}"
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
    let mut e = engine(name);
    // Each sequence alone.
    let mut got = empty_like(&o);
    for (s, p) in o.prompts.iter().enumerate() {
        step(
            &mut e,
            &o,
            &[Piece {
                seq: s,
                slot: 0,
                start: 0,
                len: p.len(),
            }],
            &mut got,
        );
    }
    report(name, "one-shot, one sequence per call", &o, &got);
    // All sequences in one batch, in shuffled slots.
    let mut got = empty_like(&o);
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
    step(&mut e, &o, &pieces, &mut got);
    report(name, "one-shot, all sequences in one batch", &o, &got);
}

fn chunked(name: &str) {
    let o = Oracle::load(name);
    let mut e = engine(name);
    let mut got = empty_like(&o);
    // Odd chunk sizes, each sequence advancing by a different schedule so that the
    // sequences sit at different offsets in every batch.
    let sizes = [
        [7usize, 3, 5, 1, 11, 2, 13],
        [1, 6, 2, 9, 4, 3, 8],
        [3, 1, 1, 5, 2, 7, 4],
    ];
    let mut next = vec![0usize; o.prompts.len()];
    let mut round = 0;
    while next.iter().zip(&o.prompts).any(|(n, p)| *n < p.len()) {
        let mut pieces = vec![];
        for s in 0..o.prompts.len() {
            let left = o.prompts[s].len() - next[s];
            // Sequence 1 skips every third round to vary which sequences share a batch.
            if left == 0 || (s == 1 && round % 3 == 2) {
                continue;
            }
            let len = sizes[s % 3][round % 7].min(left);
            pieces.push(Piece {
                seq: s,
                slot: s as i32 + 1,
                start: next[s],
                len,
            });
            next[s] += len;
        }
        pieces.reverse();
        if !pieces.is_empty() {
            step(&mut e, &o, &pieces, &mut got);
        }
        round += 1;
    }
    report(name, "chunked, interleaved", &o, &got);
}

fn prefill_then_decode(name: &str) {
    let o = Oracle::load(name);
    let mut e = engine(name);
    let mut got = empty_like(&o);
    let prefill = [13usize, 9, 5];
    let pieces: Vec<Piece> = (0..o.prompts.len())
        .map(|s| Piece {
            seq: s,
            slot: s as i32,
            start: 0,
            len: prefill[s % 3].min(o.prompts[s].len()),
        })
        .collect();
    step(&mut e, &o, &pieces, &mut got);
    let mut next: Vec<usize> = pieces.iter().map(|p| p.len).collect();
    loop {
        let pieces: Vec<Piece> = (0..o.prompts.len())
            .filter(|&s| next[s] < o.prompts[s].len())
            .map(|s| Piece {
                seq: s,
                slot: s as i32,
                start: next[s],
                len: 1,
            })
            .collect();
        if pieces.is_empty() {
            break;
        }
        step(&mut e, &o, &pieces, &mut got);
        pieces.iter().for_each(|p| next[p.seq] += 1);
    }
    report(name, "prefill + batched decode", &o, &got);
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
fn native_names_one_shot() {
    one_shot("tiny_native");
}

#[test]
fn native_names_chunked_interleaved() {
    chunked("tiny_native");
}

#[test]
fn native_names_prefill_decode() {
    prefill_then_decode("tiny_native");
}

/// logits_rows picks rows; BF16 output equals the F32 output rounded; restarting a slot at
/// position 0 forgets the previous sequence.
#[test]
fn logits_rows_bf16_and_slot_restart() {
    let o = Oracle::load("tiny");
    let mut e = engine("tiny");
    let vocab = e.config().vocab_size;
    let p0 = &o.prompts[0];
    let pos: Vec<i32> = (0..p0.len() as i32).collect();
    let rows = [p0.len() as i32 - 1, 0, 17];
    let mut out = vec![0u16; rows.len() * vocab];
    let mut b = Batch {
        token_ids: p0,
        positions: &pos,
        seq_slots: &[3],
        query_start: &[0, p0.len() as i32],
        logits_rows: Some(&rows),
        logits: LogitsOut::Bf16(&mut out),
    };
    e.forward(&mut b).unwrap();
    for (k, &r) in rows.iter().enumerate() {
        let want = &o.logits[0][r as usize * vocab..(r as usize + 1) * vocab];
        let got: Vec<f32> = out[k * vocab..(k + 1) * vocab]
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        let tol = want.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 128.0 + TOL;
        assert!(max_abs_diff(&got, want) <= tol, "row {r}");
    }
    // Slot 3 now holds sequence 0; restart it with sequence 2 from position 0.
    let p2 = &o.prompts[2];
    let pos: Vec<i32> = (0..p2.len() as i32).collect();
    let mut out = vec![0f32; p2.len() * vocab];
    let mut b = Batch {
        token_ids: p2,
        positions: &pos,
        seq_slots: &[3],
        query_start: &[0, p2.len() as i32],
        logits_rows: None,
        logits: LogitsOut::F32(&mut out),
    };
    e.forward(&mut b).unwrap();
    let d = max_abs_diff(&out, &o.logits[2]);
    assert!(d <= TOL, "restarted slot: {d}");
    // Continuing at a wrong position is rejected and leaves the slot usable.
    let mut one = vec![0f32; vocab];
    let mut b = Batch {
        token_ids: &p2[..1],
        positions: &[p2.len() as i32 + 5],
        seq_slots: &[3],
        query_start: &[0, 1],
        logits_rows: None,
        logits: LogitsOut::F32(&mut one),
    };
    let err = e.forward(&mut b).unwrap_err();
    assert_eq!(err.status, dsv4::Status::InvalidArgument);
    assert!(err.message.contains("slot 3"), "{}", err.message);
}
