//! The host contract through the C ABI (part of the GPU suite; its CPU half runs everywhere) (issue "CUDA-graph capture, in-place refit, dummy
//! load, pointer stability"): what a serving engine or an RL trainer relies on.
//!
//! Every test that makes sense on both backends runs on the CPU reference (always, so CI
//! covers it) and on CUDA device 0 when there is one; the graph-capture and soak tests are
//! CUDA-only and print `skipped: no CUDA device` without one. Outputs are compared bit for
//! bit; logits buffers are poisoned (NaN) before every forward and replay.

mod common;

use std::ffi::{CStr, CString};

use common::abi::{
    Entry, checkpoint_file_order as checkpoint, fails, find, last_error, ok, perturbed_bf16,
};
use common::bits;
use common::gpu::{devices, has_cuda};
use common::rig::{Load, Rig, RigOptions, Step};
use common::rng::{XorShift, tokens};
use dsv4::cuda::kernels::fast_moe;
use dsv4::ffi::*;

// ------------------------------------------------------------------------------ plumbing

/// The options of `model` on `dev` in official numerics (4 slots, 64 tokens, 96 positions, 4
/// threads; logits poisoned with NaN).
fn options(model: &str, dev: i32, load: Load, weight_format: i32) -> RigOptions {
    let mut o = RigOptions::new(model, dev);
    o.load = load;
    o.weight_format = Some(weight_format);
    o.numerics = DSV4_NUMERICS_OFFICIAL;
    o
}

/// create -> load -> `overrides` -> finalize of `model` on `dev` ([`options`]).
fn rig_with(model: &str, dev: i32, load: Load, weight_format: i32, overrides: &[Entry]) -> Rig {
    Rig::build(&options(model, dev, load, weight_format), overrides)
}

fn rig(model: &str, dev: i32, load: Load, weight_format: i32) -> Rig {
    rig_with(model, dev, load, weight_format, &[])
}

/// How the `tiny` rigs hold their weights: quantized to FP8 (dense) and FP4 (experts) on load
/// and on refit, so that on CUDA the default (fast) kernel set runs its own MoE kernels, whose
/// pointer tables a refit must rebuild.
const TINY_FORMAT: i32 = DSV4_WEIGHT_FORMAT_QUANTIZE;

/// The `tiny` model (most tests), weights as [`TINY_FORMAT`].
fn tiny(dev: i32, load: Load) -> Rig {
    rig("tiny", dev, load, TINY_FORMAT)
}

/// The `tiny_fp8` checkpoint held as stored (FP8/FP4 codes) on the CPU.
fn fp8_on_cpu() -> Rig {
    rig(
        "tiny_fp8",
        -1,
        Load::Checkpoint,
        DSV4_WEIGHT_FORMAT_AS_STORED,
    )
}

/// Bit-for-bit equality of two logit sets.
#[track_caller]
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(bits(got), bits(want), "{what}");
}

fn prefill() -> Step {
    Step::of(&[(0, 0, tokens(1, 13)), (1, 0, tokens(2, 9))])
}

// ------------------------------------------------------------------ pointers and derived

#[test]
fn derived_tensors_and_buffer_spans_are_reported() {
    let _turn = common::gpu::turn();
    for dev in devices() {
        let r = tiny(dev, Load::Checkpoint);
        let descs = r.descs();
        let info = r.info();
        assert_eq!(info.num_weights, descs.len());
        let derived: Vec<_> = descs.iter().filter(|d| d.derived != 0).collect();
        let names: Vec<String> = derived
            .iter()
            .map(|d| {
                unsafe { CStr::from_ptr(d.name) }
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        let fold = names
            .iter()
            .position(|n| n == "derived:layers.0.hc_attn_fn.stream_fold")
            .unwrap_or_else(|| panic!("device {dev}: no layer-0 fold among {names:?}"));
        assert_eq!(derived[fold].dtype, DSV4_DTYPE_F64);
        assert_eq!(&derived[fold].shape[..2], &[24, 128]);
        // Derived entries come after every source weight.
        let first = descs.iter().position(|d| d.derived != 0).unwrap();
        assert!(descs[first..].iter().all(|d| d.derived != 0));
        for d in &descs {
            assert!(!d.data.is_null() && d.nbytes > 0);
            assert_eq!(d.device, dev);
        }
        if dev < 0 {
            assert!(info.state_base.is_null() && info.workspace_base.is_null());
            continue;
        }
        assert!(
            names.iter().any(|n| n.ends_with("experts.w1_ptrs")),
            "{names:?}"
        );
        // The fast set's tensor-core router reads its gate as derived BF16 planes.
        assert!(
            names
                .iter()
                .any(|n| n == "derived:layers.2.ffn.gate.bf16_planes"),
            "{names:?}"
        );
        // Every buffer lies inside its span; the spans do not overlap.
        let inside = |p: u64, n: u64, base: *const std::ffi::c_void, bytes: u64| {
            p >= base as u64 && p + n <= base as u64 + bytes
        };
        for d in &descs {
            let (b, n) = if d.derived != 0 {
                (info.derived_base, info.derived_nbytes)
            } else {
                (info.weights_base, info.weights_nbytes)
            };
            assert!(inside(d.data as u64, d.nbytes, b, n));
            if !d.scale.is_null() {
                assert!(inside(
                    d.scale as u64,
                    d.scale_nbytes,
                    info.weights_base,
                    info.weights_nbytes
                ));
            }
        }
        let mut spans = [
            (info.weights_base as u64, info.weights_nbytes),
            (info.derived_base as u64, info.derived_nbytes),
            (info.state_base as u64, info.state_nbytes),
            (info.workspace_base as u64, info.workspace_nbytes),
        ];
        assert!(spans.iter().all(|&(p, n)| p != 0 && n > 0), "{spans:?}");
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "overlapping spans {spans:?}");
        }
    }
}

#[test]
fn finalize_twice_and_refit_twice_are_idempotent() {
    let _turn = common::gpu::turn();
    let ck = checkpoint("tiny");
    for dev in devices() {
        let r = tiny(dev, Load::Checkpoint);
        let ptrs = r.pointers();
        let want = r.forward_finite(&prefill());
        unsafe { ok(dsv4_finalize(r.e, r.stream())) };
        assert_same(
            &r.forward_finite(&prefill()),
            &want,
            &format!("device {dev}: second finalize"),
        );
        for round in 0..2 {
            r.refit(&ck, dev >= 0);
            assert_same(
                &r.forward_finite(&prefill()),
                &want,
                &format!("device {dev}: refit #{round} with the loaded weights"),
            );
        }
        assert_eq!(r.pointers(), ptrs, "device {dev}: a pointer moved");
    }
}

// ----------------------------------------------------------- refit rebuilds derived data

/// Refitting `changed` into a loaded engine gives exactly a fresh load with the change, and
/// the change is visible (the `tiny` rigs, [`prefill`], every device).
fn refit_equals_fresh_load(changed: &[Entry], what: &str) {
    let tiny = |dev| options("tiny", dev, Load::Checkpoint, TINY_FORMAT);
    refit_equals_fresh_load_on(&devices(), &tiny, &prefill(), changed, what);
}

/// [`refit_equals_fresh_load`] on the rigs `options` makes for `devs`, over `step`.
fn refit_equals_fresh_load_on(
    devs: &[i32],
    options: &dyn Fn(i32) -> RigOptions,
    step: &Step,
    changed: &[Entry],
    what: &str,
) {
    for &dev in devs {
        let r = Rig::build(&options(dev), &[]);
        let before = r.forward_finite(step);
        let ptrs = r.pointers();
        r.refit(changed, dev >= 0);
        let got = r.forward_finite(step);
        let want = Rig::build(&options(dev), changed).forward_finite(step);
        assert_ne!(
            bits(&got),
            bits(&before),
            "device {dev}: {what} changed nothing"
        );
        assert_same(
            &got,
            &want,
            &format!("device {dev}: {what} differs from a fresh load"),
        );
        assert_eq!(r.pointers(), ptrs, "device {dev}: a pointer moved");
    }
}

#[test]
fn refit_of_layer0_hc_attn_fn_rebuilds_the_folded_weight() {
    let _turn = common::gpu::turn();
    let ck = checkpoint("tiny");
    let hc = perturbed_bf16(find(&ck, "model.layers.0.hc_attn_fn"), 1.5);
    refit_equals_fresh_load(&[hc], "refit of layers.0.hc_attn_fn");
}

#[test]
fn refit_of_one_expert_equals_a_fresh_load() {
    let _turn = common::gpu::turn();
    let ck = checkpoint("tiny");
    // Layer 0 is hash-routed: the first prompt token's first expert is certainly used.
    let t2e = find(&ck, "model.layers.0.ffn.gate.tid2eid");
    let k = t2e.shape[1] as usize;
    let tok = prefill().toks[0] as usize;
    let at = tok * k * 8;
    let expert = i64::from_le_bytes(t2e.data[at..at + 8].try_into().unwrap());
    let changed: Vec<Entry> = ["w1", "w2", "w3"]
        .iter()
        .map(|w| {
            perturbed_bf16(
                find(
                    &ck,
                    &format!("model.layers.0.ffn.experts.{expert}.{w}.weight"),
                ),
                -1.25,
            )
        })
        .collect();
    refit_equals_fresh_load(&changed, &format!("refit of expert {expert}"));
}

/// A refit of a layer's router gate rebuilds the gate's derived BF16 planes: a prefill long
/// enough for the fast set's tensor-core router (`fast_moe::TC_MIN_TOKENS`) and the wide routing
/// plan (`fast_moe::WIDE_PLAN_MIN_TOKENS`) gives, after the refit, exactly a fresh load's logits.
/// (The other rigs' 64 tokens take the f32 router, which reads the gate itself.)
#[test]
fn refit_of_a_router_gate_rebuilds_its_planes_for_many_tokens() {
    let _turn = common::gpu::turn();
    if !has_cuda() {
        println!("skipped: no CUDA device");
        return;
    }
    let ck = checkpoint("tiny");
    // Layer 2 routes top-k (layers 0 and 1 hash, whose weights still come from the gate).
    let gate = perturbed_bf16(find(&ck, "model.layers.2.ffn.gate.weight"), -1.5);
    let n = fast_moe::TC_MIN_TOKENS.max(fast_moe::WIDE_PLAN_MIN_TOKENS) + 8;
    let long = |dev| {
        let mut o = options("tiny", dev, Load::Checkpoint, TINY_FORMAT);
        o.max_num_tokens = n as i32;
        o.max_seq_len = n as i32 + 8;
        o
    };
    let cuda: Vec<i32> = devices().into_iter().filter(|&d| d >= 0).collect();
    let step = Step::of(&[(0, 0, tokens(3, n))]);
    refit_equals_fresh_load_on(
        &cuda,
        &long,
        &step,
        std::slice::from_ref(&gate),
        "refit of layers.2.ffn.gate.weight",
    );
}

#[test]
fn a_bad_entry_among_good_ones_changes_nothing() {
    let _turn = common::gpu::turn();
    let ck = checkpoint("tiny");
    let good = perturbed_bf16(find(&ck, "model.layers.1.attn.wq_a.weight"), 2.0);
    let mut bad = perturbed_bf16(find(&ck, "model.layers.1.attn.wkv.weight"), 2.0);
    // Wrong shape: one extra row (with the bytes for it, so only the shape is wrong).
    let row = bad.data.len() / bad.shape[0] as usize;
    bad.shape[0] += 1;
    bad.data.extend(vec![0u8; row]);
    for dev in devices() {
        let r = tiny(dev, Load::Checkpoint);
        let before = r.forward_finite(&prefill());
        let descs = r.descs();
        let snapshot: Vec<Vec<u8>> = descs.iter().map(|d| r.read(d)).collect();
        for entries in [
            vec![good.clone(), bad.clone()],
            vec![bad.clone(), good.clone()],
        ] {
            let s = r.try_refit(&entries, dev >= 0);
            assert!(
                s == DSV4_STATUS_TENSOR || s == DSV4_STATUS_INVALID_ARGUMENT,
                "device {dev}: status {s}"
            );
            assert!(last_error().contains("wkv"), "{}", last_error());
        }
        for (d, old) in descs.iter().zip(&snapshot) {
            assert!(r.read(d) == *old, "device {dev}: `{:?}` changed", unsafe {
                CStr::from_ptr(d.name)
            });
        }
        assert_same(
            &r.forward_finite(&prefill()),
            &before,
            &format!("device {dev}"),
        );
    }
}

// ------------------------------------------------- loading and refitting from device memory

/// dsv4_load_tensors with every checkpoint tensor in ONE call (FP8/FP4 codes with their scale
/// entries for `tiny_fp8`; on CUDA also with every other entry in device memory, written on
/// the device) holds exactly the weights of dsv4_load and forwards alike, bit for bit.
#[test]
fn load_tensors_in_one_call_equals_a_checkpoint_load() {
    let _turn = common::gpu::turn();
    for (model, format) in [
        ("tiny", TINY_FORMAT),
        ("tiny_fp8", DSV4_WEIGHT_FORMAT_AS_STORED),
    ] {
        for dev in devices() {
            let want = rig(model, dev, Load::Checkpoint, format);
            let want_logits = want.forward_finite(&prefill());
            let sources: &[bool] = if dev >= 0 { &[false, true] } else { &[false] };
            for &device_memory in sources {
                let what = format!("{model} on device {dev}, device memory {device_memory}");
                let got = rig(model, dev, Load::Tensors { device_memory }, format);
                for (a, b) in got.descs().iter().zip(&want.descs()) {
                    if a.derived == 0 {
                        let name = unsafe { CStr::from_ptr(a.name) }.to_string_lossy();
                        assert!(
                            got.read(a) == want.read(b),
                            "{what}: weight `{name}` differs"
                        );
                    }
                }
                assert_same(&got.forward_finite(&prefill()), &want_logits, &what);
            }
        }
    }
}

/// Bad values in device memory are found on the device before anything is written: a NaN
/// in a BF16 entry that is quantized on write, an expert id out of range, a device range that
/// runs past its allocation. Each error names the entry; weights, derived tensors and logits
/// stay bit for bit what they were.
#[test]
fn a_bad_device_value_among_good_ones_changes_nothing() {
    let _turn = common::gpu::turn();
    if !has_cuda() {
        println!("skipped: no CUDA device");
        return;
    }
    let ck = checkpoint("tiny");
    let good = perturbed_bf16(find(&ck, "model.layers.1.attn.wq_a.weight"), 2.0);
    let mut nan = perturbed_bf16(find(&ck, "model.layers.1.attn.wkv.weight"), 2.0);
    nan.data[34..36].copy_from_slice(&0x7fc0u16.to_le_bytes()); // element 17: NaN
    let mut ids = find(&ck, "model.layers.0.ffn.gate.tid2eid").clone();
    let experts = ids
        .data
        .chunks(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .max();
    ids.data[40..48].copy_from_slice(&(experts.unwrap() + 1 + 64).to_le_bytes()); // element 5
    let r = tiny(0, Load::Checkpoint);
    let before = r.forward_finite(&prefill());
    let descs = r.descs();
    let snapshot: Vec<Vec<u8>> = descs.iter().map(|d| r.read(d)).collect();
    // With device memory, entry 1 of each pair is sent from the device.
    for (bad, needles) in [
        (&nan, ["wkv", "element 17", "not finite"]),
        (&ids, ["tid2eid", "element 5", "expert id"]),
    ] {
        let s = r.try_refit(&[good.clone(), bad.clone()], true);
        assert_eq!(s, DSV4_STATUS_TENSOR, "{}", last_error());
        for n in needles {
            assert!(last_error().contains(n), "`{n}` not in: {}", last_error());
        }
    }
    // A device range past the end of its allocation: refused before any kernel reads it.
    let h = r.host.as_ref().unwrap();
    let small = {
        let _g = h.ctx.enter().unwrap();
        dsv4::cuda::Arena::new(&h.ctx, 256).unwrap()
    };
    let entries = [good.clone(), nan.renamed("model.layers.1.attn.wkv.weight")];
    let mut ts = common::abi::tensors(&entries);
    ts[1].data = small.whole().addr() as *const _;
    ts[1].memory = DSV4_MEMORY_DEVICE;
    let s = unsafe { dsv4_refit(r.e, ts.as_ptr(), ts.len(), r.stream()) };
    assert_eq!(s, DSV4_STATUS_CUDA, "{}", last_error());
    assert!(last_error().contains("wkv"), "{}", last_error());
    for (d, old) in descs.iter().zip(&snapshot) {
        assert!(r.read(d) == *old, "`{:?}` changed", unsafe {
            CStr::from_ptr(d.name)
        });
    }
    assert_same(
        &r.forward_finite(&prefill()),
        &before,
        "after the refused refits",
    );
}

// ---------------------------------------------------------------- dummy, then weight sync

/// The RL flow: dummy load -> finalize -> forward (finite) -> refit every weight -> equals a
/// normal load bit for bit.
fn dummy_then_sync(model: &str, weight_format: i32) {
    let ck = checkpoint(model);
    for dev in devices() {
        let what = format!("{model}, weight_format {weight_format}, device {dev}");
        let want = rig(model, dev, Load::Checkpoint, weight_format).forward_finite(&prefill());
        let r = rig(model, dev, Load::Dummy, weight_format);
        let ptrs = r.pointers();
        let dummy = r.forward_finite(&prefill());
        r.refit(&ck, dev >= 0);
        let got = r.forward_finite(&prefill());
        assert_ne!(bits(&dummy), bits(&got), "{what}");
        assert_same(&got, &want, &format!("{what}: differs from a normal load"));
        assert_eq!(r.pointers(), ptrs, "{what}: a pointer moved");
    }
}

#[test]
fn dummy_then_sync_bf16_source_under_quantize() {
    let _turn = common::gpu::turn();
    dummy_then_sync("tiny", DSV4_WEIGHT_FORMAT_QUANTIZE);
}

#[test]
fn dummy_then_sync_stored_format_fp8_fp4() {
    let _turn = common::gpu::turn();
    dummy_then_sync("tiny_fp8", DSV4_WEIGHT_FORMAT_AS_STORED);
}

#[test]
fn stored_format_refit_needs_its_scale_in_the_same_call() {
    let _turn = common::gpu::turn();
    let ck = checkpoint("tiny_fp8");
    let w = find(&ck, "layers.0.attn.wq_a.weight").clone();
    let s = find(&ck, "layers.0.attn.wq_a.scale").clone();
    let r = fp8_on_cpu();
    assert_eq!(
        r.try_refit(std::slice::from_ref(&w), false),
        DSV4_STATUS_TENSOR
    );
    assert!(last_error().contains("scale"), "{}", last_error());
    assert_eq!(
        r.try_refit(std::slice::from_ref(&s), false),
        DSV4_STATUS_TENSOR
    );
    assert!(last_error().contains("together"), "{}", last_error());
    r.refit(&[s, w], false);
}

#[test]
fn stored_format_refit_rejects_malformed_entries() {
    let _turn = common::gpu::turn();
    let ck = checkpoint("tiny_fp8");
    let w = find(&ck, "layers.0.attn.wq_a.weight").clone();
    let s = find(&ck, "layers.0.attn.wq_a.scale").clone();
    let e1 = find(&ck, "layers.0.ffn.experts.0.w1.weight").clone();
    let e1s = find(&ck, "layers.0.ffn.experts.0.w1.scale").clone();
    let r = fp8_on_cpu();
    let before = r.forward_finite(&prefill());
    let expect = |entries: Vec<Entry>, status: i32, words: &[&str]| {
        assert_eq!(r.try_refit(&entries, false), status, "{}", last_error());
        let msg = last_error();
        for w in words {
            assert!(msg.contains(w), "`{w}` not in: {msg}");
        }
    };
    // A scale in a dtype that is not a scale dtype.
    let mut bad_scale = s.clone();
    bad_scale.dtype = DSV4_DTYPE_I32;
    bad_scale.data = vec![0u8; s.data.len() * 4];
    expect(
        vec![w.clone(), bad_scale],
        DSV4_STATUS_TENSOR,
        &["wq_a", "E8M0"],
    );
    // The scale grid of another shape.
    let mut grid = s.clone();
    grid.shape = vec![grid.shape[0] + 1, grid.shape[1]];
    grid.data.extend(vec![127u8; s.shape[1] as usize]);
    expect(
        vec![w.clone(), grid],
        DSV4_STATUS_TENSOR,
        &["wq_a", "scale"],
    );
    // Two scales for one weight (two names of the same scale).
    let mut alias = s.clone();
    alias.name = CString::new("layers.0.attn.wq_a.weight_scale_inv").unwrap();
    expect(
        vec![w.clone(), s.clone(), alias],
        DSV4_STATUS_INVALID_ARGUMENT,
        &["both the scale"],
    );
    // Packed FP4 with an odd logical column count cannot exist.
    let mut odd = e1.clone();
    *odd.shape.last_mut().unwrap() -= 1;
    expect(
        vec![odd, e1s.clone()],
        DSV4_STATUS_INVALID_ARGUMENT,
        &["odd"],
    );
    // FP4 codes sent for an FP8 weight: the packed shape cannot match.
    let mut as_fp4 = w.clone();
    as_fp4.dtype = DSV4_DTYPE_FP4_E2M1;
    as_fp4.shape = vec![w.shape[0], w.shape[1] * 2];
    expect(vec![as_fp4, s.clone()], DSV4_STATUS_TENSOR, &["wq_a"]);
    // A scale-dtype value for a float weight without a scale role.
    let mut norm = find(&ck, "layers.0.attn_norm.weight").clone();
    norm.dtype = DSV4_DTYPE_E8M0;
    norm.data = vec![127u8; norm.shape.iter().product::<i64>() as usize];
    expect(vec![norm], DSV4_STATUS_TENSOR, &["attn_norm", "E8M0"]);
    // None of it changed anything; a well-formed pair still works.
    assert_eq!(bits(&r.forward_finite(&prefill())), bits(&before));
    r.refit(&[e1s, e1, s, w], false);
    assert_eq!(bits(&r.forward_finite(&prefill())), bits(&before));
}

// --------------------------------------------------------------------- CUDA graph capture

/// Restages new contents into buffer sets without touching the graph.
fn restage(r: &Rig, steps: &[(&Step, usize)]) {
    for (s, set) in steps {
        r.stage(s, *set);
    }
}

#[test]
fn captured_decode_and_prefill_replay_equal_eager() {
    let _turn = common::gpu::turn();
    if !has_cuda() {
        return;
    }
    let eager = tiny(0, Load::Checkpoint);
    let cap = tiny(0, Load::Checkpoint);
    let p = prefill();
    assert_same(
        &eager.forward_finite(&p),
        &cap.forward_finite(&p),
        "eager forwards",
    );

    // Decode: one token for each of the two sequences.
    let d1 = Step::of(&[(0, 13, tokens(3, 1)), (1, 9, tokens(4, 1))]);
    let g = cap.capture(&[(&d1, 1)]);
    let want = eager.forward_finite(&d1);
    assert_same(&cap.replay(&g, &[(1, 2)])[0], &want, "decode replay");
    // New contents (next position, other tokens), same graph.
    for k in 0..3 {
        let dk = Step::of(&[
            (0, 14 + k, tokens(10 + k as u64, 1)),
            (1, 10 + k, tokens(20 + k as u64, 1)),
        ]);
        restage(&cap, &[(&dk, 1)]);
        let want = eager.forward_finite(&dk);
        assert_same(
            &cap.replay(&g, &[(1, 2)])[0],
            &want,
            &format!("decode replay {k}"),
        );
    }

    // A prefill chunk (positions from 0 restart the slots inside the graph).
    let p2 = Step::of(&[(2, 0, tokens(5, 11)), (3, 0, tokens(6, 7))]);
    let g2 = cap.capture(&[(&p2, 2)]);
    let want = eager.forward_finite(&p2);
    assert_same(&cap.replay(&g2, &[(2, 18)])[0], &want, "prefill replay");
    let p3 = Step::of(&[(2, 0, tokens(7, 11)), (3, 0, tokens(8, 7))]);
    restage(&cap, &[(&p3, 2)]);
    let want = eager.forward_finite(&p3);
    assert_same(
        &cap.replay(&g2, &[(2, 18)])[0],
        &want,
        "prefill replay, new tokens",
    );
}

#[test]
fn old_graph_replays_with_refit_weights() {
    let _turn = common::gpu::turn();
    if !has_cuda() {
        return;
    }
    let ck = checkpoint("tiny");
    let r = tiny(0, Load::Dummy);
    let p = prefill();
    let d = Step::of(&[(0, 13, tokens(3, 1)), (1, 9, tokens(4, 1))]);
    // One graph holding a prefill (restarting both slots) and a decode step.
    let g = r.capture(&[(&p, 0), (&d, 1)]);
    let before = r.replay(&g, &[(0, 22), (1, 2)]);
    let ptrs = r.pointers();

    // Chunked sync of the real weights, half of them from device memory.
    unsafe { ok(dsv4_refit_begin(r.e)) };
    let half = ck.len() / 2;
    r.refit(&ck[..half], true);
    r.refit(&ck[half..], true);
    unsafe { ok(dsv4_refit_end(r.e, r.stream())) };
    assert_eq!(r.pointers(), ptrs, "a pointer moved during the refit");

    let after = r.replay(&g, &[(0, 22), (1, 2)]);
    let fresh = tiny(0, Load::Checkpoint);
    let want_p = fresh.forward_finite(&p);
    let want_d = fresh.forward_finite(&d);
    assert_ne!(bits(&before[0]), bits(&after[0]));
    assert_same(&after[0], &want_p, "old graph prefill vs fresh engine");
    assert_same(&after[1], &want_d, "old graph decode vs fresh engine");
}

// ------------------------------------------------------------------------------- soak

/// 2,000 random forward / refit / release calls on a CUDA engine, each mirrored on a CPU
/// engine created with the same weights: outputs equal bit for bit at every step, no error,
/// and device free memory is unchanged at the end.
#[test]
fn soak_of_interleaved_forward_refit_release() {
    let _turn = common::gpu::turn();
    if !has_cuda() {
        return;
    }
    let ck = checkpoint("tiny");
    // Two values per refittable weight: as loaded, and perturbed.
    let alt: Vec<Entry> = ck
        .iter()
        .map(|e| {
            if e.dtype == DSV4_DTYPE_BF16 {
                perturbed_bf16(e, 0.75)
            } else {
                e.clone()
            }
        })
        .collect();
    // The GPU mirrors the CPU bit for bit: the reference kernel set.
    let mut o = RigOptions::new("tiny", 0);
    o.weight_format = Some(TINY_FORMAT);
    o.kernel_set = Some("reference");
    let g = Rig::build(&o, &[]);
    let m = tiny(-1, Load::Checkpoint);
    let ctx = &g.host.as_ref().unwrap().ctx;
    // Warm up (first forward may load lazily) before the memory baseline.
    g.forward_finite(&prefill());
    m.forward_finite(&prefill());
    let free0 = ctx.mem_info().unwrap().0;
    let mut len = [0i32; 4];
    len[0] = 13;
    len[1] = 9;
    let mut rng = XorShift(0x5EED);
    let mut next = |n: u64| rng.below(n);
    let (mut forwards, mut refits, mut releases) = (0, 0, 0);
    for op in 0..2000 {
        match next(10) {
            0..=6 => {
                // A batch of 1..4 slots, each continuing or (when empty / nearly full, or at
                // random) restarting at position 0.
                let nseq = 1 + next(4) as usize;
                let mut slots: Vec<i32> = (0..4).collect();
                for i in (1..4).rev() {
                    slots.swap(i, next(i as u64 + 1) as usize);
                }
                let mut seqs = vec![];
                for &s in &slots[..nseq] {
                    let n = 1 + next(6) as i32;
                    let restart = len[s as usize] == 0 || len[s as usize] + n > 90 || next(8) == 0;
                    let p0 = if restart { 0 } else { len[s as usize] };
                    seqs.push((s, p0, tokens(op as u64 * 7 + s as u64, n as usize)));
                    len[s as usize] = p0 + n;
                }
                let st = Step::of(&seqs);
                let a = g.forward_finite(&st);
                let b = m.forward_finite(&st);
                assert_same(&a, &b, &format!("op {op}: forward {st:?}"));
                forwards += 1;
            }
            7 | 8 => {
                let k = 1 + next(3) as usize;
                let picked: Vec<Entry> = (0..k)
                    .map(|_| {
                        let i = next(ck.len() as u64) as usize;
                        if next(2) == 0 {
                            ck[i].clone()
                        } else {
                            alt[i].clone()
                        }
                    })
                    .collect();
                // Distinct weights only (a weight named twice is an error by contract).
                let mut names = std::collections::HashSet::new();
                let picked: Vec<Entry> = picked
                    .into_iter()
                    .filter(|e| names.insert(e.name.clone()))
                    .collect();
                g.refit(&picked, next(2) == 0);
                m.refit(&picked, false);
                refits += 1;
            }
            _ => {
                let s = next(4) as i32;
                unsafe {
                    ok(dsv4_release_slot(g.e, s));
                    ok(dsv4_release_slot(m.e, s));
                }
                len[s as usize] = 0;
                releases += 1;
            }
        }
    }
    let free1 = ctx.mem_info().unwrap().0;
    println!(
        "soak: {forwards} forwards, {refits} refits, {releases} releases; device free {free0} -> {free1}"
    );
    assert_eq!(free0, free1, "device memory changed during the soak");
}

// --------------------------------------------------------------------------- slot lengths

/// dsv4_slot_length (ABI 1.3) follows prefill, decode and release on every backend (CUDA:
/// read after the forwards on the host's stream), and checks its arguments.
#[test]
fn slot_length_follows_prefill_decode_and_release() {
    let _turn = common::gpu::turn();
    for dev in devices() {
        let r = tiny(dev, Load::Checkpoint);
        let len = |slot: i32| {
            let mut v = -1;
            // SAFETY: live engine, writable out.
            unsafe { ok(dsv4_slot_length(r.e, slot, r.stream(), &mut v)) };
            v
        };
        assert_eq!((len(0), len(1)), (0, 0), "device {dev}: fresh slots");
        r.forward_finite(&prefill());
        assert_eq!(
            (len(0), len(1), len(2)),
            (13, 9, 0),
            "device {dev}: after prefill"
        );
        r.forward_finite(&Step::of(&[(0, 13, tokens(3, 1)), (1, 9, tokens(4, 1))]));
        assert_eq!((len(0), len(1)), (14, 10), "device {dev}: after decode");
        // SAFETY: live engine.
        unsafe { ok(dsv4_release_slot(r.e, 0)) };
        assert_eq!((len(0), len(1)), (0, 10), "device {dev}: after release");
        unsafe {
            let mut v = 0;
            fails(
                dsv4_slot_length(r.e, 4, r.stream(), &mut v),
                DSV4_STATUS_INVALID_ARGUMENT,
                &["`slot` = 4", "max_num_seqs = 4"],
            );
            fails(
                dsv4_slot_length(r.e, 0, r.stream(), std::ptr::null_mut()),
                DSV4_STATUS_NULL_POINTER,
                &["out"],
            );
        }
    }
}
