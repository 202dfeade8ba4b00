//! The HF-oracle parity scenarios, written once and run on any backend: one-shot, chunked
//! prefill with odd chunks and the sequences interleaved at different offsets, prefill +
//! batched single-token decode, over the prompts of a fixture's `oracle.safetensors`.
//!
//! A scenario drives a [`Forward`] (the Rust `Engine` in parity_hf, a C-ABI [`Rig`] on the
//! CPU in parity_c_abi, a CUDA rig mirrored on the CPU in gpu_parity_oracle) and checks every
//! logit against both oracles (HF one-shot and HF decode) within [`TOL`] (DESIGN.md §4).
//! Two schedule sets exist, [`hf`] and [`c_abi`], one per CPU test file; each keeps its own
//! chunk sizes, slots and orders.

use super::rig::{Rig, Step};
use super::{Oracle, max_abs_diff};

/// max |dlogit| against either oracle.
pub const TOL: f32 = 1e-3;

/// Something that runs one forward from a step's host arrays and returns its logits,
/// [num_logits, vocab] row-major.
pub trait Forward {
    fn vocab(&self) -> usize;
    fn forward_step(&mut self, s: &Step) -> Vec<f32>;
}

impl Forward for Rig {
    fn vocab(&self) -> usize {
        self.vocab
    }

    fn forward_step(&mut self, s: &Step) -> Vec<f32> {
        self.forward(s)
    }
}

/// One piece of work in a step: tokens [start, start + len) of sequence `seq` in `slot`.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub seq: usize,
    pub slot: i32,
    pub start: usize,
    pub len: usize,
}

/// The step of `pieces` over the oracle's prompts. With `permute_rows`, every row is
/// requested through `logits_rows` in a scrambled order: odd rows descending, then even rows
/// ascending.
pub fn step_of(o: &Oracle, pieces: &[Piece], permute_rows: bool) -> Step {
    let seqs: Vec<(i32, i32, Vec<i32>)> = pieces
        .iter()
        .map(|p| {
            (
                p.slot,
                p.start as i32,
                o.prompts[p.seq][p.start..p.start + p.len].to_vec(),
            )
        })
        .collect();
    let mut s = Step::of(&seqs);
    if permute_rows {
        let n = s.toks.len() as i32;
        s.rows = Some(
            (0..n)
                .rev()
                .filter(|r| r % 2 == 1)
                .chain((0..n).filter(|r| r % 2 == 0))
                .collect(),
        );
    }
    s
}

/// Runs one batch made of `pieces` and scatters its logits into `got[seq]` (rows requested
/// in a permuted order are put back in place).
pub fn run_step(
    f: &mut dyn Forward,
    o: &Oracle,
    pieces: &[Piece],
    got: &mut [Vec<f32>],
    permute_rows: bool,
) {
    let vocab = f.vocab();
    let s = step_of(o, pieces, permute_rows);
    let out = f.forward_step(&s);
    // Token row -> (sequence, position).
    let owner: Vec<(usize, usize)> = pieces
        .iter()
        .flat_map(|p| (p.start..p.start + p.len).map(move |t| (p.seq, t)))
        .collect();
    for (k, r) in s.logits_token_rows().into_iter().enumerate() {
        let (seq, t) = owner[r];
        got[seq][t * vocab..(t + 1) * vocab].copy_from_slice(&out[k * vocab..(k + 1) * vocab]);
    }
}

/// Per-sequence logits buffers shaped like the oracle's, NaN-filled.
pub fn empty_like(o: &Oracle) -> Vec<Vec<f32>> {
    o.logits.iter().map(|l| vec![f32::NAN; l.len()]).collect()
}

/// Every logit was written and is finite.
pub fn assert_finite(label: &str, got: &[Vec<f32>]) {
    for (s, g) in got.iter().enumerate() {
        assert!(
            g.iter().all(|v| v.is_finite()),
            "{label}: sequence {s} has unset or non-finite logits"
        );
    }
}

/// Checks every row against both oracles within [`TOL`] and prints the measured maxima.
pub fn report(label: &str, o: &Oracle, got: &[Vec<f32>]) {
    let worst = (0..o.prompts.len())
        .map(|s| max_abs_diff(&got[s], &o.logits[s]))
        .fold(0.0, f32::max);
    let worst_dec = (0..o.prompts.len())
        .map(|s| max_abs_diff(&got[s], &o.logits_decode[s]))
        .fold(0.0, f32::max);
    println!("{label}: max |dlogit| vs HF one-shot = {worst:.3e}, vs HF decode = {worst_dec:.3e}");
    assert!(worst <= TOL, "{label}: max |dlogit| = {worst} > {TOL}");
    assert!(
        worst_dec <= TOL,
        "{label}: vs decode oracle {worst_dec} > {TOL}"
    );
}

/// Every whole prompt in one batch, sequence s in slot [2, 0, 3][s % 3].
fn whole_prompts(o: &Oracle) -> Vec<Piece> {
    o.prompts
        .iter()
        .enumerate()
        .map(|(s, p)| Piece {
            seq: s,
            slot: [2, 0, 3][s % 3],
            start: 0,
            len: p.len(),
        })
        .collect()
}

/// Chunk sizes of `hf::chunked` and `c_abi::chunked` (see [`chunk_rounds`]).
const HF_CHUNKS: [[usize; 7]; 3] = [
    [7, 3, 5, 1, 11, 2, 13],
    [1, 6, 2, 9, 4, 3, 8],
    [3, 1, 1, 5, 2, 7, 4],
];
const C_ABI_CHUNKS: [[usize; 7]; 3] = [
    [7, 3, 5, 1, 11, 3, 13],
    [1, 5, 3, 9, 1, 3, 7],
    [3, 1, 1, 5, 3, 7, 1],
];

/// A chunked schedule, round by round until every prompt is done: each unfinished
/// sequence's next chunk of `sizes[s % 3][round % 7]` tokens (at most what is left) in slot
/// `slot(s)`. Sequence 1 skips every third round to vary which sequences share a batch.
/// Returns the non-empty rounds with their round numbers.
fn chunk_rounds(
    o: &Oracle,
    sizes: &[[usize; 7]; 3],
    slot: impl Fn(usize) -> i32,
) -> Vec<(usize, Vec<Piece>)> {
    let mut next = vec![0usize; o.prompts.len()];
    let mut rounds = vec![];
    let mut round = 0;
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
                slot: slot(s),
                start: next[s],
                len,
            });
            next[s] += len;
        }
        if !pieces.is_empty() {
            rounds.push((round, pieces));
        }
        round += 1;
    }
    rounds
}

/// Prefill 13, 9, 5 tokens, then one token per unfinished sequence per step, sequence s in
/// slot `slot(s)`, into `got`; returns the number of decode steps.
fn prefill_then_decode_into(
    f: &mut dyn Forward,
    o: &Oracle,
    got: &mut [Vec<f32>],
    slot: impl Fn(usize) -> i32,
) -> usize {
    let prefill = [13usize, 9, 5];
    let pieces: Vec<Piece> = (0..o.prompts.len())
        .map(|s| Piece {
            seq: s,
            slot: slot(s),
            start: 0,
            len: prefill[s % 3].min(o.prompts[s].len()),
        })
        .collect();
    run_step(f, o, &pieces, got, false);
    let mut next: Vec<usize> = pieces.iter().map(|p| p.len).collect();
    let mut steps = 0;
    loop {
        let pieces: Vec<Piece> = (0..o.prompts.len())
            .filter(|&s| next[s] < o.prompts[s].len())
            .map(|s| Piece {
                seq: s,
                slot: slot(s),
                start: next[s],
                len: 1,
            })
            .collect();
        if pieces.is_empty() {
            break;
        }
        run_step(f, o, &pieces, got, false);
        pieces.iter().for_each(|p| next[p.seq] += 1);
        steps += 1;
    }
    steps
}

/// A parity scenario: runs a schedule on a forward and checks it against the oracle; the
/// last argument names the run in messages.
pub type Scenario = fn(&mut dyn Forward, &Oracle, &str);

/// The tests of one scenario set (`hf` or `c_abi`, in scope by that name): every scenario on
/// each fixture model as a test of its own, run by `$run(scenario, model)`.
#[macro_export]
macro_rules! parity_tests {
    ($set:ident, $run:path) => {
        $crate::parity_tests!(@tests $set, $run,
            tiny_one_shot: one_shot("tiny"),
            tiny_chunked_interleaved: chunked("tiny"),
            tiny_prefill_decode: prefill_then_decode("tiny"),
            native_one_shot: one_shot("tiny_native"),
            native_chunked_interleaved: chunked("tiny_native"),
            native_prefill_decode: prefill_then_decode("tiny_native"),
        );
    };
    (@tests $set:ident, $run:path, $($test:ident: $scenario:ident($model:literal),)*) => {
        $(
            #[test]
            fn $test() {
                $run($set::$scenario, $model);
            }
        )*
    };
}

/// The schedules of parity_hf (the Rust engine API on the CPU; on CUDA in gpu_parity_oracle).
pub mod hf {
    use super::*;

    /// Each sequence alone in slot 0; then all sequences in one batch, in shuffled slots.
    pub fn one_shot(f: &mut dyn Forward, o: &Oracle, name: &str) {
        let mut got = empty_like(o);
        for (s, p) in o.prompts.iter().enumerate() {
            let piece = Piece {
                seq: s,
                slot: 0,
                start: 0,
                len: p.len(),
            };
            run_step(f, o, &[piece], &mut got, false);
        }
        report(&format!("{name} one-shot, one sequence per call"), o, &got);
        let mut got = empty_like(o);
        run_step(f, o, &whole_prompts(o), &mut got, false);
        report(
            &format!("{name} one-shot, all sequences in one batch"),
            o,
            &got,
        );
    }

    /// Odd chunk sizes, each sequence advancing by a different schedule so that the
    /// sequences sit at different offsets in every batch.
    pub fn chunked(f: &mut dyn Forward, o: &Oracle, name: &str) {
        let mut got = empty_like(o);
        for (_, mut pieces) in chunk_rounds(o, &HF_CHUNKS, |s| s as i32 + 1) {
            pieces.reverse();
            run_step(f, o, &pieces, &mut got, false);
        }
        report(&format!("{name} chunked, interleaved"), o, &got);
    }

    /// Prefill 13, 9, 5 tokens, then one token per sequence per step.
    pub fn prefill_then_decode(f: &mut dyn Forward, o: &Oracle, name: &str) {
        let mut got = empty_like(o);
        prefill_then_decode_into(f, o, &mut got, |s| s as i32);
        report(&format!("{name} prefill + batched decode"), o, &got);
    }
}

/// The schedules of parity_c_abi (the C ABI on the CPU; on CUDA in gpu_parity_oracle).
/// Every result is also checked finite.
pub mod c_abi {
    use super::*;

    /// All 3 sequences in one batch, every row; again (position 0 restarts every slot) with
    /// the rows requested in a permuted order.
    pub fn one_shot(f: &mut dyn Forward, o: &Oracle, name: &str) {
        assert_eq!(o.prompts.len(), 3);
        let pieces = whole_prompts(o);
        for (permute, case) in [
            (false, "one-shot, all 3 sequences in one batch"),
            (true, "one-shot, permuted logits_rows"),
        ] {
            let mut got = empty_like(o);
            run_step(f, o, &pieces, &mut got, permute);
            let label = format!("{name} {case} (C ABI)");
            assert_finite(&label, &got);
            report(&label, o, &got);
        }
    }

    /// Odd chunk sizes, each sequence on its own schedule, so the sequences sit at different
    /// offsets in every batch; sequence 1 sits out every third round and the order of the
    /// sequences in the batch alternates.
    pub fn chunked(f: &mut dyn Forward, o: &Oracle, name: &str) {
        let mut got = empty_like(o);
        let (mut batches, mut shared) = (0, 0);
        for (round, mut pieces) in chunk_rounds(o, &C_ABI_CHUNKS, |s| 3 - s as i32) {
            if round % 2 == 0 {
                pieces.reverse();
            }
            if pieces.len() > 1 && pieces.iter().any(|p| p.start != pieces[0].start) {
                shared += 1;
            }
            run_step(f, o, &pieces, &mut got, false);
            batches += 1;
        }
        assert!(
            shared >= 3,
            "the schedule must mix offsets in shared batches"
        );
        let label = format!(
            "{name} chunked, odd chunks interleaved ({batches} batches, {shared} mixing offsets) (C ABI)"
        );
        assert_finite(&label, &got);
        report(&label, o, &got);
    }

    /// The oracle's decode run: prefill 13, 9, 5 tokens (metadata `decode_prefill`), then
    /// batched single-token decode.
    pub fn prefill_then_decode(f: &mut dyn Forward, o: &Oracle, name: &str) {
        let mut got = empty_like(o);
        let steps = prefill_then_decode_into(f, o, &mut got, |s| s as i32 + 1);
        let label =
            format!("{name} prefill + batched single-token decode ({steps} decode steps) (C ABI)");
        assert_finite(&label, &got);
        report(&label, o, &got);
    }
}

/// The C-ABI engine of the parity scenarios on `dev` (-1 CPU, else a CUDA ordinal): config
/// from the fixture, exact numerics, checkpoint AUTO, 4 slots, 160 tokens, 64 positions,
/// 2 threads; every call must leave the last error empty. Asserts it is ready, in exact
/// numerics, on `dev`.
pub fn abi_engine(model: &str, dev: i32) -> Rig {
    use dsv4::ffi::*;
    let mut opts = super::rig::RigOptions::new(model, dev);
    opts.numerics = DSV4_NUMERICS_EXACT;
    opts.max_num_seqs = 4;
    opts.max_num_tokens = 160;
    opts.max_seq_len = 64;
    opts.num_threads = 2;
    opts.strict = true;
    let r = Rig::build(&opts, &[]);
    let i = r.info();
    assert_eq!(i.numerics, DSV4_NUMERICS_EXACT);
    assert_eq!(i.phase, DSV4_PHASE_READY);
    assert_eq!(i.device, dev);
    r
}
