//! The host contract through the C ABI (part of the GPU suite; its CPU half runs everywhere) (issue "CUDA-graph capture, in-place refit, dummy
//! load, pointer stability"): what a serving engine or an RL trainer relies on.
//!
//! Every test that makes sense on both backends runs on the CPU reference (always, so CI
//! covers it) and on CUDA device 0 when there is one; the graph-capture and soak tests are
//! CUDA-only and print `skipped: no CUDA device` without one. Outputs are compared bit for
//! bit; logits buffers are poisoned (NaN) before every forward and replay.

mod common;

use std::ffi::{CStr, CString};

use common::fixture_dir;
use dsv4::cuda::arena::{copy_to_device_sync, copy_to_host_sync, memset_async};
use dsv4::cuda::graph::Graph;
use dsv4::cuda::{Arena, Context, DevicePtr, OwnedStream};
use dsv4::ffi::*;
use safetensors::SafeTensors;

// ------------------------------------------------------------------------------ plumbing

fn last_error() -> String {
    unsafe { CStr::from_ptr(dsv4_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(s: dsv4_status) {
    assert_eq!(s, DSV4_STATUS_OK, "{}", last_error());
}

fn gpu() -> bool {
    match dsv4::cuda::device_count() {
        Ok(n) if n > 0 => true,
        _ => {
            println!("skipped: no CUDA device");
            false
        }
    }
}

/// The CPU reference always; CUDA device 0 too when present.
fn devices() -> Vec<i32> {
    if gpu() { vec![-1, 0] } else { vec![-1] }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One checkpoint tensor as a refit entry.
#[derive(Clone)]
struct Entry {
    name: CString,
    dtype: i32,
    shape: Vec<i64>,
    data: Vec<u8>,
}

/// Every tensor of a fixture checkpoint (all shards), in the dsv4 dtype a host would send:
/// BF16/F32/I64 as stored, F8_E4M3 codes, E8M0 scales, packed FP4 (I8 [r, c/2] -> logical
/// shape [r, c]).
fn checkpoint(model: &str) -> Vec<Entry> {
    let mut files: Vec<_> = std::fs::read_dir(fixture_dir(model))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && !p
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with("oracle")
                && !p
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with("quant_reference")
        })
        .collect();
    files.sort();
    let mut out = vec![];
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            let mut shape: Vec<i64> = t.shape().iter().map(|&x| x as i64).collect();
            let dtype = match t.dtype() {
                safetensors::Dtype::BF16 => DSV4_DTYPE_BF16,
                safetensors::Dtype::F32 => DSV4_DTYPE_F32,
                safetensors::Dtype::I64 => DSV4_DTYPE_I64,
                safetensors::Dtype::F8_E4M3 => DSV4_DTYPE_F8_E4M3,
                safetensors::Dtype::F8_E8M0 => DSV4_DTYPE_E8M0,
                safetensors::Dtype::I8 | safetensors::Dtype::U8 => {
                    *shape.last_mut().unwrap() *= 2;
                    DSV4_DTYPE_FP4_E2M1
                }
                d => panic!("unexpected dtype {d:?} in fixture {model}"),
            };
            out.push(Entry {
                name: CString::new(name).unwrap(),
                dtype,
                shape,
                data: t.data().to_vec(),
            });
        }
    }
    out
}

fn find<'a>(entries: &'a [Entry], name: &str) -> &'a Entry {
    entries
        .iter()
        .find(|e| e.name.to_str().unwrap() == name)
        .unwrap_or_else(|| panic!("no tensor `{name}` in the fixture"))
}

/// BF16 values of `e` scaled by `factor` and shifted by a small position-dependent term
/// (still BF16): a weight change large enough to move every logit.
fn perturbed_bf16(e: &Entry, factor: f32) -> Entry {
    assert_eq!(e.dtype, DSV4_DTYPE_BF16);
    let data = e
        .data
        .chunks_exact(2)
        .enumerate()
        .flat_map(|(i, b)| {
            let v = half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            let w = v * factor + 0.01 * ((i % 7) as f32 - 3.0);
            half::bf16::from_f32(w).to_bits().to_le_bytes()
        })
        .collect();
    Entry { data, ..e.clone() }
}

/// Host-memory `dsv4_tensor` entries pointing into `entries` (valid while they live).
fn tensors(entries: &[Entry]) -> Vec<dsv4_tensor> {
    entries
        .iter()
        .map(|e| {
            let mut t = dsv4_tensor_default();
            t.name = e.name.as_ptr();
            t.dtype = e.dtype;
            t.ndim = e.shape.len() as i32;
            t.shape[..e.shape.len()].copy_from_slice(&e.shape);
            t.data = e.data.as_ptr().cast();
            t
        })
        .collect()
}

/// One forward step: tokens, positions, slots, query_start.
#[derive(Clone, Debug)]
struct Step {
    toks: Vec<i32>,
    pos: Vec<i32>,
    slots: Vec<i32>,
    qs: Vec<i32>,
}

impl Step {
    /// Sequences `(slot, first position, tokens)` batched together.
    fn of(seqs: &[(i32, i32, Vec<i32>)]) -> Step {
        let mut s = Step {
            toks: vec![],
            pos: vec![],
            slots: vec![],
            qs: vec![0],
        };
        for (slot, p0, toks) in seqs {
            s.slots.push(*slot);
            s.pos.extend((0..toks.len() as i32).map(|k| p0 + k));
            s.toks.extend(toks);
            s.qs.push(s.toks.len() as i32);
        }
        s
    }
}

fn tokens(seed: u64, n: usize) -> Vec<i32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 256) as i32
        })
        .collect()
}

/// The host's side of a CUDA engine: its stream and fixed device buffers for batches.
struct DeviceHost {
    ctx: Context,
    stream: OwnedStream,
    buf: Arena,
}

const MB: usize = 1 << 20;

impl DeviceHost {
    fn new() -> DeviceHost {
        let ctx = Context::retain(0).expect("context");
        let _g = ctx.enter().unwrap();
        let stream = OwnedStream::new(&ctx).expect("stream");
        let buf = Arena::new(&ctx, 24 * MB).expect("host buffers");
        DeviceHost { ctx, stream, buf }
    }

    /// Input array `i` (0..4) of batch buffer set `set`, and logits buffer `set`.
    fn part(&self, set: usize, i: usize) -> DevicePtr {
        self.buf
            .whole()
            .slice((set * 5 + i) * MB / 2, MB / 2)
            .unwrap()
    }

    fn logits(&self, set: usize) -> DevicePtr {
        self.buf
            .whole()
            .slice(8 * MB + set * 4 * MB, 4 * MB)
            .unwrap()
    }
}

/// An engine driven through the C ABI, on either backend.
struct Rig {
    e: *mut dsv4_engine,
    dev: i32,
    vocab: usize,
    host: Option<DeviceHost>,
}

#[derive(Clone, Copy, PartialEq)]
enum Load {
    Checkpoint,
    Dummy,
}

impl Rig {
    fn new(model: &str, dev: i32, load: Load, weight_format: i32, numerics: i32) -> Rig {
        Rig::build(model, dev, load, weight_format, numerics, &[])
    }

    /// The `tiny` model with weights as stored and official numerics (most tests).
    fn tiny(dev: i32, load: Load) -> Rig {
        Rig::new(
            "tiny",
            dev,
            load,
            DSV4_WEIGHT_FORMAT_AS_STORED,
            DSV4_NUMERICS_OFFICIAL,
        )
    }

    /// create -> load -> `overrides` through dsv4_load_tensor -> finalize.
    fn build(
        model: &str,
        dev: i32,
        load: Load,
        weight_format: i32,
        numerics: i32,
        overrides: &[Entry],
    ) -> Rig {
        let dir = CString::new(fixture_dir(model).to_str().unwrap()).unwrap();
        let mut p = dsv4_create_params_default();
        p.config_path = dir.as_ptr();
        p.device = dev;
        p.numerics = numerics;
        p.weight_format = weight_format;
        p.max_num_seqs = 4;
        p.max_num_tokens = 64;
        p.max_seq_len = 96;
        p.num_threads = 4;
        let mut e = std::ptr::null_mut();
        unsafe {
            ok(dsv4_create(&p, &mut e));
            match load {
                Load::Checkpoint => ok(dsv4_load(e, dir.as_ptr(), DSV4_LOAD_AUTO)),
                Load::Dummy => ok(dsv4_load(e, std::ptr::null(), DSV4_LOAD_DUMMY)),
            }
            for t in tensors(overrides) {
                ok(dsv4_load_tensor(e, &t));
            }
        }
        let host = (dev >= 0).then(DeviceHost::new);
        let mut r = Rig {
            e,
            dev,
            vocab: 256,
            host,
        };
        unsafe { ok(dsv4_finalize(e, r.stream())) };
        r.vocab = r.info().vocab_size as usize;
        r
    }

    fn stream(&self) -> *mut std::ffi::c_void {
        self.host
            .as_ref()
            .map_or(std::ptr::null_mut(), |h| h.stream.borrow().raw() as *mut _)
    }

    fn info(&self) -> dsv4_info {
        let mut i: dsv4_info = unsafe { std::mem::zeroed() };
        i.struct_size = std::mem::size_of::<dsv4_info>();
        unsafe { ok(dsv4_get_info(self.e, &mut i)) };
        i
    }

    fn descs(&self) -> Vec<dsv4_weight_desc> {
        let mut n = 0usize;
        unsafe { ok(dsv4_weight_count(self.e, &mut n)) };
        (0..n)
            .map(|i| {
                let mut w: dsv4_weight_desc = unsafe { std::mem::zeroed() };
                w.struct_size = std::mem::size_of::<dsv4_weight_desc>();
                unsafe { ok(dsv4_weight_info(self.e, i, &mut w)) };
                w
            })
            .collect()
    }

    /// Every address a host could have captured: weights, scales, derived tensors, the
    /// get_info spans.
    fn pointers(&self) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .descs()
            .iter()
            .flat_map(|d| {
                let n = unsafe { CStr::from_ptr(d.name) }
                    .to_string_lossy()
                    .into_owned();
                [
                    (n.clone(), d.data as u64),
                    (format!("{n} (scale)"), d.scale as u64),
                ]
            })
            .collect();
        let i = self.info();
        for (n, p, b) in [
            ("weights", i.weights_base, i.weights_nbytes),
            ("derived", i.derived_base, i.derived_nbytes),
            ("state", i.state_base, i.state_nbytes),
            ("workspace", i.workspace_base, i.workspace_nbytes),
        ] {
            v.push((format!("{n}_base"), p as u64));
            v.push((format!("{n}_nbytes"), b));
        }
        v
    }

    /// The bytes of storage `d` (host or device).
    fn read(&self, d: &dsv4_weight_desc) -> Vec<u8> {
        let mut out = vec![0u8; d.nbytes as usize];
        match &self.host {
            None => unsafe {
                std::ptr::copy_nonoverlapping(d.data as *const u8, out.as_mut_ptr(), out.len())
            },
            Some(h) => {
                let _g = h.ctx.enter().unwrap();
                let src = unsafe { DevicePtr::from_raw(d.data as u64, out.len()) };
                copy_to_host_sync(&mut out, src, h.stream.borrow()).unwrap();
            }
        }
        out
    }

    /// A batch over buffer set `set` (CUDA) or the step's host arrays (CPU).
    fn batch(&self, s: &Step, set: usize, host_logits: &mut [f32]) -> dsv4_batch {
        let mut b = dsv4_batch_default();
        b.num_tokens = s.toks.len() as i32;
        b.num_seqs = s.slots.len() as i32;
        b.num_logits = s.toks.len() as i32;
        b.logits_dtype = DSV4_LOGITS_F32;
        match &self.host {
            None => {
                b.token_ids = s.toks.as_ptr();
                b.positions = s.pos.as_ptr();
                b.seq_slots = s.slots.as_ptr();
                b.query_start = s.qs.as_ptr();
                b.logits = host_logits.as_mut_ptr().cast();
            }
            Some(h) => {
                let p = |i| h.part(set, i).addr() as *const i32;
                b.token_ids = p(0);
                b.positions = p(1);
                b.seq_slots = p(2);
                b.query_start = p(3);
                b.logits = h.logits(set).addr() as *mut _;
            }
        }
        b
    }

    /// CUDA: copies a step's arrays into buffer set `set` and poisons its logits (NaN).
    fn stage(&self, s: &Step, set: usize) {
        let h = self.host.as_ref().expect("CUDA rig");
        let _g = h.ctx.enter().unwrap();
        let st = h.stream.borrow();
        copy_to_device_sync(h.part(set, 0), &s.toks, st).unwrap();
        copy_to_device_sync(h.part(set, 1), &s.pos, st).unwrap();
        copy_to_device_sync(h.part(set, 2), &s.slots, st).unwrap();
        copy_to_device_sync(h.part(set, 3), &s.qs, st).unwrap();
        memset_async(h.logits(set), 0xFF, st).unwrap();
        st.synchronize().unwrap();
    }

    /// CUDA: the logits of buffer set `set` after the stream is done.
    fn fetch(&self, set: usize, rows: usize) -> Vec<f32> {
        let h = self.host.as_ref().expect("CUDA rig");
        let _g = h.ctx.enter().unwrap();
        let mut out = vec![f32::NAN; rows * self.vocab];
        copy_to_host_sync(&mut out, h.logits(set), h.stream.borrow()).unwrap();
        out
    }

    /// Eager forward; returns the logits of every token.
    fn try_forward(&self, s: &Step) -> (dsv4_status, Vec<f32>) {
        let mut host = vec![f32::NAN; s.toks.len() * self.vocab];
        if self.host.is_some() {
            self.stage(s, 0);
        }
        let b = self.batch(s, 0, &mut host);
        let st = unsafe { dsv4_forward(self.e, &b, self.stream()) };
        if self.host.is_some() && st == DSV4_STATUS_OK {
            host = self.fetch(0, s.toks.len());
        }
        (st, host)
    }

    fn forward(&self, s: &Step) -> Vec<f32> {
        let (st, out) = self.try_forward(s);
        ok(st);
        assert!(
            out.iter().all(|v| v.is_finite()),
            "non-finite logits (device {})",
            self.dev
        );
        out
    }

    /// Refit entries; with `device_memory`, every other entry is sent from device memory
    /// (CUDA only).
    fn try_refit(&self, entries: &[Entry], device_memory: bool) -> dsv4_status {
        let staging = match (&self.host, device_memory) {
            (Some(h), true) => {
                let _g = h.ctx.enter().unwrap();
                let total: usize = entries
                    .iter()
                    .map(|e| e.data.len().next_multiple_of(256))
                    .sum();
                Some(Arena::new(&h.ctx, total.max(256)).unwrap())
            }
            _ => None,
        };
        let mut ts = tensors(entries);
        // With device memory: every other entry is copied to the device and sent from there.
        if let (Some(a), Some(h)) = (&staging, &self.host) {
            let _g = h.ctx.enter().unwrap();
            let mut off = 0usize;
            for (t, e) in ts.iter_mut().zip(entries).skip(1).step_by(2) {
                let dst = a.whole().slice(off, e.data.len()).unwrap();
                copy_to_device_sync(dst, &e.data, h.stream.borrow()).unwrap();
                off += e.data.len().next_multiple_of(256);
                t.data = dst.addr() as *const _;
                t.memory = DSV4_MEMORY_DEVICE;
            }
        }
        unsafe { dsv4_refit(self.e, ts.as_ptr(), ts.len(), self.stream()) }
    }

    fn refit(&self, entries: &[Entry], device_memory: bool) {
        ok(self.try_refit(entries, device_memory));
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        unsafe { dsv4_destroy(self.e) };
    }
}

fn prefill() -> Step {
    Step::of(&[(0, 0, tokens(1, 13)), (1, 0, tokens(2, 9))])
}

// ------------------------------------------------------------------ pointers and derived

#[test]
fn derived_tensors_and_buffer_spans_are_reported() {
    for dev in devices() {
        let r = Rig::tiny(dev, Load::Checkpoint);
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
        // Every buffer lies inside its span; the spans do not overlap.
        let inside = |p: u64, n: u64, base: *mut std::ffi::c_void, bytes: u64| {
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
    let ck = checkpoint("tiny");
    for dev in devices() {
        let r = Rig::tiny(dev, Load::Checkpoint);
        let ptrs = r.pointers();
        let want = r.forward(&prefill());
        unsafe { ok(dsv4_finalize(r.e, r.stream())) };
        assert_eq!(
            bits(&r.forward(&prefill())),
            bits(&want),
            "device {dev}: second finalize"
        );
        for round in 0..2 {
            r.refit(&ck, dev >= 0);
            assert_eq!(
                bits(&r.forward(&prefill())),
                bits(&want),
                "device {dev}: refit #{round} with the loaded weights"
            );
        }
        assert_eq!(r.pointers(), ptrs, "device {dev}: a pointer moved");
    }
}

// ----------------------------------------------------------- refit rebuilds derived data

/// Refitting `changed` into a loaded engine gives exactly a fresh load with the change, and
/// the change is visible.
fn refit_equals_fresh_load(changed: &[Entry], what: &str) {
    for dev in devices() {
        let r = Rig::tiny(dev, Load::Checkpoint);
        let before = r.forward(&prefill());
        let ptrs = r.pointers();
        r.refit(changed, dev >= 0);
        let got = r.forward(&prefill());
        let want = Rig::build(
            "tiny",
            dev,
            Load::Checkpoint,
            DSV4_WEIGHT_FORMAT_AS_STORED,
            DSV4_NUMERICS_OFFICIAL,
            changed,
        )
        .forward(&prefill());
        assert_ne!(
            bits(&got),
            bits(&before),
            "device {dev}: {what} changed nothing"
        );
        assert_eq!(
            bits(&got),
            bits(&want),
            "device {dev}: {what} differs from a fresh load"
        );
        assert_eq!(r.pointers(), ptrs, "device {dev}: a pointer moved");
    }
}

#[test]
fn refit_of_layer0_hc_attn_fn_rebuilds_the_folded_weight() {
    let ck = checkpoint("tiny");
    let hc = perturbed_bf16(find(&ck, "model.layers.0.hc_attn_fn"), 1.5);
    refit_equals_fresh_load(&[hc], "refit of layers.0.hc_attn_fn");
}

#[test]
fn refit_of_one_expert_equals_a_fresh_load() {
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

#[test]
fn a_bad_entry_among_good_ones_changes_nothing() {
    let ck = checkpoint("tiny");
    let good = perturbed_bf16(find(&ck, "model.layers.1.attn.wq_a.weight"), 2.0);
    let mut bad = perturbed_bf16(find(&ck, "model.layers.1.attn.wkv.weight"), 2.0);
    // Wrong shape: one extra row (with the bytes for it, so only the shape is wrong).
    let row = bad.data.len() / bad.shape[0] as usize;
    bad.shape[0] += 1;
    bad.data.extend(vec![0u8; row]);
    for dev in devices() {
        let r = Rig::tiny(dev, Load::Checkpoint);
        let before = r.forward(&prefill());
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
        assert_eq!(bits(&r.forward(&prefill())), bits(&before), "device {dev}");
    }
}

// ---------------------------------------------------------------- dummy, then weight sync

/// The RL flow: dummy load -> finalize -> forward (finite) -> refit every weight -> equals a
/// normal load bit for bit.
fn dummy_then_sync(model: &str, weight_format: i32) {
    let ck = checkpoint(model);
    for dev in devices() {
        let what = format!("{model}, weight_format {weight_format}, device {dev}");
        let want = Rig::new(
            model,
            dev,
            Load::Checkpoint,
            weight_format,
            DSV4_NUMERICS_OFFICIAL,
        )
        .forward(&prefill());
        let r = Rig::new(
            model,
            dev,
            Load::Dummy,
            weight_format,
            DSV4_NUMERICS_OFFICIAL,
        );
        let ptrs = r.pointers();
        let dummy = r.forward(&prefill());
        r.refit(&ck, dev >= 0);
        let got = r.forward(&prefill());
        assert_ne!(bits(&dummy), bits(&got), "{what}");
        assert_eq!(
            bits(&got),
            bits(&want),
            "{what}: differs from a normal load"
        );
        assert_eq!(r.pointers(), ptrs, "{what}: a pointer moved");
    }
}

#[test]
fn dummy_then_sync_bf16_source_under_quantize() {
    dummy_then_sync("tiny", DSV4_WEIGHT_FORMAT_QUANTIZE);
}

#[test]
fn dummy_then_sync_stored_format_fp8_fp4() {
    dummy_then_sync("tiny_fp8", DSV4_WEIGHT_FORMAT_AS_STORED);
}

#[test]
fn stored_format_refit_needs_its_scale_in_the_same_call() {
    let ck = checkpoint("tiny_fp8");
    let w = find(&ck, "layers.0.attn.wq_a.weight").clone();
    let s = find(&ck, "layers.0.attn.wq_a.scale").clone();
    let r = Rig::new(
        "tiny_fp8",
        -1,
        Load::Checkpoint,
        DSV4_WEIGHT_FORMAT_AS_STORED,
        DSV4_NUMERICS_OFFICIAL,
    );
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
    let ck = checkpoint("tiny_fp8");
    let w = find(&ck, "layers.0.attn.wq_a.weight").clone();
    let s = find(&ck, "layers.0.attn.wq_a.scale").clone();
    let e1 = find(&ck, "layers.0.ffn.experts.0.w1.weight").clone();
    let e1s = find(&ck, "layers.0.ffn.experts.0.w1.scale").clone();
    let r = Rig::new(
        "tiny_fp8",
        -1,
        Load::Checkpoint,
        DSV4_WEIGHT_FORMAT_AS_STORED,
        DSV4_NUMERICS_OFFICIAL,
    );
    let before = r.forward(&prefill());
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
    assert_eq!(bits(&r.forward(&prefill())), bits(&before));
    r.refit(&[e1s, e1, s, w], false);
    assert_eq!(bits(&r.forward(&prefill())), bits(&before));
}

// --------------------------------------------------------------------- CUDA graph capture

/// Captures one forward of `s` (staged into buffer set `set`) on `r`'s stream.
fn capture(r: &Rig, steps: &[(&Step, usize)]) -> Graph {
    let h = r.host.as_ref().unwrap();
    let _g = h.ctx.enter().unwrap();
    for (s, set) in steps {
        r.stage(s, *set);
    }
    let mut scratch = vec![];
    let batches: Vec<dsv4_batch> = steps
        .iter()
        .map(|(s, set)| r.batch(s, *set, &mut scratch))
        .collect();
    Graph::capture(h.stream.borrow(), || {
        for b in &batches {
            let st = unsafe { dsv4_forward(r.e, b, r.stream()) };
            if st != DSV4_STATUS_OK {
                return Err(dsv4::Error::new(dsv4::Status::Cuda, last_error()));
            }
        }
        Ok(())
    })
    .expect("capture")
}

fn replay(r: &Rig, g: &Graph, sets: &[(usize, usize)]) -> Vec<Vec<f32>> {
    let h = r.host.as_ref().unwrap();
    let _g = h.ctx.enter().unwrap();
    for &(set, _) in sets {
        memset_async(h.logits(set), 0xFF, h.stream.borrow()).unwrap();
    }
    g.launch(h.stream.borrow()).unwrap();
    h.stream.borrow().synchronize().unwrap();
    sets.iter().map(|&(set, rows)| r.fetch(set, rows)).collect()
}

/// Restages new contents into buffer sets without touching the graph.
fn restage(r: &Rig, steps: &[(&Step, usize)]) {
    for (s, set) in steps {
        r.stage(s, *set);
    }
}

#[test]
fn captured_decode_and_prefill_replay_equal_eager() {
    if !gpu() {
        return;
    }
    let eager = Rig::tiny(0, Load::Checkpoint);
    let cap = Rig::tiny(0, Load::Checkpoint);
    let p = prefill();
    assert_eq!(bits(&eager.forward(&p)), bits(&cap.forward(&p)));

    // Decode: one token for each of the two sequences.
    let d1 = Step::of(&[(0, 13, tokens(3, 1)), (1, 9, tokens(4, 1))]);
    let g = capture(&cap, &[(&d1, 1)]);
    let want = eager.forward(&d1);
    assert_eq!(
        bits(&replay(&cap, &g, &[(1, 2)])[0]),
        bits(&want),
        "decode replay"
    );
    // New contents (next position, other tokens), same graph.
    for k in 0..3 {
        let dk = Step::of(&[
            (0, 14 + k, tokens(10 + k as u64, 1)),
            (1, 10 + k, tokens(20 + k as u64, 1)),
        ]);
        restage(&cap, &[(&dk, 1)]);
        let want = eager.forward(&dk);
        assert_eq!(
            bits(&replay(&cap, &g, &[(1, 2)])[0]),
            bits(&want),
            "decode replay {k}"
        );
    }

    // A prefill chunk (positions from 0 restart the slots inside the graph).
    let p2 = Step::of(&[(2, 0, tokens(5, 11)), (3, 0, tokens(6, 7))]);
    let g2 = capture(&cap, &[(&p2, 2)]);
    let want = eager.forward(&p2);
    assert_eq!(
        bits(&replay(&cap, &g2, &[(2, 18)])[0]),
        bits(&want),
        "prefill replay"
    );
    let p3 = Step::of(&[(2, 0, tokens(7, 11)), (3, 0, tokens(8, 7))]);
    restage(&cap, &[(&p3, 2)]);
    let want = eager.forward(&p3);
    assert_eq!(
        bits(&replay(&cap, &g2, &[(2, 18)])[0]),
        bits(&want),
        "prefill replay, new tokens"
    );
}

#[test]
fn old_graph_replays_with_refit_weights() {
    if !gpu() {
        return;
    }
    let ck = checkpoint("tiny");
    let r = Rig::tiny(0, Load::Dummy);
    let p = prefill();
    let d = Step::of(&[(0, 13, tokens(3, 1)), (1, 9, tokens(4, 1))]);
    // One graph holding a prefill (restarting both slots) and a decode step.
    let g = capture(&r, &[(&p, 0), (&d, 1)]);
    let before = replay(&r, &g, &[(0, 22), (1, 2)]);
    let ptrs = r.pointers();

    // Chunked sync of the real weights, half of them from device memory.
    unsafe { ok(dsv4_refit_begin(r.e)) };
    let half = ck.len() / 2;
    r.refit(&ck[..half], true);
    r.refit(&ck[half..], true);
    unsafe { ok(dsv4_refit_end(r.e, r.stream())) };
    assert_eq!(r.pointers(), ptrs, "a pointer moved during the refit");

    let after = replay(&r, &g, &[(0, 22), (1, 2)]);
    let fresh = Rig::tiny(0, Load::Checkpoint);
    let want_p = fresh.forward(&p);
    let want_d = fresh.forward(&d);
    assert_ne!(bits(&before[0]), bits(&after[0]));
    assert_eq!(
        bits(&after[0]),
        bits(&want_p),
        "old graph prefill vs fresh engine"
    );
    assert_eq!(
        bits(&after[1]),
        bits(&want_d),
        "old graph decode vs fresh engine"
    );
}

// ------------------------------------------------------------------------------- soak

/// 2,000 random forward / refit / release calls on a CUDA engine, each mirrored on a CPU
/// engine created with the same weights: outputs equal bit for bit at every step, no error,
/// and device free memory is unchanged at the end.
#[test]
fn soak_of_interleaved_forward_refit_release() {
    if !gpu() {
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
    let g = Rig::tiny(0, Load::Checkpoint);
    let m = Rig::tiny(-1, Load::Checkpoint);
    let ctx = &g.host.as_ref().unwrap().ctx;
    // Warm up (first forward may load lazily) before the memory baseline.
    g.forward(&prefill());
    m.forward(&prefill());
    let free0 = ctx.mem_info().unwrap().0;
    let mut len = [0i32; 4];
    len[0] = 13;
    len[1] = 9;
    let mut rng = 0x5EED_u64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
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
                let a = g.forward(&st);
                let b = m.forward(&st);
                assert_eq!(bits(&a), bits(&b), "op {op}: forward {st:?}");
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
