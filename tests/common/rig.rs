//! An engine driven through the C ABI on either backend, the way a host drives it: on the
//! CPU reference (`dev` = -1) a batch points at host arrays; on a CUDA device the host
//! stages its arrays into fixed device buffers of its own (several buffer sets, so one graph
//! may hold several batches), forwards on its own stream and copies the logits back.
//!
//! The helper every backend-neutral test uses: build a [`Step`] from host slices
//! ([`Step::of`], [`Step::from_slices`]) and call [`Rig::forward`] / [`Rig::try_forward`]:
//! host logits back, whatever the backend. Logits buffers are poisoned (the rig's `poison`
//! byte) before every forward and replay.

use std::ffi::{CStr, CString, c_void};

use dsv4::cuda::arena::{copy_to_device_sync, copy_to_host_sync, memset_async};
use dsv4::cuda::graph::Graph;
use dsv4::cuda::{Arena, Context, DevicePtr, OwnedStream};
use dsv4::ffi::*;

use super::abi::{Entry, last_error, ok, ok_clean, tensors};
use super::fixture_dir;

pub const MB: usize = 1 << 20;

/// A forward batch's host arrays. Counts: num_tokens = toks.len(), num_seqs = slots.len(),
/// num_logits = rows.len() (or num_tokens without rows).
#[derive(Clone, Debug)]
pub struct Step {
    pub toks: Vec<i32>,
    pub pos: Vec<i32>,
    pub slots: Vec<i32>,
    pub qs: Vec<i32>,
    pub rows: Option<Vec<i32>>,
}

impl Step {
    /// Sequences `(slot, first position, tokens)` batched together, every row's logits.
    pub fn of(seqs: &[(i32, i32, Vec<i32>)]) -> Step {
        let mut s = Step {
            toks: vec![],
            pos: vec![],
            slots: vec![],
            qs: vec![0],
            rows: None,
        };
        for (slot, p0, toks) in seqs {
            s.slots.push(*slot);
            s.pos
                .extend((0..toks.len() as i32).map(|k| p0.wrapping_add(k)));
            s.toks.extend(toks);
            s.qs.push(s.toks.len() as i32);
        }
        s
    }

    /// A step of the given host arrays, as they are (nothing is checked here).
    pub fn from_slices(
        toks: &[i32],
        pos: &[i32],
        slots: &[i32],
        qs: &[i32],
        rows: Option<&[i32]>,
    ) -> Step {
        Step {
            toks: toks.to_vec(),
            pos: pos.to_vec(),
            slots: slots.to_vec(),
            qs: qs.to_vec(),
            rows: rows.map(|r| r.to_vec()),
        }
    }

    /// The step as an engine-API batch writing f32 logits into `out`.
    pub fn batch<'a>(&'a self, out: &'a mut [f32]) -> dsv4::Batch<'a> {
        dsv4::Batch {
            token_ids: &self.toks,
            positions: &self.pos,
            seq_slots: &self.slots,
            query_start: &self.qs,
            logits_rows: self.rows.as_deref(),
            logits: dsv4::LogitsOut::F32(out),
        }
    }

    pub fn num_logits(&self) -> usize {
        self.rows.as_ref().map_or(self.toks.len(), |r| r.len())
    }

    /// The token row of each logits row.
    pub fn logits_token_rows(&self) -> Vec<usize> {
        match &self.rows {
            Some(r) => r.iter().map(|&x| x as usize).collect(),
            None => (0..self.toks.len()).collect(),
        }
    }
}

/// The host's side of a CUDA engine: its context, its stream and fixed device buffers for
/// batches: buffer set `set` (0..3) holds five input arrays of MB/2 bytes each and a 4 MB
/// logits buffer.
pub struct DeviceHost {
    pub ctx: Context,
    pub stream: OwnedStream,
    pub buf: Arena,
}

impl DeviceHost {
    pub fn new(dev: i32) -> DeviceHost {
        let ctx = Context::retain(dev).expect("context");
        let _g = ctx.enter().unwrap();
        let stream = OwnedStream::new(&ctx).expect("stream");
        let buf = Arena::new(&ctx, 24 * MB).expect("host buffers");
        DeviceHost { ctx, stream, buf }
    }

    /// Input array `i` of buffer set `set`: 0 tokens, 1 positions, 2 slots, 3 query_start,
    /// 4 logits_rows.
    pub fn part(&self, set: usize, i: usize) -> DevicePtr {
        assert!(set < 3 && i < 5, "buffer set {set}, array {i}");
        self.buf
            .whole()
            .slice((set * 5 + i) * MB / 2, MB / 2)
            .unwrap()
    }

    /// The logits buffer of set `set`.
    pub fn logits(&self, set: usize) -> DevicePtr {
        self.buf
            .whole()
            .slice(8 * MB + set * 4 * MB, 4 * MB)
            .unwrap()
    }

    /// Copies the arrays of `s` into buffer set `set` and fills its logits with `poison`
    /// bytes.
    pub fn stage(&self, s: &Step, set: usize, poison: u8) {
        let _g = self.ctx.enter().unwrap();
        let st = self.stream.borrow();
        copy_to_device_sync(self.part(set, 0), &s.toks, st).unwrap();
        copy_to_device_sync(self.part(set, 1), &s.pos, st).unwrap();
        copy_to_device_sync(self.part(set, 2), &s.slots, st).unwrap();
        copy_to_device_sync(self.part(set, 3), &s.qs, st).unwrap();
        if let Some(r) = &s.rows {
            copy_to_device_sync(self.part(set, 4), r, st).unwrap();
        }
        memset_async(self.logits(set), poison, st).unwrap();
        st.synchronize().unwrap();
    }

    /// `n` floats of the logits of set `set`, after the stream is done.
    pub fn fetch(&self, set: usize, n: usize) -> Vec<f32> {
        let _g = self.ctx.enter().unwrap();
        let mut out = vec![f32::NAN; n];
        copy_to_host_sync(&mut out, self.logits(set), self.stream.borrow()).unwrap();
        out
    }

    /// A driver operation of the host's own: allocate, copy a pattern through the device,
    /// read it back, free. Fails if the context was poisoned.
    pub fn context_is_healthy(&self) {
        let _g = self.ctx.enter().unwrap();
        let a = Arena::new(&self.ctx, 4096).expect("cuMemAlloc after a bad batch");
        let pattern: Vec<u32> = (0..1024).map(|i| i * 2654435761u32).collect();
        copy_to_device_sync(a.whole(), &pattern, self.stream.borrow()).expect("copy in");
        let mut back = vec![0u32; 1024];
        copy_to_host_sync(&mut back, a.whole(), self.stream.borrow()).expect("copy out");
        assert_eq!(back, pattern, "the device returned other bytes");
        self.stream.borrow().synchronize().unwrap();
    }
}

/// dsv4_refit's and dsv4_load_tensors' signature.
pub type EntriesCall =
    unsafe extern "C" fn(*mut dsv4_engine, *const dsv4_tensor, usize, *mut c_void) -> dsv4_status;

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Load {
    /// The fixture's own checkpoint (DSV4_LOAD_AUTO).
    Checkpoint,
    /// DSV4_LOAD_DUMMY.
    Dummy,
    /// Every tensor of the fixture's checkpoint in ONE dsv4_load_tensors call (stored-format
    /// weights with their scales); with `device_memory` every other entry is sent from device
    /// memory (CUDA only).
    Tensors { device_memory: bool },
}

/// How a [`Rig`] is created.
#[derive(Clone, Debug)]
pub struct RigOptions {
    /// Fixture directory name (its config.json, and its checkpoint for `Load::Checkpoint`).
    pub model: String,
    /// -1 (CPU reference) or a CUDA ordinal.
    pub dev: i32,
    pub load: Load,
    /// `dsv4_create_params.weight_format`; None leaves the default.
    pub weight_format: Option<i32>,
    pub numerics: i32,
    pub max_num_seqs: i32,
    pub max_num_tokens: i32,
    pub max_seq_len: i32,
    pub num_threads: i32,
    /// The byte logits buffers are filled with before each forward and replay.
    pub poison: u8,
    /// Every successful call must also leave `dsv4_last_error` empty.
    pub strict: bool,
    /// The CUDA kernel set (None: the default for the numerics).
    pub kernel_set: Option<&'static str>,
}

impl RigOptions {
    /// `model` on `dev`: its checkpoint, official numerics, 4 slots, 64 tokens, 96
    /// positions, 4 threads, NaN (0xFF) poison.
    pub fn new(model: &str, dev: i32) -> RigOptions {
        RigOptions {
            model: model.into(),
            dev,
            load: Load::Checkpoint,
            weight_format: None,
            numerics: DSV4_NUMERICS_OFFICIAL,
            max_num_seqs: 4,
            max_num_tokens: 64,
            max_seq_len: 96,
            num_threads: 4,
            poison: 0xFF,
            strict: false,
            kernel_set: None,
        }
    }
}

/// An engine driven through the C ABI, on either backend; destroyed on drop.
pub struct Rig {
    pub e: *mut dsv4_engine,
    pub dev: i32,
    pub vocab: usize,
    /// The CUDA host side (None on the CPU).
    pub host: Option<DeviceHost>,
    pub poison: u8,
    pub strict: bool,
}

impl Rig {
    /// create -> load -> `overrides` through dsv4_load_tensor -> finalize (on the host's
    /// stream on CUDA).
    pub fn build(o: &RigOptions, overrides: &[Entry]) -> Rig {
        let dir = CString::new(fixture_dir(&o.model).to_str().unwrap()).unwrap();
        let mut p = dsv4_create_params_default();
        p.config_path = dir.as_ptr();
        p.device = o.dev;
        p.numerics = o.numerics;
        if let Some(f) = o.weight_format {
            p.weight_format = f;
        }
        p.max_num_seqs = o.max_num_seqs;
        p.max_num_tokens = o.max_num_tokens;
        p.max_seq_len = o.max_seq_len;
        p.num_threads = o.num_threads;
        let set = o.kernel_set.map(|k| CString::new(k).unwrap());
        if let Some(k) = &set {
            p.kernel_set = k.as_ptr();
        }
        let mut e = std::ptr::null_mut();
        let mut r = Rig {
            e,
            dev: o.dev,
            vocab: 0,
            host: None,
            poison: o.poison,
            strict: o.strict,
        };
        // SAFETY: valid params and out pointer; the strings outlive the calls.
        unsafe {
            r.check(dsv4_create(&p, &mut e), "dsv4_create");
            r.e = e;
            match o.load {
                Load::Checkpoint => {
                    r.check(dsv4_load(e, dir.as_ptr(), DSV4_LOAD_AUTO), "dsv4_load")
                }
                Load::Dummy => {
                    r.check(dsv4_load(e, std::ptr::null(), DSV4_LOAD_DUMMY), "dsv4_load")
                }
                Load::Tensors { device_memory } => {
                    r.host = (o.dev >= 0).then(|| DeviceHost::new(o.dev));
                    let entries = super::abi::checkpoint_file_order(&o.model);
                    let s = r.send(dsv4_load_tensors, &entries, device_memory);
                    r.check(s, "dsv4_load_tensors");
                }
            }
            for t in tensors(overrides) {
                r.check(dsv4_load_tensor(e, &t), "dsv4_load_tensor");
            }
        }
        if r.host.is_none() {
            r.host = (o.dev >= 0).then(|| DeviceHost::new(o.dev));
        }
        // SAFETY: live engine; the stream is the host's (or NULL on the CPU).
        unsafe { r.check(dsv4_finalize(e, r.stream()), "dsv4_finalize") };
        r.vocab = r.info().vocab_size as usize;
        r
    }

    /// Asserts a status is OK (and, when strict, that the last error is empty).
    #[track_caller]
    pub fn check(&self, s: dsv4_status, what: &str) {
        if self.strict {
            ok_clean(s, what);
        } else {
            ok(s);
        }
    }

    /// The host's stream on CUDA, NULL on the CPU.
    pub fn stream(&self) -> *mut c_void {
        self.host
            .as_ref()
            .map_or(std::ptr::null_mut(), |h| h.stream.borrow().raw() as *mut _)
    }

    pub fn info(&self) -> dsv4_info {
        // SAFETY: a zeroed dsv4_info is valid; struct_size says how much may be written.
        let mut i: dsv4_info = unsafe { std::mem::zeroed() };
        i.struct_size = std::mem::size_of::<dsv4_info>();
        // SAFETY: live engine, valid out pointer.
        unsafe { self.check(dsv4_get_info(self.e, &mut i), "dsv4_get_info") };
        i
    }

    /// Every weight's description (dsv4_weight_info), in index order.
    pub fn descs(&self) -> Vec<dsv4_weight_desc> {
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
    pub fn pointers(&self) -> Vec<(String, u64)> {
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
    pub fn read(&self, d: &dsv4_weight_desc) -> Vec<u8> {
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

    /// The batch struct of `s`: its host arrays and `host_logits` (CPU) or buffer set `set`
    /// (CUDA, staged separately).
    pub fn batch(&self, s: &Step, set: usize, host_logits: &mut [f32]) -> dsv4_batch {
        let mut b = dsv4_batch_default();
        b.num_tokens = s.toks.len() as i32;
        b.num_seqs = s.slots.len() as i32;
        b.num_logits = s.num_logits() as i32;
        b.logits_dtype = DSV4_LOGITS_F32;
        match &self.host {
            None => {
                b.token_ids = s.toks.as_ptr();
                b.positions = s.pos.as_ptr();
                b.seq_slots = s.slots.as_ptr();
                b.query_start = s.qs.as_ptr();
                b.logits_rows = s.rows.as_ref().map_or(std::ptr::null(), |r| r.as_ptr());
                b.logits = host_logits.as_mut_ptr().cast();
            }
            Some(h) => {
                let p = |i| h.part(set, i).addr() as *const i32;
                b.token_ids = p(0);
                b.positions = p(1);
                b.seq_slots = p(2);
                b.query_start = p(3);
                b.logits_rows = if s.rows.is_some() {
                    p(4)
                } else {
                    std::ptr::null()
                };
                b.logits = h.logits(set).addr() as *mut _;
            }
        }
        b
    }

    /// CUDA: copies a step's arrays into buffer set `set` and poisons its logits.
    pub fn stage(&self, s: &Step, set: usize) {
        self.host
            .as_ref()
            .expect("CUDA rig")
            .stage(s, set, self.poison);
    }

    /// CUDA: `rows` logits rows of buffer set `set` after the stream is done.
    pub fn fetch(&self, set: usize, rows: usize) -> Vec<f32> {
        let h = self.host.as_ref().expect("CUDA rig");
        h.fetch(set, rows * self.vocab)
    }

    /// Eager forward of `s` (staged into buffer set 0 on CUDA): the call's status and the
    /// logits, [num_logits, vocab] (the poison where nothing was written).
    pub fn try_forward(&self, s: &Step) -> (dsv4_status, Vec<f32>) {
        let poison = f32::from_bits(u32::from_ne_bytes([self.poison; 4]));
        let mut host = vec![poison; s.num_logits() * self.vocab];
        if self.host.is_some() {
            self.stage(s, 0);
        }
        let b = self.batch(s, 0, &mut host);
        // SAFETY: live engine; the batch points at live host arrays of the stated sizes (CPU)
        // or at the staged device buffers (CUDA).
        let st = unsafe { dsv4_forward(self.e, &b, self.stream()) };
        if self.host.is_some() {
            host = self.fetch(0, s.num_logits());
        }
        (st, host)
    }

    /// [`Rig::try_forward`], asserted OK.
    pub fn forward(&self, s: &Step) -> Vec<f32> {
        let (st, out) = self.try_forward(s);
        self.check(st, "dsv4_forward");
        out
    }

    /// [`Rig::forward`], and every logit finite.
    pub fn forward_finite(&self, s: &Step) -> Vec<f32> {
        let out = self.forward(s);
        assert!(
            out.iter().all(|v| v.is_finite()),
            "non-finite logits (device {})",
            self.dev
        );
        out
    }

    /// One forward from host slices on either backend: host logits back,
    /// [num_logits, vocab] (num_logits = rows.len(), or every token without rows).
    pub fn run(
        &self,
        toks: &[i32],
        pos: &[i32],
        slots: &[i32],
        qs: &[i32],
        rows: Option<&[i32]>,
    ) -> Vec<f32> {
        self.forward(&Step::from_slices(toks, pos, slots, qs, rows))
    }

    /// Refit entries; with `device_memory`, every other entry is sent from device memory
    /// (CUDA only).
    pub fn try_refit(&self, entries: &[Entry], device_memory: bool) -> dsv4_status {
        self.send(dsv4_refit, entries, device_memory)
    }

    /// Calls `f` (dsv4_refit or dsv4_load_tensors) with `entries` on the rig's stream; with
    /// `device_memory`, every other entry is copied to the device and sent from there.
    pub fn send(&self, f: EntriesCall, entries: &[Entry], device_memory: bool) -> dsv4_status {
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
        unsafe { f(self.e, ts.as_ptr(), ts.len(), self.stream()) }
    }

    pub fn refit(&self, entries: &[Entry], device_memory: bool) {
        ok(self.try_refit(entries, device_memory));
    }

    /// CUDA: stages each step into its buffer set and captures one graph of their forwards,
    /// in order, on the rig's stream (the graph reads the buffers when it replays).
    pub fn capture(&self, steps: &[(&Step, usize)]) -> Graph {
        let h = self.host.as_ref().expect("CUDA rig");
        for (s, set) in steps {
            self.stage(s, *set);
        }
        let _g = h.ctx.enter().unwrap();
        let mut scratch = vec![];
        let batches: Vec<dsv4_batch> = steps
            .iter()
            .map(|(s, set)| self.batch(s, *set, &mut scratch))
            .collect();
        Graph::capture(h.stream.borrow(), || {
            for b in &batches {
                let st = unsafe { dsv4_forward(self.e, b, self.stream()) };
                if st != DSV4_STATUS_OK {
                    return Err(dsv4::Error::new(dsv4::Status::Cuda, last_error()));
                }
            }
            Ok(())
        })
        .expect("capture")
    }

    /// CUDA: poisons the logits of `sets` (`(set, rows)`), replays `g`, and returns each
    /// set's logits rows.
    pub fn replay(&self, g: &Graph, sets: &[(usize, usize)]) -> Vec<Vec<f32>> {
        let h = self.host.as_ref().expect("CUDA rig");
        let _g = h.ctx.enter().unwrap();
        for &(set, _) in sets {
            memset_async(h.logits(set), self.poison, h.stream.borrow()).unwrap();
        }
        g.launch(h.stream.borrow()).unwrap();
        h.stream.borrow().synchronize().unwrap();
        sets.iter()
            .map(|&(set, rows)| self.fetch(set, rows))
            .collect()
    }

    /// dsv4_device_error: (status, record, message).
    pub fn device_error(&self) -> (dsv4_status, dsv4_batch_fault, String) {
        let mut rec = dsv4_batch_fault {
            status: -7,
            ..Default::default()
        };
        let st = unsafe { dsv4_device_error(self.e, self.stream(), &mut rec) };
        (st, rec, last_error())
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        // SAFETY: created by dsv4_create, destroyed once (NULL if create failed).
        unsafe { dsv4_destroy(self.e) };
    }
}
