//! CPU reference vs the transformers fp32 oracle (tests/fixtures), through the engine:
//! one-shot, chunked prefill with sequences interleaved at different offsets in one
//! batch, prefill + batched decode, logits_rows / BF16 output, slot restart.
//! Tolerance (DESIGN.md §4): max |dlogit| <= 1e-3. The scenarios are common::parity::hf
//! (gpu_parity_oracle runs them on CUDA).

mod common;

use common::parity::{Forward, Scenario, TOL, hf};
use common::rig::Step;
use common::{Oracle, fixture_engine, max_abs_diff};
use dsv4::{Batch, Engine, EngineOptions, LogitsOut, Numerics};

fn engine(name: &str) -> Engine {
    let opts = EngineOptions {
        max_num_seqs: 4,
        max_num_tokens: 160,
        max_seq_len: 64,
        numerics: Numerics::Exact,
        num_threads: 2,
        ..Default::default()
    };
    fixture_engine(name, opts)
}

/// The Rust engine API as a scenario's [`Forward`].
struct Api(Engine);

impl Forward for Api {
    fn vocab(&self) -> usize {
        self.0.config().vocab_size
    }

    fn forward_step(&mut self, s: &Step) -> Vec<f32> {
        let mut out = vec![f32::NAN; s.num_logits() * self.vocab()];
        self.0.forward(&mut s.batch(&mut out)).expect("forward");
        out
    }
}

/// Runs `scenario` on a fresh CPU engine of `model` through the Rust API.
fn on_cpu(scenario: Scenario, model: &str) {
    scenario(&mut Api(engine(model)), &Oracle::load(model), model);
}

parity_tests!(hf, on_cpu);

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
