//! The released formats and the two numerics modes on the CPU reference:
//! - exact mode on an upstream FP8/FP4 sharded checkpoint vs transformers (dequantized);
//! - official mode vs the official-simulation oracle, and how far exact and official are apart;
//! - `weight_format = quantize` of the BF16 checkpoint equals the pre-quantized upstream
//!   checkpoint bit for bit (stored codes, scales and logits);
//! - NaN/Inf in a BF16 refit under FP8/FP4 storage is rejected and leaves the engine unchanged.

mod common;

use common::{
    Oracle, OracleExtra, fixture_dir, fixture_engine, forward_all_rows, max_abs_diff, nan_logits,
};
use dsv4::weights::store::TensorData;
use dsv4::weights::{HostDtype, WeightFormat};
use dsv4::{Engine, EngineOptions, Numerics, Status, TensorUpdate};

fn engine(model: &str, numerics: Numerics, format: WeightFormat) -> Engine {
    let opts = EngineOptions {
        max_num_seqs: 4,
        max_num_tokens: 128,
        max_seq_len: 64,
        numerics,
        weight_format: format,
        num_threads: 2,
        ..Default::default()
    };
    fixture_engine(model, opts)
}

/// One-shot logits of every oracle prompt, each in its own slot of one batch.
fn one_shot(e: &mut Engine, o: &Oracle) -> Vec<Vec<f32>> {
    let vocab = e.config().vocab_size;
    let (mut toks, mut pos, mut qs) = (vec![], vec![], vec![0i32]);
    for p in &o.prompts {
        toks.extend_from_slice(p);
        pos.extend(0..p.len() as i32);
        qs.push(toks.len() as i32);
    }
    let slots: Vec<i32> = (0..o.prompts.len() as i32).collect();
    let out = forward_all_rows(e, &toks, &pos, &slots, &qs);
    let mut res = vec![];
    let mut row = 0;
    for p in &o.prompts {
        res.push(out[row * vocab..(row + p.len()) * vocab].to_vec());
        row += p.len();
    }
    res
}

/// Prefill of the first 13/9/5 tokens, then one token per sequence per step.
fn prefill_decode(e: &mut Engine, o: &Oracle) -> Vec<Vec<f32>> {
    run_schedule(
        e,
        o,
        |s, step| if step == 0 { [13, 9, 5][s % 3] } else { 1 },
    )
}

/// Odd chunk sizes that differ per sequence, so sequences sit at different offsets.
fn chunked(e: &mut Engine, o: &Oracle) -> Vec<Vec<f32>> {
    run_schedule(e, o, |s, step| {
        [[7, 3, 5, 1, 11], [2, 9, 1, 4, 6], [5, 1, 3, 8, 2]][s % 3][step % 5]
    })
}

/// Runs every oracle prompt in its own slot; at step k sequence s advances by `size(s, k)`
/// tokens (clipped to what is left); all sequences with tokens left share each batch.
fn run_schedule(e: &mut Engine, o: &Oracle, size: impl Fn(usize, usize) -> usize) -> Vec<Vec<f32>> {
    let vocab = e.config().vocab_size;
    let mut res = nan_logits(o, vocab);
    let mut next = vec![0usize; o.prompts.len()];
    let mut step = 0;
    while next.iter().zip(&o.prompts).any(|(n, p)| *n < p.len()) {
        let (mut toks, mut pos, mut qs, mut slots, mut spans) =
            (vec![], vec![], vec![0i32], vec![], vec![]);
        for (s, p) in o.prompts.iter().enumerate() {
            if next[s] >= p.len() {
                continue;
            }
            let n = size(s, step).min(p.len() - next[s]);
            toks.extend_from_slice(&p[next[s]..next[s] + n]);
            pos.extend(next[s] as i32..(next[s] + n) as i32);
            qs.push(toks.len() as i32);
            slots.push(s as i32);
            spans.push((s, next[s], n));
            next[s] += n;
        }
        step += 1;
        let out = forward_all_rows(e, &toks, &pos, &slots, &qs);
        let mut row = 0;
        for (s, start, n) in spans {
            res[s][start * vocab..(start + n) * vocab]
                .copy_from_slice(&out[row * vocab..(row + n) * vocab]);
            row += n;
        }
    }
    res
}

fn worst(got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(g, w)| max_abs_diff(g, w))
        .fold(0.0, f32::max)
}

#[test]
fn exact_mode_on_upstream_fp8_fp4_checkpoint_matches_transformers() {
    let o = Oracle::load("tiny_fp8");
    let mut e = engine("tiny_fp8", Numerics::Exact, WeightFormat::AsStored);
    // The weights really are held as FP8/FP4 codes.
    let wq_a = e.weights().index_of("layers.0.attn.wq_a.weight").unwrap();
    assert!(e.weights().is_quantized(wq_a));
    let d1 = worst(&one_shot(&mut e, &o), &o.logits);
    let d2 = worst(&prefill_decode(&mut e, &o), &o.logits);
    let d3 = worst(&chunked(&mut e, &o), &o.logits);
    println!(
        "tiny_fp8 exact: one-shot max |dlogit| = {d1:.3e}, prefill+decode = {d2:.3e}, chunked = {d3:.3e}"
    );
    assert!(d1 <= 1e-3 && d2 <= 1e-3 && d3 <= 1e-3, "{d1} {d2} {d3}");
}

#[test]
fn official_mode_matches_the_official_simulation_oracle() {
    let o = Oracle::load("tiny_fp8");
    let official = o.extra("logits_official");
    let mut e = engine("tiny_fp8", Numerics::Official, WeightFormat::AsStored);
    let got = one_shot(&mut e, &o);
    let d = worst(&got, &official);
    let bite = worst(&official, &o.logits);
    println!(
        "tiny_fp8 official: max |dlogit| vs official oracle = {d:.3e}; exact vs official oracle = {bite:.3e}"
    );
    assert!(d <= 5e-3, "official mode vs oracle: {d}");
    assert!(
        bite > 10.0 * d,
        "the simulations must bite: exact vs official {bite}"
    );
    if o.has("logits_official_decode.0") {
        let dec = o.extra("logits_official_decode");
        let d2 = worst(&prefill_decode(&mut e, &o), &dec);
        let d3 = worst(&chunked(&mut e, &o), &official);
        println!("tiny_fp8 official: prefill+decode max |dlogit| = {d2:.3e}, chunked = {d3:.3e}");
        assert!(
            d2 <= 5e-3 && d3 <= 5e-3,
            "official decode {d2}, chunked {d3}"
        );
    }
}

/// Stored bytes of every weight (codes and scales for quantized storage).
fn stored_bytes(e: &Engine) -> Vec<(String, Vec<u8>, Vec<u32>)> {
    e.host_store()
        .expect("CPU engine")
        .tensors()
        .iter()
        .map(|t| match &t.data {
            TensorData::Quant(q) => (
                t.spec.name.clone(),
                q.codes.clone(),
                q.scales.iter().map(|s| s.to_bits()).collect(),
            ),
            TensorData::F32(v) => (
                t.spec.name.clone(),
                vec![],
                v.iter().map(|s| s.to_bits()).collect(),
            ),
            TensorData::Bf16(v) => (
                t.spec.name.clone(),
                vec![],
                v.iter().map(|&s| s as u32).collect(),
            ),
            TensorData::I32(v) => (
                t.spec.name.clone(),
                vec![],
                v.iter().map(|&s| s as u32).collect(),
            ),
        })
        .collect()
}

/// Every logit of `a` equals the one of `b` bit for bit (else fails with `what`).
fn assert_same_bits(a: &[Vec<f32>], b: &[Vec<f32>], what: &str) {
    for (a, b) in a.iter().zip(b) {
        assert!(
            a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{what}"
        );
    }
}

/// The logical shape of weight `name`.
fn shape_of(e: &Engine, name: &str) -> Vec<usize> {
    let w = e.weights();
    w.entry(w.index_of(name).unwrap()).spec.shape.clone()
}

/// `n` values `f(i)` as BF16 bytes.
fn bf16_bytes(n: usize, f: impl Fn(usize) -> f32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| half::bf16::from_f32(f(i)).to_bits().to_le_bytes())
        .collect()
}

#[test]
fn quantize_on_load_equals_the_prequantized_checkpoint_bit_for_bit() {
    let o = Oracle::load("tiny");
    for numerics in [Numerics::Exact, Numerics::Official] {
        let mut q = engine("tiny", numerics, WeightFormat::Quantize);
        let mut p = engine("tiny_fp8", numerics, WeightFormat::AsStored);
        let (bq, bp) = (stored_bytes(&q), stored_bytes(&p));
        assert_eq!(bq.len(), bp.len());
        for (a, b) in bq.iter().zip(&bp) {
            assert!(
                a == b,
                "{numerics:?}: weight `{}` differs between quantize(BF16) and the FP8/FP4 checkpoint",
                a.0
            );
        }
        let (lq, lp) = (one_shot(&mut q, &o), one_shot(&mut p, &o));
        assert_same_bits(&lq, &lp, &format!("{numerics:?}: logits differ"));
    }
}

#[test]
fn non_finite_refit_under_quantized_storage_is_rejected_and_engine_unchanged() {
    let o = Oracle::load("tiny");
    let mut e = engine("tiny", Numerics::Official, WeightFormat::Quantize);
    let before = one_shot(&mut e, &o);
    let name = "layers.1.attn.wq_b.weight";
    let shape = shape_of(&e, name);
    let n: usize = shape.iter().product();
    let good_shape = shape_of(&e, "norm.weight");
    let good = bf16_bytes(good_shape[0], |i| 0.5 + i as f32 * 1e-3);
    for bad_value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut bad = bf16_bytes(n, |i| (i % 7) as f32 * 0.01);
        bad[2 * 1234..2 * 1234 + 2]
            .copy_from_slice(&half::bf16::from_f32(bad_value).to_bits().to_le_bytes());
        let updates = [
            TensorUpdate {
                name: "norm.weight",
                dtype: HostDtype::Bf16,
                shape: &good_shape,
                data: (&good).into(),
            },
            TensorUpdate {
                name,
                dtype: HostDtype::Bf16,
                shape: &shape,
                data: (&bad).into(),
            },
        ];
        let err = e.refit(&updates).unwrap_err();
        assert_eq!(err.status, Status::Tensor, "{}", err.message);
        assert!(
            err.message.contains(name) && err.message.contains("1234"),
            "{}",
            err.message
        );
        let after = one_shot(&mut e, &o);
        assert_same_bits(&before, &after, "engine changed by a rejected refit");
    }
}

/// The engine's dequantization of stored FP8/FP4 weights equals an independent Python
/// dequantization bit for bit (tests/fixtures/tiny_fp8/quant_reference.safetensors).
#[test]
fn stored_weights_dequantize_like_the_python_reference() {
    let e = engine("tiny_fp8", Numerics::Exact, WeightFormat::AsStored);
    let bytes = std::fs::read(fixture_dir("tiny_fp8").join("quant_reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for (name, view) in st.tensors() {
        let canon = name.strip_prefix("deq.").expect("deq.<name>");
        let i = e
            .weights()
            .index_of(canon)
            .unwrap_or_else(|| panic!("{canon}"));
        assert!(e.weights().is_quantized(i), "{canon} is not held quantized");
        let want: Vec<u32> = view
            .data()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let cols = *view.shape().last().unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..want.len() / cols {
            let store = e.host_store().expect("CPU engine");
            store.matrix(i).row_into(r, cols, &mut row);
            let got: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want[r * cols..(r + 1) * cols], "{canon} row {r}");
        }
        checked += 1;
    }
    assert!(checked >= 3);
}
