//! Versioned `#[repr(C)]` structs of the ABI, their `*_default()` initializers, the integer
//! enums, and their conversion into the engine's Rust types.
//!
//! Every struct starts with `struct_size`. The library accepts any `struct_size >=` the
//! size it was built with (a newer host may append fields it does not know; they are
//! ignored on input and left untouched on output) and rejects a smaller one with
//! `DSV4_STATUS_INVALID_ARGUMENT`. Structs are read and written unaligned-safe, so
//! nothing here trusts the host's alignment. Enums cross as `int32_t` and are validated.

use std::ffi::{CStr, OsStr, c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::ptr;

use crate::engine::{
    ConfigSource, EngineOptions, KernelSetName, LoadFormat, Numerics, Phase, WeightFormat,
};
use crate::error::{Error, Result};
use crate::ffi::status::{invalid, null_error};
use crate::weights::HostDtype;

/// Maximum number of dimensions of a tensor crossing the ABI.
pub const DSV4_MAX_DIMS: usize = 8;

/// `device` value selecting the CPU reference backend.
pub const DSV4_DEVICE_CPU: i32 = -1;

/// `numerics`: no precision simulation (parity with transformers in fp32).
pub const DSV4_NUMERICS_EXACT: i32 = 0;
/// `numerics`: the official FP8/FP4 activation simulations (default).
pub const DSV4_NUMERICS_OFFICIAL: i32 = 1;

/// `weight_format`: keep weights in the checkpoint's format (default).
pub const DSV4_WEIGHT_FORMAT_AS_STORED: i32 = 0;
/// `weight_format`: hold weights as BF16.
pub const DSV4_WEIGHT_FORMAT_BF16: i32 = 1;
/// `weight_format`: quantize BF16 weights to FP8/FP4 on load and on refit.
pub const DSV4_WEIGHT_FORMAT_QUANTIZE: i32 = 2;

/// `dsv4_load` format: a safetensors checkpoint if `source` names one, else an error.
pub const DSV4_LOAD_AUTO: i32 = 0;
/// `dsv4_load` format: a safetensors checkpoint (directory with an index, or one file).
pub const DSV4_LOAD_SAFETENSORS: i32 = 1;
/// `dsv4_load` format: deterministic small dummy values; no file is read.
pub const DSV4_LOAD_DUMMY: i32 = 2;

/// Element type of tensor data: float32.
pub const DSV4_DTYPE_F32: i32 = 0;
/// Element type of tensor data: bfloat16.
pub const DSV4_DTYPE_BF16: i32 = 1;
/// Element type of tensor data: float16.
pub const DSV4_DTYPE_F16: i32 = 2;
/// Element type of tensor data: int32.
pub const DSV4_DTYPE_I32: i32 = 3;
/// Element type of tensor data: int64.
pub const DSV4_DTYPE_I64: i32 = 4;
/// FP8 e4m3fn codes, one byte each. `dsv4_weight_info` reports it with f32 block scales at
/// `scale`; a `dsv4_refit` entry of this dtype (a weight in its stored format) must come with
/// its block-scale entry (`<weight>.scale` or `<weight>_scale_inv`, DSV4_DTYPE_E8M0 or F32)
/// in the same call.
pub const DSV4_DTYPE_F8_E4M3: i32 = 5;
/// FP4 e2m1 codes, two per byte (low nibble = even column, bit 3 = sign). `shape` is the
/// logical shape (last dimension even); the data holds numel / 2 bytes. `dsv4_weight_info`
/// reports it with f32 1x32 block scales at `scale`; a `dsv4_refit` entry needs its scale
/// entry as for DSV4_DTYPE_F8_E4M3.
pub const DSV4_DTYPE_FP4_E2M1: i32 = 6;
/// UE8M0 block-scale bytes (value 2^(b - 127)), for the scale entries of stored-format
/// refits.
pub const DSV4_DTYPE_E8M0: i32 = 7;
/// float64: reported by `dsv4_weight_info` for derived tensors only.
pub const DSV4_DTYPE_F64: i32 = 8;

/// Tensor data lives in host memory.
pub const DSV4_MEMORY_HOST: i32 = 0;
/// Tensor data lives in CUDA device memory of the engine's device
/// (DSV4_STATUS_UNSUPPORTED on the CPU backend).
pub const DSV4_MEMORY_DEVICE: i32 = 1;

/// Logits output element type: float32.
pub const DSV4_LOGITS_F32: i32 = 0;
/// Logits output element type: bfloat16 (bit patterns, round to nearest even).
pub const DSV4_LOGITS_BF16: i32 = 1;

/// `seq_slots` value of a padding sequence: it reads and writes no slot state, its tokens
/// may be any ids in range and its positions any values, and its logits rows are written as
/// zeros. Hosts pad real batches up to the shapes of their captured graphs with it.
pub const DSV4_PAD_SLOT: i32 = -1;

/// Batch field of a fault (`dsv4_batch_fault.field`): `batch->token_ids`.
pub const DSV4_FIELD_TOKEN_IDS: i32 = 1;
/// `batch->positions`.
pub const DSV4_FIELD_POSITIONS: i32 = 2;
/// `batch->seq_slots`.
pub const DSV4_FIELD_SEQ_SLOTS: i32 = 3;
/// `batch->query_start`.
pub const DSV4_FIELD_QUERY_START: i32 = 4;
/// `batch->logits_rows`.
pub const DSV4_FIELD_LOGITS_ROWS: i32 = 5;

/// Rule a fault breaks (`dsv4_batch_fault.rule`): the value is outside [0, expected).
pub const DSV4_RULE_RANGE: i32 = 1;
/// The slot is already used by sequence `expected` of the same batch.
pub const DSV4_RULE_DUPLICATE: i32 = 2;
/// query_start[index] is not above query_start[index - 1] (= expected).
pub const DSV4_RULE_NOT_INCREASING: i32 = 3;
/// query_start[0] must be 0 and query_start[num_seqs] num_tokens (= expected).
pub const DSV4_RULE_ENDPOINT: i32 = 4;
/// A position is not the previous position + 1 (= expected).
pub const DSV4_RULE_NOT_CONSECUTIVE: i32 = 5;
/// A sequence's first position is neither 0 nor its slot's length (= expected).
pub const DSV4_RULE_NOT_CONTINUING: i32 = 6;

/// The first fault of a bad batch on a CUDA engine, as dsv4_device_error returns it. The
/// same 32 bytes live in device memory at `dsv4_info.device_error`, where a host may copy
/// them inside its own graph (status 0 = no fault recorded).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct dsv4_batch_fault {
    /// DSV4_STATUS_INVALID_ARGUMENT or DSV4_STATUS_CAPACITY (a position >= max_seq_len);
    /// DSV4_STATUS_OK when no fault is recorded.
    pub status: i32,
    /// DSV4_FIELD_*: the batch array holding the bad value.
    pub field: i32,
    /// Index into that array.
    pub index: i32,
    /// The value found there.
    pub value: i32,
    /// DSV4_RULE_*: the rule it breaks.
    pub rule: i32,
    /// The rule's bound or expected value (see DSV4_RULE_*).
    pub expected: i32,
    /// The sequence (index into seq_slots) the fault belongs to, or -1.
    pub seq: i32,
    /// seq_slots[seq] when seq >= 0.
    pub slot: i32,
}

/// Engine phase: created, weights not (all) loaded yet.
pub const DSV4_PHASE_CREATED: i32 = 0;
/// Engine phase: every weight has a value; dsv4_finalize not yet run.
pub const DSV4_PHASE_LOADED: i32 = 1;
/// Engine phase: finalized; dsv4_forward and dsv4_refit allowed.
pub const DSV4_PHASE_READY: i32 = 2;
/// Engine phase: between dsv4_refit_begin and dsv4_refit_end (refit allowed, forward not).
pub const DSV4_PHASE_REFITTING: i32 = 3;

/// What a tensor name accepted by dsv4_load_tensor / dsv4_refit stands for
/// (dsv4_canonical_name, since ABI 1.3): one weight, whose canonical name is returned ...
pub const DSV4_NAME_WEIGHT: i32 = 0;
/// ... the block scale of the weight whose canonical name is returned ...
pub const DSV4_NAME_SCALE: i32 = 1;
/// ... transformers' fused `mlp.experts.gate_up_proj` [E, 2I, D] of a layer: every expert's
/// w1 (rows 0..I) and w3 (rows I..2I); the returned prefix is `layers.L.ffn.experts` ...
pub const DSV4_NAME_FUSED_GATE_UP: i32 = 2;
/// ... transformers' fused `mlp.experts.down_proj` [E, D, I]: every expert's w2; the prefix is
/// returned likewise ...
pub const DSV4_NAME_FUSED_DOWN: i32 = 3;
/// ... or a multi-token-prediction tensor (`mtp.*`), which the engine skips; the name is
/// returned as given.
pub const DSV4_NAME_SKIPPED: i32 = 4;

const _: () = {
    assert!(DSV4_DTYPE_F32 == HostDtype::F32 as i32);
    assert!(DSV4_DTYPE_BF16 == HostDtype::Bf16 as i32);
    assert!(DSV4_DTYPE_F16 == HostDtype::F16 as i32);
    assert!(DSV4_DTYPE_I32 == HostDtype::I32 as i32);
    assert!(DSV4_DTYPE_I64 == HostDtype::I64 as i32);
};

/// Options of `dsv4_create`. Initialize with `dsv4_create_params_default()`, then set fields.
///
/// Exactly one model config source must be given: `config_path`, `config_json`, or
/// `use_tiny_default != 0`. Strings are borrowed for the duration of `dsv4_create` only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_create_params {
    /// sizeof(dsv4_create_params) as the host compiled it.
    pub struct_size: usize,
    /// A model directory holding config.json, or the path of a config .json file; NULL if
    /// another source is used.
    pub config_path: *const c_char,
    /// The config.json text itself (NUL-terminated UTF-8), or NULL.
    pub config_json: *const c_char,
    /// Nonzero: use the embedded tiny demo model config (tests, demos).
    pub use_tiny_default: i32,
    /// DSV4_DEVICE_CPU (-1) = CPU reference backend; >= 0 = CUDA device ordinal.
    pub device: i32,
    /// Number of sequence slots (>= 1). Default 8.
    pub max_num_seqs: i32,
    /// Most tokens in one dsv4_forward batch (>= 1). Default 512.
    pub max_num_tokens: i32,
    /// Most positions per sequence (>= 1, <= the model's max_position_embeddings). Default 4096.
    pub max_seq_len: i32,
    /// CPU worker threads; 0 = all cores. Default 0.
    pub num_threads: i32,
    /// DSV4_NUMERICS_EXACT or DSV4_NUMERICS_OFFICIAL (default).
    pub numerics: i32,
    /// DSV4_WEIGHT_FORMAT_AS_STORED (default), _BF16 or _QUANTIZE.
    pub weight_format: i32,
    /// Directory for the CUDA backend's compiled-kernel (CUBIN) cache, created if missing.
    /// NULL = the default: `$DSV4_CACHE_DIR`, else `$XDG_CACHE_HOME/dsv4`, else
    /// `$HOME/.cache/dsv4`. With none of those set, or a directory that cannot be written,
    /// kernels are compiled at every dsv4_finalize (a warning is logged), never an error.
    pub cache_dir: *const c_char,
    /// Since ABI 1.2. The CUDA kernel set: "reference" (the f64 kernels, bit-identical to the
    /// CPU reference; the device oracle) or "fast" (`official` numerics on tensor cores;
    /// today its MoE layer, the rest still the reference kernels). NULL = the default:
    /// "fast" for `numerics = official` on an sm_90 (Hopper) GPU, else "reference" (said at
    /// INFO). A name this build lacks, "fast" with `numerics = exact`, or "fast" on a GPU
    /// without sm_90a (its kernels use wgmma) is DSV4_STATUS_CONFIG naming it. Ignored by the
    /// CPU backend, which accepts the same names.
    pub kernel_set: *const c_char,
    /// Since ABI 1.4. CUDA backend: total bytes of the pinned host buffers that dsv4_load,
    /// dsv4_load_tensor and dsv4_refit stage host values through on their way into device
    /// memory; it bounds the host memory a load takes (the engine keeps no host copy of the
    /// weights). Held from the first write until dsv4_finalize / the end of a refit.
    /// 0 = the default, 256 MiB. Ignored by the CPU backend.
    pub staging_nbytes: u64,
}

/// One named tensor handed to `dsv4_load_tensor` / `dsv4_refit`. Initialize with
/// `dsv4_tensor_default()`. Everything it points to is borrowed for the call only.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_tensor {
    /// sizeof(dsv4_tensor) as the host compiled it.
    pub struct_size: usize,
    /// Canonical weight name (NUL-terminated UTF-8), e.g. "layers.0.attn.wq_a.weight".
    pub name: *const c_char,
    /// DSV4_DTYPE_* of `data`.
    pub dtype: i32,
    /// Number of dimensions, 0..=DSV4_MAX_DIMS.
    pub ndim: i32,
    /// Extent of each dimension (the first `ndim` entries are read; each >= 0).
    pub shape: [i64; DSV4_MAX_DIMS],
    /// Densely packed row-major elements; may be NULL only when the tensor has no elements.
    pub data: *const c_void,
    /// DSV4_MEMORY_HOST (default) or DSV4_MEMORY_DEVICE.
    pub memory: i32,
}

/// One forward step: `num_seqs` sequences with `num_tokens` tokens in all, each sequence's
/// tokens consecutive in the arrays. Initialize with `dsv4_batch_default()`. On the CPU
/// backend the arrays are host pointers, borrowed for the call only. On the CUDA backend
/// they are device pointers (fixed buffers a captured graph can replay), read, and `logits`
/// written, when the stream reaches the forward: keep them valid until then (dsv4_forward).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_batch {
    /// sizeof(dsv4_batch) as the host compiled it.
    pub struct_size: usize,
    /// Tokens in the batch, 1..=max_num_tokens.
    pub num_tokens: i32,
    /// Sequences in the batch, 1..=max_num_seqs.
    pub num_seqs: i32,
    /// [num_tokens] token ids, each in [0, vocab_size).
    pub token_ids: *const i32,
    /// [num_tokens] absolute position of each token in its sequence (< max_seq_len; any
    /// value in a padding sequence).
    pub positions: *const i32,
    /// [num_seqs] slot of each sequence, distinct, in [0, max_num_seqs), or DSV4_PAD_SLOT
    /// for a padding sequence (any number of them).
    pub seq_slots: *const i32,
    /// [num_seqs + 1] offsets of each sequence's tokens: 0 = query_start[0] < ... <
    /// query_start[num_seqs] = num_tokens.
    pub query_start: *const i32,
    /// [num_logits] token rows that produce logits, or NULL = every token (then
    /// num_logits must equal num_tokens).
    pub logits_rows: *const i32,
    /// Rows of the logits output, 0..=max_num_tokens.
    pub num_logits: i32,
    /// Caller-owned output [num_logits, vocab_size] of `logits_dtype`.
    pub logits: *mut c_void,
    /// DSV4_LOGITS_F32 (default) or DSV4_LOGITS_BF16.
    pub logits_dtype: i32,
}

/// Configuration and capacities in effect, filled by `dsv4_get_info`. Set `struct_size`
/// to sizeof(dsv4_info) before the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_info {
    /// sizeof(dsv4_info) as the host compiled it (set by the caller, left unchanged).
    pub struct_size: usize,
    /// Rows of the embedding and of the logits: size a logits buffer as
    /// `num_logits * vocab_size` values.
    pub vocab_size: i32,
    /// Model width D.
    pub hidden_size: i32,
    /// Transformer layers (MTP not included).
    pub num_layers: i32,
    /// Attention heads and their dimension.
    pub num_heads: i32,
    pub head_dim: i32,
    /// mHC residual streams (N).
    pub hc_mult: i32,
    /// Routed experts per MoE layer, and how many each token uses.
    pub n_routed_experts: i32,
    pub experts_per_tok: i32,
    /// Capacities fixed at create: sequence slots, tokens per forward, positions per slot.
    pub max_num_seqs: i32,
    pub max_num_tokens: i32,
    pub max_seq_len: i32,
    /// DSV4_DEVICE_CPU or the CUDA ordinal.
    pub device: i32,
    /// DSV4_NUMERICS_* in effect.
    pub numerics: i32,
    /// DSV4_WEIGHT_FORMAT_* in effect.
    pub weight_format: i32,
    /// DSV4_PHASE_* now.
    pub phase: i32,
    /// Number of weights (the valid range of dsv4_weight_info's index): the source weights,
    /// then the derived tensors.
    pub num_weights: usize,
    /// Since ABI 1.1. The engine's fixed buffers by kind, each one contiguous span that never
    /// moves from dsv4_create to dsv4_destroy (device memory on CUDA; NULL / 0 on the CPU
    /// backend, whose buffers are separate host allocations): weights and their scales ...
    pub weights_base: *const c_void,
    pub weights_nbytes: u64,
    /// ... derived tensors (rebuilt by finalize / refit) ...
    pub derived_base: *const c_void,
    pub derived_nbytes: u64,
    /// ... per-slot decode state (KV windows, compressed entries, compressor state) ...
    pub state_base: *const c_void,
    pub state_nbytes: u64,
    /// ... and the activation workspace of dsv4_forward.
    pub workspace_base: *const c_void,
    pub workspace_nbytes: u64,
    /// Since ABI 1.2. Device address of the engine's error record: a `dsv4_batch_fault`
    /// (32 bytes) that the first bad batch since it was last cleared fills in (CUDA; NULL on
    /// the CPU backend, which reports a bad batch from dsv4_forward). Read and clear it with
    /// dsv4_device_error, or copy it inside a graph.
    pub device_error: *const c_void,
    /// Since ABI 1.3. The config's `bos_token_id` and `eos_token_id` (0 and 1, DeepSeek-V4's,
    /// when the config names none).
    pub bos_token_id: i64,
    pub eos_token_id: i64,
    /// Since ABI 1.3. The rest of the memory figures (`dsv4_memory_plan`, whose other fields
    /// are the `*_nbytes` above, which since 1.3 the CPU backend fills too, with NULL bases):
    /// the state of one slot at max_seq_len, the device bytes the engine allocated (0 on the
    /// CPU) and the host bytes its buffers take (CPU: the weights and state; CUDA: the
    /// staging buffers, held only while a load or refit writes).
    pub state_slot_nbytes: u64,
    pub device_nbytes: u64,
    pub host_nbytes: u64,
    /// Since ABI 1.4. Host bytes the engine holds right now beyond its fixed buffers: the CUDA
    /// staging buffers while a load or refit writes (0 once finalized), and the copies of
    /// chunked-refit halves waiting for their partner.
    pub host_transient_nbytes: u64,
}

/// The memory an engine would use, by kind (`dsv4_plan_memory`, since ABI 1.3); after create
/// `dsv4_get_info` reports the same figures. Set `struct_size` to sizeof(dsv4_memory_plan).
///
/// CPU backend: host memory. Weights are the values and f32 scales of every weight as stored
/// (`weight_format`), derived is layer 0's folded mHC projection, state the decode state of
/// every slot; the forward's scratch is allocated per call and not counted (workspace 0).
/// CUDA backend: the create-time device allocation, each kind the span it occupies (padding
/// included), `device_nbytes` the allocation's size; `host_nbytes` is the pinned staging that
/// load and refit write through (`staging_nbytes`), held only while they run: the engine keeps
/// no host copy of the weights.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_memory_plan {
    /// sizeof(dsv4_memory_plan) as the host compiled it (set by the caller, left unchanged).
    pub struct_size: usize,
    pub weights_nbytes: u64,
    pub derived_nbytes: u64,
    /// All `max_num_seqs` slots, and one slot at `max_seq_len` (CUDA: what one more slot adds;
    /// size `max_num_seqs` to a budget as (budget - everything else) / state_slot_nbytes).
    pub state_nbytes: u64,
    pub state_slot_nbytes: u64,
    pub workspace_nbytes: u64,
    pub device_nbytes: u64,
    pub host_nbytes: u64,
}

/// One weight of the engine, filled by `dsv4_weight_info`. Set `struct_size` to
/// sizeof(dsv4_weight_desc) before the call. (Named _desc because C has one namespace for
/// the function dsv4_weight_info and typedefs.)
#[repr(C)]
#[derive(Clone, Copy)]
pub struct dsv4_weight_desc {
    /// sizeof(dsv4_weight_desc) as the host compiled it (set by the caller, left unchanged).
    pub struct_size: usize,
    /// Canonical name; owned by the engine, valid until dsv4_destroy. Do not free.
    pub name: *const c_char,
    /// DSV4_DTYPE_* of the engine's storage.
    pub dtype: i32,
    /// Number of dimensions.
    pub ndim: i32,
    /// Extents (entries past `ndim` are 0).
    pub shape: [i64; DSV4_MAX_DIMS],
    /// Address of the engine's storage: fixed from dsv4_create to dsv4_destroy. Host memory
    /// when `device` is DSV4_DEVICE_CPU, else device memory. Read-only for the host (change
    /// weights with dsv4_refit, which also rebuilds what derives from them).
    pub data: *const c_void,
    /// Bytes of storage at `data`.
    pub nbytes: u64,
    /// Nonzero if the tensor is derived (rebuilt by finalize/refit, not loadable by name).
    pub derived: i32,
    /// DSV4_DEVICE_CPU (host memory) or the CUDA ordinal holding `data`.
    pub device: i32,
    /// Block scales (f32, row-major over the block grid) when `dtype` is
    /// DSV4_DTYPE_F8_E4M3 or DSV4_DTYPE_FP4_E2M1, else NULL. Fixed address like `data`.
    pub scale: *const c_void,
    /// Bytes at `scale` (0 when NULL).
    pub scale_nbytes: u64,
    /// Rows and columns of the weight covered by one scale (0, 0 when unscaled).
    pub scale_block: [i32; 2],
}

/// A struct of the ABI whose first field is `struct_size`.
pub(crate) trait Versioned: Copy {
    /// Size of the first published layout (v1). Later minors only append fields; when one
    /// does, pin this to the v1 literal and read the new fields only if `struct_size`
    /// covers them.
    const V1_SIZE: usize;
    /// How a host should initialize it, for error messages.
    const INIT_HINT: &'static str;
}

impl Versioned for dsv4_create_params {
    /// ABI 1.0 ended at `cache_dir`; 1.2 appended `kernel_set`.
    const V1_SIZE: usize = std::mem::offset_of!(dsv4_create_params, kernel_set);
    const INIT_HINT: &'static str = "initialize it with dsv4_create_params_default()";
}
impl Versioned for dsv4_tensor {
    const V1_SIZE: usize = size_of::<Self>();
    const INIT_HINT: &'static str = "initialize it with dsv4_tensor_default()";
}
impl Versioned for dsv4_batch {
    const V1_SIZE: usize = size_of::<Self>();
    const INIT_HINT: &'static str = "initialize it with dsv4_batch_default()";
}
impl Versioned for dsv4_info {
    /// ABI 1.0 ended at `num_weights`; 1.1 appended the buffer spans.
    const V1_SIZE: usize = std::mem::offset_of!(dsv4_info, weights_base);
    const INIT_HINT: &'static str = "set it to sizeof(dsv4_info)";
}
impl Versioned for dsv4_memory_plan {
    const V1_SIZE: usize = size_of::<Self>();
    const INIT_HINT: &'static str = "set it to sizeof(dsv4_memory_plan)";
}
impl Versioned for dsv4_weight_desc {
    const V1_SIZE: usize = size_of::<Self>();
    const INIT_HINT: &'static str = "set it to sizeof(dsv4_weight_desc)";
}

/// How a field of the struct argument `what` is written in messages: `tensor->name` for a
/// pointer argument, `tensors[3].name` for an array entry.
pub(crate) fn member(what: &str, field: &str) -> String {
    if what.ends_with(']') {
        format!("{what}.{field}")
    } else {
        format!("{what}->{field}")
    }
}

/// Reads and checks `struct_size` at `p` (the argument called `what`).
///
/// # Safety
/// A non-NULL `p` must point to at least `size_of::<usize>()` readable bytes.
unsafe fn checked_size<T: Versioned>(p: *const T, what: &str) -> Result<usize> {
    if p.is_null() {
        return Err(null_error(what));
    }
    // SAFETY: non-NULL, and every dsv4 struct starts with a size_t.
    let size = unsafe { ptr::read_unaligned(p.cast::<usize>()) };
    if size < T::V1_SIZE {
        return Err(invalid(format!(
            "`{}` = {size} is smaller than this library's v1 layout ({} bytes); {}",
            member(what, "struct_size"),
            T::V1_SIZE,
            T::INIT_HINT
        )));
    }
    Ok(size)
}

/// Copies an input struct after checking `struct_size`; fields past v1 are ignored.
///
/// # Safety
/// A non-NULL `p` must point to a struct of at least its declared `struct_size` bytes.
pub(crate) unsafe fn read_versioned<T: Versioned>(p: *const T, what: &str) -> Result<T> {
    // SAFETY: forwarded.
    let size = unsafe { checked_size(p, what)? };
    // An older host's struct ends early: the fields it lacks stay zero (NULL / 0, which is
    // every appended field's default).
    let n = size.min(size_of::<T>());
    // SAFETY: every dsv4 input struct is plain data (integers, pointers) for which all-zero
    // bytes are a valid value; `n` <= struct_size bytes are readable at `p`.
    unsafe {
        let mut v = std::mem::MaybeUninit::<T>::zeroed();
        ptr::copy_nonoverlapping(p.cast::<u8>(), v.as_mut_ptr().cast::<u8>(), n);
        Ok(v.assume_init())
    }
}

/// Writes an output struct after checking `struct_size`, which is preserved: as many of
/// this library's fields as the caller's layout holds (an older host gets the prefix it
/// knows); bytes past this library's layout are left untouched.
///
/// # Safety
/// A non-NULL `p` must point to a writable struct of at least its declared `struct_size`.
pub(crate) unsafe fn write_versioned<T: Versioned>(p: *mut T, what: &str, value: T) -> Result<()> {
    // SAFETY: forwarded.
    let size = unsafe { checked_size(p, what)? };
    let n = size.min(size_of::<T>());
    // SAFETY: `n` <= struct_size bytes are writable at `p`, and `value` has size_of::<T>()
    // >= n readable bytes; then restore the caller's struct_size.
    unsafe {
        ptr::copy_nonoverlapping((&value as *const T).cast::<u8>(), p.cast::<u8>(), n);
        ptr::write_unaligned(p.cast::<usize>(), size);
    }
    Ok(())
}

/// Default create params: tiny model off, CPU, 8 seqs, 512 tokens, 4096 positions,
/// all cores, official numerics, weights as stored.
pub(crate) fn create_params_default() -> dsv4_create_params {
    let o = EngineOptions::default();
    dsv4_create_params {
        struct_size: size_of::<dsv4_create_params>(),
        config_path: ptr::null(),
        config_json: ptr::null(),
        use_tiny_default: 0,
        device: o.device,
        max_num_seqs: o.max_num_seqs as i32,
        max_num_tokens: o.max_num_tokens as i32,
        max_seq_len: o.max_seq_len as i32,
        num_threads: o.num_threads as i32,
        numerics: numerics_to_i32(o.numerics),
        weight_format: weight_format_to_i32(o.weight_format),
        cache_dir: ptr::null(),
        kernel_set: ptr::null(),
        staging_nbytes: o.staging_bytes as u64,
    }
}

pub(crate) fn tensor_default() -> dsv4_tensor {
    dsv4_tensor {
        struct_size: size_of::<dsv4_tensor>(),
        name: ptr::null(),
        dtype: DSV4_DTYPE_F32,
        ndim: 0,
        shape: [0; DSV4_MAX_DIMS],
        data: ptr::null(),
        memory: DSV4_MEMORY_HOST,
    }
}

pub(crate) fn batch_default() -> dsv4_batch {
    dsv4_batch {
        struct_size: size_of::<dsv4_batch>(),
        num_tokens: 0,
        num_seqs: 0,
        token_ids: ptr::null(),
        positions: ptr::null(),
        seq_slots: ptr::null(),
        query_start: ptr::null(),
        logits_rows: ptr::null(),
        num_logits: 0,
        logits: ptr::null_mut(),
        logits_dtype: DSV4_LOGITS_F32,
    }
}

/// A borrowed C string as raw bytes (paths need not be UTF-8).
///
/// # Safety
/// A non-NULL `p` must be NUL-terminated and valid for `'a`.
pub(crate) unsafe fn opt_cstr<'a>(p: *const c_char) -> Option<&'a CStr> {
    // SAFETY: forwarded.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) })
}

/// A C string as UTF-8 text, naming `what` when it is not.
pub(crate) fn utf8<'a>(s: &'a CStr, what: &str) -> Result<&'a str> {
    s.to_str()
        .map_err(|e| invalid(format!("`{what}` is not valid UTF-8: {e}")))
}

pub(crate) fn path_of(s: &CStr) -> PathBuf {
    PathBuf::from(OsStr::from_bytes(s.to_bytes()))
}

fn non_negative(v: i32, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| invalid(format!("`{what}` = {v} must be >= 0")))
}

fn positive(v: i32, what: &str) -> Result<usize> {
    if v <= 0 {
        return Err(invalid(format!("`{what}` = {v} must be >= 1")));
    }
    Ok(v as usize)
}

pub(crate) fn numerics_from_i32(v: i32, what: &str) -> Result<Numerics> {
    match v {
        DSV4_NUMERICS_EXACT => Ok(Numerics::Exact),
        DSV4_NUMERICS_OFFICIAL => Ok(Numerics::Official),
        _ => Err(invalid(format!(
            "`{what}` = {v} is not a dsv4 numerics mode (DSV4_NUMERICS_EXACT = 0, DSV4_NUMERICS_OFFICIAL = 1)"
        ))),
    }
}

pub(crate) fn numerics_to_i32(n: Numerics) -> i32 {
    match n {
        Numerics::Exact => DSV4_NUMERICS_EXACT,
        Numerics::Official => DSV4_NUMERICS_OFFICIAL,
    }
}

pub(crate) fn weight_format_from_i32(v: i32, what: &str) -> Result<WeightFormat> {
    match v {
        DSV4_WEIGHT_FORMAT_AS_STORED => Ok(WeightFormat::AsStored),
        DSV4_WEIGHT_FORMAT_BF16 => Ok(WeightFormat::Bf16),
        DSV4_WEIGHT_FORMAT_QUANTIZE => Ok(WeightFormat::Quantize),
        _ => Err(invalid(format!(
            "`{what}` = {v} is not a dsv4 weight format (DSV4_WEIGHT_FORMAT_AS_STORED = 0, _BF16 = 1, _QUANTIZE = 2)"
        ))),
    }
}

pub(crate) fn weight_format_to_i32(w: WeightFormat) -> i32 {
    match w {
        WeightFormat::AsStored => DSV4_WEIGHT_FORMAT_AS_STORED,
        WeightFormat::Bf16 => DSV4_WEIGHT_FORMAT_BF16,
        WeightFormat::Quantize => DSV4_WEIGHT_FORMAT_QUANTIZE,
    }
}

pub(crate) fn load_format_from_i32(v: i32, what: &str) -> Result<LoadFormat> {
    match v {
        DSV4_LOAD_AUTO => Ok(LoadFormat::Auto),
        DSV4_LOAD_SAFETENSORS => Ok(LoadFormat::Safetensors),
        DSV4_LOAD_DUMMY => Ok(LoadFormat::Dummy),
        _ => Err(invalid(format!(
            "`{what}` = {v} is not a dsv4 load format (DSV4_LOAD_AUTO = 0, DSV4_LOAD_SAFETENSORS = 1, DSV4_LOAD_DUMMY = 2)"
        ))),
    }
}

pub(crate) fn dtype_from_i32(v: i32, what: &str) -> Result<HostDtype> {
    HostDtype::from_i32(v).ok_or_else(|| {
        invalid(format!(
            "`{what}` = {v} is not a dsv4 tensor dtype (DSV4_DTYPE_F32 = 0, _BF16 = 1, _F16 = 2, _I32 = 3, _I64 = 4, _F8_E4M3 = 5, _FP4_E2M1 = 6, _E8M0 = 7)"
        ))
    })
}

pub(crate) fn phase_to_i32(p: Phase) -> i32 {
    match p {
        Phase::Created => DSV4_PHASE_CREATED,
        Phase::Loaded => DSV4_PHASE_LOADED,
        Phase::Ready => DSV4_PHASE_READY,
        Phase::Refitting => DSV4_PHASE_REFITTING,
    }
}

/// Validated `dsv4_create` arguments.
pub(crate) struct CreateArgs {
    pub source: ConfigSource,
    pub options: EngineOptions,
}

/// Checks every field of `p` (read from the argument `params`).
///
/// # Safety
/// String fields that are non-NULL must be NUL-terminated.
pub(crate) unsafe fn create_args(p: &dsv4_create_params) -> Result<CreateArgs> {
    // SAFETY: forwarded.
    let (path, json, dir, kernel_set) = unsafe {
        (
            opt_cstr(p.config_path),
            opt_cstr(p.config_json),
            opt_cstr(p.cache_dir),
            opt_cstr(p.kernel_set),
        )
    };
    let given = [path.is_some(), json.is_some(), p.use_tiny_default != 0];
    if given.iter().filter(|&&g| g).count() != 1 {
        return Err(invalid(format!(
            "exactly one of `params->config_path`, `params->config_json`, `params->use_tiny_default` must be set \
             (got config_path {}, config_json {}, use_tiny_default = {})",
            if path.is_some() { "set" } else { "NULL" },
            if json.is_some() { "set" } else { "NULL" },
            p.use_tiny_default
        )));
    }
    let source = if let Some(path) = path {
        if path.is_empty() {
            return Err(invalid("`params->config_path` is an empty string"));
        }
        ConfigSource::Path(path_of(path))
    } else if let Some(json) = json {
        ConfigSource::Json(utf8(json, "params->config_json")?.to_owned())
    } else {
        ConfigSource::TinyDefault
    };
    if p.device < DSV4_DEVICE_CPU {
        return Err(invalid(format!(
            "`params->device` = {} must be -1 (DSV4_DEVICE_CPU) or a CUDA ordinal >= 0",
            p.device
        )));
    }
    let options = EngineOptions {
        device: p.device,
        max_num_seqs: positive(p.max_num_seqs, "params->max_num_seqs")?,
        max_num_tokens: positive(p.max_num_tokens, "params->max_num_tokens")?,
        max_seq_len: positive(p.max_seq_len, "params->max_seq_len")?,
        num_threads: non_negative(p.num_threads, "params->num_threads")?,
        numerics: numerics_from_i32(p.numerics, "params->numerics")?,
        weight_format: weight_format_from_i32(p.weight_format, "params->weight_format")?,
        cache_dir: match dir {
            Some(d) if d.is_empty() => {
                return Err(invalid(
                    "`params->cache_dir` is an empty string (use NULL for the default)",
                ));
            }
            Some(d) => Some(path_of(d)),
            None => None,
        },
        kernel_set: match kernel_set {
            Some(k) => Some(
                KernelSetName::parse(utf8(k, "params->kernel_set")?)
                    .map_err(|e| e.context("`params->kernel_set`".to_string()))?,
            ),
            None => None,
        },
        staging_bytes: usize::try_from(p.staging_nbytes).map_err(|_| {
            invalid(format!(
                "`params->staging_nbytes` = {} does not fit this machine's address space",
                p.staging_nbytes
            ))
        })?,
    };
    if let Some(k) = options.kernel_set {
        k.check_numerics(options.numerics)
            .map_err(|e| e.context("`params->kernel_set`".to_string()))?;
    }
    Ok(CreateArgs { source, options })
}

/// Where a validated tensor's bytes are.
pub(crate) enum TensorBytes<'a> {
    Host(&'a [u8]),
    /// DSV4_MEMORY_DEVICE: `nbytes` at a device address of the engine's device (staged to
    /// the host by the caller, on the call's stream).
    Device {
        addr: u64,
        nbytes: usize,
    },
}

/// A validated tensor: name, dtype, shape and where its bytes are.
pub(crate) struct TensorArgs<'a> {
    pub name: &'a str,
    pub dtype: HostDtype,
    pub shape: Vec<usize>,
    pub data: TensorBytes<'a>,
}

/// Checks every field of a `dsv4_tensor` (called `what`, e.g. "tensors[3]").
/// `device` is the engine's device: DSV4_MEMORY_DEVICE is unsupported on the CPU.
///
/// # Safety
/// Non-NULL `name` must be NUL-terminated; non-NULL `data` must hold the bytes the shape
/// and dtype describe; both must stay valid for `'a`.
pub(crate) unsafe fn tensor_args<'a>(
    t: &dsv4_tensor,
    what: &str,
    device: i32,
) -> Result<TensorArgs<'a>> {
    // SAFETY: forwarded.
    let name = unsafe { opt_cstr(t.name) }.ok_or_else(|| null_error(&member(what, "name")))?;
    let name = utf8(name, &member(what, "name"))?;
    let field = |f: &str| member(what, f);
    let dtype = dtype_from_i32(t.dtype, &field("dtype"))
        .map_err(|e| e.context(format!("weight `{name}`")))?;
    let on_device = match t.memory {
        DSV4_MEMORY_HOST => false,
        DSV4_MEMORY_DEVICE if device < 0 => {
            return Err(Error::new(
                crate::error::Status::Unsupported,
                format!(
                    "`{}` = DSV4_MEMORY_DEVICE (weight `{name}`): the CPU backend reads host memory only",
                    field("memory")
                ),
            ));
        }
        DSV4_MEMORY_DEVICE => true,
        m => {
            return Err(invalid(format!(
                "`{}` = {m} (weight `{name}`) is not DSV4_MEMORY_HOST (0) or DSV4_MEMORY_DEVICE (1)",
                field("memory")
            )));
        }
    };
    if t.ndim < 0 || t.ndim as usize > DSV4_MAX_DIMS {
        return Err(invalid(format!(
            "`{}` = {} (weight `{name}`) must be in [0, {DSV4_MAX_DIMS}]",
            field("ndim"),
            t.ndim
        )));
    }
    let mut shape = Vec::with_capacity(t.ndim as usize);
    let mut numel: usize = 1;
    for (k, &d) in t.shape[..t.ndim as usize].iter().enumerate() {
        let d = usize::try_from(d).map_err(|_| {
            invalid(format!(
                "`{}` = {d} (weight `{name}`) must be >= 0",
                field(&format!("shape[{k}]"))
            ))
        })?;
        numel = numel.checked_mul(d).ok_or_else(|| {
            invalid(format!(
                "`{}` (weight `{name}`) has more elements than fit in memory",
                field("shape")
            ))
        })?;
        shape.push(d);
    }
    let nbytes = dtype
        .nbytes(&shape)
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or_else(|| {
            invalid(format!(
                "`{}` = {shape:?} (weight `{name}`, {}) has more bytes than fit in memory{}",
                field("shape"),
                dtype.name(),
                if dtype == HostDtype::Fp4E2M1 {
                    ", or an odd last dimension (FP4 packs two codes per byte)"
                } else {
                    ""
                }
            ))
        })?;
    let data = if nbytes == 0 {
        TensorBytes::Host(&[])
    } else if t.data.is_null() {
        return Err(Error::new(
            crate::error::Status::NullPointer,
            format!(
                "`{}` is NULL but weight `{name}` has {numel} elements",
                field("data")
            ),
        ));
    } else if on_device {
        TensorBytes::Device {
            addr: t.data as u64,
            nbytes,
        }
    } else {
        // SAFETY: the caller promises `nbytes` readable bytes at `data` for 'a.
        TensorBytes::Host(unsafe { std::slice::from_raw_parts(t.data.cast::<u8>(), nbytes) })
    };
    Ok(TensorArgs {
        name,
        dtype,
        shape,
        data,
    })
}
