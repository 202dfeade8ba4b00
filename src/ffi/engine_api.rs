//! The exported functions of the C ABI (except the log callback, in `logging.rs`).
//!
//! Each export is a thin shell: `ffi_boundary` (panic boundary + last error), pointer and
//! enum validation naming the culprit, conversion to Rust types, one call into
//! [`Engine`]. No model logic lives here, and nothing here may panic across the boundary.

use std::ffi::{CString, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

use crate::engine::DeviceBatch;
use crate::engine::{Batch, Engine, LogitsOut, NameKind, TensorUpdate};
use crate::error::{Error, Result, Status};
use crate::ffi::params::*;
use crate::ffi::status::*;
use crate::weights::qmatrix::{FP4_BLOCK, QFormat};
use crate::weights::table::{StorageKind, TableEntry};

/// ABI major version: bumped on any incompatible change. A host must refuse a library
/// whose major differs from the header's.
pub const DSV4_ABI_VERSION_MAJOR: u32 = 1;
/// ABI minor version: bumped when functions, enum values or trailing struct fields are
/// added. A host built against minor M works with any library of the same major and
/// minor >= M.
pub const DSV4_ABI_VERSION_MINOR: u32 = 4;

/// An engine: one model's weights, per-slot decode state and workspaces. Opaque; create
/// with `dsv4_create`, free with `dsv4_destroy`.
pub struct dsv4_engine {
    engine: Engine,
    /// NUL-terminated weight names handed out by `dsv4_weight_info` (valid until destroy).
    names: Vec<CString>,
    /// Set when a call that modifies the engine panicked or reported INTERNAL: its state is
    /// unknown, so every later modifying call on it fails with INTERNAL.
    poisoned: Option<String>,
}

impl dsv4_engine {
    fn new(engine: Engine) -> Self {
        // Source weights, then derived tensors (both lists are fixed at create).
        let names = engine
            .weights()
            .entries()
            .iter()
            .map(|t| t.spec.name.clone())
            .chain(engine.derived_tensors().into_iter().map(|d| d.name))
            .map(|n| CString::new(n.replace('\0', "?")).unwrap_or_default())
            .collect();
        dsv4_engine {
            engine,
            names,
            poisoned: None,
        }
    }

    /// Runs a call that modifies the engine; a panic or an INTERNAL error poisons it.
    fn run_mut<R>(&mut self, f: impl FnOnce(&mut Engine) -> Result<R>) -> Result<R> {
        if let Some(why) = &self.poisoned {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "the engine is unusable after an earlier internal error ({why}); destroy it"
                ),
            ));
        }
        match catch_unwind(AssertUnwindSafe(|| f(&mut self.engine))) {
            Ok(Err(e)) if e.status == Status::Internal => {
                self.poisoned = Some(e.message.clone());
                Err(e)
            }
            Ok(r) => r,
            Err(p) => {
                let msg = format!("internal error (panic): {}", panic_message(&*p));
                self.poisoned = Some(msg.clone());
                Err(Error::new(Status::Internal, msg))
            }
        }
    }
}

/// # Safety
/// A non-NULL `p` must come from `dsv4_create` and not be destroyed or used concurrently.
unsafe fn engine_mut<'a>(p: *mut dsv4_engine) -> Result<&'a mut dsv4_engine> {
    // SAFETY: forwarded.
    unsafe { non_null_mut(p, "engine") }
}

/// # Safety
/// A non-NULL `p` must come from `dsv4_create` and not be destroyed.
unsafe fn engine_ref<'a>(p: *const dsv4_engine) -> Result<&'a dsv4_engine> {
    // SAFETY: forwarded.
    unsafe { non_null(p, "engine") }
}

fn usize_to_i32(v: usize) -> i32 {
    i32::try_from(v).unwrap_or(i32::MAX)
}

// ---------------------------------------------------------------------------------------
// Versions, errors

/// Run-time ABI version of the loaded library: `(major << 16) | minor`.
/// Compare with DSV4_ABI_VERSION_MAJOR / _MINOR of the header (same major, library
/// minor >= header minor). Thread-safe; never fails.
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_abi_version() -> u32 {
    (DSV4_ABI_VERSION_MAJOR << 16) | DSV4_ABI_VERSION_MINOR
}

/// Human-readable library version, e.g. "dsv4 0.1.0 (abi 1.1)". Static storage: never
/// free it. Thread-safe; never fails.
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_version_string() -> *const c_char {
    const V: &str = concat!("dsv4 ", env!("CARGO_PKG_VERSION"), " (abi 1.4)\0");
    const _: () = assert!(
        DSV4_ABI_VERSION_MAJOR == 1 && DSV4_ABI_VERSION_MINOR == 4,
        "update the version string"
    );
    V.as_ptr().cast()
}

/// Message of the most recent status-returning dsv4 call on the calling thread: it names
/// the argument, field, tensor or file at fault; "" if that call succeeded (every
/// status-returning call clears it on entry). Never NULL. Owned by the library: do not
/// free; valid until the next dsv4 call on this thread. Thread-local, so concurrent
/// threads never see each other's errors.
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_last_error() -> *const c_char {
    infallible("dsv4_last_error", c"".as_ptr(), last_error_ptr)
}

/// Static name of a status code without the prefix ("OK", "INVALID_ARGUMENT", ...;
/// "UNKNOWN" for values this library does not define). Never NULL; never free it.
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_status_name(status: dsv4_status) -> *const c_char {
    status_cname(status).as_ptr()
}

// ---------------------------------------------------------------------------------------
// Struct initializers

/// Default `dsv4_create_params`: struct_size set; no config source chosen (set exactly one
/// of config_path, config_json, use_tiny_default); device = DSV4_DEVICE_CPU;
/// max_num_seqs = 8; max_num_tokens = 512; max_seq_len = 4096; num_threads = 0 (all
/// cores); numerics = DSV4_NUMERICS_OFFICIAL; weight_format = DSV4_WEIGHT_FORMAT_AS_STORED;
/// cache_dir = NULL (default location).
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_create_params_default() -> dsv4_create_params {
    create_params_default()
}

/// Default `dsv4_tensor`: struct_size set, name/data NULL, DSV4_DTYPE_F32, ndim 0,
/// DSV4_MEMORY_HOST.
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_tensor_default() -> dsv4_tensor {
    tensor_default()
}

/// Default `dsv4_batch`: struct_size set, counts 0, pointers NULL, DSV4_LOGITS_F32.
#[unsafe(no_mangle)]
pub extern "C" fn dsv4_batch_default() -> dsv4_batch {
    batch_default()
}

// ---------------------------------------------------------------------------------------
// Lifecycle

/// Creates an engine: parses the model config, picks the backend (params->device) and
/// allocates every buffer at its final address (weights, per-slot state for
/// max_num_seqs x max_seq_len, workspaces for max_num_tokens).
///
/// `params` is read during the call only. On success `*out` receives a new engine in phase
/// DSV4_PHASE_CREATED, owned by the caller and freed with dsv4_destroy. On failure
/// `*out` is set to NULL (if `out` is not NULL) and nothing is allocated.
///
/// Errors: NULL_POINTER (`params`, `out`), INVALID_ARGUMENT (struct_size, no or several
/// config sources, a field out of range, a bad enum), IO (config file unreadable), CONFIG
/// (malformed JSON or an invalid config field, named in the message), CAPACITY (allocation
/// failed), NO_DEVICE / CUDA / UNSUPPORTED (device >= 0 not usable).
///
/// # Safety
/// `params` must point to a dsv4_create_params whose strings are NUL-terminated or NULL;
/// `out` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_create(
    params: *const dsv4_create_params,
    out: *mut *mut dsv4_engine,
) -> dsv4_status {
    ffi_boundary("dsv4_create", || {
        if out.is_null() {
            return Err(null_error("out"));
        }
        // SAFETY: `out` is non-NULL and writable per the contract.
        unsafe { out.write_unaligned(ptr::null_mut()) };
        // SAFETY: per the contract.
        let p = unsafe { read_versioned(params, "params")? };
        // SAFETY: per the contract.
        let args = unsafe { create_args(&p)? };
        let engine = Engine::create(args.source, args.options)?;
        let handle = Box::into_raw(Box::new(dsv4_engine::new(engine)));
        // SAFETY: as above.
        unsafe { out.write_unaligned(handle) };
        Ok(())
    })
}

/// The memory an engine created with `params` would use, by kind (since ABI 1.3): see
/// `dsv4_memory_plan`. It reads the config and checks the params exactly as dsv4_create
/// does, and allocates nothing (no weights, no device memory; CUDA needs no device: the
/// plan is the same on any GPU). After dsv4_create with the same params, dsv4_get_info
/// reports the same figures.
///
/// Errors: those of dsv4_create's checks (NULL_POINTER, INVALID_ARGUMENT, CONFIG, IO), and
/// NULL_POINTER for `out`.
///
/// # Safety
/// As dsv4_create; `out` writable with `out->struct_size` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_plan_memory(
    params: *const dsv4_create_params,
    out: *mut dsv4_memory_plan,
) -> dsv4_status {
    ffi_boundary("dsv4_plan_memory", || {
        if out.is_null() {
            return Err(null_error("out"));
        }
        // SAFETY: per the contract.
        let p = unsafe { read_versioned(params, "params")? };
        // SAFETY: per the contract.
        let args = unsafe { create_args(&p)? };
        let m = Engine::plan_memory(&args.source, &args.options)?;
        let plan = dsv4_memory_plan {
            struct_size: 0, // restored to the caller's value by write_versioned
            weights_nbytes: m.weights,
            derived_nbytes: m.derived,
            state_nbytes: m.state,
            state_slot_nbytes: m.state_per_slot,
            workspace_nbytes: m.workspace,
            device_nbytes: m.device,
            host_nbytes: m.host,
        };
        // SAFETY: per the contract.
        unsafe { write_versioned(out, "out", plan) }
    })
}

/// Frees an engine and everything it owns. NULL is a no-op. The handle and every pointer
/// obtained from it (weight names, weight data) are invalid afterwards. Must not race with
/// any other call on the same engine. Never fails.
///
/// # Safety
/// `engine` must be NULL or come from dsv4_create and not be destroyed already.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_destroy(engine: *mut dsv4_engine) {
    if engine.is_null() {
        return;
    }
    infallible("dsv4_destroy", (), || {
        // SAFETY: `engine` came from Box::into_raw in dsv4_create.
        drop(unsafe { Box::from_raw(engine) });
    })
}

/// Loads every weight. `format`: DSV4_LOAD_AUTO or DSV4_LOAD_SAFETENSORS read the
/// checkpoint at `source` (a directory with a sharded index or one .safetensors file, or a
/// single file); DSV4_LOAD_DUMMY fills deterministic small values and ignores `source`
/// (may be NULL). Allowed in phases CREATED and LOADED (a second load overwrites);
/// success moves the engine to DSV4_PHASE_LOADED. Call dsv4_finalize next.
///
/// Errors: NULL_POINTER (`engine`; `source` for a checkpoint format), INVALID_ARGUMENT
/// (bad `format`), STATE (after dsv4_finalize), IO / FORMAT (file problems), TENSOR
/// (an unknown, missing or mis-shaped tensor, named). After a failure the engine keeps
/// its phase but weights may be partly overwritten: load again before finalizing.
///
/// # Safety
/// `engine` from dsv4_create; `source` NULL or NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_load(
    engine: *mut dsv4_engine,
    source: *const c_char,
    format: i32,
) -> dsv4_status {
    ffi_boundary("dsv4_load", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        let format = load_format_from_i32(format, "format")?;
        // SAFETY: per the contract.
        let source = unsafe { opt_cstr(source) };
        let path = match (source, format) {
            (_, crate::engine::LoadFormat::Dummy) => None,
            (None, _) => {
                return Err(Error::new(
                    Status::NullPointer,
                    "`source` is NULL but DSV4_LOAD_AUTO / DSV4_LOAD_SAFETENSORS need a checkpoint path",
                ));
            }
            (Some(s), _) if s.is_empty() => return Err(invalid("`source` is an empty string")),
            (Some(s), _) => Some(path_of(s)),
        };
        h.run_mut(|e| e.load(path.as_deref(), format))
    })
}

/// Loads one named weight (streaming hosts) from host memory, or from device memory of the
/// engine's device (DSV4_MEMORY_DEVICE, CUDA backend: read on the legacy default stream):
/// validates the name, dtype and shape against the engine's table, converts to the storage
/// format and copies (device values on the device, without a host copy). Names may follow any
/// of the three naming schemes, like dsv4_refit's (dsv4_canonical_name maps a name to what it
/// stands for). Float / index values only: a stored-format weight needs its scale entry in
/// the same call, which dsv4_load_tensors (and dsv4_refit) take.
/// Allowed in phases CREATED and LOADED; when every weight has been given a value the
/// engine moves to DSV4_PHASE_LOADED. `tensor` and its data are read during the call only.
///
/// Errors: NULL_POINTER (`engine`, `tensor`, `tensor->name`, `tensor->data` with elements),
/// INVALID_ARGUMENT (struct_size, dtype, ndim, negative extent), UNSUPPORTED
/// (DSV4_MEMORY_DEVICE on the CPU backend), CUDA (device data unreadable), STATE (after
/// finalize), TENSOR (unknown name, wrong shape or dtype). On failure the weight is unchanged.
///
/// # Safety
/// `engine` from dsv4_create; `tensor` valid with `data` holding the described bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_load_tensor(
    engine: *mut dsv4_engine,
    tensor: *const dsv4_tensor,
) -> dsv4_status {
    ffi_boundary("dsv4_load_tensor", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        // SAFETY: per the contract.
        let t = unsafe { read_versioned(tensor, "tensor")? };
        let device = h.engine.options().device;
        // SAFETY: per the contract.
        let a = unsafe { tensor_args(&t, "tensor", device)? };
        let updates = updates_of(&h.engine, std::slice::from_ref(&a))?;
        h.run_mut(|e| e.load_tensor(&updates[0]))
    })
}

/// Since ABI 1.4. Loads named weights like dsv4_load_tensor, several in one call: `tensors`
/// is an array of `n` entries laid out as for dsv4_refit (stride = tensors[0].struct_size),
/// ALL validated before ANY is written. A weight in its stored format (F8_E4M3 / FP4_E2M1
/// codes) comes with its block-scale entry (`<weight>.scale` / `<weight>_scale_inv`, E8M0 or
/// F32) in the same call. Entries may be in host memory or (CUDA backend,
/// DSV4_MEMORY_DEVICE) device memory of the engine's device, read on `stream`: device values
/// never go through the host. Stored-format codes are copied device to device (scales
/// converted to the engine's f32), other values converted or quantized by kernels, bit for
/// bit as the host path; before anything is written a device pass checks that floats headed
/// for FP8/FP4 storage are finite and that hash-routing ids are in range, and the driver
/// confirms each device range lies inside one CUDA allocation. Host entries stream through
/// the bounded staging buffers (`staging_nbytes`). Allowed in phases CREATED and LOADED;
/// when every weight has a value the engine moves to DSV4_PHASE_LOADED. `n` = 0 writes
/// nothing.
///
/// Errors: NULL_POINTER (`engine`, `tensors` with n > 0, an entry's `name` / `data`),
/// INVALID_ARGUMENT (struct_size, dtype, ndim, extent; a weight named twice), UNSUPPORTED
/// (device memory on the CPU backend), CUDA (a device range outside its allocation), STATE
/// (after finalize), TENSOR (unknown name, wrong shape or dtype, a stored-format weight
/// without its scale or a scale without its weight, a non-finite value headed for FP8/FP4
/// storage, an expert id out of range: entry and weight named). On any of these nothing is
/// written.
///
/// # Safety
/// `engine` from dsv4_create; `tensors` NULL (n = 0) or `n` valid entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_load_tensors(
    engine: *mut dsv4_engine,
    tensors: *const dsv4_tensor,
    n: usize,
    stream: *mut c_void,
) -> dsv4_status {
    ffi_boundary("dsv4_load_tensors", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        // SAFETY: per the contract.
        let args = unsafe { tensor_array(tensors, n, h.engine.options().device)? };
        let updates = updates_of(&h.engine, &args)?;
        h.run_mut(|e| e.load_tensors(&updates, stream))
    })
}

/// Makes the engine runnable: rebuilds every derived tensor in place, compiles and loads
/// every kernel, warms up. Runs after every load format. Idempotent (a second call on a
/// READY engine returns OK). `stream`: the CUstream to work on (CUDA backend; NULL is the
/// legacy default stream); ignored by the CPU backend. Success moves the engine to
/// DSV4_PHASE_READY; from then on no weight or state address changes.
///
/// Errors: NULL_POINTER (`engine`), STATE (weights not all loaded: the first missing one
/// is named), CUDA. After a failure the engine stays in its phase.
///
/// # Safety
/// `engine` from dsv4_create.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_finalize(
    engine: *mut dsv4_engine,
    stream: *mut c_void,
) -> dsv4_status {
    ffi_boundary("dsv4_finalize", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        h.run_mut(|e| e.finalize_on(stream))
    })
}

/// Runs one batch (prefill, chunked prefill and decode are the same call) and writes the
/// logits of the requested rows into the caller's buffer. Only in DSV4_PHASE_READY.
/// Each sequence's tokens continue its slot's state at consecutive positions; position 0
/// starts a fresh sequence in that slot. A sequence whose slot is DSV4_PAD_SLOT (-1) is
/// padding: it reads and writes no state, its token ids must be in range but its positions
/// may be anything, and its logits rows are zeros. `stream`: the CUstream to launch on (CUDA
/// backend; NULL = the legacy default stream); ignored by the CPU backend.
///
/// The rules every batch value must follow, on every backend: token ids in [0, vocab_size);
/// seq_slots in [0, max_num_seqs) or DSV4_PAD_SLOT, no slot twice; query_start starting at 0,
/// strictly increasing, ending at num_tokens; a real sequence's positions in
/// [0, max_seq_len), consecutive, starting at 0 or at its slot's current length; logits_rows
/// in [0, num_tokens).
///
/// CPU backend: the arrays are host memory, read during the call; `batch->logits` is
/// written before it returns. A bad value is reported by the call itself (below), before any
/// state changes.
///
/// CUDA backend: the arrays are device memory and the call only enqueues work on `stream`:
/// they are read, and `batch->logits` written, when the stream reaches this forward, so they
/// must stay valid (and unchanged) until then; the logits are ready when work enqueued after
/// the call on `stream` may run (an event or a stream sync tells the host). The call never
/// syncs, so it cannot see the values: it checks only the counts and pointers listed below.
/// A value that breaks a rule is caught on the device: the batch changes no slot's state and
/// writes nothing outside `batch->logits`, whose rows are all NaN; the first such fault is
/// kept in a sticky device record that dsv4_device_error returns (and clears), and whose
/// address dsv4_get_info gives. No batch value can crash the host's CUDA context. The same
/// holds when a captured graph replays the call with new array contents.
///
/// Errors returned by the call (all detected before anything is enqueued or any state
/// changes): NULL_POINTER (`engine`, `batch`, an array with a nonzero count: named),
/// INVALID_ARGUMENT (struct_size, counts < 1, num_seqs > num_tokens, num_logits !=
/// num_tokens when logits_rows is NULL, bad logits_dtype; on the CPU backend also misaligned
/// arrays and every value rule above, naming the field and index), CAPACITY (num_tokens >
/// max_num_tokens, num_seqs > max_num_seqs, num_logits > max_num_tokens; on the CPU backend a
/// position >= max_seq_len), STATE (not finalized). After any of these the engine and every
/// slot are unchanged. A CUDA error mid-run leaves the batch's slots undefined (release
/// them); INTERNAL leaves the engine unusable (destroy it).
///
/// # Safety
/// `engine` from dsv4_create; `batch` valid, with each array holding the number of
/// int32 entries its count states and `logits` num_logits x vocab_size elements (CUDA: for as
/// long as the stream needs them, see above).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_forward(
    engine: *mut dsv4_engine,
    batch: *const dsv4_batch,
    stream: *mut c_void,
) -> dsv4_status {
    ffi_boundary("dsv4_forward", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        // SAFETY: per the contract.
        let b = unsafe { read_versioned(batch, "batch")? };
        let opts = h.engine.options();
        let vocab = h.engine.config().vocab_size;
        let (max_tokens, max_seqs) = (opts.max_num_tokens, opts.max_num_seqs);

        let count = |v: i32, what: &str, max: usize, max_name: &str| -> Result<usize> {
            if v < 1 {
                return Err(invalid(format!("`batch->{what}` = {v} must be >= 1")));
            }
            if v as usize > max {
                return Err(Error::new(
                    Status::Capacity,
                    format!(
                        "`batch->{what}` = {v} exceeds {max_name} = {max} (fixed at dsv4_create)"
                    ),
                ));
            }
            Ok(v as usize)
        };
        let t = count(b.num_tokens, "num_tokens", max_tokens, "max_num_tokens")?;
        let s = count(b.num_seqs, "num_seqs", max_seqs, "max_num_seqs")?;
        if b.num_logits < 0 {
            return Err(invalid(format!(
                "`batch->num_logits` = {} must be >= 0",
                b.num_logits
            )));
        }
        if b.num_logits as usize > max_tokens {
            return Err(Error::new(
                Status::Capacity,
                format!(
                    "`batch->num_logits` = {} exceeds max_num_tokens = {max_tokens}",
                    b.num_logits
                ),
            ));
        }
        let rows = b.num_logits as usize;
        if b.logits_rows.is_null() && rows != t {
            return Err(invalid(format!(
                "`batch->num_logits` = {rows} must equal batch->num_tokens = {t} when batch->logits_rows is NULL"
            )));
        }
        let logits_bf16 = match b.logits_dtype {
            DSV4_LOGITS_F32 => false,
            DSV4_LOGITS_BF16 => true,
            v => {
                return Err(invalid(format!(
                    "`batch->logits_dtype` = {v} is not DSV4_LOGITS_F32 (0) or DSV4_LOGITS_BF16 (1)"
                )));
            }
        };

        if h.engine.is_cuda() {
            // Device buffers: only counts and NULL checks here; the values are checked on the
            // device by the forward's first kernel (kernels/batch.cu).
            if s > t {
                return Err(invalid(format!(
                    "`batch->num_seqs` = {s} exceeds batch->num_tokens = {t}: every sequence needs at least one token"
                )));
            }
            let dev = |p: *const i32, n: usize, what: &str| -> Result<u64> {
                if n > 0 && p.is_null() {
                    return Err(Error::new(
                        Status::NullPointer,
                        format!("`batch->{what}` is NULL but holds {n} entries"),
                    ));
                }
                Ok(p as u64)
            };
            let db = DeviceBatch {
                num_tokens: t,
                num_seqs: s,
                token_ids: dev(b.token_ids, t, "token_ids")?,
                positions: dev(b.positions, t, "positions")?,
                seq_slots: dev(b.seq_slots, s, "seq_slots")?,
                query_start: dev(b.query_start, s + 1, "query_start")?,
                logits_rows: b.logits_rows as u64,
                num_logits: rows,
                logits: dev(b.logits as *const i32, rows, "logits")?,
                logits_bf16,
            };
            return h.run_mut(|e| e.forward_device(&db, stream));
        }
        // Host arrays -> slices, after NULL and alignment checks (slices must be valid).
        fn ints<'a>(p: *const i32, n: usize, what: &str) -> Result<&'a [i32]> {
            if n == 0 {
                return Ok(&[]);
            }
            if p.is_null() {
                return Err(Error::new(
                    Status::NullPointer,
                    format!("`batch->{what}` is NULL but holds {n} entries"),
                ));
            }
            if !p.is_aligned() {
                return Err(invalid(format!("`batch->{what}` is not 4-byte aligned")));
            }
            // SAFETY: the host promises `n` readable int32 values at `p` for the call.
            Ok(unsafe { std::slice::from_raw_parts(p, n) })
        }
        let token_ids = ints(b.token_ids, t, "token_ids")?;
        let positions = ints(b.positions, t, "positions")?;
        let seq_slots = ints(b.seq_slots, s, "seq_slots")?;
        let query_start = ints(b.query_start, s + 1, "query_start")?;
        let logits_rows = if b.logits_rows.is_null() {
            None
        } else {
            Some(ints(b.logits_rows, rows, "logits_rows")?)
        };
        let n_out = rows.checked_mul(vocab).ok_or_else(|| {
            invalid(format!(
                "`batch->num_logits` = {rows} x vocab_size overflows"
            ))
        })?;
        let logits = if n_out == 0 {
            if logits_bf16 {
                LogitsOut::Bf16(&mut [])
            } else {
                LogitsOut::F32(&mut [])
            }
        } else if b.logits.is_null() {
            return Err(Error::new(
                Status::NullPointer,
                format!(
                    "`batch->logits` is NULL but must hold num_logits x vocab_size = {rows} x {vocab} values"
                ),
            ));
        } else if logits_bf16 {
            let p = b.logits.cast::<u16>();
            if !p.is_aligned() {
                return Err(invalid("`batch->logits` is not 2-byte aligned (bf16)"));
            }
            // SAFETY: the host promises num_logits x vocab writable bf16 values.
            LogitsOut::Bf16(unsafe { std::slice::from_raw_parts_mut(p, n_out) })
        } else {
            let p = b.logits.cast::<f32>();
            if !p.is_aligned() {
                return Err(invalid("`batch->logits` is not 4-byte aligned (float)"));
            }
            // SAFETY: the host promises num_logits x vocab writable floats.
            LogitsOut::F32(unsafe { std::slice::from_raw_parts_mut(p, n_out) })
        };
        let mut batch = Batch {
            token_ids,
            positions,
            seq_slots,
            query_start,
            logits_rows,
            logits,
        };
        h.run_mut(|e| e.forward(&mut batch))
    })
}

/// Replaces named weights in place after finalize (RL weight sync): `tensors` is an array
/// of `n` entries (stride = tensors[0].struct_size; every entry must carry the same
/// struct_size), each naming one weight with its full new value. Names follow any of the
/// three naming schemes (upstream DeepSeek, transformers' save_pretrained, transformers'
/// native module paths including the fused `mlp.experts.gate_up_proj` / `down_proj`, which
/// update every expert of a layer); dsv4_canonical_name says what a name stands for. Values
/// are in host memory or (CUDA
/// backend, DSV4_MEMORY_DEVICE) device memory of the engine's device, read on `stream`
/// after the host's earlier work there. Values are F32/BF16/F16 (quantized on write when
/// the engine stores FP8/FP4), I32/I64 for index tables, or the stored format: F8_E4M3 or
/// FP4_E2M1 codes with their block-scale entry (`<weight>.scale` / `<weight>_scale_inv`,
/// any naming scheme, E8M0 or F32). In DSV4_PHASE_READY the scale must be in the SAME call.
/// Between dsv4_refit_begin and dsv4_refit_end the two may come in different calls, in
/// either order (buckets, or checkpoint shards that split a pair): the half that comes first
/// is validated as far as it can be alone (name, dtype, shape, or the scale's grid against
/// the weight) and the engine keeps a host copy of it until its partner arrives (the host
/// may free its buffer when the call returns); the pair is then validated and written as if
/// sent in one call. Held halves cost host memory until paired.
/// ALL entries are validated (name, dtype, shape, finite values when quantizing) before ANY
/// is written, so a bad entry leaves the engine unchanged, held halves included; then every
/// derived tensor depending on a touched weight is rebuilt (expert tables, layer 0's folded
/// mHC projection, RoPE tables). No device memory is allocated. Device-memory entries stay on
/// the device (as for dsv4_load_tensors: codes copied device to device, other values
/// converted or quantized by kernels, checked on the device before anything is written); host
/// entries stream through the bounded pinned staging (`staging_nbytes`). The one exception is
/// a chunked refit's half held for its partner, which is kept as a host copy.
/// Weight addresses do not change, so CUDA graphs captured before a refit replay with the
/// new values. In DSV4_PHASE_READY (derived buffers rebuilt now) or DSV4_PHASE_REFITTING
/// (rebuilt at dsv4_refit_end). `n` = 0 changes nothing.
/// `stream`: the CUstream to copy on (CUDA backend); ignored by the CPU backend.
///
/// Errors: NULL_POINTER (`engine`, `tensors` with n > 0, `tensors[k].name/data`),
/// INVALID_ARGUMENT (struct_size, a bad dtype/ndim/extent in `tensors[k]`, a weight named
/// twice or two scales of one weight, counting held halves: both named), UNSUPPORTED (device
/// memory on CPU), CUDA (device data unreadable), STATE (not finalized), TENSOR (unknown
/// name, wrong shape or dtype; in DSV4_PHASE_READY also a scale without its weight or a
/// stored-format weight without its scale: entry and weight named). On any of these nothing
/// is written and nothing is held.
///
/// # Safety
/// `engine` from dsv4_create; `tensors` NULL (n = 0) or `n` valid entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_refit(
    engine: *mut dsv4_engine,
    tensors: *const dsv4_tensor,
    n: usize,
    stream: *mut c_void,
) -> dsv4_status {
    ffi_boundary("dsv4_refit", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        // SAFETY: per the contract.
        let args = unsafe { tensor_array(tensors, n, h.engine.options().device)? };
        let updates = updates_of(&h.engine, &args)?;
        h.run_mut(|e| e.refit_on(&updates, stream))
    })
}

/// Reads the host's array of `n` entries (stride = tensors[0].struct_size, the same for every
/// entry) and checks each one's fields.
///
/// # Safety
/// `tensors` NULL (n = 0) or `n` valid entries.
unsafe fn tensor_array<'a>(
    tensors: *const dsv4_tensor,
    n: usize,
    device: i32,
) -> Result<Vec<TensorArgs<'a>>> {
    if n > 0 && tensors.is_null() {
        return Err(Error::new(
            Status::NullPointer,
            format!("`tensors` is NULL but n = {n}"),
        ));
    }
    let mut args = Vec::with_capacity(n.min(1 << 16));
    let mut stride = 0usize;
    for k in 0..n {
        let what = format!("tensors[{k}]");
        let p = if k == 0 {
            tensors
        } else {
            // SAFETY: entry k lies within the host's array (k < n, stride checked).
            unsafe { tensors.cast::<u8>().add(k * stride) }.cast::<dsv4_tensor>()
        };
        // SAFETY: per the contract.
        let t = unsafe { read_versioned(p, &what)? };
        if k == 0 {
            stride = t.struct_size;
            if stride
                .checked_mul(n)
                .is_none_or(|b| b > isize::MAX as usize)
            {
                return Err(invalid(format!(
                    "`n` = {n} entries of {stride} bytes overflow the address space"
                )));
            }
        } else if t.struct_size != stride {
            return Err(invalid(format!(
                "`{what}.struct_size` = {} differs from tensors[0].struct_size = {stride} (all entries share one layout)",
                t.struct_size
            )));
        }
        // SAFETY: per the contract.
        args.push(unsafe { tensor_args(&t, &what, device)? });
    }
    Ok(args)
}

/// The engine's view of validated entries: host bytes, or (CUDA backend) device memory that
/// the engine reads on the device. DSV4_MEMORY_DEVICE on the CPU backend is UNSUPPORTED,
/// naming the entry, before anything is validated or written.
fn updates_of<'a>(engine: &Engine, args: &'a [TensorArgs]) -> Result<Vec<TensorUpdate<'a>>> {
    use crate::weights::Bytes;
    args.iter()
        .map(|a| {
            let data = match a.data {
                TensorBytes::Host(h) => Bytes::Host(h),
                TensorBytes::Device { addr, nbytes } if engine.is_cuda() => Bytes::Device {
                    addr,
                    len: nbytes,
                },
                TensorBytes::Device { .. } => {
                    return Err(Error::new(
                        Status::Unsupported,
                        format!(
                            "device data of weight `{}`: DSV4_MEMORY_DEVICE on the CPU backend (it reads host memory only)",
                            a.name
                        ),
                    ));
                }
            };
            Ok(TensorUpdate {
                name: a.name,
                dtype: a.dtype,
                shape: &a.shape,
                data,
            })
        })
        .collect()
}

/// Opens a chunked refit (RL weight sync in pieces): after it, any number of dsv4_refit calls
/// (each all-or-nothing) write weights; dsv4_forward and dsv4_finalize are STATE errors until
/// dsv4_refit_end rebuilds the derived buffers once. A stored-format weight and its block
/// scale may come in different dsv4_refit calls of the refit, in either order (see
/// dsv4_refit). Moves DSV4_PHASE_READY to DSV4_PHASE_REFITTING. Allocates nothing.
///
/// Errors: NULL_POINTER (`engine`), STATE (not READY: not finalized, or a refit already open).
///
/// # Safety
/// `engine` from dsv4_create.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_refit_begin(engine: *mut dsv4_engine) -> dsv4_status {
    ffi_boundary("dsv4_refit_begin", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        h.run_mut(|e| e.refit_begin())
    })
}

/// Closes a chunked refit: rebuilds every derived buffer from the current weights (on
/// `stream` for the CUDA backend, waiting for it) and returns to DSV4_PHASE_READY. Weight
/// addresses do not change: graphs captured before the refit replay with the new weights.
///
/// Errors: NULL_POINTER (`engine`), STATE (no refit open), CUDA, TENSOR (a stored-format
/// weight sent without its scale, or a scale without its weight, is still waiting for its
/// partner: the message names every such entry). After TENSOR nothing has changed: the
/// engine stays in DSV4_PHASE_REFITTING with those entries held, so the host can send the
/// missing halves with dsv4_refit and call dsv4_refit_end again.
///
/// # Safety
/// `engine` from dsv4_create.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_refit_end(
    engine: *mut dsv4_engine,
    stream: *mut c_void,
) -> dsv4_status {
    ffi_boundary("dsv4_refit_end", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        h.run_mut(|e| e.refit_end(stream))
    })
}

/// Ends an open chunked refit without completing it (since ABI 1.3). What it leaves:
/// - the weights of every dsv4_refit chunk that succeeded since dsv4_refit_begin stay
///   written (a chunk is all-or-nothing, so each is either fully in or fully out);
/// - stored-format halves still held for their partner are dropped: never written;
/// - every derived buffer is rebuilt from the current weights (on `stream` for the CUDA
///   backend, waiting for it), as dsv4_refit_end does;
/// - the engine is in DSV4_PHASE_READY; no address changes.
///
/// Errors: NULL_POINTER (`engine`), STATE (no refit open), CUDA (the rebuild failed; the
/// engine stays REFITTING and abort may be called again).
///
/// # Safety
/// `engine` from dsv4_create.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_refit_abort(
    engine: *mut dsv4_engine,
    stream: *mut c_void,
) -> dsv4_status {
    ffi_boundary("dsv4_refit_abort", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        h.run_mut(|e| e.refit_abort(stream))
    })
}

/// Forgets the state of sequence slot `slot` (in [0, max_num_seqs)); its next sequence must
/// start at position 0 (a batch continuing it is bad). Allowed in every phase.
///
/// CUDA backend: it first waits for all work queued on the engine's device (forwards on any
/// stream may still read the slot), then clears the slot's length on the device with the
/// legacy default stream; it blocks the host until done, so it must not be called inside a
/// graph capture. (A sequence that simply starts again at position 0 needs no release.)
///
/// Errors: NULL_POINTER (`engine`), INVALID_ARGUMENT (slot out of range; nothing changes),
/// CUDA.
///
/// # Safety
/// `engine` from dsv4_create.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_release_slot(engine: *mut dsv4_engine, slot: i32) -> dsv4_status {
    ffi_boundary("dsv4_release_slot", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        let max = h.engine.options().max_num_seqs;
        if slot < 0 || slot as usize >= max {
            return Err(invalid(format!(
                "`slot` = {slot} is outside [0, max_num_seqs = {max})"
            )));
        }
        h.run_mut(|e| e.release_slot(slot as i64))
    })
}

/// Maps a tensor name that dsv4_load_tensor and dsv4_refit accept to what it stands for in
/// this engine's model (since ABI 1.3). Every entry point that takes tensor names accepts all
/// three naming schemes (upstream DeepSeek `layers.0.attn.wq_a.weight`; transformers'
/// `save_pretrained` default, `model.`-prefixed; transformers' native module paths such as
/// `model.layers.0.self_attn.q_a_proj.weight`, including the fused experts
/// `mlp.experts.gate_up_proj` / `down_proj`), and block-scale companions (`.scale`,
/// `.weight_scale_inv`). `*kind` gets DSV4_NAME_*; `out` the canonical name (the weight's for a
/// scale; the `layers.L.ffn.experts` prefix for fused experts; `name` itself for a skipped MTP
/// tensor), NUL-terminated, as much of it as fits in `out_size` bytes; `*out_len` its length
/// without the NUL. `out` may be NULL with `out_size` 0 to ask for the length.
///
/// Errors: NULL_POINTER (`engine`, `name`, `kind`, `out_len`, or `out` with `out_size` > 0),
/// INVALID_ARGUMENT (`name` not UTF-8), TENSOR (no scheme knows `name`, or the model has no
/// such weight: the message names it), CAPACITY (`out_size` < `*out_len` + 1; `*out_len` and
/// `*kind` are set, `out` holds the truncated, NUL-terminated prefix).
///
/// # Safety
/// `engine` from dsv4_create; `name` NUL-terminated; `out` writable for `out_size` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_canonical_name(
    engine: *const dsv4_engine,
    name: *const c_char,
    out: *mut c_char,
    out_size: usize,
    out_len: *mut usize,
    kind: *mut i32,
) -> dsv4_status {
    ffi_boundary("dsv4_canonical_name", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_ref(engine)? };
        if name.is_null() {
            return Err(null_error("name"));
        }
        if out_len.is_null() {
            return Err(null_error("out_len"));
        }
        if kind.is_null() {
            return Err(null_error("kind"));
        }
        if out.is_null() && out_size > 0 {
            return Err(null_error("out"));
        }
        // SAFETY: non-NULL and NUL-terminated per the contract.
        let name = utf8(unsafe { std::ffi::CStr::from_ptr(name) }, "name")?;
        let (k, canonical) = h.engine.canonical_name(name)?;
        let code = match k {
            NameKind::Weight => DSV4_NAME_WEIGHT,
            NameKind::Scale => DSV4_NAME_SCALE,
            NameKind::FusedGateUp => DSV4_NAME_FUSED_GATE_UP,
            NameKind::FusedDown => DSV4_NAME_FUSED_DOWN,
            NameKind::Skipped => DSV4_NAME_SKIPPED,
        };
        let bytes = canonical.as_bytes();
        // SAFETY: non-NULL and writable per the contract; at most out_size bytes written.
        unsafe {
            out_len.write_unaligned(bytes.len());
            kind.write_unaligned(code);
            if out_size > 0 {
                let n = bytes.len().min(out_size - 1);
                std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), n);
                out.add(n).write(0);
            }
        }
        if out_size < bytes.len() + 1 {
            return Err(Error::new(
                Status::Capacity,
                format!(
                    "`out_size` = {out_size} holds not the canonical name of `{name}` ({} bytes with its NUL)",
                    bytes.len() + 1
                ),
            ));
        }
        Ok(())
    })
}

/// The number of positions sequence slot `slot` holds now (since ABI 1.3): the length its
/// next chunk continues from; 0 for a slot never used or released. Allowed in every phase.
///
/// CUDA backend: it reads the device's copy once the work enqueued on `stream` (the stream of
/// the forwards to account for; NULL = the legacy default stream) has run, so it blocks the
/// host and must not be called inside a graph capture. A bad batch leaves every length as
/// it was.
///
/// Errors: NULL_POINTER (`engine`, `out`), INVALID_ARGUMENT (slot out of range), CUDA.
///
/// # Safety
/// `engine` from dsv4_create; `out` writable; `stream` NULL or a CUstream of the engine's
/// device.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_slot_length(
    engine: *const dsv4_engine,
    slot: i32,
    stream: *mut c_void,
    out: *mut i32,
) -> dsv4_status {
    ffi_boundary("dsv4_slot_length", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_ref(engine)? };
        if out.is_null() {
            return Err(null_error("out"));
        }
        let max = h.engine.options().max_num_seqs;
        if slot < 0 || slot as usize >= max {
            return Err(invalid(format!(
                "`slot` = {slot} is outside [0, max_num_seqs = {max})"
            )));
        }
        let len = h.engine.slot_length(slot as i64, stream)?;
        // SAFETY: non-NULL and writable per the contract.
        unsafe { out.write_unaligned(usize_to_i32(len)) };
        Ok(())
    })
}

/// Returns and clears the first fault of a bad batch that a CUDA engine's forwards met since
/// the last call (DESIGN.md §3). On CUDA, dsv4_forward cannot read the batch's device arrays
/// without a sync, so it checks them on the device: a bad batch leaves every slot unchanged,
/// its logits rows are NaN, and its first fault lands in this sticky record.
///
/// Waits for everything enqueued on `stream` (the CUstream the forwards ran on; NULL = the
/// legacy default stream) to finish, so it is NOT for use inside a graph capture: to read the
/// record inside a graph, copy the 32 bytes at `dsv4_info.device_error` instead.
///
/// Returns DSV4_STATUS_OK when no fault is recorded (and always on the CPU backend, whose
/// dsv4_forward reports a bad batch itself). Otherwise returns the fault's status
/// (INVALID_ARGUMENT, or CAPACITY for a position >= max_seq_len), with dsv4_last_error()
/// naming the field, index and value as the CPU backend's message does. `out` (may be NULL)
/// receives the record, all zeros when there is none. Allowed in every phase.
///
/// Errors of the call itself: NULL_POINTER (`engine`), CUDA.
///
/// # Safety
/// `engine` from dsv4_create; `out` NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_device_error(
    engine: *mut dsv4_engine,
    stream: *mut c_void,
    out: *mut dsv4_batch_fault,
) -> dsv4_status {
    ffi_boundary("dsv4_device_error", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_mut(engine)? };
        if !out.is_null() {
            // SAFETY: writable per the contract.
            unsafe { out.write_unaligned(dsv4_batch_fault::default()) };
        }
        let fault = h.run_mut(|e| e.take_device_error(stream))?;
        match fault {
            None => Ok(()),
            Some(f) => {
                if !out.is_null() {
                    let r = f.to_record();
                    let rec = dsv4_batch_fault {
                        status: r[0],
                        field: r[1],
                        index: r[2],
                        value: r[3],
                        rule: r[4],
                        expected: r[5],
                        seq: r[6],
                        slot: r[7],
                    };
                    // SAFETY: writable per the contract.
                    unsafe { out.write_unaligned(rec) };
                }
                Err(f.to_error())
            }
        }
    })
}

// ---------------------------------------------------------------------------------------
// Introspection (read-only: safe to call concurrently with other read-only calls)

/// Fills `*out` with the model config and capacities in effect and the current phase.
/// The caller sets out->struct_size = sizeof(dsv4_info) first; it is left unchanged, as
/// are bytes past this library's layout. Allowed in every phase.
///
/// Errors: NULL_POINTER (`engine`, `out`), INVALID_ARGUMENT (out->struct_size too small;
/// `*out` untouched).
///
/// # Safety
/// `engine` from dsv4_create; `out` writable for out->struct_size bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_get_info(
    engine: *const dsv4_engine,
    out: *mut dsv4_info,
) -> dsv4_status {
    ffi_boundary("dsv4_get_info", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_ref(engine)? };
        let (c, o) = (h.engine.config(), h.engine.options());
        let spans = h.engine.buffer_spans();
        let mem = h.engine.memory();
        let info = dsv4_info {
            struct_size: 0, // restored to the caller's value by write_versioned
            vocab_size: usize_to_i32(c.vocab_size),
            hidden_size: usize_to_i32(c.hidden_size),
            num_layers: usize_to_i32(c.num_layers),
            num_heads: usize_to_i32(c.num_heads),
            head_dim: usize_to_i32(c.head_dim),
            hc_mult: usize_to_i32(c.hc_mult),
            n_routed_experts: usize_to_i32(c.n_routed_experts),
            experts_per_tok: usize_to_i32(c.experts_per_tok),
            max_num_seqs: usize_to_i32(o.max_num_seqs),
            max_num_tokens: usize_to_i32(o.max_num_tokens),
            max_seq_len: usize_to_i32(o.max_seq_len),
            device: o.device,
            numerics: numerics_to_i32(o.numerics),
            weight_format: weight_format_to_i32(o.weight_format),
            phase: phase_to_i32(h.engine.phase()),
            num_weights: h.names.len(),
            weights_base: spans.weights.0 as *const c_void,
            weights_nbytes: mem.weights,
            derived_base: spans.derived.0 as *const c_void,
            derived_nbytes: mem.derived,
            state_base: spans.state.0 as *const c_void,
            state_nbytes: mem.state,
            workspace_base: spans.workspace.0 as *const c_void,
            workspace_nbytes: mem.workspace,
            device_error: spans.device_error.0 as *const c_void,
            bos_token_id: c.bos_token_id,
            eos_token_id: c.eos_token_id,
            state_slot_nbytes: mem.state_per_slot,
            device_nbytes: mem.device,
            host_nbytes: mem.host,
            host_transient_nbytes: h.engine.transient_host_bytes(),
        };
        // SAFETY: per the contract.
        unsafe { write_versioned(out, "out", info) }
    })
}

/// Writes the number of weights (sources and derived) to `*out`. Allowed in every phase.
///
/// Errors: NULL_POINTER (`engine`, `out`).
///
/// # Safety
/// `engine` from dsv4_create; `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_weight_count(
    engine: *const dsv4_engine,
    out: *mut usize,
) -> dsv4_status {
    ffi_boundary("dsv4_weight_count", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_ref(engine)? };
        if out.is_null() {
            return Err(null_error("out"));
        }
        // SAFETY: non-NULL and writable per the contract.
        unsafe { out.write_unaligned(h.names.len()) };
        Ok(())
    })
}

/// A weight's storage as the ABI reports it.
struct Storage {
    dtype: i32,
    nbytes: u64,
    scale: *const c_void,
    scale_nbytes: u64,
    scale_block: [i32; 2],
}

fn storage_of(t: &TableEntry) -> Storage {
    let l = t.layout;
    let plain = |dtype| Storage {
        dtype,
        nbytes: l.data_bytes as u64,
        scale: std::ptr::null_mut(),
        scale_nbytes: 0,
        scale_block: [0, 0],
    };
    match l.kind {
        StorageKind::F32 => plain(DSV4_DTYPE_F32),
        StorageKind::Bf16 => plain(DSV4_DTYPE_BF16),
        StorageKind::I32 => plain(DSV4_DTYPE_I32),
        StorageKind::Quant(q) => {
            let (dtype, block) = match q {
                QFormat::Fp8 { block } => (DSV4_DTYPE_F8_E4M3, [block[0] as i32, block[1] as i32]),
                QFormat::Fp4 => (DSV4_DTYPE_FP4_E2M1, [1, FP4_BLOCK as i32]),
            };
            Storage {
                dtype,
                nbytes: l.data_bytes as u64,
                // The backend's address (dsv4_weight_info sets it from weight_addr).
                scale: std::ptr::null_mut(),
                scale_nbytes: 4 * l.scales as u64,
                scale_block: block,
            }
        }
    }
}

/// The descriptor of a derived tensor (no scale).
fn derived_desc(
    name: *const c_char,
    d: &crate::engine::DerivedTensor,
    device: i32,
) -> dsv4_weight_desc {
    use crate::engine::Elem;
    let mut shape = [0i64; DSV4_MAX_DIMS];
    for (dst, &x) in shape.iter_mut().zip(&d.shape) {
        *dst = x as i64;
    }
    dsv4_weight_desc {
        struct_size: 0, // restored to the caller's value by write_versioned
        name,
        dtype: match d.dtype {
            Elem::F32 => DSV4_DTYPE_F32,
            Elem::F64 => DSV4_DTYPE_F64,
            Elem::I32 => DSV4_DTYPE_I32,
            // Device addresses as 8-byte integers; no derived tensor is raw bytes (U8 is the
            // memory plan's weight storage), reported as I32 words if one ever were.
            Elem::U64 => DSV4_DTYPE_I64,
            Elem::U8 => DSV4_DTYPE_I32,
            Elem::Bf16 => DSV4_DTYPE_BF16,
            Elem::F16 => DSV4_DTYPE_F16,
        },
        ndim: d.shape.len().min(DSV4_MAX_DIMS) as i32,
        shape,
        data: d.addr as *const c_void,
        nbytes: d.nbytes as u64,
        derived: 1,
        device,
        scale: std::ptr::null_mut(),
        scale_nbytes: 0,
        scale_block: [0, 0],
    }
}

/// Describes weight `index` (in [0, dsv4_weight_count)): name, storage dtype and shape,
/// storage address (fixed from create to destroy, so hosts can check pointer stability),
/// byte size, derived flag, and where it lives. The caller sets out->struct_size =
/// sizeof(dsv4_weight_desc) first. `out->name` is owned by the engine and valid until
/// dsv4_destroy. Allowed in every phase (values are meaningful after load).
///
/// Errors: NULL_POINTER (`engine`, `out`), INVALID_ARGUMENT (index out of range,
/// out->struct_size too small; `*out` untouched).
///
/// # Safety
/// `engine` from dsv4_create; `out` writable for out->struct_size bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dsv4_weight_info(
    engine: *const dsv4_engine,
    index: usize,
    out: *mut dsv4_weight_desc,
) -> dsv4_status {
    ffi_boundary("dsv4_weight_info", || {
        // SAFETY: per the contract.
        let h = unsafe { engine_ref(engine)? };
        let w = h.engine.weights();
        if index >= h.names.len() {
            return Err(invalid(format!(
                "`index` = {index} is outside [0, dsv4_weight_count = {})",
                h.names.len()
            )));
        }
        let device = h.engine.options().device; // -1: host memory; else the CUDA ordinal
        if index >= w.len() {
            // A derived tensor (listed after the source weights).
            let all = h.engine.derived_tensors();
            let d = all.get(index - w.len()).ok_or_else(|| {
                Error::new(Status::Internal, "derived tensor list changed since create")
            })?;
            return unsafe {
                write_versioned(out, "out", derived_desc(h.names[index].as_ptr(), d, device))
            };
        }
        let t = w.entry(index);
        if t.spec.shape.len() > DSV4_MAX_DIMS {
            return Err(Error::new(
                Status::Internal,
                format!(
                    "weight `{}` has {} dimensions (> DSV4_MAX_DIMS)",
                    t.spec.name,
                    t.spec.shape.len()
                ),
            ));
        }
        let mut shape = [0i64; DSV4_MAX_DIMS];
        for (dst, &d) in shape.iter_mut().zip(&t.spec.shape) {
            *dst = d as i64;
        }
        let mut st = storage_of(t);
        // The backend's copy: the host store on the CPU, the device arena on CUDA (both in
        // the table's storage layout).
        let addr = h.engine.weight_addr(index);
        let data = addr.data as *const c_void;
        if addr.scales != 0 {
            st.scale = addr.scales as *const c_void;
        }
        let info = dsv4_weight_desc {
            struct_size: 0, // restored to the caller's value by write_versioned
            name: h.names[index].as_ptr(),
            dtype: st.dtype,
            ndim: t.spec.shape.len() as i32,
            shape,
            data,
            nbytes: st.nbytes,
            derived: 0,
            device,
            scale: st.scale,
            scale_nbytes: st.scale_nbytes,
            scale_block: st.scale_block,
        };
        // SAFETY: per the contract.
        unsafe { write_versioned(out, "out", info) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{ConfigSource, EngineOptions};

    fn handle() -> dsv4_engine {
        let opts = EngineOptions {
            max_num_seqs: 1,
            max_num_tokens: 4,
            max_seq_len: 8,
            ..EngineOptions::default()
        };
        dsv4_engine::new(Engine::create(ConfigSource::TinyDefault, opts).expect("tiny engine"))
    }

    #[test]
    fn panic_in_a_modifying_call_poisons_the_engine() {
        let mut h = handle();
        let e = h
            .run_mut(|_| -> Result<()> { panic!("boom in forward") })
            .unwrap_err();
        assert_eq!(e.status, Status::Internal);
        assert!(e.message.contains("boom in forward"), "{}", e.message);
        let e = h.run_mut(|_| Ok(())).unwrap_err();
        assert_eq!(e.status, Status::Internal);
        assert!(
            e.message.contains("unusable") && e.message.contains("boom in forward"),
            "{}",
            e.message
        );
    }

    #[test]
    fn internal_error_poisons_other_errors_do_not() {
        let mut h = handle();
        let e = h
            .run_mut(|_| -> Result<()> { Err(Error::new(Status::State, "wrong phase")) })
            .unwrap_err();
        assert_eq!(e.status, Status::State);
        assert!(h.run_mut(|_| Ok(())).is_ok());
        let _ = h.run_mut(|_| -> Result<()> { Err(Error::new(Status::Internal, "table broken")) });
        assert!(
            h.run_mut(|_| Ok(()))
                .unwrap_err()
                .message
                .contains("table broken")
        );
    }
}
