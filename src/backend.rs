//! The backend seam: what the engine asks of a backend, and the types both backends share.
//!
//! `engine` holds one `Box<dyn Backend>` and never matches on which one it is; `reference`
//! (CPU) and `cuda` implement [`Backend`] and import only this module, `options`, `model`,
//! `state` and `weights` from above them. Nothing here knows CUDA or C.

use crate::error::Result;
use crate::model::batch::BatchFault;
use crate::weights::load::{DeviceCheck, DeviceWrite};
use crate::weights::store::WeightStore;
use crate::weights::table::WeightTable;
use crate::weights::values::{Progress, WeightValues};

/// A host's CUDA stream (`CUstream`) as it crosses the seam; NULL is the legacy default
/// stream. The CPU backend ignores it.
pub type StreamHandle = *mut std::ffi::c_void;

/// Caller-owned logits output.
pub enum LogitsOut<'a> {
    F32(&'a mut [f32]),
    /// bfloat16 bit patterns.
    Bf16(&'a mut [u16]),
}

impl LogitsOut<'_> {
    pub fn len(&self) -> usize {
        match self {
            LogitsOut::F32(v) => v.len(),
            LogitsOut::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One forward step (DESIGN.md §3); host slices for the CPU backend.
pub struct Batch<'a> {
    pub token_ids: &'a [i32],
    pub positions: &'a [i32],
    pub seq_slots: &'a [i32],
    /// `num_seqs + 1` offsets into the token arrays.
    pub query_start: &'a [i32],
    /// Rows that produce logits; None = every token.
    pub logits_rows: Option<&'a [i32]>,
    pub logits: LogitsOut<'a>,
}

/// One forward step of the CUDA backend: device addresses, read only by kernels on the
/// host's stream (the host may capture the call in a CUDA graph). Counts are host integers.
#[derive(Clone, Copy, Debug)]
pub struct DeviceBatch {
    pub num_tokens: usize,
    pub num_seqs: usize,
    pub token_ids: u64,
    pub positions: u64,
    pub seq_slots: u64,
    pub query_start: u64,
    /// 0 = every token produces logits.
    pub logits_rows: u64,
    pub num_logits: usize,
    pub logits: u64,
    pub logits_bf16: bool,
}

/// Element type of an engine buffer: a derived tensor as dsv4_weight_info reports it, and
/// every buffer of the CUDA memory plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F64,
    I32,
    /// Device addresses.
    U64,
    /// Raw bytes (weights in their stored format; FP8 codes).
    U8,
    /// bfloat16 bit patterns.
    Bf16,
    /// IEEE half bit patterns.
    F16,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::U8 => 1,
            Elem::Bf16 | Elem::F16 => 2,
            Elem::F32 | Elem::I32 => 4,
            Elem::F64 | Elem::U64 => 8,
        }
    }
}

/// A tensor the engine builds from weights at finalize / refit (not loadable by name), at a
/// fixed address: what dsv4_weight_info lists after the source weights.
#[derive(Clone, Debug)]
pub struct DerivedTensor {
    pub name: String,
    pub dtype: Elem,
    pub shape: Vec<usize>,
    /// Host address (CPU backend) or device address (CUDA backend).
    pub addr: u64,
    pub nbytes: usize,
}

/// Fixed spans of the engine's buffers, by kind (dsv4_get_info): `(address, bytes)`, device
/// addresses on CUDA; (0, 0) where a backend has no such single span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BufferSpans {
    pub weights: (u64, u64),
    pub derived: (u64, u64),
    pub state: (u64, u64),
    pub workspace: (u64, u64),
    /// The device error record (inside `state`), [`crate::model::batch::FAULT_RECORD_INTS`]
    /// int32 words.
    pub device_error: (u64, u64),
}

/// Where a backend keeps weight `i`: its values and (quantized weights) block scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WeightAddr {
    pub data: u64,
    /// 0 when the weight has no scales.
    pub scales: u64,
}

/// What the engine asks of a backend. Every buffer is allocated when the backend is made
/// (at create) and keeps its address until it is dropped.
pub trait Backend {
    /// "cpu" or "cuda:N".
    fn device_name(&self) -> String;

    /// True when batches and refit sources live in device memory.
    fn is_device(&self) -> bool;

    /// Writes validated values (load, load_tensor, refit) into the backend's copies of their
    /// target weights, in place: the host store, or device memory through bounded pinned
    /// staging (no host copy of the weights), copying on `stream`. Returns once the copies
    /// are complete (the host may free the sources). Derived tensors are not rebuilt here.
    fn write_weights(
        &mut self,
        table: &WeightTable,
        values: &dyn WeightValues,
        progress: &Progress,
        stream: StreamHandle,
    ) -> Result<()>;

    /// Runs `checks` over device values (finite floats, expert ids in range) and fails with
    /// the first entry that does not pass, before anything is written (a device backend;
    /// others refuse device memory).
    /// `writes` are the device writes to come: the backend confirms their sources are
    /// readable device memory first.
    fn check_device(
        &mut self,
        checks: &[DeviceCheck],
        writes: &[DeviceWrite],
        stream: StreamHandle,
    ) -> Result<()> {
        let _ = stream;
        unsupported_device(checks.len() + writes.len())
    }

    /// Writes weights from device memory on the device (codes copied device to device, or
    /// converted / quantized by kernels), on `stream`, and waits. Checked before by
    /// [`Backend::check_device`].
    fn write_device(
        &mut self,
        table: &WeightTable,
        writes: &[DeviceWrite],
        stream: StreamHandle,
    ) -> Result<()> {
        let _ = (table, stream);
        unsupported_device(writes.len())
    }

    /// The end of a sequence of [`Backend::write_weights`] (finalize, the end of a refit):
    /// frees what writing needed (the CUDA staging buffers). Default: nothing.
    fn end_writes(&mut self) {}

    /// Rebuilds every derived tensor from the weights as written, resets the slots' state and
    /// compiles / loads what it runs. Idempotent.
    fn finalize(&mut self, stream: StreamHandle) -> Result<()>;

    /// Rebuilds every derived tensor from the weights as written (after a refit).
    fn rebuild_derived(&mut self, stream: StreamHandle) -> Result<()>;

    /// One forward from host memory (the CPU backend; a device backend refuses it).
    fn forward_host(&mut self, batch: &mut Batch) -> Result<()>;

    /// One forward from device memory, enqueued on `stream` (a host backend refuses it).
    fn forward_device(&mut self, batch: &DeviceBatch, stream: StreamHandle) -> Result<()>;

    /// Forgets `slot`'s state (`slot` < max_num_seqs, checked by the engine).
    fn release_slot(&mut self, slot: usize) -> Result<()>;

    /// The engine's memory by kind, as allocated at create (crate::memory: the same figures
    /// its plan gave).
    fn memory(&self) -> crate::memory::MemoryFigures;

    /// Positions `slot` holds (`slot` < max_num_seqs, checked by the engine), after the work
    /// enqueued on `stream` has run (a device backend reads its copy, blocking the host).
    fn slot_length(&self, slot: usize, stream: StreamHandle) -> Result<usize>;

    /// Returns and clears the first fault of a bad device batch (None on a host backend).
    fn take_device_error(&mut self, stream: StreamHandle) -> Result<Option<BatchFault>>;

    /// Where weight `i` lives (the host store's own buffers on the CPU backend).
    fn weight_addr(&self, i: usize) -> WeightAddr;

    /// The host store when the weights live in host memory (the CPU backend); None when they
    /// live on a device only.
    fn host_store(&self) -> Option<&WeightStore> {
        None
    }

    /// Host memory the backend holds now beyond its fixed buffers (CUDA: staging buffers
    /// while a load or refit writes).
    fn transient_host_bytes(&self) -> u64 {
        0
    }

    /// Derived tensors, at fixed addresses.
    fn derived(&self) -> Vec<DerivedTensor>;

    /// The fixed spans of the engine's buffers by kind.
    fn spans(&self) -> BufferSpans;

    /// What the finalize log line reports of this backend (device, kernels); see
    /// [`crate::load_report`]. Default: nothing beyond the device name.
    fn facts(&self) -> crate::load_report::BackendFacts {
        Default::default()
    }

    /// Copies `nbytes` at device address `addr` (a DSV4_MEMORY_DEVICE entry) to the host,
    /// ordered after the host's work on `stream`. UNSUPPORTED on a host backend.
    fn stage_device_bytes(
        &self,
        addr: u64,
        nbytes: usize,
        stream: StreamHandle,
        what: &str,
    ) -> Result<Vec<u8>>;
}

/// UNSUPPORTED for device-memory values on a backend without a device (none: OK).
fn unsupported_device(n: usize) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    Err(crate::error::Error::new(
        crate::error::Status::Unsupported,
        "DSV4_MEMORY_DEVICE entries need the CUDA backend (this engine runs on the CPU)",
    ))
}
