//! The C ABI seen from a test: the last error, status checks, `dsv4_get_info`, and fixture
//! checkpoints as the `dsv4_tensor` entries a host would send to `dsv4_load_tensor` /
//! `dsv4_refit`.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

use dsv4::ffi::*;
use safetensors::SafeTensors;

use super::fixture_dir;

/// The calling thread's last error text.
pub fn last_error() -> String {
    // SAFETY: dsv4_last_error never returns NULL and the text is NUL-terminated.
    unsafe { CStr::from_ptr(dsv4_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// The name of a status (`DSV4_STATUS_...`).
pub fn status_name(s: dsv4_status) -> String {
    // SAFETY: static NUL-terminated string.
    unsafe { CStr::from_ptr(dsv4_status_name(s)) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts `s` is OK (the message shows the last error).
#[track_caller]
pub fn ok(s: dsv4_status) {
    assert_eq!(s, DSV4_STATUS_OK, "{}", last_error());
}

/// Asserts `got` is `want` and the last error mentions every needle; a success must leave
/// the last error empty, a failure must leave a message.
#[track_caller]
pub fn check(got: dsv4_status, want: dsv4_status, needles: &[&str]) {
    let msg = last_error();
    assert_eq!(
        got,
        want,
        "status {} (want {}), message: {msg}",
        status_name(got),
        status_name(want)
    );
    if want == DSV4_STATUS_OK {
        assert_eq!(msg, "", "a successful call leaves dsv4_last_error empty");
        return;
    }
    assert!(!msg.is_empty(), "failure without a message");
    for n in needles {
        assert!(msg.contains(n), "message does not name `{n}`: {msg}");
    }
}

/// Asserts `s` is OK and the last error is empty; `what` names the call.
#[track_caller]
pub fn ok_clean(s: dsv4_status, what: &str) {
    let name = status_name(s);
    assert_eq!(s, DSV4_STATUS_OK, "{what}: {name}: {}", last_error());
    assert_eq!(
        last_error(),
        "",
        "{what}: success leaves the last error empty"
    );
}

/// Asserts `s` is `status` and the last error mentions every one of `words`.
#[track_caller]
pub fn fails(s: dsv4_status, status: dsv4_status, words: &[&str]) {
    let msg = last_error();
    assert_eq!(s, status, "{msg}");
    for w in words {
        assert!(msg.contains(w), "`{w}` not in: {msg}");
    }
}

/// `dsv4_get_info` of `e` (asserted OK).
pub fn info(e: *mut dsv4_engine) -> dsv4_info {
    // SAFETY: a zeroed dsv4_info is valid; struct_size says how much the library may write.
    let mut i: dsv4_info = unsafe { std::mem::zeroed() };
    i.struct_size = std::mem::size_of::<dsv4_info>();
    // SAFETY: `e` is a live engine of the caller's; `i` is a valid out pointer.
    unsafe { ok(dsv4_get_info(e, &mut i)) };
    i
}

/// One checkpoint tensor as a refit entry, in the dtype a host would send: BF16/F32/I64 as
/// stored, F8_E4M3 codes, E8M0 scales, packed FP4 (I8 [r, c/2] sent with the logical shape
/// [r, c]).
#[derive(Clone)]
pub struct Entry {
    pub name: CString,
    pub dtype: i32,
    pub shape: Vec<i64>,
    pub data: Vec<u8>,
}

impl Entry {
    pub fn name(&self) -> &str {
        self.name.to_str().unwrap()
    }

    /// The same tensor under another name (another naming scheme of the same weight).
    pub fn renamed(&self, name: &str) -> Entry {
        Entry {
            name: CString::new(name).unwrap(),
            ..self.clone()
        }
    }
}

/// The checkpoint shards of `dir`: every `*.safetensors` but the oracles, sorted by name.
pub fn shard_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_str().unwrap();
            n.ends_with(".safetensors")
                && !n.starts_with("oracle")
                && !n.starts_with("quant_reference")
        })
        .collect();
    files.sort();
    files
}

/// The tensors of one safetensors file, in the file's order, as a host reading it would
/// send them.
pub fn shard_entries(path: &Path) -> Vec<Entry> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, t)| {
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
                d => panic!("unexpected dtype {d:?} in {}", path.display()),
            };
            Entry {
                name: CString::new(name).unwrap(),
                dtype,
                shape,
                data: t.data().to_vec(),
            }
        })
        .collect()
}

/// Every tensor of a fixture checkpoint: the shards in name order, each in its file order.
pub fn checkpoint_file_order(model: &str) -> Vec<Entry> {
    shard_files(&fixture_dir(model))
        .iter()
        .flat_map(|f| shard_entries(f))
        .collect()
}

pub fn find<'a>(entries: &'a [Entry], name: &str) -> &'a Entry {
    entries
        .iter()
        .find(|e| e.name() == name)
        .unwrap_or_else(|| panic!("no tensor `{name}` in the fixture"))
}

/// Host-memory `dsv4_tensor` entries pointing into `entries` (valid while they live).
pub fn tensors(entries: &[Entry]) -> Vec<dsv4_tensor> {
    entries
        .iter()
        .map(|e| {
            let mut t = dsv4_tensor_default();
            t.name = e.name.as_ptr();
            t.dtype = e.dtype;
            t.ndim = e.shape.len() as i32;
            t.shape[..e.shape.len()].copy_from_slice(&e.shape);
            t.data = e.data.as_ptr().cast();
            t.memory = DSV4_MEMORY_HOST;
            t
        })
        .collect()
}

/// BF16 values of `e` scaled by `factor` and shifted by a small position-dependent term
/// (still BF16): a weight change large enough to move every logit.
pub fn perturbed_bf16(e: &Entry, factor: f32) -> Entry {
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

/// One forward of `toks` as one sequence in slot 0 from position 0, every row's f32 logits
/// (`vocab` per row) into a NaN-poisoned buffer: the status and the logits.
pub fn forward_one_sequence(
    e: *mut dsv4_engine,
    toks: &[i32],
    vocab: usize,
) -> (dsv4_status, Vec<f32>) {
    let pos: Vec<i32> = (0..toks.len() as i32).collect();
    let (slots, qs) = ([0i32], [0, toks.len() as i32]);
    let mut out = vec![f32::NAN; toks.len() * vocab];
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
    // SAFETY: `e` is a live engine; the batch points into the arrays above, alive for the call.
    let s = unsafe { dsv4_forward(e, &b, std::ptr::null_mut()) };
    (s, out)
}
